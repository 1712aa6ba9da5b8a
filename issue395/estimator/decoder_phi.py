"""phi's parallel decoder layer's forward requests, bf16 and NF4 (its one LayerNorm feeding the attention and the
MLP, gelu_new, every linear with a bias), built as decoder's layer is. Stdlib only.

phi (``layer_phi_nf4``, NF4 only): one LayerNorm's fp32 output feeds the attention and the MLP (parallel), the
rotary part of q and k rotated in fp32 and cat with its pass-through part, dense, fc1's fp32 output and gelu_new's
fp32 blocks (0.5 x, tanh and 1 + tanh kept from layer 1 on, and in layer 0 under an fc1 target), fc2, attention +
MLP + residual, the final LayerNorm; every linear and the head with a bias: the capture's request for request at
phi-2 512x1 (the H200's choice, none fused, and every shape fused), 1024x1 and 2048x1 (tests/estimator/
test_sequence.py; 512x4-2048x4 not held there), and the H100 trace's forward request for request at 512x1: admitted
(sequence.NF4_SEQUENCE_TYPES).
Its bf16 step (sequence.forward_phi, ``layer_phi``): the LayerNorm's fp32 copy of its bf16 input (autocast's fp32
policy; what its backward keeps from layer 1 on) and fp32 output, each linear's own bf16 cast of it (peft's LoRA
casts nothing: its input is fp32 already), q and k rotated in bf16, gelu_new on fc1's bf16 output (0.5 x bf16, the
rest fp32 from pow's fp32 copy of its input), fc2 on the product's bf16 cast, the final LayerNorm's fp32 copy and
output, the head's bf16 cast of it: the capture's request for request at phi-2 512x1-2048x4, admitted
(sequence.BF16_SEQUENCE_TYPES).
"""

from __future__ import annotations

from .arch import Arch
from .recorder import Requests
from .decoder import output_copy, projection, quiet_parts, rotary
from .decoder_nf4 import proj4bit


def gelu_new(q: Requests, T: int, i: int, unsaved: bool, b: int = 4):
    """phi's gelu_new, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), on fc1's output of ``b`` B an element, in
    Python's order: 0.5 x (``b`` B), on a bf16 input autocast's fp32 copy torch.pow takes (its fp32 policy; what
    pow's backward keeps), the cube (freed), its scaled, the sum, its scaled, tanh (kept where its input needs a
    gradient: not ``unsaved``), 1 + tanh, the product (returned), each fp32 from the cube on; 0.5 x and 1 + tanh are
    what the product's backward keeps (returned with them, the copy pow keeps where its input needs a gradient)."""
    half = q.get(b * T * i)
    copy = q.get(4 * T * i) if b != 4 else None
    cube = q.get(4 * T * i)
    if unsaved:
        q.put(copy)
    scaled = q.get(4 * T * i)
    q.put(cube)
    total = q.get(4 * T * i)
    q.put(scaled)
    inner = q.get(4 * T * i)
    q.put(total)
    tanh = q.get(4 * T * i)
    q.put(inner)
    one = q.get(4 * T * i)
    if unsaved:
        q.put(tanh)
    return q.get(4 * T * i), [half, one]


def phi_attention_nf4(q: Requests, a: Arch, T: int, first: bool, lora: tuple):
    """phi's attention under NF4: q, k, v projected (fp32 outputs), the rotary part of q and k rotated in fp32 and
    each cat with its pass-through part, autocast's bf16 q, k, v, flash's output and logsumexp, dense (bf16 in,
    bf16 out, returned); the fp32 blocks live until the attention returns (its locals), then freed."""
    outs = {m: proj4bit(q, a, T, m, lora, not first) for m in ("q_proj", "k_proj", "v_proj")}
    rotated = [rotary(q, T, a.heads * a.rotary_dim, 4), rotary(q, T, a.kv * a.rotary_dim, 4)]
    cats = [q.get(4 * T * a.heads * a.head_dim), q.get(4 * T * a.kv * a.head_dim)]
    for w in (a.kv, a.kv, a.heads):  # autocast's bf16 v, k, q (its argument pack cast right to left), flash saves
        q.get(2 * T * w * a.head_dim)
    q.get(2 * T * a.heads * a.head_dim)
    q.get(4 * T * a.heads)
    copy = output_copy(q, a, T)
    o = proj4bit(q, a, T, "dense", lora, True, False)
    if not q.saves_input("dense", lora):  # else lora_A saves the copy, as attention_nf4's
        q.put(copy)
    q.put(*cats, outs["v_proj"], rotated[0], outs["q_proj"], rotated[1], outs["k_proj"])
    return o


