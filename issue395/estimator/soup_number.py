"""Soup's own pre-flight number, computed by the release's own code: its ``estimate_stream_peak_vram``
and its setup's helpers (``_estimate_adapter_params``, ``_stream_large_budget_bytes``) read from that
release's source with ``ast`` and executed in an isolated namespace (no torch, no soup_cli import),
fed exactly the keywords that release's setup passes (read from its own call), each computed here
from the config: the shard bytes Soup counts (its union layer spec for MoE and hybrid layers),
extras, the large-layer slot, the expert in flight, the chunked loss, and the task's rows. Which
release does what is read from its source (``read_features``), never from its version string.
Equal to the byte to every ``soup_predicted`` the GPU captured, on both measured releases.
"""

from __future__ import annotations

import ast
import functools
import math
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from ..constants import STREAM_KEYS
from ..errors import UsageError
from ..tasks import PROTOCOL_TASK, TASKS
from .arch import Arch, arch_from_config, layer_bytes
from .moe import expert_in_flight
from .releases import (PATCH_MARKER, PATCH_MODULE, RELEASE_FEATURES, RELEASES_ENV, Features, _TWELVE, installed_release,
                       release_source, soup_dir)

# -- a release's own code, read with ast --
def _top_defs(tree: ast.Module) -> dict:
    defs = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(t, ast.Name):
                    defs[t.id] = node
    return defs


@functools.lru_cache(maxsize=16)
def _namespace(src: Path) -> dict:
    path = src / "utils" / "layer_stream.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    defs = _top_defs(tree)
    wanted, todo = set(), ["estimate_stream_peak_vram", "SUPPORTED_STREAM_ARCHS", "_STREAM_ARCH_ALIASES",
                           "LOGITS_BYTES_PER_ELEMENT", "RAM_TIER_HEADROOM"]
    while todo:
        name = todo.pop()
        if name in wanted or name not in defs:
            continue
        wanted.add(name)
        todo.extend(n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name))
    body = [n for n in tree.body if any(n is defs[w] for w in wanted)]
    ns: dict = {"math": math, "__name__": "soup_layer_stream_extract"}
    ns.update({k: getattr(typing, k) for k in typing.__all__})
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), ns)
    return ns


def soup_namespace(src: Optional[Path] = None) -> dict:
    """Soup's estimator and every top-level name it reaches, exec'd from its source, nothing else."""
    return _namespace(src or soup_dir())


#: The setup's helpers the number calls, exec'd as the release's mixin defines them.
_HELPERS = ("_estimate_adapter_params", "_stream_shape_config", "_stream_total_experts", "_stream_large_budget_bytes")


def _class(tree: ast.Module, name: str) -> Optional[ast.ClassDef]:
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def _stream_attrs(cls: Optional[ast.ClassDef]) -> dict:
    """A class body's literal _STREAM_* attributes."""
    out = {}
    for n in (cls.body if cls else ()):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant):
            out.update({t.id: n.value.value for t in n.targets if isinstance(t, ast.Name) and t.id.startswith("_STREAM_")})
    return out


@functools.lru_cache(maxsize=16)
def _mixin(src: Path) -> type:
    """The release's StreamingSetupMixin holding only its own budget helpers and _STREAM_* defaults."""
    path = src / "trainer" / "stream_setup.py"
    cls = _class(ast.parse(path.read_text(encoding="utf-8")), "StreamingSetupMixin")
    if cls is None:
        raise UsageError(f"{path}: no StreamingSetupMixin, so its setup's rules cannot be read")
    body = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in _HELPERS]
    body += [n for n in cls.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
             and any(isinstance(t, ast.Name) and t.id.startswith("_STREAM_") for t in n.targets)]
    mod = ast.fix_missing_locations(ast.Module(body=[ast.ClassDef(
        name="StreamingSetupMixin", bases=[], keywords=[], body=body or [ast.Pass()], decorator_list=[])],
        type_ignores=[]))
    ns: dict = {"__name__": "soup_stream_setup_extract"}
    exec(compile(mod, str(path), "exec"), ns)
    return ns["StreamingSetupMixin"]


def _estimator_call(src: Path) -> tuple:
    """(keyword, its value as spelled) at the setup's call of estimate_stream_peak_vram."""
    path = src / "trainer" / "stream_setup.py"
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "estimate_stream_peak_vram":
            return tuple((k.arg, ast.unparse(k.value)) for k in n.keywords)
    raise UsageError(f"{path}: its setup never calls estimate_stream_peak_vram")


def _names(path: Path) -> set:
    tree = ast.parse(path.read_text(encoding="utf-8")) if path.is_file() else ast.Module(body=[], type_ignores=[])
    return ({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
            | {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)})


