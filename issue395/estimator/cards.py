"""Cards a run may be asked to fit: named cards with their total memory and compute capability,
plain sizes, the CUDA context each leaves outside the caching allocator, and the cuBLAS
workspace per handle PyTorch gives each compute capability, and what bitsandbytes' gemm_4bit heuristic reads
of each (gemm4bit.Dispatch). Imports only constants, errors and gemm4bit.

The verdict every fit answer uses: ``needs_free + context + the runtime's growth <= total``,
i.e. a run fits when ``needs_free <= step_free_bytes``, the card's free memory
(``total_bytes - context_bytes``, what an idle process sees) less what the CUDA runtime adds
outside the allocator by the end of the step. Soup's gate reads the free memory earlier, less
only what the runtime has added by then: in `soup train` (``gate_free_bytes``), in this tool's own
process (``harness_gate_free_bytes``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Optional

from ..constants import CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_PRE_HOPPER, WORKSPACE_CONFIG_VAR, MiB, comma_list
from ..errors import UsageError
from .gemm4bit import Dispatch, dispatch_for

#: The CUDA context and driver reservation outside the caching allocator, for a card this tool
#: has not measured: Soup's own figure (estimate_stream_peak_vram's docstring), a bound with one
#: measurement behind it, not a law, so --context GB overrides it, and on a GPU this tool measures
#: its own (cuda.context_bytes). Evidence: docs/PEAK.md, "CONTEXT_BOUND_BYTES".
CONTEXT_BOUND_BYTES = 850_000_000
CONTEXT_EVIDENCE = "0.85 GB on the dev box, which also drives"  # the words in Soup's source

#: What the CUDA runtime adds outside the caching allocator after the context above: by Soup's
#: gate, the kernel modules CUDA loads lazily as Soup's setup first runs them; by the end of the
#: step, those the step loads and the backward thread's library handles. The largest measured of
#: each, charged on every card. Evidence: docs/PEAK.md, "GATE_GROWTH_BYTES, STEP_GROWTH_BYTES".
GATE_GROWTH_BYTES = 94_371_840
STEP_GROWTH_BYTES = 262_144_000
#: ...by Soup's gate in `soup train`'s own process (the CLI, whose setup runs far fewer kernels before its
#: gate than this tool's in-process setup): the card's total less the box's context less the free memory
#: Soup's gate printed, 16.3 to 22.4 MB on 33 --find-max probes of 9 configs when it was set (two decimals:
#: +-5 MB; the four probes since are inside it); the most measured. Evidence: docs/PEAK.md, "GATE_GROWTH_BYTES, STEP_GROWTH_BYTES" (bench/findings.py
#: gate_growth() reads it off the find-max JSONs).
CLI_GATE_GROWTH_BYTES = 22_400_000
#: ...by the step's end in `soup train`'s own process on a resident run (training.stream_layers false, every layer on
#: the card, expandable segments): 176,947,200 B read at exit by 24 of the 30 probes that read it, of 8 --find-max
#: searches on an H100 (sm_90); the other 6, OOMs before their step had loaded it all, 101,449,728 B; torch's OOM
#: messages there 166.6 to 179.4 MB (two decimals of GiB): results/resident-findmax-gc-growth-h100-soup0.77.0-1a0b582 (Phi-3-mini and phi-2 bf16
#: with checkpointing), results/resident-findmax-heldout-h100-soup0.77.0-3cbde2c (Qwen2.5 KTO bf16, Qwen3 ORPO NF4),
#: results/resident-findmax-llama8b-gc-h100-soup0.77.0-07712a8 (Llama-3.1-8B bf16 with checkpointing),
#: results/resident-findmax-gc-charged-h100-soup0.77.0-d887191 (the same two gc searches again, Llama-3.2-1B gc). The most
#: measured, on Hopper alone (the kernel images loaded are the card's architecture's): ``step_growth`` says where it
#: is charged. Evidence: docs/PEAK.md, "GATE_GROWTH_BYTES, STEP_GROWTH_BYTES" (tests/estimator/test_cards.py reads
#: every committed resident probe's reading against it).
RESIDENT_STEP_GROWTH_BYTES = 176_947_200
#: The compute capability majors RESIDENT_STEP_GROWTH_BYTES was measured on (H100, 9.0).
RESIDENT_GROWTH_MAJORS = (9,)
#: Which growth a fit charges, in words (every place that prints the growth names it).
GROWTH_BOUND = "the bound"
GROWTH_RESIDENT = "measured resident soup-train growth, sm_90"
GROWTH_PROBES = "measured by this search's probes"


def _measured_resident(resident: bool, cc: Optional[tuple]) -> bool:
    # Measured only on resident runs in `soup train`'s process on Hopper; a plain size (cc None), another
    # architecture or a streamed run keeps the bound.
    return bool(resident) and cc is not None and cc[0] in RESIDENT_GROWTH_MAJORS


def step_growth(resident: bool, cc: Optional[tuple]) -> int:
    """What the CUDA runtime adds outside the allocator after the context by the step's end, as a fit charges it:
    RESIDENT_STEP_GROWTH_BYTES for a resident run on a card of compute capability ``cc`` where it was measured
    (RESIDENT_GROWTH_MAJORS), else STEP_GROWTH_BYTES."""
    return RESIDENT_STEP_GROWTH_BYTES if _measured_resident(resident, cc) else STEP_GROWTH_BYTES


def growth_source(resident: bool, cc: Optional[tuple]) -> str:
    """Which of step_growth's two figures it charges, in words."""
    return GROWTH_RESIDENT if _measured_resident(resident, cc) else GROWTH_BOUND

