"""The shape of any config this tool builds (pool, extras, adapter, dims) derived on a meta skeleton,
from a registry family, a hub id or a local config; what the installed Soup streams (asked of a
streamed run only: a resident run streams nothing), and what the map cannot cover. The families
themselves are issue395.model.registry's.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from ..constants import CONFIG_LIMITS, is_whole
from ..errors import UsageError, last_line
from ..record import GRID_ADAPTER_FACTOR, LORA_ALPHA, LORA_R
from ..model.registry import FAMILIES, MAP_FAMILIES, NOT_ON_MAP, RELEASE_FAMILIES, SHAPES, Shape, config_json
from ..model.streaming import Streaming, family_of
from ..estimator.arch import protocol_targets_in
from ..estimator.moe import soup_intermediate
from ..estimator.releases import installed_release
from ..estimator.soup_number import stream_aliases, streamed_as, supported_archs
from .console import quiet_libraries


def bitsandbytes_present() -> bool:
    """NF4 needs bitsandbytes; without it Soup's setup fails deep inside transformers."""
    return importlib.util.find_spec("bitsandbytes") is not None




def size_problem(attr: str, value: Any) -> Optional[str]:
    """Why a config size cannot be a real model's (None if it can)."""
    if not is_whole(value, minimum=1) or value > CONFIG_LIMITS[attr]:
        return (f"config {attr} is {value!r}; it must be a whole number from 1 to {CONFIG_LIMITS[attr]} "
                "(no real model is larger)")
    return None


def derive_shape(config: Any, name: str, key: str = "custom", hub_id: Optional[str] = None,
                 arch: Optional[dict] = None, targets: Optional[tuple] = None, lora_r: int = LORA_R,
                 lora_alpha: int = LORA_ALPHA, streamed: bool = True) -> Shape:
    """pool, extras, adapter and dims of any config this tool builds, by the grid's conventions, on a
    meta skeleton: a bf16 layer is half the pool; extras every other unique parameter (a tied
    head once); the adapter at ``lora_r`` on ``targets``; ``arch`` keeps the other public
    fields, so the exact shape can be built. ``streamed``: the run streams its layers, so Soup
    must stream its architecture (a resident run streams nothing: any model transformers builds)."""
    import torch
    from transformers import AutoModelForCausalLM

    model_type = getattr(config, "model_type", "")
    if streamed:
        refuse_unstreamed(model_type, name)
    width = soup_intermediate(lambda n: getattr(config, n, None))
    for attr in CONFIG_LIMITS:  # a MoE config may have no dense intermediate_size: Soup's width then
        value = getattr(config, attr, None)
        problem = size_problem(attr, width if attr == "intermediate_size" and value is None else value)
        if problem:
            raise UsageError(f"{name}: {problem}")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    except Exception as exc:  # a config transformers accepts but cannot build: still one line
        raise UsageError(f"{name}: its config does not build a model ({last_line(exc)})") from None
    layers = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)
                   and len(m) == config.num_hidden_layers), None)
    if layers is None:
        raise UsageError(f"{name}: could not find its {config.num_hidden_layers} decoder layers")
    targets = targets or protocol_targets_in({n.split(".")[-1] for n, m in layers.named_modules()
                                              if isinstance(m, torch.nn.Linear)})
    in_layers = {id(p) for p in layers.parameters()}
    extras = sum(p.numel() * 2 for p in model.parameters() if id(p) not in in_layers)
    adapter = sum(lora_r * (m.in_features + m.out_features) for n, m in layers.named_modules()
                  if n.split(".")[-1] in targets and isinstance(m, torch.nn.Linear))
    return Shape(key=key, name=name, hub_id=hub_id or name, model_type=model_type,
                 # the largest layer: a MoE model's dense layers are smaller than its MoE ones
                 pool=2 * max(sum(p.numel() for p in layer.parameters()) for layer in layers) * 2,
                 extras=extras, grid_adapter=adapter * GRID_ADAPTER_FACTOR, vocab=int(config.vocab_size),
                 hidden=int(config.hidden_size), intermediate=width,
                 n_layers=int(config.num_hidden_layers),
                 max_positions=int(getattr(config, "max_position_embeddings", 0) or 0),
                 arch={k: v for k, v in (arch or {}).items() if k not in NOT_ARCH},
                 record=False, targets=targets, lora_r=lora_r, lora_alpha=lora_alpha)


