"""Attribution of the blocks live at a Soup step's peak by PHYSICAL class, from their sizes alone.

An allocator history (torch.cuda.memory._snapshot) lists, at the peak, each live block's
requested size. Every class below has sizes fixed by the model's public shape and the arm, so a
block is named by its size: no torch, stdlib only. Resident tensors (pool, extras, LoRA weights,
the main thread's cuBLAS workspace) are allocated before the step and are counted apart as
``resident_at_peak``; they are not classified here.

Then ``class_breakdown`` sets each class's live bytes against the issue395.estimator.estimate term meant to
charge it, with the miss expressed in the unit it scales with.

A preference task's row (DPO, ORPO, SimPO, KTO) is sized as its own step runs: 2 x batch rows for
the paired losses, the loss's fp32 blocks as the estimator lists them (estimate.task_loss_blocks),
and 0.77.0's private copy of an untied head (estimate.head_copy) as a class of its own.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

from ..constants import CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_PRE_HOPPER, block_bytes
from ..errors import UsageError
from ..record import LORA_R
from ..model.registry import FAMILIES, SHAPES, config_json
from ..model.streaming import family_of
from .arch import arch_from_config, fp32_residual
from . import estimate as E
from .releases import RELEASE_FEATURES, installed_release
from .terms import BY_KEY, Phase, live_in
from ..tasks import PROTOCOL_TASK, task


DEQUANTISED = "dequantised layer weights"
LOGITS_BF16 = "logits bf16"
LOGITS_FP32 = "logits fp32"
HEAD_COPY = BY_KEY["head_copy"].words  # a task row's class only (SFT's runs one forward)
CHECKPOINTED = "checkpointed layer inputs"
FP32_RESIDUAL = "fp32 residual"
MASKS = "masks"
ROTARY = "rotary tables"
WORKSPACES = "cuBLAS workspaces"
REST = "the rest"

#: Tie-break order, first wins when two classes share a size:
#: 1. dequantised layer weights: they exist only on NF4 arms and only inside a layer's recompute
#:    and backward, when the logits are already freed, so a weight-sized block there is a
#:    weight (Mistral-7B NF4 512x1: 4096x4096 bf16 = 32 MiB = its bf16 logits 512x32768x2 = a
#:    Hopper cuBLAS workspace; 4096x1024 bf16 = 8 MiB = T h 4).
#: 2. logits fp32, then logits bf16: the largest blocks of the loss phase.
#: 3. checkpointed layer inputs (T h 2; T h 4 on phi NF4, whose residual is fp32 after layer 0,
#:    where L-1 saved inputs outnumber the one final-norm copy), then fp32 residual (T h 4).
#: 4. rotary tables, cuBLAS workspaces, then masks (1, 2 or 4 B x seq^2 x batch), whose sizes
#:    are the likeliest to coincide; 'the rest' is what nothing names.
CLASSES = (DEQUANTISED, LOGITS_FP32, LOGITS_BF16, CHECKPOINTED, FP32_RESIDUAL, ROTARY, WORKSPACES,
           MASKS, REST)
#: A task row's classes, in the table's order: SFT's, with the head's private copy after the logits.
TASK_CLASSES = CLASSES[:3] + (HEAD_COPY,) + CLASSES[3:]
#: A task row's tie-break where its loss's fp32 blocks are live (the loss and the reference
#: forward, where every task arm measured peaks): the recompute's dequantised layer is freed
#: there (the reference forward's no-grad linears hold one weight at a time), so a size a layer
#: weight shares is the loss phase's: Mistral-7B NF4 512x1 DPO's 32 checkpointed inputs are
#: 2 rows x 512 x 4096 x 2 = 8 MiB, its k/v weights' size. The head's copy comes first and takes
#: one block (there is one copy): on Mistral-7B DPO 1024x1 its 2^28 B is a logits block's size too.
#: Where no loss block is live (the layer phase), SFT's order, the dequantised layer taking as
#: many blocks of a size as one layer has linears of it (Classifier's limits), the inputs the rest.
TASK_LOSS_ORDER = (HEAD_COPY, LOGITS_FP32, CHECKPOINTED, FP32_RESIDUAL, LOGITS_BF16, DEQUANTISED, ROTARY,
                   WORKSPACES, MASKS, REST)
#: A seq x seq mask per row: bool (PEAK: the sliding-window mask), or an additive bf16 or fp32
#: one (transformers' eager/sdpa fallbacks). Only these widths: any multiple of seq^2 would name
#: most blocks at short seq (Mistral 512x1: a 4096x14336 weight is 448 x 512^2).
MASK_BYTES = (1, 2, 4)
#: One block of torch's default per handle, on Hopper or before it (constants).
WORKSPACE_SIZES = (CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_PRE_HOPPER)


def _sizes(exact: int) -> set:
    """A class size as requested, and as rounded to the allocator's 512 B (a caller may pass
    either; the snapshot records the requested size)."""
    return {exact, block_bytes(exact)}


def class_sizes(config: dict, *, quant: str, seq: int, batch: int, name: str = PROTOCOL_TASK,
                loss_blocks: Iterable[int] = (), head: int = 0) -> dict:
    """class -> the set of block sizes (bytes) that name it, before tie-breaks. A task's step runs
    at ``batch`` x its rows per example; ``loss_blocks`` are its loss's fp32 blocks and ``head`` the
    head's private copy, as the estimator sizes them (physical_classifier passes them)."""
    a = arch_from_config(config)  # the physics of the saved row, whatever Soup is installed
    rows = batch * task(name).rows_per_example
    T, elements = seq * rows, seq * rows * a.V
    out = {c: set() for c in TASK_CLASSES}
    if quant == "nf4":
        for fan_in, fan_out, _ in a.modules.values():
            out[DEQUANTISED] |= _sizes(2 * fan_in * fan_out)
    out[LOGITS_BF16] |= _sizes(2 * elements)
    out[LOGITS_FP32] |= _sizes(4 * elements)
    for b in loss_blocks:
        out[LOGITS_FP32] |= _sizes(b)
    if head:
        out[HEAD_COPY] |= _sizes(head)
    out[CHECKPOINTED] |= _sizes(2 * T * a.h)
    if fp32_residual(a, quant):
        out[CHECKPOINTED] |= _sizes(4 * T * a.h)
    out[FP32_RESIDUAL] |= _sizes(4 * T * a.h)
    out[ROTARY] |= _sizes(4 * a.rotary_dim * seq)
    for w in WORKSPACE_SIZES:
        out[WORKSPACES] |= _sizes(w)
    for width in MASK_BYTES:
        out[MASKS] |= _sizes(width * seq * seq * rows)
    return out


