"""The checkpointed resident step's layers (gc_sequence runs them): each op's large- and small-pool requests in
recorder's ``Requests``, built from the ``Arch``, forward without a graph and recomputed with what it saves, and
backward: Phi-3's fused layer (``layer_forward``, ``layer_backward``: its memory-efficient SDPA past the window, flash
at and under it), phi's parallel layer (``phi_layer_forward``, ``phi_layer_backward``) and llama's GQA layer
(``llama_layer_forward``, ``llama_layer_backward``), by model type in ``LAYERS``. What each follows, and where it was
checked, is gc_sequence's docstring. Stdlib only.
"""

from __future__ import annotations

from ..constants import CUBLASLT_WORKSPACE
from .arch import Arch
from .full_sequence import flash_grads
from .recorder import BF16, FP32, Requests, sdpa_workspace
from .decoder import cast_linear, norm, rotary


#: The model types whose q is a cat of its rotary and pass-through parts (decoder.output_copy).
CAT_BUILT = ("phi3", "phi")


def base_output(q: Requests, T: int, fi: int, fo: int, fp32: bool):
    """A linear's output; on an fp32 input (``fp32``: phi's LayerNorm output) autocast's bf16 cast of it first,
    freed on its return (decoder.cast_linear), and at each autograd thread's first (the forward's, the backward's:
    the recompute runs there) cuBLASLt's workspace (phi's biased linears run addmm), kept for the process."""
    if not fp32:
        return q.get(BF16 * T * fo)
    cast, out = q.get(BF16 * T * fi), q.get(BF16 * T * fo)
    thread = "backward" in q.phase  # the recompute runs on autograd's device thread
    if thread not in q.lt:
        q.lt.add(thread)
        q.get(CUBLASLT_WORKSPACE)
    q.put(cast)
    return out


def lora_nograd(q: Requests, T: int, fi: int, fo: int, r: int, fp32: bool = False):
    """A LoRA target inside a checkpointed forward (nothing saved): the base output, the fp32 cast of its input
    (none on an fp32 input: peft casts nothing), dropout's mask (freed at once) and output, the bf16 cast lora_A
    takes (freed after it), lora_B's output, the scaling, the sum (returned); the rest freed as
    decoder.lora_linear frees them."""
    base = base_output(q, T, fi, fo, fp32)
    x32 = None if fp32 else q.get(FP32 * T * fi)
    mask = q.get(T * fi)
    drop = q.get(FP32 * T * fi)
    q.put(mask)
    q.cache.append(q.get(BF16 * r * fi))  # autocast's bf16 lora_A weight, cached to the forward's end
    cast = q.get(BF16 * T * fi)
    a_out = q.get(BF16 * T * r)
    q.put(cast, drop)
    q.cache.append(q.get(BF16 * fo * r))  # lora_B's
    b_out = q.get(BF16 * T * fo)
    q.put(a_out)  # lora_B's input: no pack hook keeps it, so it goes as lora_B returns
    scaled = q.get(BF16 * T * fo)
    q.put(b_out)
    out = q.get(BF16 * T * fo)
    q.put(scaled, base, x32)
    return out


def lora_saved(q: Requests, T: int, fi: int, fo: int, r: int, fp32: bool = False):
    """A LoRA target as the recompute runs it (what it saves kept): returns its output, its bf16 cast (lora_A's
    input) and its dropout mask."""
    base = base_output(q, T, fi, fo, fp32)
    x32 = None if fp32 else q.get(FP32 * T * fi)
    mask = q.get(T * fi)
    drop = q.get(FP32 * T * fi)
    wa = q.get(BF16 * r * fi)  # autocast's bf16 lora_A weight, which its mm saves
    cast = q.get(BF16 * T * fi)
    a_out = q.get(BF16 * T * r)  # lora_A's output, which lora_B saves (the small pool's)
    q.put(drop)
    wb = q.get(BF16 * fo * r)  # lora_B's
    b_out = q.get(BF16 * T * fo)
    scaled = q.get(BF16 * T * fo)
    q.put(b_out)
    out = q.get(BF16 * T * fo)
    q.put(scaled, base, x32)
    return out, (cast, a_out, wa, wb), mask


