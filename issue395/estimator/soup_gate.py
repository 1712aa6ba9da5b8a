"""The corrected pre-flight as Soup's own gates call it (``--soup-patch``): Soup's config objects
(its ``cfg``, ``cfg.training`` and the model's transformers config) read into this tool's estimate, and
the bytes Soup's gate compares with the free memory: the streamed gate's (``preflight``, as
``_stream_budget_lines`` holds them) and the resident one's (``resident_preflight``, as
``commands/train.py:_hardware_fit_preflight`` holds them). Stdlib only: ``soup_patch`` bundles these
functions with everything they reach into one module of soup_cli, so the patched gates are this tool's
estimator, never a copy of it.
"""

from __future__ import annotations

import importlib.metadata
import sys
from dataclasses import dataclass
from typing import Any, Optional

from ..constants import STREAM_KEYS
from ..errors import UsageError
from ..record import OURS_QUANT
from ..model.arm import SETTINGS, lora_dropout
from .cards import CONTEXT_BOUND_BYTES, STEP_GROWTH_BYTES
from .estimate import estimate
from .gemm4bit import Dispatch, dispatch_for
from .resident import estimate_resident
from .terms import Phase, Term, phase_sum
from .steady import is_bounded

#: `soup train` runs many optimizer steps; from the second on the optimizer's states are live and
#: each later step repeats that peak, so two steps hold the peak over all of them (as --estimate
#: --config reads a run). Soup's setup does not know the run's length when its gate reads memory.
GATE_STEPS = 2
@dataclass(frozen=True)
class Assumed:
    """One of Soup's settings whose bytes an estimate does not model: its key (dotted, under ``training`` unless
    ``top``), the value the estimate assumes (``value``: Soup's schema default; None and False where Soup's
    default is unset; ``same``: other values Soup reads as it), the one quantization it applies under (``quant``,
    this tool's spelling; None: any), whether the resident estimate assumes it (``resident``), and why another
    value is not in the streamed figures (``streamed``; None: the streamed estimate does not read it). Another
    value keeps Soup's formula in a gate and is a NOT modelled line of --estimate (streamed: beside the run
    without it; resident: no figure). ``zero_off``: whether a zero or empty value is the setting off (False where
    Soup applies any value but unset: NEFTune's alpha 0 still hooks its noise into the embedding)."""

    key: str
    value: Any
    resident: bool = True
    streamed: Optional[str] = None
    quant: Optional[str] = None
    same: tuple = ()
    top: bool = False
    zero_off: bool = True


