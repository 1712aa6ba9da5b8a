"""Every family Soup streams, as a typed record of its public config.json, and the shape of any
streamable config (pool, extras, adapter, dims) derived on a meta skeleton.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, replace
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
    params: Optional[int]  # the public checkpoint's count; None where none is published exactly
    #: The public checkpoint's layer count where the built one is shallower (the same width, so
    #: every layer the step streams is the real one; a row says "layers 4 of 61").
    depth_of: Optional[int] = None
    #: The family's own LoRA targets where the protocol's q_proj/v_proj do not exist.
    targets: Optional[tuple] = None
    #: Where the shape comes from, when it is not one public config.json.
    source: str = ""

    @property
    def label(self) -> str:
        """The name a row carries: the checkpoint, and its depth where it is not the public one."""
        depth = self.config["num_hidden_layers"]
        return f"{self.name} (layers {depth} of {self.depth_of})" if self.depth_of else self.name

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


def streamed_as(model_type: str) -> Optional[str]:
    """The architecture the installed Soup streams ``model_type`` as (its allowlist, through its
    aliases: qwen3_5_text streams as qwen3 on 0.77.0), or None where it does not stream it."""
    from soup_cli.utils import layer_stream

    family = getattr(layer_stream, "_STREAM_ARCH_ALIASES", {}).get(model_type, model_type)
    return family if family in layer_stream.SUPPORTED_STREAM_ARCHS else None


def soup_intermediate(config: Any) -> int:
    """The activation width Soup's pre-flight reads (0.77.0's ``_stream_intermediate_size``): the
    dense MLP's, or for a MoE config without one, the routed experts a token visits plus the
    shared expert."""
    direct = int(getattr(config, "intermediate_size", 0) or 0)
    if direct:
        return direct
    moe = int(getattr(config, "moe_intermediate_size", 0) or 0)
    per_token = int(getattr(config, "num_experts_per_tok", 0) or 0)
    return moe * max(per_token, 1) + int(getattr(config, "shared_expert_intermediate_size", 0) or 0)


def derive_shape(config: Any, name: str, key: str = "custom", hub_id: Optional[str] = None,
                 arch: Optional[dict] = None, targets: Optional[tuple] = None) -> Shape:
    """pool, extras, adapter and dims of any streamable config, by the grid's conventions, on a
    meta skeleton: a bf16 layer is half the pool; extras every other unique parameter (a tied
    head once); ``arch`` keeps the other public fields, so the exact shape can be built."""
    import torch
    from soup_cli.utils.layer_stream import SUPPORTED_STREAM_ARCHS
    from transformers import AutoModelForCausalLM

    model_type = getattr(config, "model_type", "")
    if streamed_as(model_type) is None:
        raise UsageError(f"{name}: architecture {model_type!r} cannot be layer-streamed by Soup "
                         f"(it streams {', '.join(SUPPORTED_STREAM_ARCHS)})")
    for attr in CONFIG_LIMITS:  # a MoE config may have no dense intermediate_size: Soup's width then
        value = getattr(config, attr, None)
        problem = size_problem(attr, soup_intermediate(config) if attr == "intermediate_size" and value is None
                               else value)
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
    targets = targets or lora_targets(model_type)
    in_layers = {id(p) for p in layers.parameters()}
    extras = sum(p.numel() * 2 for p in model.parameters() if id(p) not in in_layers)
    adapter = sum(LORA_R * (m.in_features + m.out_features) for n, m in layers.named_modules()
                  if n.split(".")[-1] in targets and isinstance(m, torch.nn.Linear))
    return Shape(key=key, name=name, hub_id=hub_id or name, model_type=model_type,
                 # the largest layer: a MoE model's dense layers are smaller than its MoE ones
                 pool=2 * max(sum(p.numel() for p in layer.parameters()) for layer in layers) * 2,
                 extras=extras, adapter=adapter * GRID_ADAPTER_FACTOR, vocab=int(config.vocab_size),
                 hidden=int(config.hidden_size), intermediate=soup_intermediate(config),
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
    # -- depth evidence: the same width at a quarter of the depth, so a reduced-depth MoE row is
    # read against what the estimator says depth costs, on a family measured at full depth --
    "llama32-1b-d4": Family("Llama-3.2-1B", "meta-llama/Llama-3.2-1B", "llama", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
        rms_norm_eps=1e-5, hidden_act="silu"), None, depth_of=16),
    # -- soup-cli 0.77.0's new families. MoE layers are built at full width (every expert, every
    # width), at reduced depth where a lent box's disk and RAM cannot hold the real one --
    # moonshotai/Moonlight-16B-A3B config.json: DeepSeek-V3's decoder (MLA, no q_lora), 64 routed
    # experts + 2 shared, 6 per token, layer 0 dense. MLA has no q_proj/v_proj pair: LoRA goes on
    # the query and on kv_b_proj, which makes the values (and keys) from the latent.
    "moonlight": Family("Moonlight-16B-A3B", "moonshotai/Moonlight-16B-A3B", "deepseek_v3", dict(
        hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
        num_experts_per_tok=6, first_k_dense_replace=1, routed_scaling_factor=2.446, kv_lora_rank=512,
        q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=1,
        topk_group=1, norm_topk_prob=True, vocab_size=163840, tie_word_embeddings=False,
        max_position_embeddings=8192, rope_theta=50000.0, rms_norm_eps=1e-5, hidden_act="silu"),
        None, depth_of=27, targets=("q_proj", "kv_b_proj")),
    # deepseek-ai/DeepSeek-V3 config.json (MTP layer aside: transformers does not build it): 256
    # routed experts + 1 shared, 8 per token, layers 0-2 dense. Depth 4 keeps all three dense layers
    # and one MoE layer (22.5 GB of routed experts in bf16).
    "deepseek-v3": Family("DeepSeek-V3", "deepseek-ai/DeepSeek-V3", "deepseek_v3", dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=4,
        num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
        num_experts_per_tok=8, first_k_dense_replace=3, routed_scaling_factor=2.5, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
        topk_group=4, norm_topk_prob=True, vocab_size=129280, tie_word_embeddings=False,
        max_position_embeddings=163840, rope_theta=10000.0, rms_norm_eps=1e-6, hidden_act="silu",
        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
                          beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
        None, depth_of=61, targets=("q_b_proj", "kv_b_proj")),
    # moonshotai/Kimi-K2-Instruct config.json, which Soup's loader reads into DeepseekV3Config: 384
    # routed experts + 1 shared, layer 0 dense. One MoE layer is 33.8 GB in bf16.
    "kimi-k2": Family("Kimi-K2", "moonshotai/Kimi-K2-Instruct", "deepseek_v3", dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=2,
        num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1, n_routed_experts=384,
        num_experts_per_tok=8, first_k_dense_replace=1, routed_scaling_factor=2.827, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=1,
        topk_group=1, norm_topk_prob=True, vocab_size=163840, tie_word_embeddings=False,
        max_position_embeddings=131072, rope_theta=50000.0, rms_norm_eps=1e-6, hidden_act="silu",
        rope_scaling=dict(type="yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0,
                          beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
        None, depth_of=61, targets=("q_b_proj", "kv_b_proj")),
    # Qwen3.5 text decoders are hybrids: three gated delta-net (linear attention) layers, then one
    # full-attention layer. Depth 4 holds one of each kind's period. Shapes: transformers 5.16.1's
    # own config defaults (Qwen3_5TextConfig; Qwen3_5MoeTextConfig, whose documented checkpoint is
    # Qwen/Qwen3.5-35B-A3B), read from the installed class, not a public config.json.
    "qwen3.5": Family("Qwen3.5 (transformers' Qwen3_5TextConfig defaults)", "", "qwen3_5_text", dict(
        num_hidden_layers=4, vocab_size=248320, max_position_embeddings=32768), None, depth_of=32,
        source="transformers 5.16.1 Qwen3_5TextConfig defaults"),
    "qwen3.5-moe": Family("Qwen3.5-35B-A3B", "Qwen/Qwen3.5-35B-A3B", "qwen3_5_moe_text", dict(
        num_hidden_layers=4, vocab_size=248320, max_position_embeddings=32768), None, depth_of=40,
        source="transformers 5.16.1 Qwen3_5MoeTextConfig defaults (its documented checkpoint)"),
}


#: Model types Soup streams that no family here covers, and why (a map names them, never skips).
NOT_ON_MAP = {
    "qwen4_exp": "transformers 5.16.1's Qwen4ExpTextConfig defaults do not build (its sparse-attention "
                 "indexer fields default to None) and no public qwen4_exp checkpoint exists",
}


MAP_FAMILIES = ("smol", "qwen", "llama32-1b", "qwen3-0.6b", "mistral-7b", "gemma-2b", "gemma2-2b",
                "gemma3-1b", "phi-2", "phi3-mini")


#: Families a later Soup streams, on the default map wherever the installed Soup streams them.
#: DeepSeek-V3 and Kimi K2 are asked for by name: one of their MoE layers is 22.5-34 GB.
RELEASE_FAMILIES = ("moonlight", "qwen3.5", "qwen3.5-moe")


#: Every family --families takes, in the map's order: the default ten, then those only asked for.
ALL_FAMILIES = MAP_FAMILIES + RELEASE_FAMILIES + tuple(
    k for k in FAMILIES if k not in MAP_FAMILIES + RELEASE_FAMILIES)


def default_map_families() -> tuple:
    """The map's families for the installed Soup: the ten it has always streamed, and each later
    family whose model type this release streams."""
    return MAP_FAMILIES + tuple(k for k in RELEASE_FAMILIES if streamed_as(FAMILIES[k].model_type))


def not_on_map() -> list[str]:
    """Every model type the installed Soup streams (its allowlist and aliases) that no family here
    builds, named with the reason: a map never skips one silently."""
    from soup_cli.utils import layer_stream

    aliases = getattr(layer_stream, "_STREAM_ARCH_ALIASES", {})
    covered = {streamed_as(f.model_type) for f in FAMILIES.values()} | {"llama", "qwen2"}
    covered |= {f.model_type for f in FAMILIES.values()}
    lines = []
    for model_type in list(layer_stream.SUPPORTED_STREAM_ARCHS) + list(aliases):
        if model_type in covered:
            continue
        arch = aliases.get(model_type, model_type)
        reason = NOT_ON_MAP.get(arch, f"no family here builds it (it streams as {arch})")
        if f"{model_type}_text" in covered:  # the multimodal wrapper of a text decoder mapped here
            reason = (f"mapped through its text decoder ({model_type}_text), which is what Soup streams; "
                      "the wrapper's vision tower is not measured")
        lines.append(f"Soup {_soup_release()} streams {model_type}; not on this map: {reason}")
    return lines


def _soup_release() -> str:
    import importlib.metadata

    return importlib.metadata.version("soup-cli")


#: Fields of a config.json that are not its architecture (the builder sets its own token ids).
NOT_ARCH = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "model_type",
            "architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
            "auto_map", "quantization_config", "use_cache"}


def lora_targets(model_type: str) -> tuple:
    """The protocol's q_proj and v_proj where they exist; Phi-3 fuses them into qkv_proj. MLA
    (deepseek_v3) has neither: its families name their own (see FAMILIES)."""
    return ("qkv_proj",) if model_type == "phi3" else LORA_TARGETS


#: soup-cli 0.77.0's streaming modes as map axes: how a mode is spelled after a family's key
#: ("moonlight+per_expert+chunk512"), and the Soup ``training`` key each one sets.
STREAM_MODES = {"per_expert": ("stream_expert_layout", "per_expert"),
                "recompute-off": ("stream_recompute", "off")}
LOSS_CHUNK_PREFIX = "chunk"  # chunkN: training.stream_loss_chunk = N tokens


def stream_mode(key: str) -> tuple[str, dict[str, Any]]:
    """A map key's family and the Soup training keys its modes set (none: Soup's defaults)."""
    base, *modes = key.split("+")
    training: dict[str, Any] = {}
    for mode in modes:
        digits = mode[len(LOSS_CHUNK_PREFIX):]
        if mode in STREAM_MODES:
            training.__setitem__(*STREAM_MODES[mode])
        elif mode.startswith(LOSS_CHUNK_PREFIX) and digits.isdigit() and digits[0] != "0":
            training["stream_loss_chunk"] = int(digits)
        else:
            raise UsageError(f"{key}: unknown streaming mode {mode!r} (modes: "
                             f"{', '.join(STREAM_MODES)}, {LOSS_CHUNK_PREFIX}N)")
    return base, training


def mode_key(family: str, layout: str = "fused", loss_chunk: Optional[int] = None,
             recompute: str = "on") -> str:
    """The map key of ``family`` under these modes; Soup's defaults add nothing to the key."""
    return "+".join([family] + (["per_expert"] if layout == "per_expert" else [])
                    + ([f"{LOSS_CHUNK_PREFIX}{loss_chunk}"] if loss_chunk else [])
                    + (["recompute-off"] if recompute == "off" else []))


def is_moe(key: str) -> bool:
    """A family whose layers route tokens to experts (the one kind an expert layout applies to)."""
    config = FAMILIES[key].config if key in FAMILIES else {}
    return FAMILIES.get(key) is not None and (
        "n_routed_experts" in config or FAMILIES[key].model_type.endswith("moe_text"))


def family_shape(key: str) -> Shape:
    """A family's shape from its public config alone (the record's two are the record's), under
    the streaming modes its key names."""
    base, training = stream_mode(key)
    if base in SHAPES:
        shape = SHAPES[base]
    else:
        family = FAMILIES[base]
        from transformers import AutoConfig

        with quiet_libraries():
            config = AutoConfig.for_model(family.model_type, **family.config)
        shape = derive_shape(config, family.label, key=base, hub_id=family.hub_id, arch=family.config,
                             targets=family.targets)
    if not training:
        return shape
    return replace(shape, name=f"{shape.name} [{key.split('+', 1)[1]}]", stream=tuple(training.items()))


def max_positions(key: str) -> int:
    base = key.split("+")[0]
    return SHAPES[base].max_positions if base in SHAPES else FAMILIES[base].max_positions


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