def linear(q: Requests, a: Arch, T: int, name: str, saved: bool, fp32: bool = False):
    """A linear's output: a LoRA target's (lora_saved's triple where ``saved``) or a frozen one's; ``fp32``: on
    an fp32 input."""
    fi, fo, _ = a.modules[name]
    if name in q.targets:
        return (lora_saved(q, T, fi, fo, q.r, fp32) if saved
                else (lora_nograd(q, T, fi, fo, q.r, fp32), None, None))
    return base_output(q, T, fi, fo, fp32), None, None


def rotated(q: Requests, T: int, heads: int, a: Arch):
    """q's or k's rotary (decoder.rotary) cat with its pass-through part; the rotated part freed."""
    r = rotary(q, T, heads * a.rotary_dim)
    out = q.get(BF16 * T * heads * a.head_dim)
    q.put(r)
    return out


def masked(a: Arch, T: int) -> bool:
    """Whether masking_utils builds the sliding window's mask (past it), so SDPA runs the memory-efficient kernel;
    at or under it (or with no window) the mask is none and SDPA flash (allow_is_causal_skip)."""
    return a.window is not None and T > a.window


def layer_forward(q: Requests, a: Arch, T: int, saved: bool) -> dict:
    """One Phi-3 layer on its input (held by the checkpoint): checkpointing's forward (``saved`` false: returns its
    output) or its recompute (``saved``: stopped as down_proj packs its weight; returns what the layer saved)."""
    normed, n1 = norm(q, T, a.h, saved)
    qkv, qkv_cast, qkv_mask = linear(q, a, T, "qkv_proj", saved)
    qr, kr = rotated(q, T, a.heads, a), rotated(q, T, a.kv, a)
    # SDPA's bf16 additive mask (the memory-efficient kernel's attn_bias) past the window; none for flash
    bias = q.get(BF16 * T * T) if masked(a, T) else None
    sdpa = q.get(BF16 * T * a.heads * a.head_dim)  # q's layout (cat-built: (B,H,T,D)), either kernel
    lse = q.get(FP32 * a.heads * T)  # its logsumexp, which its backward reads
    if not saved:
        q.put(lse, bias)
    copy = q.get(BF16 * T * a.heads * a.head_dim)  # decoder.output_copy
    if not saved:
        q.put(sdpa)
    o, o_cast, o_mask = linear(q, a, T, "o_proj", saved)
    q.put(copy)
    if not saved:
        q.put(qr, kr, qkv)
    q.put(normed)
    mid = q.get(BF16 * T * a.h)
    q.put(o)
    normed2, n2 = norm(q, T, a.h, saved)
    gate_up = q.get(BF16 * T * 2 * a.i)
    act = q.get(BF16 * T * a.i)
    prod = q.get(BF16 * T * a.i)
    if saved:  # torch's early stop: down_proj packs its weight, the recompute's frames unwind
        q.put(prod, normed2, mid)
        return {"n1": n1, "n2": n2, "qkv": qkv, "qkv_cast": qkv_cast, "qkv_mask": qkv_mask, "qr": qr, "kr": kr,
                "bias": bias, "sdpa": sdpa, "lse": lse, "o_cast": o_cast, "o_mask": o_mask, "gate_up": gate_up, "act": act}
    q.put(act)
    down = q.get(BF16 * T * a.h)
    q.put(prod, gate_up, normed2)
    out = q.get(BF16 * T * a.h)
    q.put(down, mid)
    return {"out": out}


def norm_backward(q: Requests, T: int, h: int, g, saved: list, recomputed: bool, x=None):
    """HF's RMSNorm's backward on the bf16 gradient ``g`` (its weight frozen): the weight's product, its bf16
    cast's ToCopyBackward to fp32, x * rsqrt's and rsqrt's and pow's fp32 gradients, the fp32 input copy freed
    (first where recomputed), ``x`` (the checkpointed input) with it, the input's bf16 gradient (returned)."""
    x32, rs = saved
    gw = q.get(BF16 * T * h)
    q.put(g)
    g32 = q.get(FP32 * T * h)
    q.put(gw)
    t = q.get(FP32 * T * h)
    gx = q.get(FP32 * T * h)
    q.put(t, g32)
    p = [q.get(FP32 * T * h) for _ in range(4)]
    q.put(p[2], p[1], *((x32, p[0]) if recomputed else (p[0], x32)), rs, x, p[3])
    out = q.get(BF16 * T * h)
    q.put(gx)
    return out