def phi_mlp_grad(first: bool, lora: tuple) -> bool:
    """Whether phi's MLP keeps a graph: its input is the LayerNorm's, not the attention's, so in layer 0 only an fc1
    target puts it on the backward."""
    return not first or "fc1" in lora[0]


def layer_phi_nf4(q: Requests, a: Arch, T: int, x, first: bool, lora: tuple):
    """One phi layer under NF4 (fp32 residual): its LayerNorm's fp32 output (its mean and rstd small; the input
    itself is what its backward keeps), the attention and the MLP both on it (parallel), fc1's fp32 output and
    gelu_new's fp32 blocks (kept from layer 1 on, and in layer 0 under an fc1 target: the MLP reads the LayerNorm's
    output, not the attention's), fc2, attention + MLP + residual (the output, returned)."""
    normed = q.get(4 * T * a.h)
    o = phi_attention_nf4(q, a, T, first, lora)
    grad = phi_mlp_grad(first, lora)
    fc1 = proj4bit(q, a, T, "fc1", lora, not first)
    act, saved = gelu_new(q, T, a.i, not grad)
    if not grad:  # layer 0's input needs no gradient: its MLP keeps nothing
        q.put(*saved, fc1)
    down = proj4bit(q, a, T, "fc2", lora, grad)
    q.put(act)
    total = q.get(4 * T * a.h)
    out = q.get(4 * T * a.h)
    q.put(total, normed, o, down)
    return out


def phi_attention(q: Requests, a: Arch, T: int, first: bool, lora: tuple, quiet: bool = False):
    """phi's attention under bf16 autocast: q, k, v projected from the LayerNorm's fp32 output (each linear's own
    bf16 cast of it), the rotary part of q and k rotated and each cat with its pass-through part (the cats and v
    what flash saves), flash's output and logsumexp, dense (bf16 in, returned); q's and k's projections and
    rotated parts live until the attention returns (its locals), then freed. Without a graph (``Requests.graph``) the
    logsumexp goes as SDPA returns, its output as the transposed copy rebinds it, the cats and v with the locals.
    ``quiet``: decoder.attention's (layer 0 with no q, k or v target): all of it up to SDPA runs as without a graph,
    and dense records only as a target, its input needing no gradient."""
    with q.no_graph(quiet):
        outs = {m: projection(q, a, T, m, lora, not first, True)[0] for m in ("q_proj", "k_proj", "v_proj")}
        rotated = [rotary(q, T, a.heads * a.rotary_dim), rotary(q, T, a.kv * a.rotary_dim)]
        cats = [q.get(2 * T * a.heads * a.head_dim), q.get(2 * T * a.kv * a.head_dim)]
        sdpa = q.get(2 * T * a.heads * a.head_dim)
        lse = q.get(4 * T * a.heads)
        q.unsaved(lse)  # no backward reads the logsumexp
        copy = output_copy(q, a, T)
        q.unsaved(sdpa)  # the transposed copy rebinds SDPA's output, which nothing saved
        saves = q.graph  # whether flash saved the cats and v
    with q.no_graph(quiet and "dense" not in lora[0]):
        o = projection(q, a, T, "dense", lora, not quiet)[0]
    q.put(copy)
    q.put(rotated[0], outs["q_proj"], rotated[1], outs["k_proj"], *([] if saves else [*cats, outs["v_proj"]]))
    return o


def layer_phi(q: Requests, a: Arch, T: int, x, first: bool, lora: tuple):
    """One phi layer under bf16 autocast: its LayerNorm's fp32 copy of the input (autocast's fp32 policy; what its
    backward keeps, freed in layer 0, whose input needs no gradient) and fp32 output, the attention and the MLP
    both on it (parallel), fc1 on its bf16 cast, gelu_new on fc1's bf16 output (freed once it returns: pow keeps
    its own fp32 copy), fc2 on the product's bf16 cast, attention + MLP + residual (the output, returned). Without a
    graph every layer frees as layer 0 does without an fc1 target (its LayerNorm's copy, gelu_new's saved blocks)."""
    copy = q.get(4 * T * a.h)
    normed = q.get(4 * T * a.h)
    if first or not q.graph:
        q.put(copy)
    o = phi_attention(q, a, T, first, lora, quiet_parts(a, first, lora)[0])
    grad = phi_mlp_grad(first, lora)
    fc1 = projection(q, a, T, "fc1", lora, not first, True)[0]
    act, saved = gelu_new(q, T, a.i, not grad or not q.graph, 2)
    q.put(*saved, fc1) if not grad or not q.graph else q.put(fc1)
    down = projection(q, a, T, "fc2", lora, grad, True)[0]
    q.put(act)
    total = q.get(2 * T * a.h)
    out = q.get(2 * T * a.h)
    q.put(total, normed, o, down)
    return out
