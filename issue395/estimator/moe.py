"""The estimator's reading of soup-cli 0.77.0's new families: DeepSeek-V3's decoder (multi-head
latent attention, routed and shared experts, the first layers dense: DeepSeek-V3, Kimi K2,
Moonlight) and the Qwen3.5 hybrids (gated delta-net layers beside full-attention ones, a dense MLP
or routed experts). Stdlib only, like ``arch``: transformers' defaults written down per field, and
a test builds each family on the meta device and checks every tensor of every layer kind.

What Soup's pre-flight streams is the UNION of the layers' tensors (``RamSource.merge_layer_specs``:
one buffer must hold a dense layer and a MoE layer alike), which Soup's own ``layer_bytes`` equals
to the byte. Under NF4 Soup quantises nn.Linear weights only: routers, fused experts (3-D) and norms
stay bf16, DeepSeek's expert-score bias fp32. Evidence: docs/PEAK.md, "union_bytes".
"""

from __future__ import annotations

from dataclasses import dataclass

#: DeepseekV3Config (transformers 5.16.1) defaults for the fields its model reads.
DEEPSEEK_V3 = dict(intermediate_size=18432, num_key_value_heads=128, tie_word_embeddings=False, max_position_embeddings=4096,
                   attention_bias=False, n_shared_experts=1, n_routed_experts=256, moe_intermediate_size=2048,
                   num_experts_per_tok=8, first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536,
                   qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128)
#: Qwen3_5TextConfig / Qwen3_5MoeTextConfig (transformers 5.16.1) defaults: every fourth layer full
#: attention (full_attention_interval), a quarter of head_dim rotary, a gated query (q_proj 2x).
QWEN3_5 = dict(num_key_value_heads=4, head_dim=256, intermediate_size=12288, tie_word_embeddings=False, max_position_embeddings=32768,
               attention_bias=False, partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
               linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
               linear_num_value_heads=32, layer_types=None, full_attention_interval=4)
QWEN3_5_MOE = dict(QWEN3_5, intermediate_size=None, num_key_value_heads=2, num_experts=256, num_experts_per_tok=8,
                   moe_intermediate_size=512, shared_expert_intermediate_size=512)


@dataclass(frozen=True)
class Kind:
    """One kind of layer as a recomputed step sees it: the linears dequantised together under NF4,
    and the widths a token saves (attention q, k, v and output; latent or delta-net; MLP; routing)."""

    dequant: dict  # name -> (in, out, bias)
    attention_width: int
    extra_width: int  # MLA's latents, or a delta-net's projections and gates
    mlp_width: int  # intermediate activations per token: dense i, or top_k x moe_i + shared
    routed: int = 0  # routed experts (router logits per token); 0 for a dense MLP
    top_k: int = 0  # experts a token visits (its hidden state gathered and weighted per expert)
    expert_width: int = 0  # one routed expert's intermediate width (moe_intermediate_size)
    tensors: tuple = ()  # its parameters beside the linears, as Layers.union's (elements, kind) pairs
    # DeepSeek-V3's latent RMSNorms as (the linear whose output each normalises, its width): kv_a_layernorm's, and
    # q_a_layernorm's where q_lora_rank is set. Empty for every other kind (layer.latent_retained reads it)
    latent_norms: tuple = ()

    @property
    def shared_width(self) -> int:
        """The MLP width beside the routed experts: the shared experts', or the dense MLP's."""
        return self.mlp_width - self.top_k * self.expert_width


@dataclass(frozen=True)
class Layers:
    """What the estimator needs beyond a dense layer: Soup's union buffer as (elements, kind)
    pairs (kind: linear, bf16, fp32, expert), one routed expert's matrices, every module a LoRA
    target may name, and the kinds of layer the model has."""

    union: tuple  # ((elements, kind), ...)
    expert: tuple  # one routed expert's matrices' elements (empty: no experts)
    lora: dict  # name -> (in, out, bias)
    kinds: tuple  # (Kind, ...)
    order: tuple = ()  # each layer's index into kinds, first to last (empty: every layer the first kind)


def _get(config: dict, defaults: dict, name: str):
    """The config's value, even null (q_lora_rank null: no query latent), else transformers' default."""
    return config[name] if name in config else defaults.get(name)