def lora_backward(q: Requests, T: int, g, fi: int, fo: int, cast, mask, buffer=None, into: bool = False):
    """A LoRA target's backward on its output's gradient ``g``: the scaling's (lora_B's and lora_A's weight and
    input gradients under 1 MiB: the small pool's), lora_A's input gradient, its cast's ToCopyBackward to fp32,
    dropout's, the fp32 cast's back to bf16 (the input's gradient, returned; ``into``: added at once into an
    earlier share's buffer in place, and freed), the frozen base's input gradient added into it in place;
    ``buffer``: the gradient to free once the base has read it."""
    ga = adapter_grads(q, T, fi, fo, cast, q.get(BF16 * T * fo))
    g32 = q.get(FP32 * T * fi)
    q.put(ga[0])
    q.grads.append(q.get(FP32 * q.r * fi))  # lora_A's fp32 .grad (ToCopyBackward's), its bf16 one freed
    q.put(ga[1])
    gd = q.get(FP32 * T * fi)
    q.put(mask, g32)
    gx = q.get(BF16 * T * fi)
    q.put(gd)
    if into:
        q.put(gx)
    base = q.get(BF16 * T * fi)
    q.put(buffer, base)
    return None if into else gx


def adapter_grads(q: Requests, T: int, fi: int, fo: int, saved: tuple, gs):
    """A LoRA target's backward from the scaling's gradient ``gs`` to lora_A's input gradient, with its small
    pool's blocks in the H100 history's order (the recompute's ``saved``: lora_A's input cast, its output,
    autocast's bf16 lora_A and lora_B weights): lora_B's bf16 weight gradient, its input's, the saved output and
    bf16 lora_B freed, ``gs`` freed, lora_B's fp32 .grad (ToCopyBackward's: kept, Paged.grads), lora_A's bf16
    weight gradient, lora_A's input gradient (large), the cast and the bf16 lora_A freed; returns lora_A's input
    gradient and its bf16 weight gradient."""
    cast, a_out, wa, wb = saved
    gb = q.get(BF16 * fo * q.r)
    gin = q.get(BF16 * T * q.r)
    q.put(a_out, wb, gs)
    q.grads.append(q.get(FP32 * fo * q.r))
    q.put(gb)
    gwa = q.get(BF16 * q.r * fi)
    ga = q.get(BF16 * T * fi)
    q.put(cast, wa, gin)
    return ga, gwa


def sdpa_backward(q: Requests, a: Arch, T: int, g, kept: list):
    """SDPA's backward as the H100 histories run it (no output copy, no GQA expansion): dq, dk and dv (k's and v's
    heads), the workspace made and freed, what the recompute saved (``kept``: the output and logsumexp, then v,
    q and k as the history frees them) and ``g``. Returns dq, dk, dv."""
    dq = q.get(BF16 * T * a.heads * a.head_dim)
    dk, dv = q.get(BF16 * T * a.kv * a.head_dim), q.get(BF16 * T * a.kv * a.head_dim)
    q.put(q.get(sdpa_workspace(a, T)))
    q.put(*kept, g)
    return dq, dk, dv


def flash_backward(q: Requests, a: Arch, T: int, g, kept: list):
    """Flash's backward on a recomputed layer (bench/allocator_replay.py's Flash, torch's mha_bwd): the output's
    (B,T,H,D) contiguous copy where q was cat-built (phi's and Phi-3's rotary and pass-through parts lay flash's
    output out (B,H,T,D)), full_sequence.flash_grads' dq, dk, dv and scratch, the scratch freed, then what the
    recompute saved (``kept``, in the order the capture frees them) and ``g``."""
    out_t = q.get(BF16 * T * a.heads * a.head_dim) if a.model_type in CAT_BUILT else None
    dq, dk, dv, sd, acc = flash_grads(q, a, T)
    q.put(sd, acc, out_t)
    q.put(*kept, g)
    return dq, dk, dv


