"""Every family Soup streams, as a typed record of its public config.json, and the shape of any
streamable config (pool, extras, adapter, dims) derived on a meta skeleton.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .console import quiet_libraries
from .constants import CONFIG_LIMITS
from .errors import UsageError, last_line
from .record import GRID_ADAPTER_FACTOR, LORA_R, LORA_TARGETS, SHAPES, Shape
from .row import _whole


@dataclass(frozen=True)
class Family:
    """One public checkpoint of a family Soup streams: its config.json fields (model_type aside)
    and its public parameter count (a tied head once)."""

    name: str
    hub_id: str
    model_type: str
    config: dict
    params: int

    @property
    def max_positions(self) -> int:
        return self.config["max_position_embeddings"]

    @property
    def vocab(self) -> int:
        return self.config["vocab_size"]


def bitsandbytes_present() -> bool:
    """NF4 needs bitsandbytes; without it Soup's setup fails deep inside transformers."""
    return importlib.util.find_spec("bitsandbytes") is not None




def size_problem(attr: str, value: Any) -> Optional[str]:
    """Why a config size cannot be a real model's (None if it can)."""
    if not _whole(value, minimum=1) or value > CONFIG_LIMITS[attr]:
        return (f"config {attr} is {value!r}; it must be a whole number from 1 to {CONFIG_LIMITS[attr]} "
                "(no real model is larger)")
    return None


def derive_shape(config: Any, name: str, key: str = "custom", hub_id: Optional[str] = None,
                 arch: Optional[dict] = None) -> Shape:
    """pool, extras, adapter and dims of any streamable config, by the grid's conventions, on a
    meta skeleton: a bf16 layer is half the pool; extras every other unique parameter (a tied
    head once); ``arch`` keeps the other public fields, so the exact shape can be built."""
    import torch
    from soup_cli.utils.layer_stream import SUPPORTED_STREAM_ARCHS
    from transformers import AutoModelForCausalLM

    model_type = getattr(config, "model_type", "")
    if model_type not in SUPPORTED_STREAM_ARCHS:
        raise UsageError(f"{name}: architecture {model_type!r} cannot be layer-streamed by Soup "
                         f"(it streams {', '.join(SUPPORTED_STREAM_ARCHS)})")
    for attr in CONFIG_LIMITS:
        problem = size_problem(attr, getattr(config, attr, None))
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
    targets = lora_targets(model_type)
    in_layers = {id(p) for p in layers.parameters()}
    extras = sum(p.numel() * 2 for p in model.parameters() if id(p) not in in_layers)
    adapter = sum(LORA_R * (m.in_features + m.out_features) for n, m in layers.named_modules()
                  if n.split(".")[-1] in targets and isinstance(m, torch.nn.Linear))
    return Shape(key=key, name=name, hub_id=hub_id or name, model_type=model_type,
                 pool=2 * sum(p.numel() for p in layers[0].parameters()) * 2, extras=extras,
                 adapter=adapter * GRID_ADAPTER_FACTOR, vocab=int(config.vocab_size),
                 hidden=int(config.hidden_size), intermediate=int(config.intermediate_size),
                 n_layers=int(config.num_hidden_layers),
                 max_positions=int(getattr(config, "max_position_embeddings", 0) or 0),
                 arch={k: v for k, v in (arch or {}).items() if k not in NOT_ARCH},
                 record=False, targets=targets)


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


