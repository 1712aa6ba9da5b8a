"""--find-max's core (issue 29 items 5 and 7): the largest seq (or batch) whose run of the real
client, ``python -m soup_cli train``, completes N optimizer steps on a card, bracketed from this
tool's answer and bisected to a stated resolution, each probe a fresh process; and the probe itself:
the user's soup.yaml copied with only what a probe must change, Soup run under --emulate-card's
ballast (held in this process, outside any allocator, so Soup's own process reads the card's free
memory), and its outcome read from Soup's own console and trainer state.

Not a ``Constraint``: a Constraint's hooks run around an arm this harness measures in its own
process and its record rides on that arm's row. A find-max probe is Soup's own process, with no
measured arm, no hooks to call and no row; what it yields is one search (``FindMax``). It is a
sibling of --min-free's bisection instead, and bench/soup_train_card.py runs its single probes
through the same ``write_probe_config`` and ``run_probe``. No torch at module level; the CUDA probe
(the ballast and Soup's step) is the only thing the CPU tests fake.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

from ..constants import ALLOC_CONF_VAR, SIZE_UNITS, allocator_setting
from ..errors import cut, last_line, soups_words
from ..estimator.cards import STEP_GROWTH_BYTES
from ..text import table
from .minfree import hold_ballast, release_ballast

COMPLETED, OOM, FAILED = "completed", "OOM", "failed"

#: What Soup prints at its gates and when a step runs out of memory (soup_cli/utils/errors.py: "GPU ran
#: out of memory ..."), the same on soup-cli 0.73.3 and 0.77.0 (trainer/stream_setup.py). cuBLAS allocates
#: its handle's workspace with cudaMalloc, outside torch's allocator: when the card is full at a step's first
#: matmul it fails as CUBLAS_STATUS_ALLOC_FAILED, the same out-of-memory by another name (measured: Mistral-7B
#: ORPO NF4 on an emulated 6 GB card, results/fit4-pages-findmax-stack-*/).
GATE_LINE = re.compile(r"VRAM|predicted to need|Predicted over budget", re.IGNORECASE)
OOM_LINE = re.compile(r"out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED", re.IGNORECASE)
SOUP_NUMBER = re.compile(r"peak VRAM ~([0-9.]+) GB")
SOUP_FREE = re.compile(r"free VRAM ([0-9.]+) GB(?: \(training\.stream_vram_override; driver reports ([0-9.]+) GB)?")
#: ...and where it refuses: the streamed gate's reason, or the resident gate's panel (commands/train.py's
#: _hardware_fit_preflight, stock or --soup-patch'ed; "Hardware-fit warning" where --allow-oom-attempt lifts it).
REFUSED = re.compile(r"predicted to need .* is free|Hardware-fit gate", re.DOTALL)
#: Soup's own error line (soup_cli/utils/errors.py, format_friendly_error: "Error: <type>: <message>"),
#: above its "Run with --verbose" hint, on both releases.
SOUP_ERROR = re.compile(r"Error: ")
#: A cuDNN or cuBLAS status a failed step raised. Both libraries allocate their handles, plans and
#: workspaces with cudaMalloc, outside torch's allocator, so at the memory edge a card's last bytes run
#: out inside them under a status other than out-of-memory (observed: CUDNN_STATUS_INTERNAL_ERROR at
#: a find-max probe one step past the limit, which raised OOM twice when run again by hand). Such a
#: failure is read by the allocator's figures (``read_at_edge``), never by its name alone.
LIBRARY_STATUS = re.compile(r"\b(CUDNN_STATUS_[A-Z_]+|CUBLAS_STATUS_[A-Z_]+)")

#: What a probe's copy of the user's soup.yaml changes, and why; every other key is the user's.
PROBE_KEYS = {
    "data.max_length": "the seq probed (--find-max seq)",
    "training.batch_size": "the batch probed (--find-max batch)",
    "data.train": "the probe's rows: each 3x longer than seq, so truncation, never padding, sets the length",
    "data.val_split": "0: every row trains (no split, no evaluation pass)",
    "data.format": "the probe's rows' format, where the file names another (never where it says auto)",
    "training.epochs": "1: one epoch of exactly N optimizer steps",
    "training.stream_vram_override": "Soup's own lift of its gate, so the probe measures completion, not Soup's refusal",
    "output": "a scratch folder",
    "base": "the checkpoint the probe runs: a folder's absolute path, or the synthetic checkpoint this tool "
            "builds for a registry model's hub id",
}

#: At most this many probes in one search (the bracket from this tool's answer needs a handful).
PROBE_LIMIT = 12

#: Soup's documented opt-out of its resident gate (commands/train.py, _hardware_fit_preflight: "pass
#: --allow-oom-attempt to try anyway"), an option of `soup train` on soup-cli 0.73.3 and 0.77.0 alike: a resident
#: probe passes it, so it measures completion, not Soup's refusal (stream_vram_override is the streamed gate's).
ALLOW_OOM_ATTEMPT = "--allow-oom-attempt"


_SIZE = r"([0-9.]+) (B|KiB|MiB|GiB|TiB)"
#: torch's CUDA out-of-memory message, as its caching allocator words it (c10/cuda/CUDACachingAllocator.cpp)
_OOM_MESSAGE = re.compile(
    rf"Tried to allocate {_SIZE}\. GPU \d+ has a total capacity of {_SIZE} of which {_SIZE} is free\..*?"
    rf"this process has {_SIZE} memory in use\. Of the allocated memory {_SIZE} is allocated by PyTorch, "
    rf"and {_SIZE} is reserved by PyTorch but unallocated", re.DOTALL)


@dataclass(frozen=True)
class OomReading:
    """What torch's out-of-memory message says of the moment it raised (measured, as torch printed it,
    to its two decimals): the request, the device's free memory, this process's memory in use (with
    what lies outside the allocator), the allocator's allocated bytes and its reserved-but-unallocated
    bytes. The last is the allocator's reserve at an OOM, after it has released what it can."""

    tried: int
    free: int
    process_in_use: int
    allocated: int
    reserved_unallocated: int

    @property
    def outside_allocator(self) -> int:
        """This process's memory that is not the allocator's: the CUDA context and the runtime's growth."""
        return self.process_in_use - self.allocated - self.reserved_unallocated


