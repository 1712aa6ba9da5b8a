"""The corrected pre-flight as Soup's own setup calls it (``--soup-patch``): Soup's config objects
(its ``cfg``, ``cfg.training`` and the model's transformers config, as ``_stream_budget_lines`` holds
them) read into this tool's estimate, and the bytes Soup's gate compares with the free memory it
reads. Stdlib only: ``soup_patch`` bundles this function with everything it reaches into one module
of soup_cli, so the patched gate is this tool's estimator, never a copy of it.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

from ..constants import STREAM_KEYS
from ..errors import UsageError
from ..record import SOUP_QUANT
from ..model.arm import SETTINGS
from .cards import STEP_GROWTH_BYTES
from .estimate import estimate
from .steady import is_bounded

#: `soup train` runs many optimizer steps; from the second on the optimizer's states are live and
#: each later step repeats that peak, so two steps hold the peak over all of them (as --estimate
#: --config reads a run). Soup's setup does not know the run's length when its gate reads memory.
GATE_STEPS = 2
#: What the estimator assumes of Soup's settings it does not model (Soup's defaults): peft's dropout whose
#: mask the layer term counts, double-quantised
#: NF4 (the pool's absmax), no resident NF4 scale cache, a plain LoRA adapter (no MoE experts). Another
#: value keeps Soup's formula (which charges the scale cache itself), said so.
ASSUMED_SETTINGS = (("lora.dropout", 0.05), ("bnb_4bit_use_double_quant", True),
                    ("stream_nf4_scale_cache", False), ("moe_lora", False))
#: Soup's bnb_4bit_use_double_quant is tri-state: unset (None) is what every 4-bit load has always done, double.
_UNSET_MEANS = {"bnb_4bit_use_double_quant": (None,)}


def _setting(tcfg: Any, dotted: str, default: Any) -> Any:
    value = tcfg
    for part in dotted.split("."):
        value = getattr(value, part, default)
    return value


def gate_kwargs(cfg: Any, tcfg: Any, model_config: Any, steps: Optional[int] = None) -> tuple[dict, dict]:
    """(the model's config as a config.json dict, the estimate's keywords) from what Soup's setup
    holds; one UsageError naming a setting the estimator does not model."""
    config = model_config if isinstance(model_config, dict) else model_config.to_dict()
    quant = {soup: ours for ours, soup in SOUP_QUANT.items()}.get(str(tcfg.quantization))
    if quant is None:
        raise UsageError(f"training.quantization {tcfg.quantization!r} is not one the estimator models")
    for dotted, assumed in ASSUMED_SETTINGS:
        if _setting(tcfg, dotted, assumed) not in (assumed, *_UNSET_MEANS.get(dotted, ())):
            raise UsageError(f"training.{dotted} {_setting(tcfg, dotted, assumed)!r} is not modelled (the "
                             f"estimator assumes {assumed!r})")
    optimizer = str(getattr(tcfg, "optimizer", "adamw_torch"))
    if is_bounded(optimizer):  # --estimate charges it as an upper bound; a gate keeps Soup's formula
        raise UsageError(f"training.optimizer {optimizer!r} is not modelled (only bounded from above)")
    targets = tcfg.lora.target_modules
    targets = (targets,) if isinstance(targets, str) else tuple(str(t) for t in targets)
    stream = {k: getattr(tcfg, k) for k in STREAM_KEYS if getattr(tcfg, k, None) is not None}
    taken = set(inspect.signature(estimate).parameters)
    # the run's settings (issue395.model.arm.SETTINGS), each fed where the estimate takes it; an estimate
    # without accumulation's charges each micro-batch at batch_size rows, and the panel says so
    settings = {s.estimator: s.kind(getattr(tcfg, s.soup, None) or s.protocol) for s in SETTINGS
                if s.estimator in taken}
    return config, dict(**settings, quant=quant, seq=int(cfg.data.max_length),
                        batch=tcfg.batch_size if isinstance(tcfg.batch_size, int) else 1, targets=targets,
                        lora_r=int(tcfg.lora.r), steps=steps or GATE_STEPS, stream=stream,
                        task=str(getattr(cfg, "task", "sft")), soup=False)


def preflight(cfg: Any, tcfg: Any, model_config: Any, *, steps: Optional[int] = None,
              formula: Optional[int] = None, release: Optional[str] = None) -> dict:
    """The corrected pre-flight of the run Soup's setup holds: ``peak``, the allocated peak of its
    steady state (``steps``: GATE_STEPS unless the caller knows the run's length); ``gate_bytes``,
    what Soup's gate must see free for it (the expandable-segments reserve, and what the CUDA
    runtime adds between Soup's gate and the step's end); ``formula``, Soup's own number beside it.
    A setting the estimator does not model, or a config it cannot read, keeps Soup's formula
    (``gate_bytes`` None, ``refused`` says why, in the panel too): never a crash of Soup's setup, never
    a gate silently lifted."""
    try:
        config, kwargs = gate_kwargs(cfg, tcfg, model_config, steps)
        e = estimate(config, release=release, **kwargs)
    except Exception as exc:  # noqa: BLE001 -- inside Soup's setup: a config this estimator cannot read
        # (a UsageError names the setting) must not stop the run, nor pass unsaid: the formula gates it
        why = str(exc) if isinstance(exc, UsageError) else f"{type(exc).__name__}: {exc}"
        return {"peak": None, "gate_bytes": None, "formula": formula, "refused": why,
                "line": f"  corrected    not computed ({why}); the gate keeps Soup's formula"}
    # Soup's gate reads free memory before almost all of the runtime's growth: in `soup train`'s own
    # process (every --find-max probe) the free memory at its gate was total - context - 16 to 22 MB,
    # and torch's OOM messages there put 795-870 MB outside the allocator by the step (the context plus
    # 150-230 MB grown after the gate): so the whole step growth is charged after the gate, not
    # STEP_GROWTH_BYTES - GATE_GROWTH_BYTES (168 MB: the harness's own process, where its setup has
    # loaded 90 MiB of modules by Soup's gate). Evidence: docs/PEAK.md, "GATE_GROWTH_BYTES, STEP_GROWTH_BYTES".
    gate = e.needs_free + STEP_GROWTH_BYTES
    held = int(getattr(tcfg, "gradient_accumulation_steps", 1) or 1) > 1 and "accumulation" not in kwargs
    return {"peak": e.corrected_predicted, "needs_free": e.needs_free, "gate_bytes": gate, "phase": e.phase,
            "steps": e.steps, "release": e.release, "terms": dict(e.terms), "formula": formula, "refused": None,
            "line": (f"  corrected    peak {e.corrected_predicted / 1e9:.2f} GB allocated ({e.phase} phase, steady "
                     f"state); the gate needs {gate / 1e9:.2f} GB free"
                     + ("" if formula is None else f" (Soup's formula: {formula / 1e9:.2f} GB)")
                     + ("; the gradients held between micro-batches are not counted by this estimator" if held else ""))}