#: The compute capabilities PyTorch gives the larger default cuBLAS workspace (constants: both
#: defaults; 11.x since torch 2.9's source). CUBLAS_WORKSPACE_CONFIG replaces the default: every
#: ':SIZE_KiB:COUNT' pair adds SIZE x 1024 x COUNT; a value with no pair keeps it (torch warns).
WORKSPACE_32MIB_MAJORS = (9, 10, 11, 12)
_PAIR = re.compile(r":([0-9]+):([0-9]+)")


def cublas_workspace(cc: Optional[tuple], env: Optional[str] = None) -> int:
    """Bytes of one cuBLAS handle's workspace on a card of compute capability ``cc`` (None: not
    known, the larger default), under CUBLAS_WORKSPACE_CONFIG ``env`` as PyTorch parses it."""
    default = CUBLAS_WORKSPACE if cc is None or cc[0] in WORKSPACE_32MIB_MAJORS else CUBLAS_WORKSPACE_PRE_HOPPER
    if env is None:
        return default
    pairs = _PAIR.findall(env)
    return sum(int(size) * 1024 * int(count) for size, count in pairs) if pairs else default


@dataclass(frozen=True)
class Card:
    """A card as the driver reports it: ``total_bytes`` is nvidia-smi's MiB total (or the
    nameplate where no listing is public); ``cc`` its compute capability (CUDA's public table,
    https://developer.nvidia.com/cuda-gpus); ``source`` says where the total comes from."""

    name: str
    total_bytes: int
    cc: Optional[tuple] = None
    source: str = ""
    #: bytes the driver keeps below nvidia-smi's total that CUDA never reports as total (known
    #: only where committed evidence shows both): charged into this card's default context.
    hidden_bytes: int = 0
    #: its streaming multiprocessors (NVIDIA's public specifications: CUDA cores / cores per SM), which
    #: bitsandbytes' gemm_4bit heuristic reads; None where a name covers several (the laptop parts, A10G)
    sms: Optional[int] = None
    #: the name CUDA gives it (torch.cuda.get_device_name, a saved result's ``gpu``), where a committed stack shows it
    device: Optional[str] = None

    @property
    def context_bound(self) -> int:
        return CONTEXT_BOUND_BYTES + self.hidden_bytes

    def workspace(self, env: Optional[str] = None) -> int:
        return cublas_workspace(self.cc, env)

    def kernels(self, env: Optional[str] = None) -> dict:
        """What an estimate on this card reads of it (estimate's ``workspace`` and ``dispatch``)."""
        return {"workspace": self.workspace(env), "dispatch": self.dispatch}

    @property
    def dispatch(self) -> Optional[Dispatch]:
        """What bitsandbytes' gemm_4bit heuristic reads of this card, where both are known."""
        return dispatch_for(self.sms, self.cc)


