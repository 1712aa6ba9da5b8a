"""Attribution of the blocks live at a Soup step's peak by PHYSICAL class, from their sizes alone.

An allocator history (torch.cuda.memory._snapshot) lists, at the peak, each live block's
requested size. Every class below has sizes fixed by the model's public shape and the arm, so a
block is named by its size: no torch, stdlib only. Resident tensors (pool, extras, LoRA weights,
the main thread's cuBLAS workspace) are allocated before the step and are counted apart as
``resident_at_peak``; they are not classified here.

Then ``class_breakdown`` sets each class's live bytes against the issue395.estimator.estimate term meant to
charge it, with the miss expressed in the unit it scales with.
"""

from __future__ import annotations

from typing import Callable

from ..constants import CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_PRE_HOPPER, block_bytes
from ..errors import UsageError
from ..record import LORA_R
from ..model.registry import FAMILIES, SHAPES, config_json, family_of
from .arch import Arch, arch_from_config
from . import estimate as E
from .releases import RELEASE_FEATURES
from .terms import BY_KEY, Phase, live_in
from ..tasks import task


DEQUANTISED = "dequantised layer weights"
LOGITS_BF16 = "logits bf16"
LOGITS_FP32 = "logits fp32"
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


def _fp32_inputs(a: Arch, quant: str) -> bool:
    return a.model_type == "phi" and quant == "nf4"


def class_sizes(config: dict, *, quant: str, seq: int, batch: int) -> dict:
    """class -> the set of block sizes (bytes) that name it, before tie-breaks."""
    a = arch_from_config(config)  # the physics of the saved row, whatever Soup is installed
    T, elements = seq * batch, seq * batch * a.V
    out = {c: set() for c in CLASSES}
    if quant == "nf4":
        for fan_in, fan_out, _ in a.modules.values():
            out[DEQUANTISED] |= _sizes(2 * fan_in * fan_out)
    out[LOGITS_BF16] |= _sizes(2 * elements)
    out[LOGITS_FP32] |= _sizes(4 * elements)
    out[CHECKPOINTED] |= _sizes(2 * T * a.h)
    if _fp32_inputs(a, quant):
        out[CHECKPOINTED] |= _sizes(4 * T * a.h)
    out[FP32_RESIDUAL] |= _sizes(4 * T * a.h)
    out[ROTARY] |= _sizes(4 * a.rotary_dim * seq)
    for w in WORKSPACE_SIZES:
        out[WORKSPACES] |= _sizes(w)
    for width in MASK_BYTES:
        out[MASKS] |= _sizes(width * seq * seq * batch)
    return out


def physical_classifier(config: dict, *, quant: str, seq: int, batch: int, targets=None,
                        lora_r: int = LORA_R) -> Callable[[int], str]:
    """A function naming a block live at the peak by its size (bytes), one of CLASSES. ``targets``
    and ``lora_r`` are checked against the model (as issue395.estimator.estimate does) but name no class:
    LoRA's own blocks are far below a layer weight and fall in 'the rest'."""
    E.estimate(config, quant=quant, seq=seq, batch=batch, targets=targets, lora_r=lora_r,
               release=next(iter(RELEASE_FEATURES)), soup=False)  # the same input checks, one-line UsageErrors
    sizes = class_sizes(config, quant=quant, seq=seq, batch=batch)
    table: dict = {}
    for cls in CLASSES:  # earlier classes win a shared size
        for s in sizes[cls]:
            table.setdefault(s, cls)
    def classify(size: int) -> str:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise UsageError(f"block size {size!r} is not a whole number of bytes")
        return table.get(size, REST)

    return classify


def classifier_for(key: str, *, quant: str, seq: int, batch: int, targets=None) -> Callable[[int], str] | None:
    """``physical_classifier`` for an arm of one of the record's two models or the map's families
    (the models with a public config here; not --model), or None. It never raises: an attribution
    must never cost the measurement it attributes (e.g. a Soup release this tool cannot read)."""
    family = family_of(key)  # a streaming mode's blocks are its family's kinds
    if family not in SHAPES and family not in FAMILIES:
        return None
    try:
        return physical_classifier(config_json(family), quant=quant, seq=seq, batch=batch, targets=targets)
    except Exception:  # noqa: BLE001
        return None


def classify_blocks(sizes, classify: Callable[[int], str]) -> dict:
    """class -> live bytes (each block as the allocator holds it, 512-rounded), for the classes
    ``classify`` names among ``sizes``, in the order they first appear; the one classifier of live
    blocks, the peak's attribution's (issue395.measure.cuda) too."""
    out: dict = {}
    for s in sizes:
        c = classify(s)
        out[c] = out.get(c, 0) + block_bytes(s)
    return out