def _tcfg(targets, r: int) -> SimpleNamespace:
    """What the helpers read of Soup's training config: the LoRA targets as the file gives them
    (a list, or a string Soup resolves later: all-linear, auto), r, and moe_lora (off)."""
    return SimpleNamespace(lora=SimpleNamespace(target_modules=targets, r=r), moe_lora=False)


@functools.lru_cache(maxsize=16)
def read_features(src: Path) -> Features:
    """A release's Features, read from its own source (never imported)."""
    fn = _namespace(src)["estimate_stream_peak_vram"]
    code = fn.__code__
    params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    mixin = _mixin(src)
    base = _stream_attrs(_class(ast.parse((src / "trainer" / "stream_setup.py").read_text(encoding="utf-8")),
                                "StreamingSetupMixin"))
    tasks = []
    for t in TASKS.values():
        module, cls = t.wrapper
        path = src.parent / (module.replace(".", "/") + ".py")
        own = dict(base, **_stream_attrs(_class(ast.parse(path.read_text(encoding="utf-8")), cls)))
        tasks.append((t.name, int(own.get("_STREAM_ROWS_PER_EXAMPLE", 1)),
                      bool(own.get("_STREAM_REFILL_BEFORE_BACKWARD", False))))
    schema = _class(ast.parse((src / "config" / "schema.py").read_text(encoding="utf-8")), "TrainingConfig")
    fields = {n.target.id for n in (schema.body if schema else ()) if isinstance(n, ast.AnnAssign)
              and isinstance(n.target, ast.Name)}
    counted = mixin._estimate_adapter_params(mixin(), _tcfg("all-linear", 1),
                                             SimpleNamespace(hidden_size=1, num_hidden_layers=1))
    return Features(
        estimator_params=tuple(p for p in params if p not in _TWELVE),
        setup_kwargs=_estimator_call(src),
        splits_untied_pair=("large_keys" in _names(src / "utils" / "layer_shard.py")
                            and "large_layer_buffer_bytes" in _names(src / "utils" / "layer_stream_runtime.py")),
        large_budget=hasattr(mixin, "_stream_large_budget_bytes"),
        tasks=tuple(tasks), stream_modes=tuple(k for k in STREAM_KEYS if k in fields),
        string_targets=counted // 2,
        materialises_ref_adapter="materialize_meta_adapter_copy" in _names(src / "trainer" / "dpo.py"),
        private_head_weight="_needs_a_private_weight" in _names(src / "utils" / "layer_stream_runtime.py"))


def features(release: Optional[str] = None) -> Features:
    """``release``'s Features: read from its own source where it is here (installed, or an unpacked
    wheel), else as RELEASE_FEATURES pinned them; one line for a release neither holds."""
    src = release_source(release)
    if src is not None:
        return read_features(src)
    if release in RELEASE_FEATURES:
        return RELEASE_FEATURES[release]
    raise UsageError(f"soup-cli {release} is neither installed (soup-cli {installed_release()} is) nor a release "
                     f"this tool has read ({', '.join(RELEASE_FEATURES)})")


def supported_archs(src: Optional[Path] = None) -> tuple:
    return tuple(soup_namespace(src)["SUPPORTED_STREAM_ARCHS"])


def stream_aliases(src: Optional[Path] = None) -> dict:
    """Model types the installed Soup streams as another (0.77.0: qwen3_5_text as qwen3)."""
    return dict(soup_namespace(src).get("_STREAM_ARCH_ALIASES", {}))


def streamed_as(model_type, src: Optional[Path] = None) -> str | None:
    family = stream_aliases(src).get(model_type, model_type)
    return family if family in supported_archs(src) else None


def require_streamed(model_type: str, who: str) -> None:
    """One line where the installed Soup does not stream a registry model's type (the newest release
    this tool knows, 0.77.0, streams every one)."""
    if streamed_as(model_type) is None:
        raise UsageError(f"{who}: the installed soup-cli does not stream {model_type} (soup-cli 0.77.0 does)")


def arch_of(config: dict, src: Optional[Path] = None) -> Arch:
    """The config's Arch (arch_from_config), once Soup is known to stream its model_type."""
    mt = config.get("model_type") if isinstance(config, dict) else None
    if isinstance(config, dict) and streamed_as(mt, src) is None:
        raise UsageError(f"model_type {mt!r} cannot be layer-streamed by Soup (it streams "
                         f"{', '.join(supported_archs(src) + tuple(stream_aliases(src)))})")
    return arch_from_config(config)


def vocab_matrices_in_extras(a: Arch, f: Features) -> int:
    """Vocab matrices a release keeps resident beside the layers: a tied model's one; an untied
    model's two, or, where its shard splits the pair (0.74.0 on), none: they share one large slot."""
    return 1 if a.tied else (0 if f.splits_untied_pair else 2)