def oom_reading(text: str) -> Optional[OomReading]:
    """The first torch out-of-memory message in ``text`` (an exception's words or a console), read."""
    m = _OOM_MESSAGE.search(text)
    if m is None:
        return None
    n = [int(float(m.group(i)) * SIZE_UNITS[m.group(i + 1)]) for i in range(1, 13, 2)]
    return OomReading(tried=n[0], free=n[2], process_in_use=n[3], allocated=n[4], reserved_unallocated=n[5])


@dataclass(frozen=True)
class ProbeAllocator:
    """The probe's own caching allocator, read inside Soup's process as it exits (measured): its
    allocated peak (torch.cuda.max_memory_allocated: block sizes), requested peak (memory_stats'
    requested_bytes.all.peak: what the tensors asked for) and reserved peak (max_memory_reserved).
    reserved - allocated is the allocator's reserve at its height, allocated - requested the
    blocks' remainders: the margin's parts that a completion alone cannot name."""

    allocated_peak: int
    requested_peak: int
    reserved_peak: int
    #: the device's free memory (torch.cuda.mem_get_info) and the allocator's reserved bytes
    #: (torch.cuda.memory_reserved) at the same moment, as the process exited: with the free memory the ballast
    #: left before it started (Probe.free_held) they put its memory outside the allocator (runtime_growth); None
    #: where the hook wrote none (probes before it read them)
    free_at_exit: Optional[int] = None
    reserved_at_exit: Optional[int] = None


