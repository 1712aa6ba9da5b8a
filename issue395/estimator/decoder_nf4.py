"""The NF4 decoder layer's forward requests (Soup's resident QLoRA: bitsandbytes' Linear4bit, NF4, double
quantisation, bf16 compute), built as decoder's bf16 layer is and recorded in recorder's ``Requests``. Stdlib only.

Under NF4 the load quantises each decoder linear as it lands, every other tensor is recast to fp32 (so the residual
stream is fp32) and peft's prepare_model_for_kbit_training empties the cache (the warmup's segment, wholly free by then,
goes back to the driver), each linear is bitsandbytes' Linear4bit (a bf16 cast of its input, the dequantised weight and
its absmax, a bf16 output cast back) and each target peft's bnb LoRA layer: ``load_nf4``, ``layer_nf4`` (run by
sequence.forward_nf4), the capture's request for request past 1,536 tokens. At 1,536 tokens or fewer bitsandbytes'
gemm_4bit chooses per card and per weight shape between its fused kernel (its output alone) and that dequantising
fallback (a weight of 4 Mi elements or more past 512 tokens the fallback on every card: ``gemm4bit.may_fuse``); the card
unknown, sequence.layer_rests replays every choice and charges the largest rests (gemm4bit.gemm_choices; on a known card
its one answer, gemm4bit.fused_shapes): the capture's request for request with the heuristic forced each way
(Llama-3.2-1B and Phi-3-mini 512x1 and 1024x1, Qwen3-0.6B's five shapes fused at 512x1), and with the H200's own mixed
choice (SmolLM2 512x1: its gate and up fused).
"""

from __future__ import annotations

from .arch import NF4_BLOCK, Arch
from .gemm4bit import GEMM_4BIT_FUSED_MAX_ROWS
from .recorder import BF16, FP32, Requests
from .decoder import (ATTN, mlp_grads, module_order, output_copy, parameter_bytes, product_inputs, quiet_parts,
                      rotary, rstd)