def _whole_size(size) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise UsageError(f"block size {size!r} is not a whole number of bytes")
    return size


class Classifier:
    """Names a block live at the peak by its size (bytes), one of the classes: called on one size,
    by ``order``; over the blocks live at once (``blocks``), by ``order`` where one of
    ``loss_sizes`` is live and by ``layer_order`` where none is. ``limits`` (class -> {size: n}):
    the most blocks of a size a class holds at once; the next class that names the size takes
    more (the last one takes what is left)."""

    def __init__(self, sizes: dict, order: tuple, layer_order: tuple, loss_sizes: frozenset = frozenset(),
                 limits: dict | None = None):
        self.order, self.layer_order, self.loss_sizes = order, layer_order, loss_sizes
        self.limits = {c: {block_bytes(s): n for s, n in by.items()} for c, by in (limits or {}).items()}
        self._named = {o: self._table(sizes, o) for o in {order, layer_order}}

    @staticmethod
    def _table(sizes: dict, order: tuple) -> dict:
        table: dict = {}
        for cls in order:  # earlier classes come first for a shared size
            for s in sizes.get(cls, ()):
                table.setdefault(s, []).append(cls)
        return table

    def __call__(self, size: int) -> str:
        return self._named[self.order].get(_whole_size(size), [REST])[0]

    def blocks(self, sizes) -> dict:
        """class -> live bytes (512-rounded) of the blocks ``sizes`` live at once, in the order the
        classes first appear."""
        sizes = [_whole_size(s) for s in sizes]
        loss = not self.loss_sizes or any(s in self.loss_sizes for s in sizes)
        named = self._named[self.order if loss else self.layer_order]
        out: dict = {}
        taken: dict = {}
        for s in sizes:
            b = block_bytes(s)
            classes = named.get(s, [REST])
            c = next((c for c in classes if taken.get((c, b), 0) < self.limits.get(c, {}).get(b, math.inf)),
                     classes[-1])
            taken[(c, b)] = taken.get((c, b), 0) + 1
            out[c] = out.get(c, 0) + b
        return out


