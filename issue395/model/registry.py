"""The one model registry: every model this tool runs, by key. The record's two (``SHAPES``: their
shapes as the published grid records them) and every family Soup streams (``FAMILIES``: a typed
record of its public config.json, with its depth, LoRA targets and source where they differ from
the protocol's); the map's family lists, Soup 0.77.0's streaming modes as map keys, and ``known``:
whether a key names a model here. Every lookup by key goes through this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import UsageError
from ..record import LORA_ALPHA, LORA_R, LORA_TARGETS
from .streaming import (CHECKPOINTING, EXPERT_LAYOUTS, PROBES, RECOMPUTES, STREAM_LAYERS, Streaming,
                        family_of)


@dataclass(frozen=True)
class Shape:
    """One model as the published grid records it, and its public architecture."""

    key: str
    name: str
    hub_id: str
    model_type: str
    pool: int  # bytes of the 2 layer buffers
    extras: int  # bytes resident beside the pool (embedding, final norm, untied head)
    grid_adapter: int  # the grid's adapter count: twice the LoRA A+B parameters, as the record spells it
    vocab: int
    hidden: int
    intermediate: int
    n_layers: int
    max_positions: int
    arch: dict = field(default_factory=dict)  # the other public config.json fields
    record: bool = True  # False for --model and the map's families: no published figures
    targets: tuple = LORA_TARGETS  # the protocol's, or the family's own, or a --config file's
    lora_r: int = LORA_R  # the adapter's rank and alpha: the protocol's, or a --config file's
    lora_alpha: int = LORA_ALPHA
    #: soup-cli 0.77.0's streaming modes this arm runs under: Soup ``training`` keys and values
    #: (stream_expert_layout, stream_loss_chunk, stream_recompute); empty: Soup's defaults.
    stream: tuple = ()

    @property
    def checkpoint_bytes(self) -> int:
        """The bf16 bytes its synthetic checkpoint's weights hold: each layer half the two-buffer pool
        (a family whose layers differ pools its widest two, so this errs high), plus the extras."""
        return self.pool // 2 * self.n_layers + self.extras


#: The record's two models, as its published grid records them (docs/PROTOCOL.md's shape table).
SHAPES: dict[str, Shape] = {
    "smol": Shape("smol", "SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M", "llama",
                  pool=14160384, extras=56624256, grid_adapter=921600, vocab=49152, hidden=576,
                  intermediate=1536, n_layers=30, max_positions=8192,
                  arch={"num_attention_heads": 9, "num_key_value_heads": 3,
                        "rope_theta": 100000.0, "rms_norm_eps": 1e-5}),
    "qwen": Shape("qwen", "Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B", "qwen2",
                  pool=59649536, extras=272271104, grid_adapter=1081344, vocab=151936, hidden=896,
                  intermediate=4864, n_layers=24, max_positions=32768,
                  arch={"num_attention_heads": 14, "num_key_value_heads": 2,
                        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                        "use_sliding_window": False, "sliding_window": None}),
}


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


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


#: deepseek-ai/DeepSeek-V3 config.json (MTP layer aside: transformers does not build it): 256 routed
#: experts + 1 shared, 8 per token, layers 0-2 dense. Depth 4 keeps all three dense layers and one MoE
#: layer (22.5 GB of routed experts in bf16). Kimi K2 is this with its differences named.
DEEPSEEK_V3 = dict(
    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=4,
    num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
    num_experts_per_tok=8, first_k_dense_replace=3, routed_scaling_factor=2.5, kv_lora_rank=512,
    q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
    topk_group=4, norm_topk_prob=True, vocab_size=129280, tie_word_embeddings=False,
    max_position_embeddings=163840, rope_theta=10000.0, rms_norm_eps=1e-6, hidden_act="silu",
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
                      beta_slow=1, mscale=1.0, mscale_all_dim=1.0))

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
    "deepseek-v3": Family("DeepSeek-V3", "deepseek-ai/DeepSeek-V3", "deepseek_v3", DEEPSEEK_V3,
        None, depth_of=61, targets=("q_b_proj", "kv_b_proj")),
    # moonshotai/Kimi-K2-Instruct config.json, which Soup's loader reads into DeepseekV3Config: 384
    # routed experts + 1 shared, layer 0 dense. One MoE layer is 33.8 GB in bf16.
    "kimi-k2": Family("Kimi-K2", "moonshotai/Kimi-K2-Instruct", "deepseek_v3", dict(
        DEEPSEEK_V3, num_hidden_layers=2, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
        first_k_dense_replace=1, routed_scaling_factor=2.827, n_group=1, topk_group=1, vocab_size=163840,
        max_position_embeddings=131072, rope_theta=50000.0,
        rope_scaling=dict(DEEPSEEK_V3["rope_scaling"], factor=32.0, beta_fast=1.0, beta_slow=1.0)),
        None, depth_of=61, targets=("q_b_proj", "kv_b_proj")),
    # Qwen3.5 text decoders are hybrids: three gated delta-net (linear attention) layers, then one
    # full-attention layer. Depth 4 holds one of each kind's period. Shapes: transformers 5.16.1's
    # own config defaults (Qwen3_5TextConfig; Qwen3_5MoeTextConfig, whose documented checkpoint is
    # Qwen/Qwen3.5-35B-A3B), read from the installed class, not a public config.json.
    "qwen3.5": Family("Qwen3.5 (transformers' Qwen3_5TextConfig defaults)", "", "qwen3_5_text", dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, head_dim=256, vocab_size=248320, max_position_embeddings=32768), None, depth_of=32,
        source="transformers 5.16.1 Qwen3_5TextConfig defaults"),
    "qwen3.5-moe": Family("Qwen3.5-35B-A3B", "Qwen/Qwen3.5-35B-A3B", "qwen3_5_moe_text", dict(
        hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        vocab_size=248320, max_position_embeddings=32768), None, depth_of=40,
        source="transformers 5.16.1 Qwen3_5MoeTextConfig defaults (its documented checkpoint)"),
}


#: Model types Soup streams that no family here covers, and why (a map names them, never skips).
NOT_ON_MAP = {
    # read in both stacks' source (transformers 5.16.1 and 5.24.0), so a verdict on either says the same
    "qwen4_exp": "transformers' Qwen4ExpTextConfig defaults do not build, on 5.16.1 as on 5.24.0 (its "
                 "sparse-attention indexer fields default to None), and no public qwen4_exp checkpoint exists",
}


MAP_FAMILIES = ("smol", "qwen", "llama32-1b", "qwen3-0.6b", "mistral-7b", "gemma-2b", "gemma2-2b",
                "gemma3-1b", "phi-2", "phi3-mini")


#: Families a later Soup streams, on the default map wherever the installed Soup streams them.
#: DeepSeek-V3 and Kimi K2 are asked for by name: one of their MoE layers is 22.5-34 GB.
RELEASE_FAMILIES = ("moonlight", "qwen3.5", "qwen3.5-moe")


#: Every family --families takes, in the map's order: the default ten, then those only asked for.
ALL_FAMILIES = MAP_FAMILIES + RELEASE_FAMILIES + tuple(
    k for k in FAMILIES if k not in MAP_FAMILIES + RELEASE_FAMILIES)


def by_hub_id(hub_id: str) -> Optional[str]:
    """The registry key of the model a hub id names (a soup.yaml's base): the record's two, then
    the families in the map's order (the first of two that share one: Llama-3.2-1B is llama32-1b's);
    None for any other hub id."""
    ids = {**{k: f.hub_id for k, f in FAMILIES.items()}, **{k: s.hub_id for k, s in SHAPES.items()}}
    return next((k for k in ALL_FAMILIES if hub_id and ids[k] == hub_id), None)


#: The words of a hub name that mark one release's variants of one architecture, whose config.json shapes
#: are the same: instruct and chat tunes, Gemma's "it" beside its "pt", a "Base" beside its tune (issue 53
#: item 12: meta-llama/Llama-3.1-8B-Instruct, google/gemma-2-2b-it, mistralai/Mistral-7B-Instruct-v0.3).
VARIANT_WORDS = ("instruct", "chat", "it", "pt", "base")


def _plain(hub_id: str) -> tuple[str, str]:
    org, _, name = hub_id.lower().partition("/")
    return org, "-".join(w for w in name.split("-") if w not in VARIANT_WORDS)


def variant_of(hub_id: str) -> Optional[str]:
    """The registry key of the model ``hub_id`` is a variant of (the same org and name but for
    ``VARIANT_WORDS``: its instruct, chat or base release, the same shapes); None for a registry hub id
    itself (``by_hub_id``) and for any other. A version is no variant word: Mistral-7B-Instruct-v0.2 is not
    v0.3's."""
    if not hub_id or "/" not in hub_id or by_hub_id(hub_id) is not None:
        return None
    ids = {**{k: f.hub_id for k, f in FAMILIES.items()}, **{k: s.hub_id for k, s in SHAPES.items()}}
    plain = _plain(hub_id)
    return next((k for k in ALL_FAMILIES if ids[k] and "/" in ids[k] and _plain(ids[k]) == plain), None)