@dataclass(frozen=True)
class Probe:
    """One probe: the value run, how it ended, and Soup's own lines about it (measured)."""

    value: int
    outcome: str  # COMPLETED (every step), OOM, or FAILED (anything else, with Soup's line)
    steps: Optional[int] = None  # the trainer's own global step at the end
    line: Optional[str] = None  # Soup's line for an OOM or another failure
    seconds: Optional[float] = None  # the probe's wall time, Soup's process start to exit
    exit_code: Optional[int] = None
    soup_gb: Optional[float] = None  # Soup's own number, as its gate printed it ("peak VRAM ~X GB")
    driver_free_gb: Optional[float] = None  # the free memory its driver reported at the gate (printed by Soup)
    allocator: Optional[ProbeAllocator] = None  # None where Soup's process never initialised CUDA
    oom: Optional[OomReading] = None  # torch's first out-of-memory message in Soup's console, read
    library: Optional[str] = None  # a failure's cuDNN or cuBLAS status, as Soup's console printed it
    #: how a library failure was read (read_at_edge): by the allocator's figures, as OOM or not, in words
    edge: Optional[str] = None
    #: the device's free memory with the ballast held, before Soup's process started (measured by this process)
    free_held: Optional[int] = None

    @property
    def completed(self) -> bool:
        return self.outcome == COMPLETED


@dataclass
class FindMax:
    """One search: where it started, the largest value that completed (``limit``), the first value
    above it that raised OOM (``above``), the resolution, every probe in order, and why it stopped
    short where it did (``stopped``: a non-OOM failure or the probe limit)."""

    axis: str
    resolution: int
    start: int
    low: int
    high: int
    limit: Optional[int] = None
    above: Optional[int] = None
    probes: list = field(default_factory=list)
    stopped: Optional[str] = None
    seconds: float = 0.0

    @property
    def adjacent(self) -> bool:
        """The answer is proven: the limit completed and the value one resolution step above it raised
        OOM (or the limit is the largest value there is)."""
        if self.stopped:
            return False
        if self.limit is None:
            return self.above == self.low
        return self.limit == self.high or (self.above is not None and self.above - self.limit == self.resolution)

    def probe_at(self, value: Optional[int]) -> Optional[Probe]:
        """The probe that decided ``value`` (a failure probed once more: the last of them)."""
        return next((p for p in reversed(self.probes) if p.value == value), None)

    def to_json(self) -> dict:
        return {"axis": self.axis, "resolution": self.resolution, "start": self.start, "low": self.low,
                "high": self.high, "limit": self.limit, "oom_above": self.above, "proven": self.adjacent,
                "stopped": self.stopped, "wall_s": round(self.seconds, 1),
                "probes": [asdict(p) for p in self.probes]}


@dataclass(frozen=True)
class ResidentSearch:
    """What a search over a resident soup.yaml (training.stream_layers false) adds to its record: the file's
    gradient checkpointing, the input Soup's CLI built from it for its resident gate (computed by Soup; None: it
    builds none and skips its gate), how every probe lifted that gate, why this tool's resident estimate gave no
    answer (None: it gave one), what the search started from, in words, and the allocator setting the probes ran
    on (PYTORCH_CUDA_ALLOC_CONF: set to expandable segments where unset, or the value exported to this tool)."""

    checkpointing: bool
    soup_input: Optional[dict]
    started_from: str
    estimate_refused: Optional[str] = None
    gate_lifted_by: str = ALLOW_OOM_ATTEMPT
    allocator_conf: Optional[str] = None

    def to_json(self) -> dict:
        return asdict(self)


