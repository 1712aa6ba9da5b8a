"""A plain decoder layer's forward requests in bf16, op by op as Hugging Face's decoder runs them on CUDA under bf16
autocast, from the estimator's own shapes (``Arch``), recorded in recorder's ``Requests``: the warmup and the load
(``load``), each norm, projection and LoRA target, the rotary embedding, flash SDPA, the gated MLP (``layer``), the
rotary tables (``tables``). sequence runs them as a step and says where they are the run's (``replayed``); NF4's
layer is decoder_nf4's, phi's parallel one decoder_phi's. Stdlib only.

Phi-3 (``fused_attention``): one qkv block whose q, k, v are views (kept whole), each rotated q and k cat with its
pass-through part, one gate_up block whose halves the MLP's act and product save; the capture's request for
request at 512x1-1024x4 bf16 and 512x4-1024x4 NF4 (2048 tokens and up a sliding-window mask comes first, and the
real run's SDPA is then not flash: not built).

Gemma-2 (``layer``'s Gemma-2 path, bf16): the embedding scaled into its own block, each layer's four Gemma RMSNorms
(``gemma_norm``: the fp32 copy, rstd, 1 + weight in fp32, the product's bf16 cast) around the attention and the
MLP: the capture's and the H100 trace's request for request, but not admitted: the driver's segment addresses break
best fit's ties otherwise there, and the real run's forward blocks keep 28.8 MB where either placement's replay keeps
26.2-27.3 MB (the bound stays).
"""

from __future__ import annotations

from ..constants import CUBLAS_WORKSPACE
from .arch import Arch
from .recorder import Requests


#: The layer's attention and MLP linears by name: phi3's fused qkv_proj and gate_up_proj among them (its q, k, v and
#: gate, up are views of one block); phi's dense (its o_proj) and fc1, fc2
ATTN = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "dense")
MLP = ("gate_proj", "up_proj", "gate_up_proj", "down_proj", "fc1", "fc2")


#: The attention's linears whose LoRA target puts layer 0's attention on the backward: with one of them layer 0's
#: attention output needs a gradient, so its SDPA saves its inputs and output and its post-attention norm its fp32
#: input, as ``layer`` builds every layer. With none of them (o_proj or the MLP's linears alone) layer 0's SDPA saves
#: nothing and, without o_proj, neither does that norm (Qwen2.5 o_proj,up_proj 1536x1; SmolLM2 gate_proj,down_proj
#: 777x1): ``layer``'s and decoder_nf4's ``layer_nf4``'s quiet attention, checked on sequence.QUIET_ATTENTION_TYPES.
GRADIENT_ATTENTION = ("q_proj", "k_proj", "v_proj", "qkv_proj")


def parameters(a: Arch, targets: tuple, r: int) -> tuple[list, list]:
    """Each parameter's bytes in the checkpoint's sorted key order (a tied head once), then peft's fp32 LoRA
    matrices layer by layer."""
    names = parameter_bytes(a)
    lora = [4 * r * w for _ in range(a.L) for t in targets for w in a.modules[t][:2]]
    return [names[n] for n in sorted(names)], lora


def parameter_bytes(a: Arch) -> dict:
    """Each checkpoint tensor's name and bf16 bytes (a tied head once)."""
    return dict(module_order(a, sizes=True))


def layer_parameters(a: Arch, k: int) -> list:
    """Layer ``k``'s (name, bf16 bytes) in its modules' order: each linear's weight and bias (qwen3's q/k norms
    after o_proj), then its norms (phi: one LayerNorm, weight and bias; Gemma-2: four)."""
    p = f"model.layers.{k}."
    out = []
    for m, (fi, fo, bias) in a.modules.items():
        q = p + ("self_attn." if m in ATTN else "mlp.") + m
        out += [(q + ".weight", 2 * fi * fo)] + ([(q + ".bias", 2 * fo)] if bias else [])
        if m == "o_proj" and a.qk_norm:
            out += [(p + "self_attn.q_norm.weight", 2 * a.head_dim), (p + "self_attn.k_norm.weight", 2 * a.head_dim)]
    if a.model_type == "phi":
        return out + [(p + "input_layernorm.weight", 2 * a.h), (p + "input_layernorm.bias", 2 * a.h)]
    out += [(p + "input_layernorm.weight", 2 * a.h), (p + "post_attention_layernorm.weight", 2 * a.h)]
    if a.model_type == "gemma2":  # its two more, around the MLP
        out += [(p + "pre_feedforward_layernorm.weight", 2 * a.h), (p + "post_feedforward_layernorm.weight", 2 * a.h)]
    return out