def _mib(n: int) -> int:
    return n * MiB


#: nvidia-smi's "Memory-Usage" total as public nvidia-smi listings print it for each card (an
#: idle card reads "0MiB / <total>"); the nameplate where no listing is known, said so.
CARDS: dict[str, Card] = {c.name.lower(): c for c in (
    Card("A10G", _mib(23028), (8, 6), "nvidia-smi 23028MiB (AWS g5, public nvidia-smi listings)"),
    Card("L4", _mib(23034), (8, 9), "nvidia-smi 23034MiB (GCP g2, public nvidia-smi listings)", sms=58),
    # https://github.com/robbyant-research/MagicQuill/issues/57: "3MiB / 15360MiB", Tesla T4
    Card("T4", _mib(15360), (7, 5), "nvidia-smi 15360MiB (MagicQuill issue #57)", sms=40),
    Card("RTX3090", _mib(24576), (8, 6), "nvidia-smi 24576MiB (public nvidia-smi listings)", sms=82),
    Card("RTX4090", _mib(24564), (8, 9), "nvidia-smi 24564MiB (public nvidia-smi listings)", sms=128),
    Card("RTX5090", _mib(32607), (12, 0), "nvidia-smi 32607MiB (public nvidia-smi listings)", sms=170),
    Card("A100-40GB", _mib(40960), (8, 0), "nvidia-smi 40960MiB (A100 SXM4/PCIe 40GB)", sms=108),
    Card("A100-80GB", _mib(81920), (8, 0), "nvidia-smi 81920MiB (A100 SXM4/PCIe 80GB)", sms=108),
    Card("L40S", _mib(46068), (8, 9), "nvidia-smi 46068MiB (public nvidia-smi listings)", sms=142),
    Card("H100", _mib(81559), (9, 0), "nvidia-smi 81559MiB (H100 80GB HBM3, SXM)", sms=132,
         device="NVIDIA H100 80GB HBM3"),
    # nvidia-smi 143771MiB; CUDA's own total on our H200s is 139.80 GiB (torch's OOM text in
    # results/cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37/, "GPU 0 has a total capacity of 139.80 GiB"): 616 MiB
    # the driver keeps (139.805 GiB, the rounding's top, keeps the figure a lower bound).
    Card("H200", _mib(143771), (9, 0), "nvidia-smi 143771MiB; CUDA total 139.80 GiB (committed OOM text)",
         hidden_bytes=_mib(143771) - int(139.795 * 2**30), sms=132, device="NVIDIA H200"),
    # The record's first stack. Soup's own source (layer_stream.py, decide_stream_fit) calls it
    # "a 4.29 GB card": 4096 MiB = 4.295e9 B.
    Card("RTX3050-Laptop-4GB", _mib(4096), (8, 6), "4096 MiB (Soup's docstring: 'a 4.29 GB card')"),
    Card("RTX3050-Laptop-6GB", _mib(6144), (8, 6), "nameplate 6 GB (no nvidia-smi listing known)"),
    Card("RTX4060-Laptop-8GB", _mib(8188), (8, 9), "nvidia-smi 8188 MiB (public listing)"),
    Card("RTX3060-12GB", _mib(12288), (8, 6), "nvidia-smi 12288MiB (public nvidia-smi listings)", sms=28),
    Card("RTX4060Ti-16GB", _mib(16384), (8, 9), "nameplate 16 GB (no nvidia-smi listing known)", sms=34),
    # Issue 53 item 15. Where two drivers print two totals, the lower (a fit that holds on either).
    # https://github.com/4paradigm/k8s-vgpu-scheduler/issues/7: "112MiB / 16160MiB", Tesla V100-SXM2 (driver 440)
    Card("V100-16GB", _mib(16160), (7, 0), "nvidia-smi 16160MiB (Tesla V100-SXM2-16GB, driver 440: "
         "k8s-vgpu-scheduler issue #7; newer drivers print 16384MiB)", sms=80),
    Card("V100-32GB", _mib(32510), (7, 0), "nvidia-smi 32510MiB (Tesla V100-SXM2/PCIE-32GB, public nvidia-smi "
         "listings; newer drivers print 32768MiB)", sms=80),
    Card("RTX-A6000", _mib(49140), (8, 6), "nvidia-smi 49140MiB (ECC off, its default; public nvidia-smi listings)",
         sms=84),
    Card("RTX4080", _mib(16376), (8, 9), "nvidia-smi 16376MiB (public nvidia-smi listings)", sms=76),
    Card("RTX3080", _mib(10240), (8, 6), "nvidia-smi 10240MiB (the 10 GB card; public nvidia-smi listings)", sms=68),
    Card("A40", _mib(46068), (8, 6), "nvidia-smi 46068MiB (ECC on, its default; public nvidia-smi listings)", sms=84),
    Card("L40", _mib(46068), (8, 9), "nvidia-smi 46068MiB (ECC on, its default; 49140MiB with ECC off; public "
         "nvidia-smi listings)", sms=142),
    Card("RTX2080Ti", _mib(11264), (7, 5), "nvidia-smi 11264MiB (public nvidia-smi listings)", sms=68),
)}