def vocab_matrices_resident(a: Arch, f: Features) -> int:
    """Vocab matrices resident at the peak: the extras' and the large slot's (one, 0.74.0 on)."""
    return vocab_matrices_in_extras(a, f) or 1


def _model_config(config: dict, a: Arch) -> SimpleNamespace:
    """The config as Soup's helpers read the model's (attributes; a text_config inside); what the
    file leaves out is transformers' default, as the Arch holds it."""
    def ns(d):
        return SimpleNamespace(**{k: ns(v) if isinstance(v, dict) else v for k, v in d.items()})

    out = ns(config)
    shape = getattr(out, "text_config", None) or out
    for name, value in (("hidden_size", a.h), ("num_hidden_layers", a.L)):
        if getattr(shape, name, None) is None:
            setattr(shape, name, value)
    return out


#: Each keyword a setup passes, and every way a read release spells its value: a new spelling is
#: one line, never a guess (r3 section 4).
SPELLINGS: dict = {}
for _f in RELEASE_FEATURES.values():
    for _name, _spelled in _f.setup_kwargs:
        SPELLINGS.setdefault(_name, set()).add(_spelled)


def refused_modes(a: Arch, f: Features, stream: dict, release: str, src: Path) -> None:
    """Soup's own refusals of soup-cli 0.77.0's streaming modes: a release without them, and a
    per-expert layout on any architecture but DeepSeek-V3's (its stream_setup.py)."""
    missing = sorted(set(stream) - set(f.stream_modes))
    if missing:
        raise UsageError(f"soup-cli {release} has no {', '.join(missing)}: streaming modes need 0.77.0")
    if stream.get("stream_expert_layout") == "per_expert" and streamed_as(a.model_type, src) != "deepseek_v3":
        raise UsageError(f"Soup refuses stream_expert_layout 'per_expert' on {a.model_type} (it admits "
                         "deepseek_v3 only: stream_setup.py PER_EXPERT_LAYOUT_ARCHS)")


def stream_refused(config: dict, stream: dict) -> None:
    """The installed Soup's refusals of the streaming modes asked for this config, one line each
    (refused_modes), before anything is estimated."""
    src = release_source(None)
    if src is not None:
        refused_modes(arch_of(config, src), read_features(src), stream, installed_release(), src)


def patched(src: Path) -> Optional[str]:
    """The header line of a soup_cli folder's --soup-patch module (its tool version), None when unpatched."""
    path = src / PATCH_MODULE
    if not path.is_file():
        return None
    head = path.read_text(encoding="utf-8").lstrip('"').split("\n", 1)[0]
    return head.split(":", 1)[0] if head.startswith(PATCH_MARKER) else None


@functools.lru_cache(maxsize=4)
def _patched_module(path: Path, mtime: float):
    """A patched release's corrected_peak.py, loaded from its file (stdlib only, imports nothing of
    soup_cli), under a name of its own: never the soup_cli package."""
    import importlib.util
    import sys

    name = f"_issue395_patched_{abs(hash((str(path), mtime)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def patched_preflight(src: Path, config: dict, *, quant: str, seq: int, batch: int, targets, lora_r: int,
                      stream: dict, task: str, optimizer: str, formula: int, steps: Optional[int] = None,
                      accumulation: int = 1, buffers: int = 2) -> dict:
    """What a patched release's own setup computes: its corrected_peak.preflight called as the patched
    _stream_budget_lines calls it, on Soup's config objects as its loader builds them from these values
    (task, data.max_length, training's quantization, batch, LoRA, streaming modes, optimizer) and the
    model's config, with Soup's formula beside it. ``steps``: None as the setup calls it (the gate's
    steady state); a run of known length (a committed one-step arm) gives its own."""
    path = src / PATCH_MODULE
    module = _patched_module(path, path.stat().st_mtime)
    soup_quant = {"none": "none", "nf4": "4bit"}[quant]
    lora = SimpleNamespace(target_modules=list(targets) if isinstance(targets, (tuple, list)) else targets,
                           r=lora_r, dropout=0.05)
    tcfg = SimpleNamespace(quantization=soup_quant, batch_size=batch, lora=lora, optimizer=optimizer,
                           stream_buffers=buffers, gradient_accumulation_steps=accumulation, **dict(stream))
    cfg = SimpleNamespace(task=task, data=SimpleNamespace(max_length=seq), training=tcfg)
    return module.preflight(cfg, tcfg, dict(config), formula=formula, steps=steps)