_WITHOUT = "the estimate is of a run without it"
#: Every setting either estimate does not model, each once, in the order a resident run names them (the first is
#: its one-line verdict). Streamed (the settings Soup's loader takes beside training.stream_layers): double-quantised
#: NF4 (the pool's absmax), no NF4 scale cache, a plain LoRA adapter (no MoE experts, one r on target_modules
#: alone, both matrices trained: no rank_pattern, target_parameters, LoRA-FA); GaLore's optimizer,
#: activation offloading's saved-tensor hooks and the autocast dtype pick_mixed_precision chooses are set by the
#: trainer's own arguments or training context, not the model load streaming replaces (0.73.3's SFT applies all
#: three, its DPO and KTO the offloading), as TrainingArguments sets NEFTune and a train() callback ReLoRA. Resident:
#: another modality's model (vision, audio), Spectrum's and the freezes' partial fine-tuning
#: (unfrozen_parameters, freeze_layers, freeze_ratio; lora.r 0, every parameter trained, is modelled:
#: full.estimate_full, and on 0.77.0's fp32 master weights full.estimate_master), another adapter (DoRA, VeRA),
#: another backend, a fused or offloaded loss or activations, QAT, LISA's layer switching, MoE LoRA; double
#: quantisation as the streamed gate assumes it; auto_mixed_precision (pick_mixed_precision may answer "no": no
#: autocast, a step the estimate's bf16 matmuls are not); the rows after it (an init strategy, FlashAttention-2, packing,
#: Mixture-of-Depths, NVFP4, LongLoRA, new tokens). The LoRA dropout is read by both (model.arm.lora_dropout,
#: as a --config file's is): its masks are charged only where p is in (0, 1).
ASSUMED = (
    Assumed("backend", "transformers", top=True), Assumed("modality", "text", top=True),
    Assumed("unfrozen_parameters", None),
    Assumed("freeze_layers", None), Assumed("freeze_ratio", None), Assumed("lora.use_dora", False),
    Assumed("lora.use_vera", False),
    Assumed("stream_nf4_scale_cache", False, resident=False, quant="nf4",
            streamed="it keeps 4 B per 64-element NF4 block for the whole run (Soup's schema: 416 MiB on Mistral-7B), "
                     "not in these figures"),
    Assumed("use_galore", False, streamed=_WITHOUT), Assumed("use_liger", False), Assumed("use_cut_ce", False),
    Assumed("activation_offloading", None, streamed=_WITHOUT), Assumed("quantization_aware", False),
    Assumed("lisa_enabled", False), Assumed("moe_lora", False, streamed="the estimate is of a plain LoRA adapter"),
    # tri-state in Soup: unset (None) is what every 4-bit load has always done, double
    Assumed("bnb_4bit_use_double_quant", True, quant="nf4", same=(None,),
            streamed="the NF4 pool is charged double-quantised (Soup's default); single quantisation keeps fp32 "
                     "block scales"),
    Assumed("auto_mixed_precision", False, streamed=_WITHOUT),
    # the adapter's shape beyond r and target_modules (0.73.3's SFT and DPO LoraConfig pass neither the pattern nor
    # an init strategy; 0.77.0's build_lora_config_kwargs passes both, streamed and resident, and target_parameters)
    Assumed("lora.rank_pattern", None, streamed="the adapter is charged at training.lora.r on every target"),
    Assumed("lora.target_parameters", None,
            streamed="the adapter is charged on training.lora.target_modules alone"),
    Assumed("lora.init_strategy", "random"), Assumed("use_lorafa", False, streamed=_WITHOUT),
    # the step's own tensors: NEFTune's noise (TrainingArguments, streamed too), ReLoRA's merges (a train() callback,
    # streamed too), and on a resident load FlashAttention-2, packing, Mixture-of-Depths' routers, NVFP4 linears,
    # LongLoRA's shifted attention, and new tokens' resized embedding and head
    Assumed("neftune_alpha", None, streamed=_WITHOUT, zero_off=False), Assumed("relora_steps", None, streamed=_WITHOUT),
    Assumed("use_flash_attn", False), Assumed("packing", False), Assumed("multipack", False),
    Assumed("use_mod", False), Assumed("nvfp4", False), Assumed("use_longlora", False),
    Assumed("data.add_new_tokens", None, top=True), Assumed("data.new_special_tokens", None, top=True))


def _departs(row: Assumed, value: Any) -> bool:
    """Whether Soup's ``value`` of a setting is another than the estimate assumes (an unset or empty value where
    the assumption is off is the same)."""
    return value not in (row.value, *row.same) and not (row.zero_off and row.value in (None, False) and not value)


def _setting(tcfg: Any, dotted: str, default: Any) -> Any:
    value = tcfg
    for part in dotted.split("."):
        value = getattr(value, part, default)
    return value