def physical_classifier(config: dict, *, quant: str, seq: int, batch: int, targets=None,
                        lora_r: int = LORA_R, task: str = PROTOCOL_TASK,
                        release: str | None = None) -> Classifier:
    """The classifier of an arm's live blocks (Classifier). ``targets`` and ``lora_r`` are checked
    against the model (as issue395.estimator.estimate does) but name no class: LoRA's own blocks
    are far below a layer weight and fall in 'the rest'. ``task``: its rows, its loss's fp32 blocks
    (estimate.task_loss_blocks) and, by ``release``'s features, the head's private copy (the
    estimate's head_copy term)."""
    est = E.estimate(config, quant=quant, seq=seq, batch=batch, targets=targets, lora_r=lora_r, task=task,
                     release=release or next(iter(RELEASE_FEATURES)), soup=False)  # the checks, one line each
    if est.task == PROTOCOL_TASK:
        sizes = class_sizes(config, quant=quant, seq=seq, batch=batch)
        return Classifier(sizes, CLASSES, CLASSES)
    a = arch_from_config(config)
    loss = E.task_loss_blocks(a, est.task, seq, batch)
    head = est.terms.get("head_copy", 0)
    sizes = class_sizes(config, quant=quant, seq=seq, batch=batch, name=est.task, loss_blocks=loss, head=head)
    weights: dict = {}  # one layer's linears, by size
    for fan_in, fan_out, _ in (a.modules.values() if quant == "nf4" else ()):
        weights[2 * fan_in * fan_out] = weights.get(2 * fan_in * fan_out, 0) + 1
    return Classifier(sizes, TASK_LOSS_ORDER, TASK_CLASSES, frozenset().union(*(_sizes(b) for b in loss)),
                      limits={HEAD_COPY: {head: 1}, DEQUANTISED: weights})


def classifier_for(key: str, *, quant: str, seq: int, batch: int, targets=None, task: str = PROTOCOL_TASK,
                   release: str | None = None) -> Classifier | None:
    """``physical_classifier`` for an arm of one of the record's two models or the map's families
    (the models with a public config here; not --model), or None. A task's head copy is sized by
    ``release``'s features (default: the installed Soup's). It never raises: an attribution must
    never cost the measurement it attributes (e.g. a Soup release this tool cannot read)."""
    family = family_of(key)  # a streaming mode's blocks are its family's kinds
    if family not in SHAPES and family not in FAMILIES:
        return None
    try:
        if task != PROTOCOL_TASK:
            release = release or installed_release()
        return physical_classifier(config_json(family), quant=quant, seq=seq, batch=batch, targets=targets,
                                   task=task, release=release)
    except Exception:  # noqa: BLE001
        return None


def classify_blocks(sizes, classify: Callable[[int], str]) -> dict:
    """class -> live bytes (each block as the allocator holds it, 512-rounded), for the classes
    ``classify`` names among ``sizes``, in the order they first appear; the one classifier of live
    blocks, the peak's attribution's (issue395.measure.cuda) too. A Classifier reads the blocks
    together (the phase they show, the most blocks of a size a class holds)."""
    if isinstance(classify, Classifier):
        return classify.blocks(sizes)
    out: dict = {}
    for s in sizes:
        c = classify(s)
        out[c] = out.get(c, 0) + block_bytes(s)
    return out