def hub_id_of(key: str) -> str:
    """A registry model's hub id."""
    return (FAMILIES[key] if key in FAMILIES else SHAPES[key]).hub_id


def known(key: str) -> bool:
    """Whether ``key`` names a model here: the record's two or a family, with any streaming modes."""
    try:
        base, _ = Streaming.parse(key)
    except UsageError:
        return False
    return base in SHAPES or base in FAMILIES


def stream_mode(key: str) -> tuple[str, dict[str, Any]]:
    """A map key's family and the Soup training keys its modes set (none: Soup's defaults): ``Streaming.parse``'s."""
    base, streaming = Streaming.parse(key)
    return base, streaming.training()


def mode_key(family: str, layout: str = "fused", loss_chunk: Optional[int] = None,
             recompute: str = "on", resident: bool = False, checkpointing: bool = False, probe: bool = False) -> str:
    """The map key of ``family`` under these modes (``Streaming.key``: its refusals too)."""
    return Streaming(not resident, layout, loss_chunk, recompute, checkpointing, probe).key(family)


def is_resident(key: str) -> bool:
    """A map key whose run keeps every layer on the card (stream_layers off)."""
    try:
        return Streaming.parse(key)[1].resident
    except UsageError:
        return False


def is_moe(key: str) -> bool:
    """A family whose layers route tokens to experts (the one kind an expert layout applies to)."""
    family = FAMILIES.get(key)
    return family is not None and ("n_routed_experts" in family.config or family.model_type.endswith("moe_text"))