def refuse_unstreamed(model_type: Any, who: str) -> None:
    """One line where the installed Soup cannot layer-stream ``model_type``: a streamed run's check only."""
    if streamed_as(model_type) is None:
        raise UsageError(f"{who}: architecture {model_type!r} cannot be layer-streamed by Soup "
                         f"(it streams {', '.join(supported_archs())})")


def transformers_builds(model_type: Any) -> bool:
    """Whether the installed transformers knows ``model_type`` (its auto config's registry)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def default_map_families() -> tuple:
    """The map's families for the installed Soup: the ten it has always streamed, and each later
    family whose model type this release streams."""
    return MAP_FAMILIES + tuple(k for k in RELEASE_FAMILIES if streamed_as(FAMILIES[k].model_type))


def not_on_map() -> list[str]:
    """Every model type the installed Soup streams (its allowlist and aliases) that no family here
    builds, named with the reason: a map never skips one silently."""
    aliases = stream_aliases()
    covered = {streamed_as(f.model_type) for f in FAMILIES.values()} | {"llama", "qwen2"}
    covered |= {f.model_type for f in FAMILIES.values()}
    lines = []
    for model_type in list(supported_archs()) + list(aliases):
        if model_type in covered:
            continue
        arch = aliases.get(model_type, model_type)
        reason = NOT_ON_MAP.get(arch, f"no family here builds it (it streams as {arch})")
        if f"{model_type}_text" in covered:  # the multimodal wrapper of a text decoder mapped here
            reason = (f"mapped through its text decoder ({model_type}_text), which is what Soup streams; "
                      "the wrapper's vision tower is not measured")
        lines.append(f"Soup {installed_release()} streams {model_type}: {reason}")
    return lines


#: Fields of a config.json that are not its architecture (the builder sets its own token ids).
NOT_ARCH = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "model_type",
            "architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
            "auto_map", "quantization_config", "use_cache"}


def family_shape(key: str) -> Shape:
    """A family's shape from its public config alone (the record's two are the record's), under
    the streaming modes its key names."""
    base = family_of(key)
    return with_modes(SHAPES[base] if base in SHAPES else registry_shape(base), key)


def registry_shape(base: str, targets: Optional[tuple] = None, lora_r: int = LORA_R,
                   lora_alpha: int = LORA_ALPHA) -> Shape:
    """A registry model's shape derived from its public config (a family's; the record's two as
    config_json writes theirs) under a LoRA adapter: the family's targets and the protocol's r and
    alpha unless a --config file names its own. The model's shape, not a run's: whether the installed
    Soup streams it is checked where a streamed run of it is settled (``require_streamed``: --families,
    a --config file), so a resident run of it, and its checkpoint, build here."""
    from transformers import AutoConfig

    family, fields_ = FAMILIES.get(base), config_json(base)
    arch = {k: v for k, v in fields_.items() if k != "model_type"}
    with quiet_libraries():
        config = AutoConfig.for_model(fields_["model_type"], **arch)
    return derive_shape(config, family.label if family else SHAPES[base].name, key=base,
                        hub_id=family.hub_id if family else SHAPES[base].hub_id, arch=arch,
                        targets=targets or (family.targets if family else None), lora_r=lora_r, lora_alpha=lora_alpha,
                        streamed=False)


def with_modes(shape: Shape, key: str) -> Shape:
    """``shape`` (a family's) under the streaming modes ``key`` names: the name says them, the
    arm's Soup config carries them; the checkpoint stays the family's."""
    streaming = Streaming.parse(key)[1]
    if streaming == Streaming():
        return shape
    return replace(shape, name=streaming.label(shape.name), stream=tuple(streaming.training().items()))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def config_only(model: str) -> Optional[Path]:
    """The config.json that --model names when it brings no weights (a config.json, or a
    folder holding one and no safetensors): synthetic weights are built from it."""
    path = Path(model)
    if path.is_file():
        return path
    if path.is_dir() and (path / "config.json").is_file() and not any(path.glob("*.safetensors")):
        return path / "config.json"
    return None


def load_custom_shape(model: str, targets: Optional[tuple] = None, lora_r: int = LORA_R,
                      lora_alpha: int = LORA_ALPHA, streamed: bool = True) -> Shape:
    """--model's figures from its config (a checkpoint folder, a config.json, or a hub id), under
    the protocol's adapter unless a --config file names its own; what Soup cannot stream (where the
    run is ``streamed``: a --config file's resident run is not) or this tool cannot run is refused in
    one line, before anything is built."""
    adapter = dict(targets=targets, lora_r=lora_r, lora_alpha=lora_alpha, streamed=streamed)
    from transformers import AutoConfig

    path, config_file = Path(model), config_only(model)
    synthetic = config_file is not None  # weights will be built from this config
    if path.exists() and config_file is None:
        if not path.is_dir() or not (path / "config.json").is_file():
            raise UsageError(f"--model {model}: not a checkpoint folder (no config.json)")
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise UsageError(f"--model {model}: no tokenizer in it (none of "
                             f"{', '.join(TOKENIZER_FILES)}); the protocol's rows need one")
        config_file = path / "config.json"
    if config_file is None:  # a hub id
        with quiet_libraries():
            try:
                config = AutoConfig.from_pretrained(model)
            except Exception as exc:
                raise UsageError(f"--model {model}: cannot read its config ({last_line(exc)})") from None
        return derive_shape(config, name=model, **adapter)
    try:
        fields_ = json.loads(config_file.read_text(encoding="utf-8"))
        if not isinstance(fields_, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError, RecursionError) as exc:
        raise UsageError(f"--model {model}: {config_file.name} cannot be read ({last_line(exc)})") from None
    model_type = fields_.get("model_type")
    if streamed:
        refuse_unstreamed(model_type, f"--model {model}")
    elif not transformers_builds(model_type):  # a resident run loads it as transformers does: nothing else to ask
        raise UsageError(f"--model {model}: architecture {model_type!r} is not one the installed transformers "
                         "builds, so no run of it can be loaded")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if not is_whole(fields_.get(key), minimum=1):
            raise UsageError(f"--model {model}: {config_file.name} has {key} {fields_.get(key)!r}; it must "
                             "be a whole number >= 1")
    for key in CONFIG_LIMITS:  # before transformers sees it: a million layers is minutes of config
        if key in fields_ and size_problem(key, fields_[key]):
            raise UsageError(f"--model {model}: {config_file.name}: {size_problem(key, fields_[key])}")
    with quiet_libraries():
        try:
            config = AutoConfig.for_model(model_type, **{k: v for k, v in fields_.items() if k != "model_type"})
        except Exception as exc:
            raise UsageError(f"--model {model}: {config_file.name} is not a {model_type} config "
                             f"({last_line(exc)})") from None
    shape = derive_shape(config, name=model, arch=fields_, **adapter)
    if synthetic and shape.vocab < 300:
        raise UsageError(f"--model {model}: vocab_size {shape.vocab} is smaller than the synthetic "
                         "tokenizer's 300 tokens")
    return shape


def soup_loss_chunk_bounds() -> tuple[int, int]:
    """training.stream_loss_chunk's bounds in the installed Soup's schema (config_bounds.py)."""
    try:
        from soup_cli.utils import config_bounds
    except ImportError:  # a release with no chunked loss: the flag is refused elsewhere
        return 16, 8192
    return (getattr(config_bounds, "MIN_STREAM_LOSS_CHUNK", 16),
            getattr(config_bounds, "MAX_STREAM_LOSS_CHUNK", 8192))


def soup_has_stream_modes() -> bool:
    """Whether the installed Soup's config schema knows 0.77.0's streaming modes."""
    from soup_cli.config.schema import TrainingConfig

    return "stream_expert_layout" in TrainingConfig.model_fields