def live_blocks(blocks) -> list[list[int]]:
    """The blocks live at a peak as [size, count] pairs, largest first: what a saved attribution
    keeps, so the table names its classes when it is rendered, by the classifier then."""
    counts: dict = {}
    for s in blocks:
        counts[s] = counts.get(s, 0) + 1
    return [[s, counts[s]] for s in sorted(counts, reverse=True)]


def _charged(est, term: str) -> int:
    """A term's bytes where it counts in the estimate's binding phase (the term table's), else 0."""
    return est.terms[term] if term in est.terms and Phase(est.phase) in BY_KEY[term].phases else 0


#: The classes' terms (their bytes where the binding phase holds them); 'the rest' charges every
#: other term of the step but the allocator's rounding and the retained blocks', the loss's and reference's
#: remainders (segment tails and unsplit rests: live bytes past a request, not a block of their own).
#: 'dequantised_linear', the reference forward's one weight in flight, is read where the estimate emits it;
#: 'reference_head' (the no-grad head's bf16 logits, normed hidden and cast head beyond a layer's moment) is the
#: rest's: it spans several classes and is a difference of moments, not a set of blocks.
NAMED_TERMS = {DEQUANTISED: ("dequantised_layer", "dequantised_linear", "expert_in_flight"),
               LOGITS_FP32: ("logits", "reference_held"), HEAD_COPY: ("head_copy",),
               CHECKPOINTED: ("checkpointed_inputs",), FP32_RESIDUAL: ("final_norm",),
               MASKS: ("sliding_mask",), ROTARY: ("rotary_tables",), WORKSPACES: ("autograd_workspace",)}
_UNCHARGED = ({"allocator_rounding", "retained_remainders", "loss_remainders", "reference_remainders"}
              | set(live_in(Phase.RESIDENT)))
_STEP_PHASES = {Phase.LOSS, Phase.REFERENCE, Phase.LAYER}


def class_breakdown(classes: dict, est, *, seq: int, batch: int, config: dict) -> list[dict]:
    """Each class's live bytes against the estimator term meant to charge it. ``missed`` is live
    minus charged (positive: the estimate charges too little); ``per`` is (count, unit) the miss
    scales with, and ``missed_per`` the miss per unit; ``per`` is None for a constant. A task row
    (``est.task``) is charged at its rows, its head copy in a class of its own where either side
    holds one."""
    known = CLASSES if est.task == PROTOCOL_TASK else TASK_CLASSES
    unknown = set(classes) - set(known)
    if unknown:
        raise UsageError(f"unknown class(es): {', '.join(sorted(unknown))}")
    a = arch_from_config(config)  # the physics of the saved row, whatever Soup is installed
    rows = batch * task(est.task).rows_per_example
    T, elements = seq * rows, seq * rows * a.V
    softcap = E.SOFTCAP_EXTRA_BYTES * elements if a.softcap else 0
    charged = {c: sum(_charged(est, t) for t in terms) for c, terms in NAMED_TERMS.items()}
    logits = _charged(est, "logits")
    charged[LOGITS_FP32] -= softcap if logits else 0  # the saved bf16 tanh output
    charged[LOGITS_BF16] = softcap if logits else 0
    if fp32_residual(a, est.quant):  # phi NF4: the final norm's T h 4 copy ties with the L-1 fp32
        charged[CHECKPOINTED] += charged[FP32_RESIDUAL]  # saved inputs and is named with them
        charged[FP32_RESIDUAL] = 0  # (CLASSES tie-break 3)
    named = {t for terms in NAMED_TERMS.values() for t in terms} | _UNCHARGED
    charged[REST] = sum(_charged(est, t) for t in est.terms if t not in named and BY_KEY[t].phases & _STEP_PHASES)
    per = {DEQUANTISED: (1, "layer"), LOGITS_FP32: (elements, "logits element"),
           LOGITS_BF16: (elements, "logits element"), HEAD_COPY: None, CHECKPOINTED: (T, "token"),
           FP32_RESIDUAL: (T, "token"), MASKS: (seq * seq * rows, "seq^2"), ROTARY: (seq, "position"),
           WORKSPACES: None, REST: (T, "token")}
    out = []
    for cls in known:
        live = int(classes.get(cls, 0))
        if cls == HEAD_COPY and not (live or charged[cls]):
            continue  # a tied head, or a loss without a second forward: no copy on either side
        missed = live - charged[cls]
        out.append({"class": cls, "live": live, "charged": charged[cls], "missed": missed,
                    "per": per[cls], "missed_per": (missed / per[cls][0]) if per[cls] and per[cls][0] else None})
    return out