def soup_preflight_from_config(config: dict, *, quant: str, seq: int, batch: int, targets,
                               lora_r: int, release: str | None = None, stream: dict | None = None,
                               task: str = PROTOCOL_TASK, optimizer: str = "adamw_torch",
                               accumulation: int = 1, buffers: int = 2) -> tuple[int, dict]:
    """Soup's own number, computed by ``release``'s estimator (the installed one by default) on the
    keywords that release's setup passes, and those keywords. ``targets``: the LoRA targets as
    Soup's config holds them: a tuple of modules, or Soup's own string (all-linear, auto), which
    its _estimate_adapter_params counts as it counts it. ``stream``: Soup training keys. A release
    patched by --soup-patch: its gate's number, computed by its own corrected_peak module as its
    setup calls it (``optimizer``: training.optimizer, which that module charges from step 2 on;
    ``accumulation``: training.gradient_accumulation_steps, whose held gradients it charges; ``buffers``:
    training.stream_buffers, its pool's slots), with
    the terms {"formula": Soup's own number, "formula_kwargs": its keywords, "corrected": the
    module's record}."""
    src = release_source(release)
    release = release or installed_release()
    if src is None:
        raise UsageError(f"Soup's own number for soup-cli {release} is computed by that release's own code, "
                         f"which is not here (soup-cli {installed_release()} is installed; {RELEASES_ENV} names "
                         "a folder of unpacked wheels)")
    f = read_features(src)
    a = arch_of(config, src)
    stream = stream or {}
    refused_modes(a, f, stream, release, src)
    per_expert = stream.get("stream_expert_layout") == "per_expert"
    rows, refill = f.task(task)
    if TASKS[task].batch_refused(batch):
        raise UsageError(f"batch {batch}: {TASKS[task].batch_refused(batch)}")
    ns, mixin = _namespace(src), _mixin(src)
    vocab_mat = 2 * a.V * a.h
    slot = 0 if vocab_matrices_in_extras(a, f) else vocab_mat  # large_layer_buffer_bytes: max(embed, head)
    if f.large_budget:
        large = type("Task", (mixin,), {"_STREAM_REFILL_BEFORE_BACKWARD": refill})()._stream_large_budget_bytes(
            slot, 2 if slot else 0)
    else:
        large = slot
    soup_value = list(targets) if isinstance(targets, (tuple, list)) else targets
    resolved = list(targets) if isinstance(targets, (tuple, list)) else list(a.modules)
    adapter_kw = {"target_modules": resolved} if "target_modules" in dict(f.setup_kwargs)["adapter_params"] else {}
    values = {
        "layer_bytes": layer_bytes(a, quant, per_expert), "buffers": buffers,
        "extras_bytes": vocab_mat * vocab_matrices_in_extras(a, f) + 2 * a.h * (2 if a.norm_bias else 1)
        + (2 * a.V if a.quirks.head_bias and not a.tied else 0),
        "adapter_params": mixin._estimate_adapter_params(mixin(), _tcfg(soup_value, lora_r),
                                                         _model_config(config, a), **adapter_kw),
        "vocab_size": a.V, "hidden_size": a.h, "intermediate_size": a.i, "n_layers": a.L, "seq_len": seq,
        "batch_size": batch * rows, "logits_bytes_per_element": float(ns["LOGITS_BYTES_PER_ELEMENT"]),
        "large_layer_bytes": large,
        "persistent_bytes": expert_in_flight(a.layers.expert, quant) if per_expert and a.layers else 0,
        "loss_chunk": stream.get("stream_loss_chunk")}
    kwargs = {}
    for name, spelled in f.setup_kwargs:
        if name not in values or spelled not in SPELLINGS.get(name, ()):
            raise UsageError(f"soup-cli {release}'s setup passes {name}={spelled}: not modelled by this tool")
        kwargs[name] = values[name]
    fn = ns["estimate_stream_peak_vram"]
    taken = fn.__code__.co_varnames[:fn.__code__.co_argcount + fn.__code__.co_kwonlyargcount]
    if set(kwargs) - set(taken):
        raise UsageError(f"soup-cli {release}'s own setup passes {', '.join(sorted(set(kwargs) - set(taken)))}, "
                         "which its own estimator does not take (Soup would fail too)")
    number = int(fn(**kwargs))
    if patched(src) is None:
        return number, kwargs
    record = patched_preflight(src, config, quant=quant, seq=seq, batch=batch, targets=soup_value, lora_r=lora_r,
                               stream=stream, task=task, optimizer=optimizer, formula=number, accumulation=accumulation,
                               buffers=buffers)
    gate = number if record["gate_bytes"] is None else int(record["gate_bytes"])
    return gate, {"formula": number, "formula_kwargs": kwargs, "corrected": record}