def _spelled(value: Any) -> str:
    """A setting's value as a soup.yaml writes it (true, false, cpu)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _departures(cfg: Any, tcfg: Any, quant: Optional[str], streamed: bool) -> list[tuple[Assumed, Any]]:
    """Each row of ASSUMED the streamed (``streamed``) or resident estimate assumes, applying under ``quant`` (this
    tool's spelling), that Soup's config (``cfg``, its ``training`` ``tcfg``) departs from, with its value."""
    found = []
    for row in ASSUMED:
        if (row.streamed is not None if streamed else row.resident) and row.quant in (None, quant):
            value = _setting(cfg if row.top else tcfg, row.key, row.value)
            if _departs(row, value):
                found.append((row, value))
    return found


def streamed_unmodelled(tcfg: Any, quant: str) -> list[tuple[str, str]]:
    """Each setting of ASSUMED the streamed estimate reads that ``tcfg`` (Soup's loaded ``cfg.training``) sets to
    another value than it assumes, where it applies (a 4-bit setting only where ``quant``, this tool's spelling, is
    nf4), as (``training.key value``, why it is not in the figures); empty where the estimate models them all. The
    patched streamed gate, --estimate's key lines and the measured arm's refusal all read it."""
    return [(f"training.{row.key} {_spelled(value)}", row.streamed)
            for row, value in _departures(None, tcfg, quant, True)]


def gate_kwargs(cfg: Any, tcfg: Any, model_config: Any, steps: Optional[int] = None) -> tuple[dict, dict]:
    """(the model's config as a config.json dict, the estimate's keywords) from what Soup's setup
    holds; one UsageError naming a setting the estimator does not model."""
    config = model_config if isinstance(model_config, dict) else model_config.to_dict()
    quant = OURS_QUANT.get(str(tcfg.quantization))
    if quant is None:
        raise UsageError(f"training.quantization {tcfg.quantization!r} is not one the estimator models")
    unmodelled = streamed_unmodelled(tcfg, quant)
    if unmodelled:  # --estimate gives the run without it, said so; a gate keeps Soup's formula
        raise UsageError("; ".join(f"{setting} is not modelled: {why}" for setting, why in unmodelled))
    optimizer = str(getattr(tcfg, "optimizer", "adamw_torch"))
    if is_bounded(optimizer):  # --estimate charges it as an upper bound; a gate keeps Soup's formula
        raise UsageError(f"training.optimizer {optimizer!r} is not modelled (only bounded from above)")
    targets = tcfg.lora.target_modules
    targets = (targets,) if isinstance(targets, str) else tuple(str(t) for t in targets)
    stream = {k: getattr(tcfg, k) for k in STREAM_KEYS if getattr(tcfg, k, None) is not None}
    # the run's settings (issue395.model.arm.SETTINGS), each read off Soup's config as its loader holds it
    settings = {s.estimator: s.kind(getattr(tcfg, s.soup, None) or s.protocol) for s in SETTINGS}
    return config, dict(**settings, quant=quant, seq=int(cfg.data.max_length),
                        batch=tcfg.batch_size if isinstance(tcfg.batch_size, int) else 1, targets=targets,
                        lora_r=int(tcfg.lora.r), lora_dropout=lora_dropout(tcfg), steps=steps or GATE_STEPS,
                        stream=stream, task=str(getattr(cfg, "task", "sft")), soup=False)


def device_dispatch() -> Optional[Dispatch]:
    """The card Soup's process runs on as bitsandbytes' gemm_4bit heuristic reads it (its SM count and compute
    capability), from the torch Soup has already imported (the bundle imports nothing but the standard library);
    None without CUDA, or where the installed bitsandbytes is not the release gemm4bit ports."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_available():
            return None
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        return dispatch_for(p.multi_processor_count, (p.major, p.minor), importlib.metadata.version("bitsandbytes"))
    except Exception:  # noqa: BLE001 -- inside Soup's setup: no card read is the card-agnostic estimate
        return None


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
        e = estimate(config, release=release, dispatch=device_dispatch(), **kwargs)
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
    return {"peak": e.corrected_predicted, "needs_free": e.needs_free, "gate_bytes": gate, "phase": e.phase,
            "steps": e.steps, "release": e.release, "terms": dict(e.terms), "formula": formula, "refused": None,
            "line": (f"  corrected    peak {e.corrected_predicted / 1e9:.2f} GB allocated ({e.phase} phase, steady "
                     f"state); the gate needs {gate / 1e9:.2f} GB free"
                     + ("" if formula is None else f" (Soup's formula: {formula / 1e9:.2f} GB)"))}



def resident_departures(cfg: Any) -> list[tuple[str, str]]:
    """Every one of Soup's settings in ASSUMED the resident estimate assumes that ``cfg`` (Soup's loaded config)
    sets to another value, as (the key and its value, what the estimator assumes), each spelled as a soup.yaml
    writes it; empty where the estimate models them all."""
    quant = OURS_QUANT.get(str(cfg.training.quantization))
    return [(f"{'' if row.top else 'training.'}{row.key} {_spelled(value)}",
             "the estimator assumes " + ("it unset" if row.value is None else _spelled(row.value)))
            for row, value in _departures(cfg, cfg.training, quant, False)]


def resident_lines(cfg: Any) -> list[str]:
    """Each of resident_departures as one line."""
    return [f"{setting} is not modelled resident ({assumed})" for setting, assumed in resident_departures(cfg)]


def resident_unmodelled(cfg: Any) -> Optional[str]:
    """The first of resident_lines (a run's one-line verdict); None where the estimate models every setting."""
    return next(iter(resident_lines(cfg)), None)


def resident_kwargs(cfg: Any, model_config: Any, steps: Optional[int] = None) -> tuple[dict, dict]:
    """(the model's config as a config.json dict, estimate_resident's keywords) for the run `soup train` builds
    from ``cfg`` (Soup's loaded config): the file's task, quantization, max_length as seq, batch, LoRA targets and
    r, optimizer, accumulation and gradient checkpointing (any tier is HF's full checkpointing, as Soup's
    resolve_gradient_checkpointing sets it); one UsageError naming a setting it does not model."""
    if isinstance(model_config, BaseException):
        raise UsageError(f"the base's config could not be read ({type(model_config).__name__}: {model_config})")
    config = model_config if isinstance(model_config, dict) else model_config.to_dict()
    t = cfg.training
    quant = OURS_QUANT.get(str(t.quantization))
    if quant is None:
        raise UsageError(f"training.quantization {t.quantization!r} is not modelled resident")
    if not isinstance(t.batch_size, int) or isinstance(t.batch_size, bool):
        raise UsageError(f"training.batch_size {t.batch_size!r} is resolved later, so not known at this gate")
    why = resident_unmodelled(cfg)
    if why:
        raise UsageError(why)
    optimizer = str(getattr(t, "optimizer", "adamw_torch"))
    if is_bounded(optimizer):
        raise UsageError(f"training.optimizer {optimizer!r} is not modelled (only bounded from above)")
    targets = t.lora.target_modules
    targets = (targets,) if isinstance(targets, str) else tuple(str(x) for x in targets)
    return config, dict(quant=quant, seq=int(cfg.data.max_length), batch=int(t.batch_size), targets=targets,
                        lora_r=int(t.lora.r), lora_dropout=lora_dropout(t), steps=steps or GATE_STEPS,
                        task=str(getattr(cfg, "task", "sft")),
                        checkpointing=bool(getattr(t, "gradient_checkpointing", False)),
                        **{s.estimator: s.kind(getattr(t, s.soup, None) or s.protocol) for s in SETTINGS
                           if not s.streamed_only})


def _formula_words(formula: Optional[tuple], total: int) -> str:
    if formula is None:
        return "Soup's formula: none (its CLI builds no input for this run, so it skips its gate)"
    peak_gb, required_gb, ok = formula
    return (f"Soup's formula: {peak_gb:.1f} GB (+10% margin = {required_gb:.1f} GB) against the card's "
            f"{total / 1e9:.1f} GB total: it {'admits' if ok else 'refuses'} the run")


def resident_preflight(cfg: Any, model_config: Any, *, free: Optional[int], total: int,
                       formula: Optional[tuple] = None, steps: Optional[int] = None) -> dict:
    """The corrected resident pre-flight of the run `soup train` builds from ``cfg``: ``peak``, the allocated
    peak of its steady state (estimate_resident, ``steps``: GATE_STEPS); ``gate_bytes``, what must be free for
    it: the same charge as the streamed gate's (``preflight``: the expandable-segments reserve, which holds because
    the patch sets expandable segments for every run (soup_patch.ALLOC_HINT), and the whole
    step growth of the CUDA runtime after the gate), compared with the same reading, ``free``, the free
    memory torch reads on the card (torch.cuda.mem_get_info, which other processes and the CUDA context
    already left; so one verdict for both of Soup's gates, and the one --estimate gives on a card: needs free
    + the runtime's growth <= total - context). Where torch cannot read it (``free`` None), the card's
    ``total`` less this tool's CUDA context bound, said so. ``formula``: Soup's own (peak GB, +10% GB, admits)
    from hardware_fit, printed beside. A run the estimate does not model (a model type outside
    resident.MODELLED_TYPES, Qwen3.5 without checkpointing or Qwen3.5-MoE with it, phi NF4 with checkpointing, phi
    with qk_layernorm or with embd_pdrop and checkpointing, past a sliding window without checkpointing, a resident
    setting of ASSUMED; a full fine-tuning, lora.r 0, is estimate_resident's estimate_full, on 0.77.0's fp32 master
    weights its estimate_master, except where it refuses it) or a config it cannot read keeps Soup's
    formula (``refused`` says why; never a crash, never a gate lifted)."""
    try:
        config, kwargs = resident_kwargs(cfg, model_config, steps)
        e = estimate_resident(config, dispatch=device_dispatch(), **kwargs)
    except Exception as exc:  # noqa: BLE001 -- inside Soup's CLI: what this estimator cannot read keeps Soup's gate
        why = str(exc) if isinstance(exc, UsageError) else f"{type(exc).__name__}: {exc}"
        return {"peak": None, "gate_bytes": None, "fits": None, "refused": why,
                "line": f"Hardware-fit (corrected peak VRAM): not computed ({why}); the gate keeps Soup's formula"}
    # Not RESIDENT_STEP_GROWTH_BYTES: that grows past the box's context, and `soup train`'s process is short of it at
    # this gate (11.45 GB read where the ballast left 12,000,100,352 B: 550 MB, 74 MB under the box's 623.7 MB;
    # results/resident-patch-h100-soup0.77.0-96b7b97/patched-B-*.txt), so about 251 MB grows after it.
    gate = e.needs_free + STEP_GROWTH_BYTES
    measured = free is not None
    free = free if measured else total - CONTEXT_BOUND_BYTES
    where = ("free on the card (torch.cuda.mem_get_info)" if measured else
             f"free by the card's total less this tool's CUDA context bound ({CONTEXT_BOUND_BYTES / 1e9:.2f} GB; "
             "torch could not read the free memory)")
    fits = gate <= free
    resident, allowance = phase_sum(e.terms, Phase.RESIDENT), phase_sum(e.terms, Phase.ALLOWANCE)
    # the states are beside every phase from step 2, and inside step 1's optimizer step where that binds
    states = e.terms.get(Term.OPTIMIZER_STATES.key, 0) if e.steps > 1 or e.phase == Phase.OPTIMIZER.value else 0
    charged = (f"resident weights and adapter {resident / 1e9:.2f} | optimizer states {states / 1e9:.2f} | the "
               f"{e.phase} phase's activations, logits, loss and gradients "
               f"{(e.corrected_predicted - resident - states - allowance) / 1e9:.2f} | allowance "
               f"{allowance / 1e9:.3f} | allocator reserve {(e.needs_free - e.corrected_predicted) / 1e9:.2f} | CUDA "
               f"runtime after the gate {STEP_GROWTH_BYTES / 1e9:.2f} GB")
    run = (f"{kwargs['task']} {kwargs['quant']} {kwargs['seq']}x{kwargs['batch']}, "
           + ("full fine-tuning (lora.r 0), " if kwargs["lora_r"] == 0 else "") +
           f"{'with' if kwargs['checkpointing'] else 'no'} gradient checkpointing, step {e.steps}")
    return {"peak": e.corrected_predicted, "needs_free": e.needs_free, "gate_bytes": gate, "free": free,
            "free_measured": measured, "fits": fits, "phase": e.phase, "steps": e.steps, "refused": None,
            "terms": dict(e.terms),
            "line": (f"Hardware-fit (corrected peak VRAM): {e.corrected_predicted / 1e9:.2f} GB allocated ({run}); "
                     f"needs {gate / 1e9:.2f} GB free under expandable segments (the patch sets them); "
                     f"{free / 1e9:.2f} GB {where}: "
                     f"{'fits' if fits else 'does NOT fit'}. {_formula_words(formula, total)}"),
            "panel": (f"Predicted peak VRAM {e.corrected_predicted / 1e9:.1f} GB (corrected: this tool's resident "
                      f"estimate, {run}) needs {gate / 1e9:.1f} GB free under expandable segments (the patch sets "
                      f"them), more than the {free / 1e9:.1f} GB {where}.\n"
                      f"{charged}\n{_formula_words(formula, total)}")}