def saved_dispatch(env: Optional[dict]) -> Optional[Dispatch]:
    """What bitsandbytes' gemm_4bit heuristic read of the card a saved result ran on: the SM count and compute
    capability the run recorded (``gpu_sms``, ``gpu_cc``), else the named card whose CUDA name the result's ``gpu``
    is; None where neither is known, or the run recorded no bitsandbytes or another release than gemm4bit ports."""
    env = env or {}
    bnb = env.get("bitsandbytes")
    if not bnb:
        return None
    if env.get("gpu_sms") and env.get("gpu_cc"):
        return dispatch_for(env["gpu_sms"], tuple(int(x) for x in str(env["gpu_cc"]).split(".")), bnb)
    card = next((c for c in CARDS.values() if c.device and c.device == env.get("gpu")), None)
    return None if card is None else dispatch_for(card.sms, card.cc, bnb)


def _spelled(name: str) -> str:
    """A card's name as a user may type it: case, spaces, '-' and '_' aside (RTX 4080, rtx-a6000, v100 32gb)."""
    return re.sub(r"[^0-9a-z]", "", name.lower())


#: Every named card by its loose spelling (``_spelled``); no two cards share one.
SPELLED: dict[str, Card] = {_spelled(c.name): c for c in CARDS.values()}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GB|GiB)\s*$", re.IGNORECASE | re.ASCII)  # not ２４GB


def parse_card(part: str) -> Card:
    """A named card (any case) or a plain size: 24GB = 24e9 bytes, 24GiB = 24 x 2^30; a plain
    size has no compute capability (the larger cuBLAS workspace is charged)."""
    named = CARDS.get(part.strip().lower()) or SPELLED.get(_spelled(part))
    if named is not None:
        return named
    m = _SIZE.match(part)
    if part.strip().startswith("-") and _SIZE.match(part.strip()[1:]):
        raise UsageError(f"--card {part.strip()!r}: a card's size is positive, like 24GB")
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"--card {part.strip()!r} is not a size like 24GB or 80GiB nor a card "
                         f"({', '.join(c.name for c in CARDS.values())})")
    unit = 1e9 if m.group(2).lower() == "gb" else 2**30
    size = int(float(m.group(1)) * unit)
    if not 1 <= size <= 2**60:
        raise UsageError(f"--card {part.strip()!r}: a card holds from 1 byte to 2^60 bytes")
    return Card(f"{m.group(1)}{'GB' if unit == 1e9 else 'GiB'}", size, None, "the size given")