#: One public checkpoint per family Soup streams (docs/FAMILIES.md): its config.json
#: fields and its public parameter count (a tied head once). smol and qwen are the record's.
FAMILIES: dict[str, Family] = {
    "llama32-1b": Family("Llama-3.2-1B", "meta-llama/Llama-3.2-1B", "llama", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
        rms_norm_eps=1e-5, hidden_act="silu"), 1_235_814_400),
    "qwen3-0.6b": Family("Qwen3-0.6B", "Qwen/Qwen3-0.6B", "qwen3", dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu",
        attention_bias=False, use_sliding_window=False, sliding_window=None), 596_049_920),
    "mistral-7b": Family("Mistral-7B-v0.3", "mistralai/Mistral-7B-v0.3", "mistral", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=32768, tie_word_embeddings=False,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5, hidden_act="silu",
        sliding_window=None), 7_248_023_552),
    "gemma-2b": Family("gemma-2b", "google/gemma-2b", "gemma", dict(
        hidden_size=2048, intermediate_size=16384, num_hidden_layers=18, num_attention_heads=8,
        num_key_value_heads=1, head_dim=256, vocab_size=256000, tie_word_embeddings=True,
        max_position_embeddings=8192, rope_theta=10000.0, rms_norm_eps=1e-6,
        hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh"), 2_506_172_416),
    "gemma2-2b": Family("gemma-2-2b", "google/gemma-2-2b", "gemma2", dict(
        hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=256000, tie_word_embeddings=True,
        max_position_embeddings=8192, rope_theta=10000.0, rms_norm_eps=1e-6,
        hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, sliding_window=4096,
        query_pre_attn_scalar=256), 2_614_341_888),
    "gemma3-1b": Family("gemma-3-1b-pt", "google/gemma-3-1b-pt", "gemma3_text", dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=262144, tie_word_embeddings=True,
        max_position_embeddings=32768, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", sliding_window=512,
        sliding_window_pattern=6, query_pre_attn_scalar=256, final_logit_softcapping=None,
        attn_logit_softcapping=None), 999_885_952),
    "phi-2": Family("phi-2", "microsoft/phi-2", "phi", dict(
        hidden_size=2560, intermediate_size=10240, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=51200, tie_word_embeddings=False,
        max_position_embeddings=2048, rope_theta=10000.0, partial_rotary_factor=0.4,
        layer_norm_eps=1e-5, hidden_act="gelu_new", qk_layernorm=False), 2_779_683_840),
    "phi3-mini": Family("Phi-3-mini-4k-instruct", "microsoft/Phi-3-mini-4k-instruct", "phi3", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, tie_word_embeddings=False,
        max_position_embeddings=4096, original_max_position_embeddings=4096, rope_theta=10000.0,
        rms_norm_eps=1e-5, hidden_act="silu", sliding_window=2047), 3_821_079_552),
    "llama31-8b": Family("Llama-3.1-8B", "meta-llama/Llama-3.1-8B", "llama", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE, factor=8.0),
        rms_norm_eps=1e-5, hidden_act="silu"), 8_030_261_248),
}


MAP_FAMILIES = ("smol", "qwen", "llama32-1b", "qwen3-0.6b", "mistral-7b", "gemma-2b", "gemma2-2b",
                "gemma3-1b", "phi-2", "phi3-mini")


#: Every family --families takes, in the map's order: the default ten, then those only asked for.
ALL_FAMILIES = MAP_FAMILIES + tuple(k for k in FAMILIES if k not in MAP_FAMILIES)


#: Fields of a config.json that are not its architecture (the builder sets its own token ids).
NOT_ARCH = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "model_type",
            "architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
            "auto_map", "quantization_config", "use_cache"}


def lora_targets(model_type: str) -> tuple:
    """The protocol's q_proj and v_proj where they exist; Phi-3 fuses them into qkv_proj."""
    return ("qkv_proj",) if model_type == "phi3" else LORA_TARGETS


def family_shape(key: str) -> Shape:
    """A family's shape from its public config alone (the record's two are the record's)."""
    if key in SHAPES:
        return SHAPES[key]
    family = FAMILIES[key]
    from transformers import AutoConfig

    with quiet_libraries():
        config = AutoConfig.for_model(family.model_type, **family.config)
    return derive_shape(config, family.name, key=key, hub_id=family.hub_id, arch=family.config)


def max_positions(key: str) -> int:
    return SHAPES[key].max_positions if key in SHAPES else FAMILIES[key].max_positions


def config_json(key: str) -> dict[str, Any]:
    """A family's (or one of the record's two models') public config.json, as --estimate reads one."""
    if key in FAMILIES:
        return {"model_type": FAMILIES[key].model_type, **FAMILIES[key].config}
    s = SHAPES[key]
    return {"model_type": s.model_type, "hidden_size": s.hidden, "intermediate_size": s.intermediate,
            "num_hidden_layers": s.n_layers, "vocab_size": s.vocab, "max_position_embeddings": s.max_positions,
            "tie_word_embeddings": True, "hidden_act": "silu", **s.arch}


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


def load_custom_shape(model: str) -> Shape:
    """--model's figures from its config (a checkpoint folder, a config.json, or a hub id); what
    Soup cannot stream or this tool cannot run is refused in one line, before anything is built."""
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
        return derive_shape(config, name=model)
    try:
        fields_ = json.loads(config_file.read_text(encoding="utf-8"))
        if not isinstance(fields_, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError, RecursionError) as exc:
        raise UsageError(f"--model {model}: {config_file.name} cannot be read ({last_line(exc)})") from None
    from soup_cli.utils.layer_stream import SUPPORTED_STREAM_ARCHS

    model_type = fields_.get("model_type")
    if model_type not in SUPPORTED_STREAM_ARCHS:
        raise UsageError(f"--model {model}: architecture {model_type!r} cannot be layer-streamed by Soup "
                         f"(it streams {', '.join(SUPPORTED_STREAM_ARCHS)})")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if not _whole(fields_.get(key), minimum=1):
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
    shape = derive_shape(config, name=model, arch=fields_)
    if synthetic and shape.vocab < 300:
        raise UsageError(f"--model {model}: vocab_size {shape.vocab} is smaller than the synthetic "
                         "tokenizer's 300 tokens")
    return shape
