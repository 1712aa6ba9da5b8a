"""The estimator's reading of a config.json: ``Arch``, the fields each architecture reads with
the values transformers gives those a config leaves out, and ``arch_from_config``, the one place a
config becomes an ``Arch``. Stdlib only: transformers' config classes import torch (4.5 s), so
their defaults are written down here and a test checks them against transformers itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..constants import CONFIG_LIMITS
from ..errors import UsageError
from ..record import LORA_TARGETS
from .moe import (DEEPSEEK_V3, QWEN3_5, QWEN3_5_MOE, Layers, deepseek_v3, qwen3_5, soup_intermediate,
                  union_bytes)

_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "vocab_size")


# -- The model's shape from its config.json --
@dataclass(frozen=True)
class Arch:
    model_type: str
    h: int; i: int; L: int; V: int  # noqa: E702 (hidden, intermediate, layers, vocab)
    heads: int; kv: int; head_dim: int  # noqa: E702
    tied: bool
    max_pos: int; rotary_dim: int  # noqa: E702
    window: int | None
    softcap: bool
    modules: dict = field(default_factory=dict)  # name -> (in, out, bias)
    norms: int = 2  # per-layer norm weights of size h
    norm_bias: bool = False
    qk_norm: bool = False
    layers: Layers | None = None  # MoE / latent / hybrid layers (issue395.estimator.moe); None: one dense kind
    qk_layernorm: bool = False  # phi's optional per-head LayerNorms on q and k (PhiConfig.qk_layernorm)
    dropouts: frozenset = frozenset()  # the model's own dropout keys whose p writes a mask (0 < p < 1: MODEL_DROPOUTS)


    @property
    def quirks(self) -> "Quirks":
        """What this architecture does that the physics charges apart from the others (QUIRKS)."""
        return QUIRKS.get(self.model_type, PLAIN)


@dataclass(frozen=True)
class Quirks:
    """An architecture's departures from the plain decoder layer, as the corrected physics charges them
    (each term's evidence: docs/PEAK.md and the term's docstring in issue395.estimator.estimate)."""

    head_bias: bool = False  # an untied lm_head with a bias: V more values beside the head (phi)
    fp32_residual_nf4: bool = False  # under NF4 the residual stream is fp32 after layer 0 (phi)
    norm_inputs_saved: bool = True  # each norm saves an fp32 copy of its input in the recompute (not phi's)
    fused_qkv: bool = False  # v is a view of one fused qkv projection (phi3)
    mlp_saved: int = 6  # i-sized tensors the recomputed MLP saves and its backward makes (phi's gelu_new: 7)
    mlp_transients: int = 3  # i-sized tensors the MLP's forward holds at once (phi's gelu_new: 4)
    rotary_tables: int = 1  # rotary tables of 4 x rotary dim x seq B (Gemma-3: global and local; DeepSeek-V3: 3)
    per_expert_layout: bool = False  # Soup admits stream_expert_layout per_expert (DeepSeek-V3 alone)
    parallel_mlp: bool = False  # the MLP reads the normed layer input beside attention, not attention's sum (phi)


PLAIN = Quirks()
#: Every architecture that departs from the plain layer, and how.
QUIRKS = {"phi": Quirks(head_bias=True, fp32_residual_nf4=True, norm_inputs_saved=False, mlp_saved=7,
                        mlp_transients=4, parallel_mlp=True),
          "phi3": Quirks(fused_qkv=True), "gemma3_text": Quirks(rotary_tables=2),
          "deepseek_v3": Quirks(rotary_tables=3, per_expert_layout=True)}


def fp32_residual(a: Arch, quant: str) -> bool:
    """The residual stream is fp32 after layer 0 (phi under NF4): its saved inputs and activations are 4 B."""
    return a.quirks.fp32_residual_nf4 and quant == "nf4"


def activation_bytes(a: Arch, quant: str) -> int:
    """Bytes of one activation element in the recomputed layer: bf16, or fp32 where the residual is."""
    return 4 if fp32_residual(a, quant) else 2


HEADS, PER_HEAD = "= num_attention_heads", "= hidden_size // num_attention_heads"
#: What transformers (5.16.1, the pinned release) gives each field a config.json may leave out,
#: by model_type: the field's default in the config class (transformers/models/<m>/
#: configuration_<m>.py), HEADS / PER_HEAD where the class or the model derives it. A field not
#: in a type's entry is one its model never reads (modeling_mistral.py builds q/k/v/o with
#: bias=False whatever attention_bias says; only phi and phi3 read partial_rotary_factor for
#: their default rope). tests/estimator/test_arch.py checks this table against transformers'
#: own config class and a meta model, for every family, with each field removed.
CONFIG_DEFAULTS: dict[str, dict] = {
    "llama": dict(  # LlamaConfig
        num_key_value_heads=HEADS, head_dim=PER_HEAD, tie_word_embeddings=False,
        max_position_embeddings=2048, attention_bias=False, mlp_bias=False),
    "qwen2": dict(  # Qwen2Config; q/k/v carry a bias, o none (modeling_qwen2.py)
        num_key_value_heads=32, head_dim=PER_HEAD, tie_word_embeddings=False,
        max_position_embeddings=32768, use_sliding_window=False, sliding_window=4096,
        max_window_layers=28, layer_types=None),
    "qwen3": dict(  # Qwen3Config
        num_key_value_heads=32, head_dim=128, tie_word_embeddings=False,
        max_position_embeddings=32768, attention_bias=False, use_sliding_window=False,
        sliding_window=4096, max_window_layers=28, layer_types=None),
    "mistral": dict(  # MistralConfig
        num_key_value_heads=8, head_dim=PER_HEAD, tie_word_embeddings=False,
        max_position_embeddings=131072, sliding_window=4096),
    "gemma": dict(  # GemmaConfig
        num_key_value_heads=16, head_dim=256, tie_word_embeddings=True,
        max_position_embeddings=8192, attention_bias=False),
    "gemma2": dict(  # Gemma2Config; layer_types alternate sliding/full from layer 0
        num_key_value_heads=4, head_dim=256, tie_word_embeddings=True,
        max_position_embeddings=8192, attention_bias=False, sliding_window=4096,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, layer_types=None),
    "gemma3_text": dict(  # Gemma3TextConfig; every sliding_window_pattern-th layer full
        num_key_value_heads=4, head_dim=256, tie_word_embeddings=True,
        max_position_embeddings=131072, attention_bias=False, sliding_window=4096,
        final_logit_softcapping=None, attn_logit_softcapping=None, layer_types=None,
        sliding_window_pattern=6, use_bidirectional_attention=False),
    "phi": dict(  # PhiConfig; every linear carries a bias (modeling_phi.py)
        num_key_value_heads=HEADS, head_dim=PER_HEAD, tie_word_embeddings=False,
        max_position_embeddings=2048, partial_rotary_factor=0.5, qk_layernorm=False, resid_pdrop=0.0,
        embd_pdrop=0.0, attention_dropout=0.0),
    "phi3": dict(  # Phi3Config
        num_key_value_heads=HEADS, head_dim=PER_HEAD, tie_word_embeddings=False,
        max_position_embeddings=4096, partial_rotary_factor=1.0, sliding_window=None),
}
#: The model's own dropouts a config sets (phi's PhiConfig: microsoft/phi-2's own config.json has resid_pdrop 0.1,
#: which the registry's leaves out): nn.Dropout, like LoRA's, writes a mask only where 0 < p < 1 (layer.mask_bytes).
MODEL_DROPOUTS = ("resid_pdrop", "embd_pdrop", "attention_dropout")
#: Past these no released checkpoint goes (largest public head_dim 256, window 131072).
_HEAD_DIM_LIMIT, _WINDOW_LIMIT = 4096, 2**24
_FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window",
          "use_bidirectional_attention", "qk_layernorm")
#: Flags transformers itself types ``bool | None`` and writes as null (Gemma2Config's
#: use_bidirectional_attention defaults to None; save_pretrained writes it): null reads as false,
#: as the class reads it (``if self.use_bidirectional_attention:``).
_NULLABLE_FLAGS = ("use_bidirectional_attention",)


def _number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _check_values(config: dict) -> None:
    """Every optional field a config carries, whichever model reads it, is of its kind: a value
    no config can mean (a "false" that reads as true, a window of -1) is one line naming it."""
    for name in _FLAGS:  # "false" is a non-empty string: read as a flag it would mean true
        if name in _NULLABLE_FLAGS and config.get(name, False) is None:
            continue
        if name in config and not isinstance(config[name], bool):
            raise UsageError(f"config {name} is {config[name]!r}; it must be true or false")
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        v = config.get(name)
        if v is not None and not (_number(v) and v > 0):
            raise UsageError(f"config {name} is {v!r}; it must be a positive number or null")
    for name, low, null in (("num_key_value_heads", 1, True), ("head_dim", 1, True),
                            ("sliding_window", 1, True), ("max_window_layers", 0, False),
                            ("sliding_window_pattern", 1, False), ("max_position_embeddings", 1, False)):
        v = config.get(name, 1)
        if (v is not None or not null) and (isinstance(v, bool) or not isinstance(v, int) or v < low):
            raise UsageError(f"config {name} is {v!r}; it must be a whole number >= {low}"
                             + (" or null" if null else ""))
    if config.get("sliding_window") is not None and config["sliding_window"] > _WINDOW_LIMIT:
        raise UsageError(f"config sliding_window is {config['sliding_window']}; no real model has "
                         f"more than {_WINDOW_LIMIT}")
    rope = [config.get(n) for n in ("rope_parameters", "rope_scaling")]
    factors = [config.get("partial_rotary_factor")] + [r.get("partial_rotary_factor") for r in rope
                                                        if isinstance(r, dict)]
    for v in factors:
        if v is not None and not (_number(v) and 0 < v <= 1):
            raise UsageError(f"config partial_rotary_factor is {v!r}; it must be a fraction in (0, 1]")


def _field(config: dict, mt: str, name: str):
    """The config's value, else transformers' default for this model_type. A null stays null
    (Mistral-7B-v0.3's "sliding_window": null means no window), except where the class derives
    the field from null (num_key_value_heads, head_dim)."""
    v = config[name] if name in config else CONFIG_DEFAULTS[mt].get(name)
    if v is None and CONFIG_DEFAULTS[mt].get(name) in (HEADS, PER_HEAD):
        v = CONFIG_DEFAULTS[mt][name]
    if v == HEADS:
        return config["num_attention_heads"]
    if v == PER_HEAD:
        return config["hidden_size"] // config["num_attention_heads"]
    return v


def _rotary_factor(config: dict, mt: str) -> float:
    """phi/phi3's partial_rotary_factor: rope_parameters' (or the older rope_scaling's) own value
    first, then the top-level field, then the class default (modeling_rope_utils.py, as
    standardize_rope_params orders them). Every other family's default rope spans head_dim."""
    if "partial_rotary_factor" not in CONFIG_DEFAULTS[mt]:
        return 1.0
    for name in ("rope_parameters", "rope_scaling"):
        rope = config.get(name)
        if isinstance(rope, dict) and rope.get("partial_rotary_factor") is not None:
            return rope["partial_rotary_factor"]
    top = config.get("partial_rotary_factor")
    return CONFIG_DEFAULTS[mt]["partial_rotary_factor"] if top is None else top


def _window(config: dict, mt: str, L: int) -> int | None:
    """The sliding window if any layer slides (one bool seq x seq mask then; see sliding_mask):
    config.layer_types where the class keeps them, else as each class derives them."""
    d = CONFIG_DEFAULTS[mt]
    if "sliding_window" not in d:
        return None
    w = _field(config, mt, "sliding_window")
    if "use_sliding_window" in d and not _field(config, mt, "use_sliding_window"):
        return None  # Qwen2Config/Qwen3Config: sliding_window = None unless use_sliding_window
    if w is not None and _field(config, mt, "use_bidirectional_attention"):
        w = w // 2 + 1  # Gemma3TextConfig.__post_init__
    types = config.get("layer_types") if "layer_types" in d else None
    if types is not None:
        if not isinstance(types, list) or len(types) != L:
            raise UsageError(f"config layer_types must be a list of {L} layer kinds")
        sliding = "sliding_attention" in types
    elif mt in ("qwen2", "qwen3"):
        sliding = _field(config, mt, "max_window_layers") < L
    elif mt == "gemma3_text":
        pattern = _field(config, mt, "sliding_window_pattern")
        sliding = any((i + 1) % pattern for i in range(L))
    else:  # gemma2 alternates from a sliding layer 0; mistral and phi3 slide every layer
        sliding = True
    return w if sliding else None


#: One row per architecture the estimator reads: how its layers are laid out. The dense layouts
#: are read below; "mla" and "hybrid" by issue395.estimator.moe. A model type Soup streams but missing here
#: (qwen4_exp) is one line, never read as another architecture.
TRAITS = {"llama": "gqa", "qwen2": "gqa", "qwen3": "gqa", "mistral": "gqa", "gemma": "gqa",
          "gemma2": "gqa", "gemma3_text": "gqa", "phi": "phi", "phi3": "phi3", "deepseek_v3": "mla",
          "qwen3_5_text": "hybrid", "qwen3_5_moe_text": "hybrid-moe"}
#: Soup's aliases (0.77.0 _STREAM_ARCH_ALIASES) whose config this estimator reads as its text decoder.
TEXT_DECODER = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def moe_arch(config: dict, mt: str) -> Arch:
    """A DeepSeek-V3 or Qwen3.5 config as an Arch: the sizes, then issue395.estimator.moe's layers."""
    d = {"mla": DEEPSEEK_V3, "hybrid": QWEN3_5, "hybrid-moe": QWEN3_5_MOE}[TRAITS[mt]]
    for name in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"):
        v = config.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= CONFIG_LIMITS[name]:
            raise UsageError(f"config {name} is {v!r}; it must be a whole number from 1 to {CONFIG_LIMITS[name]}")
    _check_values(config)
    for name, v in config.items():
        if name not in d or name == "layer_types" or v is None:
            continue
        kind = bool if isinstance(d[name], bool) else float if isinstance(d[name], float) else int
        ok = isinstance(v, bool) if kind is bool else (not isinstance(v, bool) and isinstance(v, (int, float) if
                                                                                            kind is float else int)
                                                       and v >= 0)
        if not ok:
            raise UsageError(f"config {name} is {v!r}; it must be "
                             + ("true or false" if kind is bool else "a number >= 0" if kind is float
                                else "a whole number >= 0"))
    h, L, V, nh = (config[n] for n in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"))
    g = lambda n: config[n] if config.get(n) is not None else d.get(n)  # noqa: E731
    kv, tied, max_pos = g("num_key_value_heads") or nh, g("tie_word_embeddings"), g("max_position_embeddings")
    if nh % kv:
        raise UsageError(f"config num_key_value_heads is {kv!r}; it must divide num_attention_heads {nh}")
    if TRAITS[mt] == "mla":
        i = soup_intermediate(g)
        layers = deepseek_v3(config, h, i, L, nh)
        hd, rd = g("qk_nope_head_dim") + g("qk_rope_head_dim"), g("qk_rope_head_dim")
        kv = nh  # the latent expands to every head's key and value
    else:
        hd = g("head_dim")
        i = soup_intermediate(g)  # a MoE config's: what a token's experts make, as Soup reads it
        layers = qwen3_5(config, h, g("intermediate_size") or 0, L, nh, kv, hd, moe=TRAITS[mt] == "hybrid-moe")
        rd = int(hd * float(g("partial_rotary_factor")))
    return Arch(mt, h, i, L, V, nh, kv, hd, bool(tied), max_pos, rd, None, False, dict(layers.lora),
                norms=2, qk_norm=TRAITS[mt] != "mla", layers=layers)


def arch_from_config(config: dict) -> Arch:
    """The estimator's whole reading of a config.json: each field the model reads, the absent
    ones as transformers fills them (CONFIG_DEFAULTS); a value no config can mean is one line."""
    if not isinstance(config, dict):
        raise UsageError(f"config must be a config.json dict, not {type(config).__name__}")
    mt = config.get("model_type")
    if mt in TEXT_DECODER and isinstance(config.get("text_config"), dict):  # a hub wrapper: its decoder
        config = dict(config["text_config"])
    mt = TEXT_DECODER.get(mt, mt)
    if TRAITS.get(mt) in ("mla", "hybrid", "hybrid-moe"):
        return moe_arch(dict(config, model_type=mt), mt)
    if mt not in CONFIG_DEFAULTS:
        raise UsageError(f"model_type {mt!r} is not one this estimator reads (it reads "
                         f"{', '.join(TRAITS)}; its layers are not modelled here)")
    for name in _SIZES:
        v = config.get(name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise UsageError(f"config {name} is {v!r}; it must be a whole number")
        if not 1 <= v <= CONFIG_LIMITS[name]:
            raise UsageError(f"config {name} is {v}; no real model has that (1 to {CONFIG_LIMITS[name]})")
    _check_values(config)
    h, i, L, V, nh = (config[n] for n in _SIZES[:2] + ("num_hidden_layers", "vocab_size",
                                                         "num_attention_heads"))
    kv, hd = _field(config, mt, "num_key_value_heads"), _field(config, mt, "head_dim")
    if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or nh % kv:
        raise UsageError(f"config num_key_value_heads is {kv!r}; it must be a whole number that "
                         f"divides num_attention_heads {nh}")
    if isinstance(hd, bool) or not isinstance(hd, int) or not 1 <= hd <= _HEAD_DIM_LIMIT:
        raise UsageError(f"config head_dim is {hd!r}; it must be a whole number from 1 to "
                         f"{_HEAD_DIM_LIMIT} (no real model has more)")
    qw, kw = nh * hd, kv * hd
    max_pos = _field(config, mt, "max_position_embeddings")
    if isinstance(max_pos, bool) or not isinstance(max_pos, int) or max_pos < 1:
        raise UsageError(f"config max_position_embeddings is {max_pos!r}; it must be a whole number")
    factor = _rotary_factor(config, mt)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise UsageError(f"config partial_rotary_factor is {factor!r}; it must be a fraction in (0, 1]")
    if mt == "phi3":
        mods = {"qkv_proj": (h, qw + 2 * kw, False), "o_proj": (qw, h, False),
                "gate_up_proj": (h, 2 * i, False), "down_proj": (i, h, False)}
    elif mt == "phi":
        mods = {"q_proj": (h, qw, True), "k_proj": (h, kw, True), "v_proj": (h, kw, True),
                "dense": (qw, h, True), "fc1": (h, i, True), "fc2": (i, h, True)}
    else:
        bias = mt == "qwen2" or bool(_field(config, mt, "attention_bias"))
        mlp_bias = bool(_field(config, mt, "mlp_bias"))
        mods = {"q_proj": (h, qw, bias), "k_proj": (h, kw, bias), "v_proj": (h, kw, bias),
                "o_proj": (qw, h, mt != "qwen2" and bias), "gate_proj": (h, i, mlp_bias),
                "up_proj": (h, i, mlp_bias), "down_proj": (i, h, mlp_bias)}
    softcap = "final_logit_softcapping" in CONFIG_DEFAULTS[mt] and \
        _field(config, mt, "final_logit_softcapping") is not None
    return Arch(mt, h, i, L, V, nh, kv, hd, _field(config, mt, "tie_word_embeddings"),
                max_pos, int(hd * float(factor)), _window(config, mt, L), softcap, mods,
                norms=4 if mt in ("gemma2", "gemma3_text") else (1 if mt == "phi" else 2),
                norm_bias=mt == "phi", qk_norm=mt in ("qwen3", "gemma3_text"),
                qk_layernorm=bool("qk_layernorm" in CONFIG_DEFAULTS[mt] and _field(config, mt, "qk_layernorm")),
                dropouts=_dropouts(config, mt))


def _dropouts(config: dict, mt: str) -> frozenset:
    """The MODEL_DROPOUTS this model_type reads whose p writes a mask (0 < p < 1); a p no nn.Dropout takes is one
    line naming it."""
    out = set()
    for name in MODEL_DROPOUTS:
        if name not in CONFIG_DEFAULTS[mt]:
            continue
        p = _field(config, mt, name)
        p = 0.0 if p is None else p  # PhiConfig's attention_dropout may be null: phi's attention reads it as no dropout
        if not _number(p) or not 0 <= p <= 1:
            raise UsageError(f"config {name} is {p!r}; it must be a probability from 0 to 1")
        if 0 < p < 1:
            out.add(name)
    return frozenset(out)


#: A layer's linears in the order its modules register them, where that is not the Arch's (``modules``: the order
#: they run in): Phi3Attention makes o_proj before qkv_proj. model.named_modules() and named_parameters() follow it,
#: so peft's adapter, the optimizer's parameters and Soup's layer spec do.
REGISTRATION_ORDER = {"phi3": ("o_proj", "qkv_proj", "gate_up_proj", "down_proj")}


def registration_order(a: Arch) -> tuple:
    """The layer's linears in the order its modules register them (REGISTRATION_ORDER, else the Arch's)."""
    return REGISTRATION_ORDER.get(a.model_type, tuple(a.modules))


# -- The shard geometry: what one layer of the architecture holds, read by Soup's number and the physics alike --
#: bitsandbytes' NF4 block: one absmax per 64 weights (Soup quantises at its default blocksize)
NF4_BLOCK = 64


def nf4_pieces(n: int) -> list:
    """bitsandbytes NF4 + double quant, as Soup's shard stores it, in its sidecars' order (soup-cli's
    quant_sidecar_keys): packed nibbles, uint8 absmax per NF4_BLOCK, fp32 nested absmax per 256 absmax, a 4-byte
    offset; each a tensor of its own."""
    blocks = -(-n // NF4_BLOCK)
    return [-(-n // 2), blocks, 4 * -(-blocks // 256), 4]


def nf4_bytes(n: int) -> int:
    """One NF4 linear's shard bytes (nf4_pieces)."""
    return sum(nf4_pieces(n))


def layer_bytes(a: Arch, quant: str, per_expert: bool = False) -> int:
    """One streamed layer as Soup's shard header counts it (linears NF4 or bf16, the rest bf16);
    for MoE, latent and hybrid layers the union of every layer kind's tensors (issue395.estimator.moe)."""
    if a.layers is not None:
        return union_bytes(a.layers.union, quant, per_expert, nf4_bytes)
    out = 2 * a.h * a.norms * (2 if a.norm_bias else 1) + (4 * a.head_dim if a.qk_norm else 0)
    for fan_in, fan_out, bias in a.modules.values():
        out += (nf4_bytes(fan_in * fan_out) if quant == "nf4" else 2 * fan_in * fan_out)
        out += 2 * fan_out if bias else 0
    return out


def linear_elements(a: Arch) -> int:
    """The elements of a dense layer's linear weights (what NF4 quantises, what a bf16 copy holds)."""
    return sum(fi * fo for fi, fo, _ in a.modules.values())


def lora_params(a: Arch, targets: tuple, r: int) -> int:
    """The adapter's parameters over every layer: r x (fan in + fan out) per target."""
    return a.L * sum(r * (a.modules[t][0] + a.modules[t][1]) for t in targets)


def protocol_targets(a: Arch) -> tuple:
    """The protocol's LoRA targets on this architecture (``protocol_targets_in`` its modules)."""
    return protocol_targets_in(a.modules)


def protocol_targets_in(modules) -> tuple:
    """The protocol's LoRA targets among a layer's linear modules (names): q_proj and v_proj where
    both exist; Phi-3's fused qkv_proj; under latent attention the query (q_proj, or q_b_proj after
    a query latent) and kv_b_proj, which makes the keys and values from the latent (the registry's
    choice too). The estimator reads its Arch's modules, the measurement its meta skeleton's."""
    if all(t in modules for t in LORA_TARGETS):
        return LORA_TARGETS
    if "qkv_proj" in modules:
        return ("qkv_proj",)
    return ("q_proj" if "q_proj" in modules else "q_b_proj", "kv_b_proj")