def _charged(est, term: str) -> int:
    """A term's bytes where it counts in the estimate's binding phase (the term table's), else 0."""
    return est.terms.get(term, 0) if Phase(est.phase) in BY_KEY[term].phases else 0


def class_breakdown(classes: dict, est, *, seq: int, batch: int, config: dict) -> list[dict]:
    """Each class's live bytes against the estimator term meant to charge it. ``missed`` is live
    minus charged (positive: the estimate charges too little); ``per`` is (count, unit) the miss
    scales with, and ``missed_per`` the miss per unit; ``per`` is None for a constant."""
    unknown = set(classes) - set(CLASSES)
    if unknown:
        raise UsageError(f"unknown class(es): {', '.join(sorted(unknown))}")
    a = arch_from_config(config)  # the physics of the saved row, whatever Soup is installed
    rows = batch * task(est.task).rows_per_example
    T, elements = seq * rows, seq * rows * a.V
    softcap = E.SOFTCAP_EXTRA_BYTES * elements if a.softcap else 0
    logits = _charged(est, "logits")
    fp32_logits = logits - (softcap if logits else 0) + _charged(est, "reference_held")
    ckpt, norm = _charged(est, "checkpointed_inputs"), _charged(est, "final_norm")
    if _fp32_inputs(a, est.quant):  # phi NF4: the final norm's T h 4 copy ties with the L-1 fp32
        ckpt, norm = ckpt + norm, 0  # saved inputs and is named with them (CLASSES tie-break 3)
    rest = sum(_charged(est, t) for t in ("ids_labels", "kl_batch_ids", "position_ids", "layer_per_token",
                                          "chunked_loss", "retained_activations", "head_copy",
                                          "reference_layer"))
    if est.phase == Phase.LAYER.value and "retained_activations" in est.terms:  # all but the layer run
        rest += est.terms["retained_activations"] * (a.L - 1) // a.L
    spec = {
        DEQUANTISED: (_charged(est, "dequantised_layer") + _charged(est, "dequantised_linear")
                      + _charged(est, "expert_in_flight"), (1, "layer")),
        LOGITS_FP32: (fp32_logits, (elements, "logits element")),
        LOGITS_BF16: (softcap if logits else 0, (elements, "logits element")),
        CHECKPOINTED: (ckpt, (T, "token")),
        FP32_RESIDUAL: (norm, (T, "token")),
        MASKS: (_charged(est, "sliding_mask"), (seq * seq * batch, "seq^2")),
        ROTARY: (_charged(est, "rotary_tables"), (seq, "position")),
        WORKSPACES: (_charged(est, "autograd_workspace"), None),
        REST: (rest, (T, "token")),
    }
    rows = []
    for cls in CLASSES:
        charged, per = spec[cls]
        live = int(classes.get(cls, 0))
        missed = live - charged
        rows.append({"class": cls, "live": live, "charged": charged, "missed": missed,
                     "per": per, "missed_per": (missed / per[0]) if per and per[0] else None})
    return rows


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


def margin_anatomy(margins: list[dict], release: str | None = None) -> str:
    """For each attributed arm whose blocks were named by physical class: the classes against
    the corrected estimate's terms, the resident weights first (the map's margin table)."""
    out = []
    for m in margins:
        if not m.get("physical"):
            continue
        try:
            config = config_json(family_of(m["model_key"]))
            est = E.estimate_key(m["model_key"], quant=m["quant"], seq=m["seq"], batch=m["batch"],
                                 release=release, soup=False)
        except (UsageError, KeyError):  # a release or model this estimator does not know: none
            continue
        classes = dict(m["physical"])
        resident = int(classes.pop("resident weights", 0))
        charged = sum(est.terms.get(t, 0) for t in RESIDENT_TERMS)
        rows = [{"class": "resident weights", "live": resident, "charged": charged, "missed": resident - charged,
                 "per": None, "missed_per": None}]
        rows += class_breakdown(classes, est, seq=m["seq"], batch=m["batch"], config=config)
        out += [f"  {m['model']} {m['quant']} {m['seq']}x{m['batch']} (live: measured here; charged: this "
                f"tool's corrected estimate, {est.phase} phase)"]
        out += ["    " + line for line in render(rows).splitlines()]
    return "\n".join(["the peak by physical class (allocator history; missed = live - charged)"] + out) if out else ""