def parse_cards(text: str) -> list[Card]:
    if not isinstance(text, str) or not text.strip():
        raise UsageError("--card needs card names or sizes, e.g. A10G,RTX4090,24GB")
    cards = [parse_card(part) for part in comma_list(text)]
    # One card under two spellings (24GB and 24.0GB, a10g and A10G) is named twice too; two cards of one
    # total (L40 and L40S) are two cards.
    seen = [c.total_bytes if c.source == "the size given" else c.name for c in cards]
    twice = next((c.name for c, k in zip(cards, seen) if seen.count(k) > 1), None)
    if twice:
        raise UsageError(f"--card {text.strip()}: {twice} is named twice")
    return cards


def parse_context(text: Optional[str]) -> Optional[int]:
    """--context GB: the CUDA context the user's card leaves, in GB (1e9 bytes); None: the bound."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:GB)?\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) > 1024:
        raise UsageError(f"--context {text.strip()!r} is not a size in GB like 0.5")
    return int(float(m.group(1)) * 1e9)


@dataclass(frozen=True)
class Budget:
    """What one card leaves a run: total, the context, and the free memory the verdict uses."""

    card: Card
    context_bytes: int
    context_source: str  # 'measured' (this tool, on that card), 'given' (--context) or 'bound'
    #: the runtime's growth after the context by the step's end (None: STEP_GROWTH_BYTES) and which it is (GROWTH_BOUND,
    #: GROWTH_RESIDENT: step_growth's rule; GROWTH_PROBES: a search's probes' own, findmax.measured_growth)
    growth_bytes: Optional[int] = None
    growth_from: str = GROWTH_BOUND

    @property
    def free_bytes(self) -> int:
        """The card's free memory as an idle process sees it (an emulated card's ballast leaves this)."""
        return self.card.total_bytes - self.context_bytes

    @property
    def growth(self) -> int:
        return STEP_GROWTH_BYTES if self.growth_bytes is None else self.growth_bytes

    @property
    def step_free_bytes(self) -> int:
        return self.free_bytes - self.growth

    @property
    def gate_free_bytes(self) -> int:
        """What Soup's gate reads in `soup train` (what --estimate and --find-max predict): the free
        memory less what the CLI's runtime has loaded before it asks."""
        return self.free_bytes - CLI_GATE_GROWTH_BYTES

    @property
    def harness_gate_free_bytes(self) -> int:
        """...and in this tool's own process, whose setup has loaded more modules by Soup's gate (the
        map's lanes: which arms Soup admits beside the others)."""
        return self.free_bytes - GATE_GROWTH_BYTES

    def fits(self, needs_free: int) -> bool:
        return needs_free <= self.step_free_bytes


def step_free(free_bytes: int) -> int:
    """What one streamed step's allocator can have of a card's free memory: the runtime's growth
    during the step comes out of the same memory."""
    return free_bytes - STEP_GROWTH_BYTES


#: budget's ``cc`` default: the card's own compute capability.
CARD_CC = "the card's"


def budget(card: Card, context: Optional[int] = None, growth: Optional[int] = None, resident: bool = False,
           cc: Any = CARD_CC) -> Budget:
    """The card's budget: --context where given, else the documented bound for it; the runtime's growth ``growth``
    where measured (a search's probes'), else step_growth's for the run (``resident``) on a card of compute
    capability ``cc`` (the card's own unless given: the box's where the probes run on another card than the one
    emulated; None where unknown)."""
    cc = card.cc if cc is CARD_CC else cc
    grown = (growth, GROWTH_PROBES) if growth is not None else (step_growth(resident, cc), growth_source(resident, cc))
    if context is not None:
        return Budget(card, context, "given", *grown)
    return Budget(card, card.context_bound, "bound" if not card.hidden_bytes else DRIVER_KEPT, *grown)


#: A named card's context where its driver keeps memory below nvidia-smi's total (Card.hidden_bytes):
#: the bound and that, said so in the table and its legend (the H200's cell is not the 0.85 GB bound).
DRIVER_KEPT = "bound + the driver's"


def workspace_env() -> Optional[str]:
    return os.environ.get(WORKSPACE_CONFIG_VAR)


def emulated_outcome(soup_refused: bool, oom: bool) -> str:
    """An emulated arm as the issue words it, beside the tool's own verdict."""
    if soup_refused:
        return "refused by Soup"
    return "admitted and OOM" if oom else "admitted and completed"