def module_order(a: Arch, sizes: bool = False) -> list:
    """The parameters in the model's module order (model.parameters(): the embedding, each layer's attention
    (q/k/v/o, qwen3's q/k norms), MLP and norms, the final norm, an untied head; phi's final LayerNorm and its
    head's bias), with their bf16 bytes where ``sizes``."""
    phi = a.model_type == "phi"
    out = [("model.embed_tokens.weight", 2 * a.V * a.h)]
    for k in range(a.L):
        out += layer_parameters(a, k)
    out += ([("model.final_layernorm.weight", 2 * a.h), ("model.final_layernorm.bias", 2 * a.h)] if phi
            else [("model.norm.weight", 2 * a.h)])
    out += [] if a.tied else [("lm_head.weight", 2 * a.V * a.h)] + ([("lm_head.bias", 2 * a.V)] if phi else [])
    return out if sizes else [n for n, _ in out]


#: Gemma-2's one buffer transformers' warmup counts (inv_freq it leaves out): its embedding's scale, a bf16 scalar
#: (Gemma2TextScaledWordEmbedding.embed_scale), made after the weights.
GEMMA_BUFFERS = (2,)


def load(q: Requests, a: Arch, targets: tuple, r: int, unused: int = 0) -> None:
    """The warmup block (every parameter's and counted buffer's bytes less the ``unused`` bytes the process had
    reserved beside its allocated ones: sequence.WARMUP_UNUSED; freed at once), then each tensor as the loader makes
    it."""
    weights, lora = parameters(a, targets, r)
    buffers = list(GEMMA_BUFFERS) if a.model_type == "gemma2" else []
    q.put(q.get(max(sum(weights) + sum(buffers) - unused, 0)))
    for b in weights + buffers + lora:
        q.get(b)


def rstd(q: Requests, rows: int, sq):
    """An RMSNorm's fp32 mean of the square (``sq``, freed), + eps and rsqrt over ``rows`` rows: the rsqrt's
    output, which the normalising mul saves, returned (a small-pool block below 262,144 rows)."""
    var = q.get(4 * rows)
    q.put(sq)
    eps = q.get(4 * rows)
    q.put(var)
    out = q.get(4 * rows)
    q.put(eps)
    return out


def norm(q: Requests, T: int, width: int, saved: bool, heads: int = 1):
    """HF's RMSNorm on a bf16 input (``heads`` rows a token: qwen3's per-head q/k norms): its fp32 copy and
    rstd (kept where its input needs a gradient), the square, the normalised fp32, its bf16 cast, the weight's
    product (returned); the rest freed."""
    x32 = q.get(4 * T * width)
    sq = q.get(4 * T * width)
    r = rstd(q, T * heads, sq)
    y32 = q.get(4 * T * width)
    if not saved:
        q.put(x32, r)
    cast = q.get(2 * T * width)
    out = q.get(2 * T * width)
    q.put(cast, y32)
    return out, [x32, r] if saved else []


def lora_linear(q: Requests, T: int, fi: int, fo: int, r: int, grad: bool, dropout: bool, fp32: bool = False):
    """A LoRA target: the base output, the fp32 cast of its input, dropout's output and bool mask (kept where
    the input needs a gradient; neither at LoRA dropout 0, peft's nn.Identity), autocast's bf16 cast lora_A
    saves, lora_A's and lora_B's outputs, the scaling, the sum (returned). On an fp32 input (``fp32``: phi's
    LayerNorm output) the base linear's own bf16 cast of it comes first, freed on its return, and peft casts
    nothing."""
    base = cast_linear(q, T, fi, fo) if fp32 else q.get(2 * T * fo)
    x32 = None if fp32 else q.get(4 * T * fi)
    mask = q.get(T * fi) if dropout else None  # CUDA's native_dropout: its bool mask before its output
    drop = q.get(4 * T * fi) if dropout else None
    if not grad or not q.graph:
        q.put(mask)
    cast = q.get(2 * T * fi)
    a_out = q.get(2 * T * r)
    q.put(drop)
    q.unsaved(cast)  # lora_A saved nothing
    b_out = q.get(2 * T * fo)
    q.unsaved(a_out)
    scaled = q.get(2 * T * fo)
    q.put(b_out)
    out = q.get(2 * T * fo)
    q.put(scaled, base, x32)
    return out, ([cast, a_out] + ([mask] if grad else [])) if q.graph else []