def render(rows: list[dict]) -> str:
    """The breakdown as a fixed-width table, bytes in MB."""
    lines = [f"{'class':<28}{'live MB':>12}{'charged MB':>12}{'missed MB':>12}  missed per unit"]
    for r in rows:
        per = "constant" if r["per"] is None else f"{r['missed_per']:.2f} B per {r['per'][1]}"
        lines.append(f"{r['class']:<28}{r['live'] / 1e6:>12.3f}{r['charged'] / 1e6:>12.3f}"
                     f"{r['missed'] / 1e6:>12.3f}  {per}")
    return "\n".join(lines) + "\n"


#: The resident terms: allocated before the step, counted apart by the attribution.
RESIDENT_TERMS = live_in(Phase.RESIDENT)


def margin_anatomy(margins: list[dict], release: str | None = None, transformers: str | None = None) -> str:
    """For each attributed arm whose blocks were named by physical class: the classes against
    the corrected estimate's terms, the resident weights first (the map's margin table). A margin
    that kept its live blocks' sizes is named now, by its task; a task row without them was named
    at SFT's sizes when it ran, so its split is not shown. ``transformers``: the release the rows ran
    (None: the installed one), which decides eager attention's terms."""
    out = []
    for m in margins:
        if not m.get("physical"):
            continue
        name, arm = m.get("task") or PROTOCOL_TASK, f"{m['model']} {m['quant']} {m['seq']}x{m['batch']}"
        try:
            config = config_json(family_of(m["model_key"]))
            est = E.estimate_key(m["model_key"], quant=m["quant"], seq=m["seq"], batch=m["batch"],
                                 release=release, soup=False, task=name, transformers=transformers)
            classes = dict(m["physical"])
            resident = int(classes.pop("resident weights", 0))
            if m.get("live_blocks"):
                classes = classify_blocks([s for s, n in m["live_blocks"] for _ in range(n)], physical_classifier(
                    config, quant=m["quant"], seq=m["seq"], batch=m["batch"], task=name, release=release))
        except (UsageError, KeyError):  # a release or model this estimator does not know: none
            continue
        if name != PROTOCOL_TASK and not m.get("live_blocks"):
            out += [f"  {arm}: not split by class: it ran before the classes read its task (its blocks were "
                    "named at SFT's sizes) and kept no block sizes to name again"]
            continue
        charged = sum(est.terms.get(t, 0) for t in RESIDENT_TERMS)
        rows = [{"class": "resident weights", "live": resident, "charged": charged, "missed": resident - charged,
                 "per": None, "missed_per": None}]
        rows += class_breakdown(classes, est, seq=m["seq"], batch=m["batch"], config=config)
        out += [f"  {arm} (live: measured here; charged: this "
                f"tool's corrected estimate, {est.phase} phase)"]
        out += ["    " + line for line in render(rows).splitlines()]
    return "\n".join(["the peak by physical class (allocator history; missed = live - charged)"] + out) if out else ""