def quantise(q: Requests, n: int) -> tuple:
    """A decoder linear of ``n`` elements as it loads: its bf16 tensor, then bitsandbytes' quantize_4bit (fp32
    absmax a block of NF4_BLOCK, the packed weight), the absmax less its mean (fp32) and quantize_blockwise's
    uint8 absmax (its fp32 nested absmax is small), the difference and the fp32 absmax freed, then the bf16
    tensor dropped. The keys of the two it keeps: the packed weight and the uint8 absmax."""
    blocks = -(-n // NF4_BLOCK)
    source = q.get(2 * n)
    absmax = q.get(4 * blocks)
    packed = q.get(-(-n // 2))
    diff = q.get(4 * blocks)
    kept = q.get(blocks)
    q.put(diff, absmax, source)
    return packed, kept


def load_nf4(q: Requests, a: Arch, targets: tuple, r: int, unused: int = 0) -> list:
    """transformers' warmup block (a quantised element 0.5 B, every other at bf16's 2 B; less the ``unused`` bytes the
    process had reserved beside its allocated ones: sequence.WARMUP_UNUSED), each tensor in the
    checkpoint's sorted key order (a decoder linear quantised as it lands), peft's prepare_model_for_kbit_training
    (each tensor it does not quantise recast to fp32, in the modules' order, then its torch.cuda.empty_cache():
    peft/utils/other.py, auto_clear_cache), peft's fp32 LoRA matrices, which TRL recasts to bf16. The keys of the
    quantised linears' blocks."""
    names = parameter_bytes(a)
    linear = {f"model.layers.{k}.{'self_attn' if m in ATTN else 'mlp'}.{m}.weight"
              for k in range(a.L) for m in a.modules}
    q.put(q.get(max(2 * (sum(names[n] // 4 if n in linear else names[n] for n in names) // 2) - unused, 0)))
    held, packed = {}, []
    for n in sorted(names):
        if n in linear:
            packed += quantise(q, names[n] // 2)
        else:
            held[n] = q.get(names[n])
    for n in module_order(a):
        if n in held:
            q.get(2 * names[n])
            q.put(held[n])
    q.empty_cache()  # the warmup's segment, wholly free once the weights are packed, goes back to the driver
    lora = [q.get(4 * r * w) for _ in range(a.L) for t in targets for w in a.modules[t][:2]]
    for k, w in zip(lora, [w for _ in range(a.L) for t in targets for w in a.modules[t][:2]]):
        q.get(2 * r * w)
        q.put(k)
    return packed


def norm32(q: Requests, T: int, width: int, saved: bool = True, heads: int = 1):
    """HF's RMSNorm on an fp32 input (its .float() no copy): the square, the rstd (kept where its input needs a
    gradient; ``heads`` rows a token), the normalised, the weight's fp32 product (returned); the input itself is
    what its backward keeps."""
    sq = q.get(4 * T * width)
    r = rstd(q, T * heads, sq)
    y = q.get(4 * T * width)
    if not saved:
        q.put(r)
    out = q.get(4 * T * width)
    q.put(y)
    return out


def linear4bit(q: Requests, T: int, fi: int, fo: int, fp32: bool):
    """bitsandbytes' Linear4bit on an fp32 (``fp32``) or bf16 input: the input's bf16 cast, gemm_4bit's
    dequantising fallback (the nested absmax dequantised and offset, fp32, the bf16 weight; none where its fused
    kernel runs: at most GEMM_4BIT_FUSED_MAX_ROWS rows and the shape in ``q.fused``), its bf16 output, cast back
    to the input's dtype; nothing saved but the packed weight."""
    cast = q.get(2 * T * fi) if fp32 else None
    blocks = -(-fi * fo // NF4_BLOCK)
    fused = T <= GEMM_4BIT_FUSED_MAX_ROWS and (fo, fi) in q.fused
    temps = () if fused else (q.get(4 * blocks), q.get(4 * blocks), q.get(2 * fi * fo))
    out = q.get(2 * T * fo)
    q.put(*temps)
    if not fp32:
        return out
    out32 = q.get(4 * T * fo)
    q.put(out, cast)
    return out32


def lora4bit(q: Requests, T: int, fi: int, fo: int, r: int, grad: bool, dropout: bool, fp32: bool = True):
    """peft's bnb LoRA layer under autocast on an fp32 (``fp32``) or bf16 input: the base output (the input's
    dtype), peft's defensive clone, dropout's output and mask (kept where the input needs a gradient), on an fp32
    input autocast's bf16 cast lora_A saves (on a bf16 one lora_A saves dropout's output, or the input itself),
    lora_A's and lora_B's outputs, the scaling, the sum in the input's dtype (returned)."""
    b = FP32 if fp32 else BF16
    base = linear4bit(q, T, fi, fo, fp32)
    clone = q.get(b * T * fo)
    q.put(base)
    mask = q.get(T * fi) if dropout else None  # CUDA's native_dropout: its bool mask before its output
    drop = q.get(b * T * fi) if dropout else None
    if not grad or not q.graph:
        q.put(mask)
    cast = drop
    if fp32:
        cast = q.get(2 * T * fi)
        q.put(drop)
    a_out = q.get(2 * T * r)
    q.unsaved(cast)  # lora_A saved nothing
    b_out = q.get(2 * T * fo)
    q.unsaved(a_out)
    scaled = q.get(2 * T * fo)
    q.put(b_out)
    out = q.get(b * T * fo)
    q.put(clone, scaled)
    return out


def proj4bit(q: Requests, a: Arch, T: int, name: str, lora: tuple, grad: bool, fp32: bool = True):
    fi, fo, _ = a.modules[name]
    targets, r, dropout = lora
    if name in targets:
        return lora4bit(q, T, fi, fo, r, grad, dropout, fp32)
    return linear4bit(q, T, fi, fo, fp32)


def attention_nf4(q: Requests, a: Arch, T: int, first: bool, lora: tuple, quiet: bool = False):
    """The attention under NF4: q, k, v projected (fp32 outputs; qwen3's q and k normed), q and k rotated in fp32,
    autocast's bf16 q, k, v, flash's output and logsumexp, o_proj (bf16 in, bf16 out); returns o_proj's output and
    the blocks the layer frees after it. ``quiet``: as ``attention``'s."""
    with q.no_graph(quiet):
        if "qkv_proj" in a.modules:  # phi3: q, k, v views of one fused block, each rotated one cat with its pass part
            qkv = proj4bit(q, a, T, "qkv_proj", lora, not first)
            done = []
            for heads in (a.heads, a.kv):
                r = rotary(q, T, heads * a.rotary_dim, 4)
                done.append(q.get(4 * T * heads * a.head_dim))
                q.put(r)
            done.append(qkv)
        else:
            outs = {}
            for m in ("q_proj", "k_proj", "v_proj"):
                outs[m] = proj4bit(q, a, T, m, lora, not first)
                if a.qk_norm and m != "v_proj":  # qwen3's per-head RMSNorm: saves its fp32 input where it needs a grad
                    n = norm32(q, T, a.modules[m][1], q.graph and (not first or m in lora[0]),
                               a.heads if m == "q_proj" else a.kv)
                    if not q.graph or first and m not in lora[0]:  # the norm saved no input
                        q.put(outs[m])
                    outs[m] = n
            done = [rotary(q, T, a.heads * a.head_dim, 4), rotary(q, T, a.kv * a.head_dim, 4), outs["v_proj"]]
            q.put(outs["q_proj"], outs["k_proj"])
        casts = [q.get(2 * T * w * a.head_dim) for w in (a.kv, a.kv, a.heads)]  # autocast's bf16 v, k, q (its argument
        # pack cast right to left), which flash saves
        sdpa = q.get(2 * T * a.heads * a.head_dim)
        lse = q.get(4 * T * a.heads)
        q.unsaved(lse, *casts)  # nothing saved: SDPA's casts and logsumexp go as it returns
        copy = output_copy(q, a, T) if "qkv_proj" in a.modules else None
        if not q.graph and copy is not None:  # the transposed copy rebinds SDPA's output
            q.put(sdpa)
        saves = q.graph  # whether SDPA saved its inputs and output
    with q.no_graph(quiet and "o_proj" not in lora[0]):
        o = proj4bit(q, a, T, "o_proj", lora, not quiet, False)
        kept = q.saves_input("o_proj", lora)  # lora_A saves its own input: SDPA's output, or Phi-3's copy of it
    if not kept:
        q.put(copy)
    if not (saves or kept) and copy is None:
        q.put(sdpa)
    return o, done


def layer_nf4(q: Requests, a: Arch, T: int, x, first: bool, lora: tuple):
    """One decoder layer's forward under NF4 (an fp32 residual stream): returns its output. Layer 0 with no q, k or v
    target runs as ``layer`` does there: its attention up to SDPA without a graph and, with no o_proj target either,
    its post-attention norm saving nothing and its MLP keeping only what its targets need."""
    normed = norm32(q, T, a.h, q.graph and not first)
    quiet_attention, quiet = quiet_parts(a, first, lora)
    o, done = attention_nf4(q, a, T, first, lora, quiet_attention)
    q.put(*done, normed)
    mid = q.get(4 * T * a.h)  # the residual sum, which the next norm saves where it needs a gradient
    q.put(o)
    normed2 = norm32(q, T, a.h, q.graph and not quiet)
    fused = None
    if "gate_up_proj" in a.modules:  # phi3: gate and up views of one fused block (the gate view holds it to the end)
        fused = proj4bit(q, a, T, "gate_up_proj", lora, True)
        act = q.get(4 * T * a.i)  # act(gate), fp32
        prod = q.get(4 * T * a.i)
        q.unsaved(act)  # the product's input, unsaved
        g = u = True
    else:  # as mlp's
        g, u = mlp_grads(not quiet, lora)
        gate = proj4bit(q, a, T, "gate_proj", lora, not quiet)
        act = q.get(4 * T * a.i)  # act(gate), fp32
        if not (g and q.graph):  # act_fn saves its input where that needs a gradient
            q.put(gate)
        up = proj4bit(q, a, T, "up_proj", lora, not quiet)
        prod = q.get(4 * T * a.i)
        product_inputs(q, act, up, g, u)
    down = proj4bit(q, a, T, "down_proj", lora, g or u)
    q.put(prod, normed2, *([] if q.graph else [fused]))
    out = q.get(4 * T * a.h)
    q.put(down, *([] if q.graph and not quiet else [mid]))
    return out