def max_positions(key: str) -> int:
    base = family_of(key)
    return SHAPES[base].max_positions if base in SHAPES else FAMILIES[base].max_positions


def config_json(key: str) -> dict[str, Any]:
    """A family's (or one of the record's two models') public config.json, as --estimate reads one."""
    if key in FAMILIES:
        return {"model_type": FAMILIES[key].model_type, **FAMILIES[key].config}
    s = SHAPES[key]
    return {"model_type": s.model_type, "hidden_size": s.hidden, "intermediate_size": s.intermediate,
            "num_hidden_layers": s.n_layers, "vocab_size": s.vocab, "max_position_embeddings": s.max_positions,
            "tie_word_embeddings": True, "hidden_act": "silu", **s.arch}


def stream_mode_keys(families: list, layouts: list, chunks: list, recomputes: list,
                     layers: tuple = ("on",), checkpointing: tuple = ("off",), probes: tuple = ("off",)) -> tuple:
    """Every family under every mode: modes after the family, so its checkpoint serves them all.
    A per-expert layout is a MoE family's axis only; the streaming modes (Soup's probe too) are a streamed run's,
    gradient checkpointing a resident run's (``layers``: --stream-layers); each axis names each value once."""
    for flag, values, allowed in (("--expert-layout", layouts, EXPERT_LAYOUTS),
                                  ("--recompute", recomputes, RECOMPUTES),
                                  ("--stream-layers", layers, STREAM_LAYERS),
                                  ("--gradient-checkpointing", checkpointing, CHECKPOINTING),
                                  ("--stream-vram-probe", probes, PROBES)):
        if any(v not in allowed for v in values) or len(set(values)) != len(values):
            raise UsageError(f"{flag} {','.join(values)!r}: choose from {','.join(allowed)}, each once")
    if len(set(chunks)) != len(chunks):
        raise UsageError("--loss-chunk: a value named twice")
    if "per_expert" in layouts and not any(is_moe(f) for f in families):
        raise UsageError("--expert-layout per_expert: none of these families has routed experts")
    if "on" in checkpointing and "off" not in layers:
        raise UsageError("--gradient-checkpointing on: a resident run's setting; add --stream-layers off")
    if "on" in probes and "on" not in layers:
        raise UsageError("--stream-vram-probe on: Soup's probe measures a streamed step; add --stream-layers on")
    streamed = [Streaming(True, layout, chunk, recompute, probe=probe == "on") for layout in layouts
                for chunk in chunks for recompute in recomputes for probe in probes] if "on" in layers else []
    resident = [Streaming(False, checkpointing=gc == "on") for gc in checkpointing] if "off" in layers else []
    return tuple(s.key(fam) for fam in families for s in streamed + resident if s.layout == "fused" or is_moe(fam))