def cast_linear(q: Requests, T: int, fi: int, fo: int):
    """A frozen linear on an fp32 input under autocast: its bf16 cast (the matmul saves none: its weight needs no
    gradient), the output (returned), the cast freed."""
    cast = q.get(2 * T * fi)
    out = q.get(2 * T * fo)
    q.put(cast)
    return out


def projection(q: Requests, a: Arch, T: int, name: str, lora: tuple, grad: bool, fp32: bool = False):
    """A linear's output: a LoRA target's (``lora``: the targets, r, whether dropout writes a mask) or a frozen
    one's (its matmul saves nothing: its weight needs no gradient); on an fp32 input (``fp32``) after
    autocast's bf16 cast of it."""
    fi, fo, _ = a.modules[name]
    targets, r, dropout = lora
    if name in targets:
        return lora_linear(q, T, fi, fo, r, grad, dropout, fp32)
    return (cast_linear(q, T, fi, fo) if fp32 else q.get(2 * T * fo)), []


def rotary(q: Requests, T: int, width: int, b: int = 2, x: int | None = None):
    """x * cos + rotate_half(x) * sin, each step its own block of ``b`` B an element (bf16; fp32 under NF4),
    rotate_half's -x2 and cat of ``x`` B (default ``b``: full_sequence's bf16 projection on fp32 tables takes
    them bf16, its products and sum fp32); the sum returned."""
    x = b if x is None else x
    xc = q.get(b * T * width)
    half = q.get(x * T * width // 2)
    cat = q.get(x * T * width)
    q.put(half)
    xs = q.get(b * T * width)
    q.put(cat)
    out = q.get(b * T * width)
    q.put(xc, xs)
    return out


def output_copy(q: Requests, a: Arch, T: int):
    """The bf16 copy transformers' transpose(1, 2).contiguous() makes of flash's output where q was cat-built
    (phi's and Phi-3's rotary and pass-through parts): flash lays its output out as q (mha_fwd's
    empty_like(q_padded)), and a cat's output is a contiguous (B,H,T,D), so the (B,T,H,D) view is copied; the
    caller frees it once the output projection returns (the H100 phi-2 NF4 trace's one extra transient a layer)."""
    return q.get(2 * T * a.heads * a.head_dim)


def fused_attention(q: Requests, a: Arch, T: int, lora: tuple, grad: bool):
    """Phi-3: one qkv projection whose q, k, v are views of its block (kept: flash saves the v view), q and k
    rotated, each then cat with its pass-through part (empty at a full rotary: a copy all the same), flash SDPA's
    output and logsumexp, o_proj; returns o_proj's output and what the layer keeps."""
    qkv, kept = projection(q, a, T, "qkv_proj", lora, grad)
    rotated = []
    for heads in (a.heads, a.kv):
        r = rotary(q, T, heads * a.rotary_dim)
        rotated.append(q.get(2 * T * heads * a.head_dim))
        q.put(r)
    sdpa = q.get(2 * T * a.heads * a.head_dim)
    lse = q.get(4 * T * a.heads)
    q.unsaved(lse)  # no backward reads the logsumexp
    copy = output_copy(q, a, T)
    q.unsaved(sdpa)  # the transposed copy rebinds SDPA's output, which nothing saved
    o, k = projection(q, a, T, "o_proj", lora, True)
    q.put(copy)
    if not q.graph:  # the attention's locals go as it returns
        q.put(qkv, *rotated)
        return o, []
    return o, kept + k + rotated + [qkv, sdpa, lse]


def attention(q: Requests, a: Arch, T: int, x, lora: tuple, grad: bool, quiet: bool = False):
    """q, k, v projected (LoRA on the targets; qwen3's q and k normed), q and k rotated, flash SDPA's output and
    logsumexp, o_proj; returns o_proj's output and what the layer keeps. ``quiet``: nothing up to SDPA needs a
    gradient (layer 0 with no q, k or v target), so all of it runs as without a graph, and o_proj records only as a
    target (its input needs none)."""
    if "qkv_proj" in a.modules:  # phi3: o_proj's copy of SDPA's output is not built for a quiet attention
        with q.no_graph(quiet and "o_proj" not in lora[0]):
            return fused_attention(q, a, T, lora, grad)
    kept = []
    outs = {}
    with q.no_graph(quiet):
        for m in ("q_proj", "k_proj", "v_proj"):
            outs[m], k = projection(q, a, T, m, lora, grad)
            kept += k
            if a.qk_norm and m != "v_proj":  # qwen3's per-head RMSNorm; it saves its input where that needs a gradient
                normed, k = norm(q, T, a.modules[m][1], q.graph and (grad or m in lora[0]),
                                 a.heads if m == "q_proj" else a.kv)
                kept += k
                q.put(outs[m])
                outs[m] = normed
        qr = rotary(q, T, a.heads * a.head_dim)
        kr = rotary(q, T, a.kv * a.head_dim)
        q.put(outs["q_proj"], outs["k_proj"])
        sdpa = q.get(2 * T * a.heads * a.head_dim)
        lse = q.get(4 * T * a.heads)
        q.unsaved(lse)  # no backward reads the logsumexp: it goes as SDPA returns
        saves = q.graph  # whether SDPA saved its inputs and output
    with q.no_graph(quiet and "o_proj" not in lora[0]):
        o, k = projection(q, a, T, "o_proj", lora, not quiet)
    if not saves:  # the attention's locals go as it returns
        q.put(qr, kr, outs["v_proj"], sdpa)
        return o, k
    return o, kept + k + [qr, kr, outs["v_proj"], sdpa, lse]


def quiet_parts(a: Arch, first: bool, lora: tuple) -> tuple[bool, bool]:
    """What of a layer records nothing (``first``: layer 0, whose input needs no gradient; ``lora``: the targets, r,
    dropout): its attention up to SDPA, with no q, k or v target (``attention``'s and ``attention_nf4``'s ``quiet``),
    and everything before its MLP, with no o_proj target either (its post-attention norm saves nothing, its MLP only
    what its targets need). Phi-3's fused gate_up: its quiet MLP is not built, and its layer records as every
    layer's."""
    targets = set(lora[0])
    return (first and not targets & set(GRADIENT_ATTENTION),
            first and not targets & set(ATTN) and "gate_up_proj" not in a.modules)


def mlp_grads(grad: bool, lora: tuple) -> tuple[bool, bool]:
    """Whether gate's and up's outputs need a gradient: the MLP's input does (``grad``), or each is a LoRA target."""
    return grad or "gate_proj" in lora[0], grad or "up_proj" in lora[0]


def product_inputs(q: Requests, act, up, g: bool, u: bool) -> None:
    """act(gate) x up, made: it saves act where up needs a gradient (``u``), up where act does (``g``); the rest
    freed."""
    q.put(*[b for b, w in ((act, u), (up, g)) if not (w and q.graph)])


def mlp(q: Requests, a: Arch, T: int, x, lora: tuple, grad: bool = True):
    """gate, act(gate), up, their product (freed after down), down (returned); phi3's gate and up the two halves
    of one gate_up block (kept: act and the product save its views). ``grad``: whether its input needs a gradient
    (not in layer 0 with no attention target: there gate and up save their inputs only as targets, act_fn its input
    only under gate's LoRA, the product act only under up's and up only under gate's)."""
    if "gate_up_proj" in a.modules:
        gate_up, kept = projection(q, a, T, "gate_up_proj", lora, True)
        act = q.get(2 * T * a.i)
        prod = q.get(2 * T * a.i)
        q.unsaved(act)  # act(gate) unsaved; the gate view holds the fused block to the MLP's return
        down, k = projection(q, a, T, "down_proj", lora, True)
        q.put(prod)
        if not q.graph:
            q.put(gate_up)
            return down, []
        return down, kept + k + [gate_up, act]
    kept = []
    g, u = mlp_grads(grad, lora)
    gate, k = projection(q, a, T, "gate_proj", lora, grad)
    kept += k
    act = q.get(2 * T * a.i)
    if not (g and q.graph):  # act_fn saves its input where that needs a gradient
        q.put(gate)
    up, k = projection(q, a, T, "up_proj", lora, grad)
    kept += k
    prod = q.get(2 * T * a.i)
    product_inputs(q, act, up, g, u)
    down, k = projection(q, a, T, "down_proj", lora, g or u)
    kept += k
    q.put(prod)
    return down, kept + [b for b, w in ((gate, g), (act, u), (up, g)) if w and q.graph]


def layer(q: Requests, a: Arch, T: int, x, first: bool, lora: tuple):
    """One decoder layer's forward: returns its output and the blocks it keeps for its backward. Gemma-2's four
    norms are Gemma's (gemma_norm), two of them on each sublayer's output before its residual add (sandwiched)."""
    rms = gemma_norm if a.model_type == "gemma2" else norm
    normed, kept = rms(q, T, a.h, q.graph and not first)
    quiet_attention, quiet = quiet_parts(a, first, lora)
    o, k = attention(q, a, T, normed, lora, not first, quiet_attention)
    kept += k
    q.put(normed)
    o = sandwiched(q, a, T, o, kept)
    mid = q.get(2 * T * a.h)
    q.put(o)
    normed2, k = rms(q, T, a.h, q.graph and not quiet)
    kept += k
    down, k = mlp(q, a, T, normed2, lora, not quiet)
    kept += k
    q.put(normed2)
    down = sandwiched(q, a, T, down, kept)
    out = q.get(2 * T * a.h)
    q.put(down, mid)
    return out, kept


def sandwiched(q: Requests, a: Arch, T: int, y, kept: list):
    """A sublayer's output as its residual add takes it: Gemma-2's normed (gemma_norm, what it keeps added to
    ``kept``, the output freed); every other type's as it is."""
    if a.model_type != "gemma2":
        return y
    post, k = gemma_norm(q, T, a.h, q.graph)
    kept += k
    q.put(y)
    return post


def gemma_norm(q: Requests, T: int, width: int, saved: bool):
    """Gemma's RMSNorm on a bf16 input: its fp32 copy, the square and rstd (rstd's rule), the normalised fp32, the
    weight's fp32 copy and 1 + weight (kept with the fp32 copy and rstd where its input needs a gradient), their
    fp32 product, its bf16 cast (returned); the rest freed."""
    x32 = q.get(4 * T * width)
    r = rstd(q, T, q.get(4 * T * width))
    y32 = q.get(4 * T * width)
    if not saved:
        q.put(r, x32)
    w32 = q.get(4 * width)
    w1 = q.get(4 * width)
    q.put(w32)
    out32 = q.get(4 * T * width)
    if not saved:
        q.put(w1)
    q.put(y32)
    cast = q.get(2 * T * width)
    q.put(out32)
    return cast, [x32, r, w1] if saved else []


def tables(q: Requests, a: Arch, seq: int, fp32: bool, workspace: int = CUBLAS_WORKSPACE):
    """The rotary tables (the cuBLAS ``workspace`` after their first matmul): cos and sin, cast to the residual
    stream's dtype (bf16; under NF4 fp32, where the cast is none)."""
    freqs = q.get(4 * seq * a.rotary_dim // 2)
    q.get(workspace)  # held for the process
    tables = [q.get(4 * seq * a.rotary_dim) for _ in range(3)]
    q.put(tables[1])
    tables += [q.get(4 * seq * a.rotary_dim) for _ in range(2)]
    q.put(tables[3])
    if fp32:
        q.put(freqs, tables[0])
        return tables[2], tables[4]
    cos, sin = q.get(2 * seq * a.rotary_dim), q.get(2 * seq * a.rotary_dim)
    q.put(freqs, tables[0], tables[2], tables[4])
    return cos, sin