def deepseek_v3(config: dict, h: int, i: int, L: int, heads: int) -> Layers:
    """DeepSeek-V3's decoder (modeling_deepseek_v3.py): MLA (q_a/q_b or q_proj, kv_a_proj_with_mqa,
    kv_b_proj, o_proj, two latent norms), dense layers before first_k_dense_replace, then a router
    (bf16 weight, fp32 score bias), routed experts fused in memory and shared experts as one MLP."""
    g = lambda n: _get(config, DEEPSEEK_V3, n)  # noqa: E731
    nope, rope, vh, kvr, qr = (g("qk_nope_head_dim"), g("qk_rope_head_dim"), g("v_head_dim"),
                               g("kv_lora_rank"), g("q_lora_rank"))
    E, k, mi, shared = g("n_routed_experts"), g("num_experts_per_tok"), g("moe_intermediate_size"), g("n_shared_experts")
    first_dense = min(g("first_k_dense_replace"), L)
    qk = heads * (nope + rope)
    attn = ({"q_proj": (h, qk, False)} if qr is None else
            {"q_a_proj": (h, qr, False), "q_b_proj": (qr, qk, False)})
    attn.update(kv_a_proj_with_mqa=(h, kvr + rope, False), kv_b_proj=(kvr, heads * (nope + vh), False),
                o_proj=(heads * vh, h, False))
    dense = {"gate_proj": (h, i, False), "up_proj": (h, i, False), "down_proj": (i, h, False)}
    shared_mlp = {f"shared_experts.{n}": (a, b, False) for n, (a, b) in
                  {"gate_proj": (h, mi * shared), "up_proj": (h, mi * shared), "down_proj": (mi * shared, h)}.items()}
    has_dense, has_moe = first_dense > 0, L > first_dense
    union = [(a * b, "linear") for a, b, _ in attn.values()]
    union += [(h, "bf16"), (h, "bf16"), (kvr, "bf16")] + ([(qr, "bf16")] if qr else [])
    if has_dense:
        union += [(a * b, "linear") for a, b, _ in dense.values()]
    if has_moe:
        union += [(a * b, "linear") for a, b, _ in shared_mlp.values()]
        union += [(E * h, "bf16"), (E, "fp32"), (E * 2 * mi * h, "expert"), (E * h * mi, "expert")]
    # q and the expanded k (qk each), SDPA's output (vh), and v: a view of kv_b's output, which it
    # keeps whole (nope + vh; Kimi K2's live set, docs/PEAK.md "The NF4 layer phase, read per phase")
    attention_width, extra = 2 * qk + heads * (nope + vh) + heads * vh, kvr + rope + (qr or 0)
    norms = ((h, "bf16"), (h, "bf16"), (kvr, "bf16")) + (((qr, "bf16"),) if qr else ())
    experts = ((E * h, "bf16"), (E, "fp32"), (E * 2 * mi * h, "expert"), (E * h * mi, "expert"))
    latent = (("kv_a_proj_with_mqa", kvr),) + ((("q_a_proj", qr),) if qr else ())
    kinds = ((Kind(dict(attn, **dense), attention_width, extra, i, tensors=norms, latent_norms=latent),)
             if has_dense else ()) + (
        (Kind(dict(attn, **shared_mlp), attention_width, extra, k * mi + mi * shared, E, k, mi, norms + experts,
              latent),)
        if has_moe else ())
    order = tuple(0 if n < first_dense else len(kinds) - 1 for n in range(L))
    return Layers(tuple(union), (h * mi, h * mi, mi * h) if has_moe else (), dict(attn, **dense, **shared_mlp),
                  kinds, order)