def find_max(probe: Callable[[int], Probe], axis: str, start: Optional[int], resolution: int, low: int, high: int,
             limit: int = PROBE_LIMIT, clock: Callable[[], float] = time.perf_counter,
             other: Optional[int] = None) -> FindMax:
    """The largest value in [low, high] (on the grid of ``resolution`` steps) whose probe completes.
    It starts at ``start`` (this tool's answer; None: ``low``) and probes its next step on the side the
    outcome points to, so a right answer is proven in two probes: it completes and one step above raises
    OOM. Else the walk goes on by a distance that doubles each time (one step, two, four ...) until its
    far end flips, and the bracket is bisected to the resolution. ``other`` is a second prediction
    (Soup's gate's longest), probed only where it brackets: inside the walk's next stride, in place of
    the walk's own far end; where it completes on the way up, its own next step is probed next (proving
    it, where it is the limit). A probe that fails as a cuDNN or cuBLAS status (one ``read_at_edge`` did
    not read as OOM) is probed once more; a failure of any other kind, or twice, is no evidence of
    memory: the search stops there and says so."""
    started = clock()
    snap = lambda v: max(low, min(high, low + (v - low) // resolution * resolution))  # noqa: E731
    found = FindMax(axis, resolution, snap(low if start is None else start), low, high)

    def run(value: int) -> Optional[bool]:
        for attempt in (1, 2):
            if len(found.probes) >= limit:
                found.stopped = f"the probe limit ({limit}) was reached"
                return None
            p = probe(value)
            found.probes.append(p)
            if p.outcome != FAILED:
                return p.completed
            if p.library is None:  # no library's status: nothing a second probe would read otherwise
                break
        why = "; ".join(filter(None, (p.line or "no line from Soup", p.edge)))
        found.stopped = f"the probe at {value} failed{' twice' if attempt == 2 else ''}, not OOM: {why}"
        return None

    good, bad = None, None
    ok = run(found.start)
    if ok is not None:
        good, bad = (found.start, None) if ok else (None, found.start)
    gate = None if other is None else snap(other)
    stride, resume = resolution, None
    while found.stopped is None and (good is None) != (bad is None):  # the walk: one side of the bracket known
        up = bad is None
        edge = good if up else bad
        if edge == (high if up else low):
            break
        value = min(high, edge + stride) if up else max(low, edge - stride)
        gated = gate is not None and found.probe_at(gate) is None and (
            edge < gate <= value if up else value <= gate < edge)
        value = gate if gated else value  # Soup's gate's answer, where it brackets within the stride
        ok = run(value)
        if ok is None:
            break
        if ok != up:  # the far end flipped: bracketed
            good, bad = (good, value) if up else (value, bad)
        elif gated and up:  # Soup's answer completed: its next step, then the walk's stride
            good, stride, resume = value, resolution, stride
        else:
            good, bad = (value, bad) if up else (good, value)
            stride, resume = (resume, None) if resume else (stride * 2, None)
    while found.stopped is None and good is not None and bad is not None and bad - good > resolution:
        mid = good + (bad - good) // resolution // 2 * resolution
        ok = run(mid)
        if ok is None:
            break
        good, bad = (mid, bad) if ok else (good, mid)
    found.limit, found.above = good, bad
    found.seconds = clock() - started
    return found


def read_at_edge(p: Probe, card_free: int) -> Probe:
    """A probe that failed as a cuDNN or cuBLAS status, read by its allocator's figures (measured in Soup's
    own process, read as it exited): ``card_free`` (the card's total less the context the probes bring)
    less the allocator's reserved peak is what the card had left outside torch's allocator at its height.
    Where that is less than the runtime's growth in a step (STEP_GROWTH_BYTES: the most measured outside
    the allocator by a step's end, the libraries' handles among it) the library ran out of the card: OOM
    by another name (as CUBLAS_STATUS_ALLOC_FAILED is by its own). Else, or with no reading, the failure
    stays a failure (find_max probes it once more). Any other probe is returned as it is."""
    if p.outcome != FAILED or p.library is None:
        return p
    if p.allocator is None:
        return replace(p, edge="not read as OOM: Soup's process left no allocator reading")
    left = card_free - p.allocator.reserved_peak
    words = (f"the allocator's reserved peak ({p.allocator.reserved_peak / 1e9:.3f} GB, measured) left "
             f"{left / 1e6:.1f} MB of the card's {card_free / 1e9:.3f} GB free, "
             + ("less" if left < STEP_GROWTH_BYTES else "no less")
             + f" than the runtime's growth in a step ({STEP_GROWTH_BYTES / 1e6:.1f} MB)")
    if left < STEP_GROWTH_BYTES:
        return replace(p, outcome=OOM, edge=f"{p.library} read as OOM: {words}")
    return replace(p, edge=f"not read as OOM: {words}")


def runtime_growth(p: Probe, context: int) -> Optional[int]:
    """What the CUDA runtime grew by after the context in the probe's own process (measured; None where nothing
    read it): its memory outside the allocator less ``context`` (the box's, measured by the probing process). Read
    as the process exited (the free memory the ballast left, less the free memory then, less the allocator's
    reserved bytes then: the kernel modules it loaded and the libraries' handles stay loaded to the end), else at an
    OOM from torch's message (its non-allocator memory, to torch's two decimals of GiB). Where both are the exit's
    stands: it is the driver's free memory to the byte, and nothing the runtime loaded before the OOM is gone by the
    exit, so the message can only exceed it by its rounding (Llama-3.2-1B gc 6GB at 1,600: 179.4 MB from the
    message, 176,947,200 B at the exit; results/resident-findmax-gc-charged-h100-soup0.77.0-d887191).
    It stands in for STEP_GROWTH_BYTES (the most measured on four streamed arms: docs/PEAK.md, "GATE_GROWTH_BYTES,
    STEP_GROWTH_BYTES") in the answer like for like with the probes' own growth (``measured_growth``)."""
    a = p.allocator
    if a is not None and None not in (p.free_held, a.free_at_exit, a.reserved_at_exit):
        return p.free_held - a.free_at_exit - a.reserved_at_exit - context
    return None if p.oom is None else p.oom.outside_allocator - context


def measured_growth(found: FindMax, context: Optional[int]) -> Optional[int]:
    """The most the runtime grew by after ``context`` in any probe of the search that read it (runtime_growth),
    never less than 0; None where no probe read it or the context is not measured."""
    if context is None:
        return None
    seen = [g for g in (runtime_growth(p, context) for p in found.probes) if g is not None]
    return max(0, *seen) if seen else None


def measured_words(found: FindMax, steps: int) -> str:
    """What the search measured, in words: the limit and the first value above it that raised OOM; no
    value completing, the smallest raising OOM; or, where a probe failed for another reason, that
    probe and Soup's line, never an OOM it did not raise."""
    failed = next((p for p in found.probes if p.outcome == FAILED), None)
    if found.limit is None and failed is not None:
        return f"no answer: the probe at {found.axis} {failed.value} failed, not OOM: {failed.line or 'no line from Soup'}"
    if found.limit is None:
        return (f"no {found.axis} completes {steps} step(s): the smallest, {found.above}, raised OOM" if found.above
                is not None else f"no {found.axis} was probed ({found.stopped or 'nothing ran'})")
    above = found.probe_at(found.above)
    measured = (f"{found.axis} {found.limit} completes {steps} of {steps} step(s); "
                + (f"{found.axis} {found.above} raised OOM" + (f" ({above.edge})" if above and above.edge else "")
                   if found.above is not None else
                   f"no OOM up to the largest {found.axis} there is ({found.high})" if found.limit == found.high
                   else "no probe above it completed or raised OOM"))
    return measured + (f" -- stopped before the answer was proven: {found.stopped}" if found.stopped else "")


def soup_checks(config: Path, task_name: str) -> Optional[str]:
    """Soup's own checks on a probe's soup.yaml, on CPU and before any probe, so a file Soup refuses
    costs no GPU probe: its loader (schema and validators), its data loader on the probe's rows, and,
    for SFT, its own row formatting with the base's tokenizer (build_format_row: Soup refuses a
    tokenizer with no chat template unless data.chat_template names one). None where all pass; else
    Soup's words, one line. The tokenizer is read only from a folder (a hub id is not fetched)."""
    import contextlib
    import io

    from soup_cli.config.loader import load_config_from_string
    from soup_cli.data.loader import load_dataset

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # Soup's console notes ("Auto-detected format"): not ours
            _soup_checks(config, task_name, load_config_from_string, load_dataset)
    except Exception as exc:  # Soup's refusal, in its words
        return cut(soups_words(str(exc)) or last_line(exc))
    return None


def _soup_checks(config: Path, task_name: str, load_config_from_string: Callable, load_dataset: Callable) -> None:
    """soup_checks' checks, each raising Soup's own error."""
    cfg = load_config_from_string(config.read_text(encoding="utf-8"))
    dataset = load_dataset(cfg.data)
    if task_name == "sft" and Path(str(cfg.base)).is_dir() and dataset.get("train"):
        from soup_cli.data.sft_format import build_format_row
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(cfg.base))
        build_format_row(tokenizer=tokenizer, data_cfg=cfg.data, console=None,
                         training_cfg=cfg.training)(dataset["train"][0])


# -- the probe: the user's soup.yaml, Soup's own process under the ballast --
def _set(config: dict, dotted: str, value: Any) -> None:
    node = config
    *parents, key = dotted.split(".")
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[key] = value


def probe_config(user_text: str, axis: str, value: int, *, data: Path, output: Path, override: Optional[int],
                 data_format: str, base: Optional[str] = None) -> dict:
    """The user's soup.yaml (its text, never its file) with only PROBE_KEYS changed: the probed seq or
    batch, the probe's rows, one epoch of them with no split, the gate lifted (``override`` None: the
    file's gate kept, as bench/soup_train_card.py runs it without --override), a scratch output."""
    import yaml

    config = copy.deepcopy(yaml.safe_load(user_text))
    _set(config, "data.max_length" if axis == "seq" else "training.batch_size", int(value))
    _set(config, "data.train", str(data))
    _set(config, "data.val_split", 0.0)
    if config["data"].get("format", "auto") not in ("auto", data_format):
        config["data"]["format"] = data_format
    _set(config, "training.epochs", 1)
    if override is not None:
        _set(config, "training.stream_vram_override", int(override))
    config["output"] = str(output)
    if base is not None:
        config["base"] = base
    return config


def write_probe_config(folder: Path, config: dict, rows: list) -> Path:
    """The probe's soup.yaml and its rows, in the probe's own folder."""
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    Path(config["data"]["train"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = folder / "soup.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def steps_done(out: Path, log: str) -> Optional[int]:
    """The trainer's own global step (its trainer_state.json, saved at the last step), else the loss
    lines it logged."""
    states = sorted(out.rglob("trainer_state.json")) if out.is_dir() else []
    if states:
        return max(int(json.loads(p.read_text()).get("global_step", 0)) for p in states)
    logged = len(re.findall(r"['\"]loss['\"]\s*:", log))
    return logged or None


def _plain(log: str) -> str:
    """Soup's console without its panel's borders, each wrapped line joined."""
    return " ".join(re.sub(r"[│┃║|╭╮╰╯─]+", " ", log).split())


def _bare(line: str) -> str:
    """One console line of Soup's without its panel's side borders."""
    return " ".join(line.replace("│", " ").split())


def soup_lines(log: str) -> list[str]:
    """Soup's gate lines, as it printed them."""
    return [_bare(x) for x in log.splitlines() if GATE_LINE.search(x)]


def judge(value: int, log: str, exit_code: int, steps: Optional[int], wanted: int,
          seconds: Optional[float] = None) -> Probe:
    """A probe's outcome from Soup's own console, exit code and trainer state: every step done and
    exit 0 is COMPLETED; an out-of-memory line is OOM; anything else FAILED, with Soup's line."""
    plain = _plain(log)
    number, free = SOUP_NUMBER.search(plain), SOUP_FREE.search(plain)
    gate = dict(soup_gb=float(number.group(1)) if number else None,
                driver_free_gb=(float(free.group(2) or free.group(1)) if free else None))
    lines = [_bare(x) for x in log.splitlines() if x.strip()]
    oom = next((x for x in lines if OOM_LINE.search(x)), None)
    if oom is not None:
        return Probe(value, OOM, steps, cut(oom), seconds, exit_code, **gate, oom=oom_reading(plain))
    if exit_code == 0 and steps == wanted:
        return Probe(value, COMPLETED, steps, None, seconds, exit_code, **gate)
    error = next((x for x in lines if SOUP_ERROR.match(x)), None)  # Soup's own words (format_friendly_error)
    why = (f"exit 0 after {steps} of {wanted} step(s)" if exit_code == 0 and error is None else
           "refused by Soup's gate" if REFUSED.search(log) else error or (lines[-1] if lines else "no output"))
    library = LIBRARY_STATUS.search(plain) if exit_code != 0 else None
    return Probe(value, FAILED, steps, cut(why), seconds, exit_code, **gate, library=library and library.group(1))


#: Soup's own ``python -m soup_cli`` with one exit hook: the allocator's peaks, written where
#: PEAKS_ENV names, by the process that ran the step (only if it initialised CUDA). Nothing of torch is
#: imported before Soup's own code, so Soup still sets its allocator config before CUDA starts.
PEAKS_ENV = "ISSUE395_PROBE_PEAKS"
PEAKS_HOOK = """import atexit, json, os, runpy, sys
def _issue395_peaks():
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            stats = torch.cuda.memory_stats()
            try:  # the peaks are read without it where the device no longer answers
                free, reserved = int(torch.cuda.mem_get_info()[0]), int(torch.cuda.memory_reserved())
            except Exception:
                free = reserved = None
            with open(os.environ["%s"], "w") as f:
                json.dump({"allocated_peak": int(torch.cuda.max_memory_allocated()),
                           "requested_peak": int(stats.get("requested_bytes.all.peak", 0)),
                           "reserved_peak": int(torch.cuda.max_memory_reserved()),
                           "free_at_exit": free, "reserved_at_exit": reserved}, f)
    except Exception:  # a reading that fails is no reading: the probe's outcome stays Soup's own
        pass
atexit.register(_issue395_peaks)
sys.argv[0] = "soup_cli"
runpy.run_module("soup_cli", run_name="__main__", alter_sys=True)
""" % PEAKS_ENV


def soup_command(soup: Optional[list] = None) -> list:
    """soup-cli 0.73.3 and 0.77.0 alike run as ``python -m soup_cli`` (this interpreter)."""
    return list(soup) if soup else [sys.executable, "-m", "soup_cli"]


def hooked_soup_command(soup: Optional[list] = None) -> list:
    """The command a probe runs: soup_command's, with PEAKS_HOOK around Soup's own ``__main__``."""
    return list(soup) if soup else [sys.executable, "-c", PEAKS_HOOK]


def read_peaks(path: Path) -> Optional[ProbeAllocator]:
    """The probe's allocator peaks as its exit hook wrote them; None where it wrote none."""
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        exit_reading = [None if d.get(k) is None else int(d[k]) for k in ("free_at_exit", "reserved_at_exit")]
        return ProbeAllocator(int(d["allocated_peak"]), int(d["requested_peak"]), int(d["reserved_peak"]), *exit_reading)
    except (OSError, ValueError, KeyError, TypeError):
        return None


#: Why a resident search's probes run on expandable segments, in the plan's words.
ALLOC_WHY = ("the setting this tool's resident need holds under; stock `soup train` sets it in time for a streamed "
             "run of 0.77.0 only, so a resident run needs it exported: export another value to probe that one")


def probe_allocator() -> str:
    """The allocator setting a resident search's probes run on (constants.allocator_setting under this tool's
    environment): the value exported to this tool, else expandable segments."""
    return allocator_setting(os.environ)


def run_probe(config: Path, value: int, wanted: int, card_total: int, *, soup: Optional[list] = None,
              log_to: Optional[Path] = None, hold: Callable = hold_ballast, release: Callable = release_ballast,
              run: Callable = subprocess.run, clock: Callable[[], float] = time.perf_counter,
              allow_oom_attempt: bool = False, expandable: bool = False) -> tuple[Probe, Any, str]:
    """``soup train --config CONFIG --yes`` (a resident file's with ALLOW_OOM_ATTEMPT and ``expandable``: on
    probe_allocator(), the setting its answer holds under, which Soup sets for a streamed run itself) in a fresh
    process while this process holds a ballast that leaves ``card_total`` bytes free (Soup's process brings its
    own context out of it, as on the card itself); judged. Returns the probe, the ballast held and Soup's
    console."""
    ballast = hold(card_total)
    try:
        started = clock()
        peaks = config.parent / "allocator-peaks.json"
        done = run(hooked_soup_command(soup) + ["train", "--config", str(config), "--yes"]
                   + ([ALLOW_OOM_ATTEMPT] if allow_oom_attempt else []), capture_output=True, text=True,
                   cwd=str(config.parent), env=dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="400",
                                                    **{PEAKS_ENV: str(peaks)},
                                                    **({ALLOC_CONF_VAR: probe_allocator()} if expandable else {})))
        seconds = round(clock() - started, 1)
    finally:
        release(ballast)
    log = (done.stdout or "") + (done.stderr or "")
    if log_to is not None:
        log_to.write_text(log)
    import yaml

    out = Path(yaml.safe_load(config.read_text())["output"])
    probe = replace(judge(value, log, done.returncode, steps_done(out, log), wanted, seconds), allocator=read_peaks(peaks),
                    free_held=getattr(ballast, "free_after", None))
    return probe, ballast, log


def probe_words(p: Probe, wanted: int) -> str:
    if p.completed:
        return f"completed {p.steps} of {wanted} step(s)"
    if p.library and p.outcome == OOM:  # a library's failure read as OOM: its status, and by what
        return f"OOM ({p.library}, read by the allocator's figures): {p.line}"
    return f"{p.outcome}: {p.line}" if p.line else p.outcome


def probe_table(found: FindMax, wanted: int, context: Optional[int] = None) -> list[str]:
    """Every probe in order (measured), with the allocator's peaks Soup's own process read at its exit; with the
    box's ``context`` (measured), and where a probe read it, the runtime's growth after it (runtime_growth)."""
    def peak(p: Probe, name: str) -> str:
        return f"{getattr(p.allocator, name) / 1e9:.3f}" if p.allocator is not None else "-"

    def grown(p: Probe) -> list[str]:
        g = runtime_growth(p, context)
        return [f"{g / 1e6:.1f}" if g is not None else "-"]
    read = context is not None and any(runtime_growth(p, context) is not None for p in found.probes)
    cells = [[str(i), str(p.value), probe_words(p, wanted)[:110], f"{p.seconds:.1f}" if p.seconds is not None else "-",
              f"{p.soup_gb:.2f}" if p.soup_gb is not None else "-",
              f"{p.driver_free_gb:.2f}" if p.driver_free_gb is not None else "-",
              peak(p, "allocated_peak"), peak(p, "reserved_peak"), *(grown(p) if read else [])]
             for i, p in enumerate(found.probes, 1)]
    return table([("#", 2), (found.axis, 6), ("outcome (measured)", -40), ("wall s", 6),
                  ("Soup's number GB", 16), ("driver's free GB", 16), ("allocated GB", 12), ("reserved GB", 11),
                  *([("runtime growth MB", 17)] if read else [])], cells)