def rotary_backward(q: Requests, T: int, w: int):
    """x * cos + rotate_half(x) * sin's backward (bf16 tables): rotate_half's share, its negation, each half's
    zero-padded slice gradient (the second added in place), x's share added in place (returned)."""
    s = q.get(BF16 * T * w)
    n = q.get(BF16 * T * w // 2)
    acc = q.get(BF16 * T * w)
    q.put(n)
    other = q.get(BF16 * T * w)
    q.put(s, other)
    q.put(q.get(BF16 * T * w))
    return acc


def layer_backward(q: Requests, a: Arch, T: int, g, x) -> None:
    """One layer's recompute and backward on the residual stream's gradient buffer ``g`` (every share of it added
    in place); ``x``: the checkpointed input freed with the input norm's backward."""
    s = layer_forward(q, a, T, True)
    qw, kw = a.heads * a.head_dim, a.kv * a.head_dim
    gprod = q.get(BF16 * T * a.i)
    gact, gup = q.get(BF16 * T * a.i), q.get(BF16 * T * a.i)
    q.put(s["act"], gprod)
    ggate = q.get(BF16 * T * a.i)
    q.put(s["gate_up"], gact)
    cat = q.get(BF16 * T * 2 * a.i)
    q.put(ggate, gup)
    gn = q.get(BF16 * T * a.h)
    q.put(cat)
    q.put(norm_backward(q, T, a.h, gn, s["n2"], True))
    fi, fo, _ = a.modules["o_proj"]
    gcopy = lora_backward(q, T, g, fi, fo, s["o_cast"], s["o_mask"])
    if masked(a, T):
        dq, dk, dv = sdpa_backward(q, a, T, gcopy, [s["lse"], s["sdpa"], s["qkv"], s["qr"], s["kr"], s["bias"]])
    else:
        dq, dk, dv = flash_backward(q, a, T, gcopy, [s["lse"], s["sdpa"], s["qkv"], s["qr"], s["kr"]])
    rk = rotary_backward(q, T, kw)
    rq = rotary_backward(q, T, qw)
    ck = q.get(BF16 * T * kw)  # the rotary part's slice gradient
    q.put(dk, rk)
    cq = q.get(BF16 * T * qw)
    q.put(dq, rq)
    vk = q.get(BF16 * T * kw)  # the (B, T, H, D) view's reshape copy
    q.put(ck)
    vq = q.get(BF16 * T * qw)
    q.put(cq)
    fi, fo, _ = a.modules["qkv_proj"]
    gqkv = q.get(BF16 * T * fo)  # v's slice gradient, then k's and q's added in place
    q.put(dv)
    for v in (vk, vq):
        share = q.get(BF16 * T * fo)
        q.put(v, share)
    gx = lora_backward(q, T, gqkv, fi, fo, s["qkv_cast"], s["qkv_mask"], gqkv)
    q.put(norm_backward(q, T, a.h, gx, s["n1"], True, x))


def gelu(q: Requests, T: int, i: int, saved: bool) -> dict:
    """decoder_phi.gelu_new on fc1's bf16 output, its blocks named: 0.5 x (bf16), pow's fp32 copy, the cube, its
    scaled, the sum, its scaled, tanh, 1 + tanh, the product; pow's copy and tanh freed unless ``saved``."""
    half, copy, cube = q.get(BF16 * T * i), q.get(FP32 * T * i), q.get(FP32 * T * i)
    if not saved:
        q.put(copy)
    scaled = q.get(FP32 * T * i)
    q.put(cube)
    total = q.get(FP32 * T * i)
    q.put(scaled)
    inner = q.get(FP32 * T * i)
    q.put(total)
    tanh = q.get(FP32 * T * i)
    q.put(inner)
    one = q.get(FP32 * T * i)
    if not saved:
        q.put(tanh)
    return {"half": half, "pow": copy, "tanh": tanh, "one": one, "prod": q.get(FP32 * T * i)}


def layernorm(q: Requests, T: int, h: int, saved: bool):
    """phi's LayerNorm under autocast's fp32 policy: its weight's and bias's fp32 casts, the input's fp32 copy, the
    output (returned), its mean and rstd; the rest freed unless ``saved`` (then returned: the backward reads it)."""
    wb = [q.get(FP32 * h), q.get(FP32 * h)]
    copy, out = q.get(FP32 * T * h), q.get(FP32 * T * h)
    stats = [q.get(FP32 * T), q.get(FP32 * T)]
    if saved:
        return out, (copy, wb, stats)
    q.put(*stats, copy, *wb)
    return out, None


def phi_layer_forward(q: Requests, a: Arch, T: int, saved: bool) -> dict:
    """One phi layer on its input (held by the checkpoint): checkpointing's forward (``saved`` false: returns its
    output) or its recompute (``saved``: stopped once fc2's input is cast, the product's mul the last to save;
    returns what the layer saved)."""
    normed, copy = layernorm(q, T, a.h, saved)
    p = {m: linear(q, a, T, m, saved, True) for m in ("q_proj", "k_proj", "v_proj")}
    qr, kr = rotary(q, T, a.heads * a.rotary_dim), rotary(q, T, a.kv * a.rotary_dim)
    qcat, kcat = q.get(BF16 * T * a.heads * a.head_dim), q.get(BF16 * T * a.kv * a.head_dim)
    seeds = [q.get(8), q.get(8)]  # SDPA's philox seed and offset, which its backward reads
    sdpa = q.get(BF16 * T * a.heads * a.head_dim)
    lse = q.get(FP32 * a.heads * T)  # its logsumexp, likewise
    q.put(q.get(256))  # a 256 B scratch the history's SDPA makes and frees at once
    if not saved:  # the rest of SDPA's tuple goes as transformers keeps its output alone
        q.put(lse, *seeds)
    out_copy = q.get(BF16 * T * a.heads * a.head_dim)  # decoder.output_copy
    if not saved:
        q.put(sdpa)
    o, o_cast, o_mask = linear(q, a, T, "dense", saved)
    q.put(out_copy)
    if not saved:
        q.put(qcat, kcat, p["v_proj"][0])
    q.put(qr, p["q_proj"][0], kr, p["k_proj"][0])
    fc1 = cast_linear(q, T, a.h, a.i)
    g = gelu(q, T, a.i, saved)
    if saved:  # torch's early stop: the recompute's frames unwind after fc2's input cast
        q.put(fc1)
        q.put(q.get(BF16 * T * a.i), g["prod"], normed, o)
        return {"copy": copy, "seeds": seeds, "lora": {m: p[m][1:] for m in p}, "v": p["v_proj"][0], "qcat": qcat,
                "kcat": kcat, "sdpa": sdpa, "lse": lse, "o_cast": o_cast, "o_mask": o_mask, **g}
    q.put(g["half"], g["one"], fc1)
    down = cast_linear(q, T, a.i, a.h)
    q.put(g["prod"])
    total = q.get(BF16 * T * a.h)
    out = q.get(BF16 * T * a.h)
    q.put(total, normed, o, down)
    return {"out": out}


def layernorm_backward(q: Requests, T: int, h: int, g, kept, recomputed: bool = False):
    """phi's final LayerNorm's backward on the head's bf16 input gradient ``g``: its cast's to fp32, the norm's
    fp32 input gradient, its saved fp32 copy ``x32`` freed, the cast back to bf16 (returned: the residual stream's
    gradient buffer)."""
    g32 = q.get(FP32 * T * h)
    q.put(g)
    gn = q.get(FP32 * T * h)
    copy, wb, stats = kept
    q.put(g32, wb[0], copy, wb[1], *stats)
    out = q.get(BF16 * T * h)
    q.put(gn)
    return out


def gelu_backward(q: Requests, T: int, i: int, s: dict):
    """fc2's input gradient (its cast's to fp32), the product's mul, 0.5 x's cast back to bf16, tanh's, the inner
    sum's scaling, x's share (bf16), the cube's pow backward (its square, the exponent's scaling, the product) and
    its cast back to bf16 and 0.5 x's share, each added into x's share in place: fc1's output gradient, returned."""
    g2 = q.get(BF16 * T * i)
    gp = q.get(FP32 * T * i)
    q.put(g2)
    gone, ghalf32 = q.get(FP32 * T * i), q.get(FP32 * T * i)
    q.put(s["half"], s["one"])
    ghalf = q.get(BF16 * T * i)
    q.put(ghalf32, gp)
    gt = q.get(FP32 * T * i)
    q.put(s["tanh"], gone)
    gtot = q.get(FP32 * T * i)
    q.put(gt)
    gx = q.get(BF16 * T * i)
    gcube = q.get(FP32 * T * i)
    q.put(gtot)
    sq, scaled, prod = q.get(FP32 * T * i), q.get(FP32 * T * i), q.get(FP32 * T * i)
    q.put(scaled, sq, s["pow"], gcube)
    cast = q.get(BF16 * T * i)
    q.put(prod, cast)
    share = q.get(BF16 * T * i)
    q.put(ghalf, share)
    return gx


def lora_backward_fp32(q: Requests, T: int, g, fi: int, fo: int, cast, mask):
    """lora_backward on an fp32 input (phi's q, k, v on the LayerNorm's output): the scaling's, lora_A's input
    gradient, its cast's to fp32, dropout's (added into the norm's fp32 gradient in place), the frozen base's bf16
    input gradient, ``g`` freed once it has read it, its cast to fp32 added likewise."""
    ga = adapter_grads(q, T, fi, fo, cast, q.get(BF16 * T * fo))
    g32 = q.get(FP32 * T * fi)
    q.put(ga[0])
    q.grads.append(q.get(FP32 * q.r * fi))  # lora_A's fp32 .grad (ToCopyBackward's), its bf16 one freed
    q.put(ga[1])
    gd = q.get(FP32 * T * fi)
    q.put(mask, g32, gd)
    base = q.get(BF16 * T * fi)
    q.put(g)
    b32 = q.get(FP32 * T * fi)
    q.put(base, b32)


def phi_layer_backward(q: Requests, a: Arch, T: int, g, x) -> None:
    """One phi layer's recompute and backward on the residual stream's gradient ``g`` (the layer norm's share
    added in place): the MLP's, dense's, flash's, k's then q's rotary and their slices' zero-padded gradients, v's,
    k's and q's (each from its reshape copy) into the norm's fp32 gradient, the LayerNorm's; ``x``: the
    checkpointed input, freed with it."""
    s = phi_layer_forward(q, a, T, True)
    qw, kw = a.heads * a.head_dim, a.kv * a.head_dim
    gx = gelu_backward(q, T, a.i, s)
    gin = q.get(BF16 * T * a.h)  # fc1's input gradient, then its cast's to fp32: the norm's gradient buffer
    q.put(gx)
    gn = q.get(FP32 * T * a.h)
    q.put(gin)
    fi, fo, _ = a.modules["dense"]
    gcopy = lora_backward(q, T, g, fi, fo, s["o_cast"], s["o_mask"])
    dq, dk, dv = sdpa_backward(q, a, T, gcopy, [*s["seeds"], s["sdpa"], s["lse"], s["v"], s["qcat"], s["kcat"]])
    rk = rotary_backward(q, T, a.kv * a.rotary_dim)
    rq = rotary_backward(q, T, a.heads * a.rotary_dim)
    pads = []
    for d, r, w in ((dk, rk, kw), (dq, rq, qw)):  # the pass-through slice's gradient, the rotated one's added
        pads.append(q.get(BF16 * T * w))
        q.put(d)
        pad = q.get(BF16 * T * w)
        q.put(r, pad)
    ck, cq = pads
    fi, fo, _ = a.modules["v_proj"]
    lora_backward_fp32(q, T, dv, fi, fo, *s["lora"]["v_proj"])
    for name, c, w in (("k_proj", ck, kw), ("q_proj", cq, qw)):
        view = q.get(BF16 * T * w)  # the (B,T,H,D) reshape copy
        q.put(c)
        fi, fo, _ = a.modules[name]
        lora_backward_fp32(q, T, view, fi, fo, *s["lora"][name])
    gl = q.get(FP32 * T * a.h)
    (copy, wb, stats) = s["copy"]
    q.put(*stats, wb[0], copy, wb[1], gn, *(x if isinstance(x, list) else [x]))
    cast = q.get(BF16 * T * a.h)  # its cast back to bf16, added into g in place
    q.put(gl, cast)


def llama_layer_forward(q: Requests, a: Arch, T: int, saved: bool) -> dict:
    """One llama layer on its input (held by the checkpoint): checkpointing's forward (``saved`` false: returns its
    output) or its recompute (``saved``: stopped as down_proj packs its weight; returns what the layer saved)."""
    normed, n1 = norm(q, T, a.h, saved)
    p = {m: linear(q, a, T, m, saved) for m in ("q_proj", "k_proj", "v_proj")}
    qr, kr = rotary(q, T, a.heads * a.head_dim), rotary(q, T, a.kv * a.head_dim)
    q.put(p["q_proj"][0], p["k_proj"][0])
    sdpa = q.get(BF16 * T * a.heads * a.head_dim)  # (B,T,H,D): the o_proj input's view
    lse = q.get(FP32 * a.heads * T)  # flash's logsumexp, which its backward reads
    o = q.get(BF16 * T * a.h)
    if not saved:
        q.put(sdpa, lse, qr, kr, p["v_proj"][0])
    q.put(normed)
    mid = q.get(BF16 * T * a.h)
    q.put(o)
    normed2, n2 = norm(q, T, a.h, saved)
    gate, act = q.get(BF16 * T * a.i), q.get(BF16 * T * a.i)
    if not saved:
        q.put(gate)
    up, prod = q.get(BF16 * T * a.i), q.get(BF16 * T * a.i)
    if saved:  # torch's early stop: down_proj packs its weight, the recompute's frames unwind
        q.put(prod, normed2, mid)
        return {"n1": n1, "n2": n2, "lora": {m: p[m][1:] for m in p}, "v": p["v_proj"][0], "qr": qr, "kr": kr,
                "sdpa": sdpa, "lse": lse, "gate": gate, "act": act, "up": up}
    q.put(act, up)
    down = q.get(BF16 * T * a.h)
    q.put(prod, normed2)
    out = q.get(BF16 * T * a.h)
    q.put(down, mid)
    return {"out": out}


def added(q: Requests, n: int, old, new):
    """InputBuffer's out-of-place sum of two bf16 gradient shares of ``n`` elements: the sum made, the old share
    freed as the buffer takes the sum, then the new one."""
    total = q.get(BF16 * n)
    q.put(old, new)
    return total


def llama_rotary_backward(q: Requests, T: int, w: int, g):
    """rotary_backward on a view's gradient ``g``, freed before x's share is added in place (returned)."""
    s = q.get(BF16 * T * w)
    n = q.get(BF16 * T * w // 2)
    acc = q.get(BF16 * T * w)
    q.put(n)
    other = q.get(BF16 * T * w)
    q.put(s, other)
    last = q.get(BF16 * T * w)
    q.put(g, last)
    return acc


def llama_layer_backward(q: Requests, a: Arch, T: int, g, x) -> None:
    """One llama layer's recompute and backward on the residual stream's gradient ``g`` (every share added in
    place): the MLP's (down's input gradient, the product's two, up's input gradient, silu's, gate's added), the
    post-attention norm's, o_proj's, flash's, q's and k's rotary, v's, k's then q's projections (autograd's order:
    the last made first; each (B,T,H,D) reshape copy, the first share the buffer the later ones add into), the
    input norm's; ``x``: the checkpointed input, freed with it."""
    s = llama_layer_forward(q, a, T, True)
    gp = q.get(BF16 * T * a.i)
    g1, g2 = q.get(BF16 * T * a.i), q.get(BF16 * T * a.i)
    q.put(s["act"], s["up"], gp)
    gin = q.get(BF16 * T * a.h)
    q.put(g1)
    silu = q.get(BF16 * T * a.i)
    q.put(s["gate"], g2)
    gg = q.get(BF16 * T * a.h)
    q.put(silu)
    gin = added(q, T * a.h, gin, gg)
    q.put(norm_backward(q, T, a.h, gin, s["n2"], True))
    go = q.get(BF16 * T * a.heads * a.head_dim)
    dq, dk, dv = sdpa_backward(q, a, T, go, [s["sdpa"], s["lse"], s["v"], s["qr"], s["kr"]])
    grads = {"k_proj": llama_rotary_backward(q, T, a.kv * a.head_dim, dk), "v_proj": dv}
    grads["q_proj"] = llama_rotary_backward(q, T, a.heads * a.head_dim, dq)
    buffer = None
    for name in ("v_proj", "k_proj", "q_proj"):
        fi, fo, _ = a.modules[name]
        gout = grads[name]
        if name != "v_proj":  # the rotated gradient's (B,T,H,D) reshape copy
            gout = q.get(BF16 * T * fo)
            q.put(grads[name])
        if name in q.targets:
            gx = lora_backward(q, T, gout, fi, fo, *s["lora"][name], gout, into=buffer is not None)
        else:
            gx = q.get(BF16 * T * fi)
            q.put(gout)
            if buffer is not None:
                q.put(gx)
                gx = None
        buffer = buffer if gx is None else gx
    q.put(norm_backward(q, T, a.h, buffer, s["n1"], True, x))


#: Each checked model type's checkpointed layer: its forward (and recompute) and its backward.
LAYERS = {"phi3": (layer_forward, layer_backward), "phi": (phi_layer_forward, phi_layer_backward),
          "llama": (llama_layer_forward, llama_layer_backward)}