def qwen3_5(config: dict, h: int, i: int, L: int, heads: int, kv: int, hd: int, moe: bool) -> Layers:
    """A Qwen3.5 text decoder (modeling_qwen3_5*.py): gated delta-net layers (in_proj_qkv, in_proj_z,
    in_proj_b, in_proj_a, out_proj, a depthwise conv, A_log, dt_bias, a gated norm) and full-attention
    layers with a gated query (q_proj twice the heads' width), q/k norms; an MLP, or a router, fused
    routed experts, one shared expert and its 1-wide gate."""
    d = QWEN3_5_MOE if moe else QWEN3_5
    g = lambda n: _get(config, d, n)  # noqa: E731
    kd, vd, nk, nv, ck = (g("linear_key_head_dim"), g("linear_value_head_dim"), g("linear_num_key_heads"),
                          g("linear_num_value_heads"), g("linear_conv_kernel_dim"))
    # the layers built (a reduced depth keeps the first L of a config's list)
    types = (config.get("layer_types") or ["full_attention" if (n + 1) % g("full_attention_interval") == 0
                                           else "linear_attention" for n in range(L)])[:L]
    qkv = 2 * nk * kd + nv * vd
    delta = {"in_proj_qkv": (h, qkv, False), "in_proj_z": (h, nv * vd, False), "in_proj_b": (h, nv, False),
             "in_proj_a": (h, nv, False), "out_proj": (nv * vd, h, False)}
    full = {"q_proj": (h, 2 * heads * hd, False), "k_proj": (h, kv * hd, False), "v_proj": (h, kv * hd, False),
            "o_proj": (heads * hd, h, False)}
    if moe:
        E, k, mi, si = g("num_experts"), g("num_experts_per_tok"), g("moe_intermediate_size"), g(
            "shared_expert_intermediate_size")
        mlp = {"shared_expert.gate_proj": (h, si, False), "shared_expert.up_proj": (h, si, False),
               "shared_expert.down_proj": (si, h, False), "shared_expert_gate": (h, 1, False)}
    else:
        E, k, mi, si = 0, 0, 0, 0
        mlp = {"gate_proj": (h, i, False), "up_proj": (h, i, False), "down_proj": (i, h, False)}
    union = [(h, "bf16"), (h, "bf16")] + [(a * b, "linear") for a, b, _ in mlp.values()]
    if "linear_attention" in types:
        union += [(a * b, "linear") for a, b, _ in delta.values()]
        union += [(qkv * ck, "bf16"), (nv, "bf16"), (nv, "bf16"), (vd, "bf16")]
    if "full_attention" in types:
        union += [(a * b, "linear") for a, b, _ in full.values()] + [(hd, "bf16"), (hd, "bf16")]
    if moe:
        union += [(E * h, "bf16"), (E * 2 * mi * h, "expert"), (E * h * mi, "expert")]
    width = k * mi + si if moe else i
    own = {"linear_attention": ((qkv * ck, "bf16"), (nv, "bf16"), (nv, "bf16"), (vd, "bf16")),
           "full_attention": ((hd, "bf16"), (hd, "bf16"))}
    experts = ((E * h, "bf16"), (E * 2 * mi * h, "expert"), (E * h * mi, "expert")) if moe else ()
    present = [(kind, attn, aw, ew) for kind, attn, aw, ew in (
        ("linear_attention", delta, 0, 2 * qkv + 2 * nv * vd + 4 * nv),
        ("full_attention", full, 3 * heads * hd + 2 * kv * hd, 0)) if kind in types]
    kinds = tuple(Kind(dict(attn, **mlp), aw, ew, width, E, k, mi, ((h, "bf16"), (h, "bf16")) + own[kind] + experts)
                  for kind, attn, aw, ew in present)
    order = tuple([kind for kind, *_ in present].index(t) for t in types)
    return Layers(tuple(union), (h * mi, h * mi, mi * h) if moe else (), dict(delta, **full, **mlp), kinds, order)


def soup_intermediate(get) -> int:
    """The activation width Soup's pre-flight reads (0.77.0's ``_stream_intermediate_size``): the
    dense MLP's, or for a MoE config without one, the routed experts a token visits plus the shared
    expert. ``get(name)`` reads a config field (a transformers config or a config.json alike)."""
    direct = int(get("intermediate_size") or 0)
    if direct:
        return direct
    return (int(get("moe_intermediate_size") or 0) * max(int(get("num_experts_per_tok") or 0), 1)
            + int(get("shared_expert_intermediate_size") or 0))


def union_bytes(union: tuple, quant: str, per_expert: bool, nf4_bytes) -> int:
    """Soup's per-buffer bytes: the union spec, NF4 linears under nf4, experts out under per_expert."""
    out = 0
    for n, kind in union:
        if kind == "expert":
            out += 0 if per_expert else 2 * n
        elif kind == "linear":
            out += nf4_bytes(n) if quant == "nf4" else 2 * n
        else:
            out += (4 if kind == "fp32" else 2) * n
    return out


def expert_in_flight(expert: tuple, quant: str) -> int:
    """Soup's expert_stream_vram_bytes: one routed expert's packed copy (NF4: n/2 + 4 B per 64) and
    its dense bf16 weights, twice (the backward's recompute beside the previous expert's blocks)."""
    w = sum(expert)
    packed = w // 2 + (w // 64) * 4 if quant == "nf4" else 0
    return 2 * (packed + 2 * w)
