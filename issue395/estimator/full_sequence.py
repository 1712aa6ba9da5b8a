"""A resident full fine-tuning step's large-pool requests on fp32 master weights (soup-cli 0.77.0's
resolve_base_load_dtype, full.estimate_master) built from the estimator's own shapes (``Arch``), op by op as
transformers' plain decoder runs it on CUDA under accelerate's bf16 autocast, and replayed through
estimator/allocator.py: the rests the optimizer step's blocks hold past their requests at its peak (issue 51: a
term built from the allocator's history, in place of the 1 MiB a gradient, state and square-root block bound,
constants.unsplit_rests). Stdlib only.

The step, as bench/allocator_replay.py ``capture --full`` captures it from the real model on the meta device (its
oracle): the cuBLAS workspace the process made before the arm; transformers' caching_allocator_warmup at 4 B an
element and each parameter in the checkpoint's sorted key order, fp32; the embedding (fp32: the residual stream),
the rotary tables; each layer's forward (the RMSNorm in fp32 with its normed tensor kept for its weight's
gradient, each linear's cached bf16 weight copy and its own bf16 cast of its fp32 input, q and k rotated in fp32
from their bf16 projections, autocast's bf16 q and k for flash, o_proj, the fp32 residual adds, the gated MLP);
the final norm, the head, HF's loss (its fp32 logits copy and log_softmax), accelerate's fp32 logits copy, TRL's
entropy over 128-row chunks; the backward (the loss's, the head's with the backward's cuBLAS workspace after its
first matmul, the final norm's, each layer's in reverse: the MLP, the post-attention norm, o_proj, flash's
backward, k's then q's rotary, v_proj, k_proj, q_proj, the input norm; the embedding's, added into a tied head's
gradient); each fp32 gradient the ToCopyBackward of its weight's bf16 copy; the Trainer's two AdamW groups
(decay, then no-decay: transformers' get_decay_parameter_names), each group's exp_avg and exp_avg_sq made by
_init_group, then its foreach step's square root of every exp_avg_sq, freed last to first. With checkpointing
(non-reentrant) each layer's forward keeps nothing but its input and its cast weights (the forward's autocast
cache), and its recompute, under autocast with a cache of its own, precedes its backward.

A request of 1 MiB or less is the small pool's (``recorder.Requests`` leaves it out); the builders emit every
request with its size all the same, so a shape whose k and v (or rotary tables) pass 1 MiB follows.

``replayed`` says where it was checked request for request against the capture (tests/estimator/test_full.py):
the plain llama-type decoder without q/k norms (MASTER_SEQUENCE_TYPES), batch 1, SFT, transformers
sequence.SEQUENCE_TRANSFORMERS, the default allocator; elsewhere full.py keeps the bound.
"""

from __future__ import annotations

from ..constants import CUBLASLT_WORKSPACE
from .arch import Arch
from .recorder import BF16, FP32, Requests, entropy_chunks
from .decoder import module_order, parameter_bytes, rotary, tables
from .sequence import SEQUENCE_TRANSFORMERS, WORKSPACE_SIZES, default_allocator

#: The model types whose full fine-tuning step this sequence follows (llama's decoder; qwen2's q/k/v biases).
MASTER_SEQUENCE_TYPES = ("llama", "qwen2")
#: transformers 5.16.1 Trainer.get_decay_parameter_names: the no-decay group's names (biases and norms).
NO_DECAY_WORDS = ("bias", "layernorm", "rmsnorm", "norm.", "_norm")
#: flash's backward rounds the tokens to this (mha_bwd's seqlen_q_rounded) and the head size to 32 (64 past 128).
FLASH_ROWS = 128


def replayed(a: Arch, task: str, batch: int, *, transformers: str, environ=None) -> bool:
    """Whether this sequence is the run's: a plain llama-type decoder (MASTER_SEQUENCE_TYPES, one kind of layer,
    no q/k norms, no model dropout, a full rotary), SFT at batch 1 (TRL's shifted logits then need no copy),
    transformers sequence.SEQUENCE_TRANSFORMERS and the default allocator (sequence.default_allocator): every
    capture it was checked against."""
    return (a.model_type in MASTER_SEQUENCE_TYPES and a.layers is None and not a.qk_norm and not a.dropouts
            and a.rotary_dim == a.head_dim and a.norms == 2 and task == "sft" and batch == 1
            and transformers == SEQUENCE_TRANSFORMERS and default_allocator(environ))


def load_master(q: Requests, a: Arch, workspace: int) -> None:
    """The cuBLAS workspace the process made before the arm, the warmup block (every parameter at 4 B, freed at
    once), then each parameter fp32 in the checkpoint's sorted key order."""
    q.get(workspace)
    names = {n: 2 * b for n, b in parameter_bytes(a).items()}
    q.put(q.get(sum(names.values())))
    for n in sorted(names):
        q.get(names[n])


def norm_forward(q: Requests, T: int, h: int, keep: bool) -> tuple:
    """HF's RMSNorm on the fp32 residual (its .float() no copy): the square (freed), the variance, + eps and
    rsqrt, the normalised (kept for the trained weight's gradient), the weight's product (returned); the
    variance freed as the function returns. Returns (output, [normalised, rsqrt]) with ``keep``, else frees
    them as the last reference goes (checkpointing's forward keeps nothing)."""
    sq = q.get(FP32 * T * h)
    var = q.get(FP32 * T)
    q.put(sq)
    eps = q.get(FP32 * T)
    r = q.get(FP32 * T)
    q.put(eps)
    y = q.get(FP32 * T * h)
    if not keep:
        q.put(r)
    out = q.get(FP32 * T * h)
    if not keep:
        q.put(y)
    q.put(var)
    return out, ([y, r] if keep else [])


class Linear:
    """What one linear's forward leaves for its backward: its bf16 weight copy, its input's bf16 cast (None where
    the input is bf16 already), whether it has a bias (addmm: its backward makes the input's gradient first)."""

    def __init__(self, w, x, bias: bool, fi: int, fo: int):
        self.w, self.x, self.bias, self.fi, self.fo = w, x, bias, fi, fo


def linear_forward(q: Requests, T: int, fi: int, fo: int, bias: bool, fp32_input: bool, cache: dict, name: str,
                   keep: bool, lt: list) -> tuple:
    """F.linear under autocast: the bias's bf16 cast, the weight's (autocast's cache holds it through the
    forward region; ``cache`` maps a weight to its copy), the input's (fp32 only), the output; the bias's cast
    freed on return, the input's cast too where nothing saves it (``keep`` false). cuBLASLt's workspace after
    the first addmm (``lt``: whether made)."""
    b = q.get(BF16 * fo) if bias else None
    if name not in cache:
        cache[name] = q.get(BF16 * fi * fo)
    x = q.get(BF16 * T * fi) if fp32_input else None
    out = q.get(BF16 * T * fo)
    if bias and not lt:
        lt.append(q.get(CUBLASLT_WORKSPACE))
    q.put(b)
    if not keep:
        q.put(x)
        x = None
    return out, Linear(cache[name], x, bias, fi, fo)


def layer_forward(q: Requests, a: Arch, T: int, keep: bool, cache: dict, k: int, lt: list,
                  recompute: bool = False) -> tuple:
    """One decoder layer's forward on its fp32 input (held by the caller): returns its output and what it keeps
    for its backward (a dict; empty where ``keep`` is false, checkpointing's first forward). ``recompute``:
    checkpointing's recompute, which stops once the last tensor the layer saves is packed again (torch's
    non-reentrant early stop: down_proj's weight copy, before its matmul runs), the post-attention norm's output
    freed as its frame unwinds; no output then (None)."""
    qw, kw = a.heads * a.head_dim, a.kv * a.head_dim
    s: dict = {}
    normed, s["n1"] = norm_forward(q, T, a.h, keep)
    lin = {}
    outs = {}
    for m in ("q_proj", "k_proj", "v_proj"):
        fi, fo, bias = a.modules[m]
        outs[m], lin[m] = linear_forward(q, T, fi, fo, bias, True, cache, f"{k}.{m}", keep, lt)
    qr = rotary(q, T, qw, FP32, BF16)
    kr = rotary(q, T, kw, FP32, BF16)
    q.put(outs["q_proj"], outs["k_proj"])
    kc = q.get(BF16 * T * kw)  # autocast's bf16 k, then q (its argument pack cast right to left; v is bf16)
    qc = q.get(BF16 * T * qw)
    sdpa = q.get(BF16 * T * qw)
    small = [q.get(FP32 * a.heads * T), q.get(8), q.get(8)]  # logsumexp, philox seed and offset
    if not keep:
        q.put(*small, qc, kc)
    fi, fo, bias = a.modules["o_proj"]
    o, lin["o_proj"] = linear_forward(q, T, fi, fo, bias, False, cache, f"{k}.o_proj", keep, lt)
    q.put(*([qr, kr] if keep else [sdpa, qr, kr, outs["v_proj"]]), normed)  # the attention's frame, then its input
    mid = q.get(FP32 * T * a.h)
    q.put(o)
    normed2, s["n2"] = norm_forward(q, T, a.h, keep)
    fi, fo, bias = a.modules["gate_proj"]
    gate, lin["gate_proj"] = linear_forward(q, T, fi, fo, bias, True, cache, f"{k}.gate_proj", keep, lt)
    act = q.get(BF16 * T * a.i)
    if not keep:
        q.put(gate)
    fi, fo, bias = a.modules["up_proj"]
    up, lin["up_proj"] = linear_forward(q, T, fi, fo, bias, True, cache, f"{k}.up_proj", keep, lt)
    prod = q.get(BF16 * T * a.i)
    if not keep:
        q.put(act, up)
    fi, fo, bias = a.modules["down_proj"]
    if recompute:
        lin["down_proj"] = Linear(q.get(BF16 * fi * fo), None, bias, fi, fo)
        q.put(normed2)
        s.update(lin=lin, v=outs["v_proj"], kc=kc, qc=qc, sdpa=sdpa, small=small, mid=mid, gate=gate, act=act,
                 up=up, prod=prod)
        return None, s
    down, lin["down_proj"] = linear_forward(q, T, fi, fo, bias, False, cache, f"{k}.down_proj", keep, lt)
    if not keep:
        q.put(prod)
    q.put(normed2)
    out = q.get(FP32 * T * a.h)
    q.put(down)
    if not keep:
        q.put(mid)
    if keep:
        s.update(lin=lin, v=outs["v_proj"], kc=kc, qc=qc, sdpa=sdpa, small=small, mid=mid, gate=gate, act=act,
                 up=up, prod=prod)
    return out, s


def head_forward(q: Requests, a: Arch, T: int, x, cache: dict, checkpointing: bool) -> dict:
    """The final norm on the last layer's output ``x``, the head (its bf16 weight copy, its input's cast, the bf16
    logits), HF's loss (the logits' fp32 copy, log_softmax, freed with the final norm's output as the model
    returns), accelerate's fp32 logits copy in place of the bf16 ones, TRL's entropy over ENTROPY_CHUNK_ROWS-row chunks
    (no grad: each chunk's log_softmax freed as the next comes, the last as the function returns), and the fp32
    logits dropped: what the loss's backward reads. The forward's autocast region exits once accelerate's copy is
    made and its cache goes: with checkpointing the layers' weight copies with it (nothing saved them)."""
    out, nf = norm_forward(q, T, a.h, True)
    w = cache.setdefault("lm_head", q.get(BF16 * a.V * a.h))
    xc = q.get(BF16 * T * a.h)
    logits = q.get(BF16 * T * a.V)
    copy = q.get(FP32 * T * a.V)
    lsm = q.get(FP32 * T * a.V)
    q.put(copy, out)
    fp32 = q.get(FP32 * T * a.V)
    q.put(logits)
    if checkpointing:
        q.put(*[w for name, w in cache.items() if name != "lm_head"])
    entropy_chunks(q, T, a.V)
    q.put(fp32)
    return {"x": x, "nf": nf, "w": w, "xc": xc, "lsm": lsm}


def mm_backward(q: Requests, T: int, g, lin: Linear, fp32_input: bool, grads: list, into=None, ck: bool = False):
    """A linear's backward on its bf16 output gradient ``g``: mm's weight gradient then its input's (addmm: the
    input's, the weight's, the bias's), ``g`` and what it saved freed, then each ToCopyBackward to fp32 (the
    input's cast's first, added into ``into`` where its buffer holds a gradient already; the weight's, then the
    bias's, appended to ``grads``). Returns the input's gradient (fp32 where the input was cast, else bf16).
    ``ck``: what it saved was recomputed (checkpointing), each tensor held by the node's unpacked copy alone, so
    freed as the node returns, before ``g``."""
    fi, fo = lin.fi, lin.fo
    if lin.bias and ck:
        gx, gw = q.get(BF16 * T * fi), q.get(BF16 * fi * fo)
        q.put(lin.w, lin.x)
        gb = q.get(BF16 * fo)
        q.put(g)
    elif lin.bias:
        gx, gw, gb = q.get(BF16 * T * fi), q.get(BF16 * fi * fo), q.get(BF16 * fo)
        q.put(g, lin.x, lin.w)
    else:
        gw, gx, gb = q.get(BF16 * fi * fo), q.get(BF16 * T * fi), None
        q.put(*((lin.x, lin.w, g) if ck else (g, lin.w, lin.x)))
    if fp32_input:
        gx32 = q.get(FP32 * T * fi)
        q.put(gx)
        if into is not None:
            acc = q.get(FP32 * T * fi)
            q.put(into, gx32)
            gx32 = acc
        gx = gx32
    grads.append(q.get(FP32 * fi * fo))
    q.put(gw)
    if gb is not None:
        grads.append(q.get(FP32 * fo))
        q.put(gb)
    return gx


def norm_backward(q: Requests, T: int, h: int, g, saved: list, x, prior, grads: list, ck: bool = False,
                  x_recomputed: bool = False):
    """RMSNorm's backward on the fp32 gradient ``g``: the weight's product (its gradient summed), x * rsqrt's
    (the input's share added into ``prior``, the gradient its buffer holds already, where there is one), the
    rsqrt's and mean's, pow's; ``x``, the input, freed as its last saver goes. Returns the input's gradient.
    ``ck``: its saved tensors recomputed (mm_backward's), ``x_recomputed`` too where ``x`` is not the layer's
    input."""
    y, r = saved
    gy = q.get(FP32 * T * h)
    t = q.get(FP32 * T * h)
    if ck:
        q.put(y)
    grads.append(q.get(FP32 * h))
    q.put(t, g, *([] if ck else [y]))
    t = q.get(FP32 * T * h)
    gx = q.get(FP32 * T * h)
    s = q.get(FP32 * T)
    q.put(t, gy)
    if prior is not None:
        acc = q.get(FP32 * T * h)
        q.put(prior, gx)
        gx = acc
    c1, c2, c3 = q.get(FP32 * T), q.get(FP32 * T), q.get(FP32 * T)
    q.put(c2, c1, *((r, s) if ck else (s, r)))
    m = q.get(FP32 * T * h)
    q.put(c3)
    p = [q.get(FP32 * T * h) for _ in range(3)]
    q.put(p[1], p[0], *((x, m) if x_recomputed else (m, x)))
    acc = q.get(FP32 * T * h)
    q.put(gx, p[2])
    return acc


def rotary_backward(q: Requests, T: int, w: int, g, tables: list):
    """x * cos + rotate_half(x) * sin's backward on the fp32 gradient ``g``: the cat's share (fp32, then bf16),
    rotate_half's halves (the negation, each slice's zero-padded gradient, their sum), x's share (fp32, then
    bf16), the two added; the tables freed where this was their last saver (``tables``: [cos, sin] then)."""
    a = q.get(FP32 * T * w)
    c = q.get(BF16 * T * w)
    q.put(a)
    if tables:
        q.put(tables[1])
    n = q.get(BF16 * T * w // 2)
    s1 = q.get(BF16 * T * w)
    q.put(n)
    s2 = q.get(BF16 * T * w)
    q.put(c)
    acc = q.get(BF16 * T * w)
    q.put(s1, s2)
    a2 = q.get(FP32 * T * w)
    b2 = q.get(BF16 * T * w)
    q.put(a2, g)
    if tables:
        q.put(tables[0])
    out = q.get(BF16 * T * w)
    q.put(acc, b2)
    return out


def flash_grads(q: Requests, a: Arch, T: int) -> tuple:
    """Flash's backward's blocks (bench/allocator_replay.py's Flash, from torch's mha_bwd): dq, dk, dv, softmax_d
    and dq_accum (the tokens rounded to FLASH_ROWS, the head size to 32, 64 past 128), then a GQA's dk and dv
    expanded to q's heads, freed at once. Returns dq, dk, dv, softmax_d and dq_accum: the caller frees the last two
    with what its forward saved (every replay of flash's backward takes these: this one's and gc_layers')."""
    qw, kw = a.heads * a.head_dim, a.kv * a.head_dim
    rows = -(-T // FLASH_ROWS) * FLASH_ROWS
    step = 32 if a.head_dim <= 128 else 64
    dr = -(-a.head_dim // step) * step
    dq, dk, dv = q.get(BF16 * T * qw), q.get(BF16 * T * kw), q.get(BF16 * T * kw)
    sd = q.get(FP32 * a.heads * rows)
    acc = q.get(FP32 * rows * a.heads * dr)
    if a.kv != a.heads:
        e = [q.get(BF16 * T * qw), q.get(BF16 * T * qw)]
        q.put(e[1], e[0])
    return dq, dk, dv, sd, acc


def flash_backward(q: Requests, a: Arch, T: int, g, s: dict, ck: bool = False):
    """Flash's backward (flash_grads), the scratch freed, then ``g`` and what the forward saved (q, k, v, the
    output, logsumexp, seeds). Returns dq, dk, dv."""
    dq, dk, dv, sd, acc = flash_grads(q, a, T)
    if ck:  # recomputed: each unpacked copy goes as the node returns (q's last), then g
        q.put(sd, acc, s["kc"], s["v"], s["sdpa"], *s["small"], s["qc"], g)
    else:
        q.put(sd, acc, g, s["qc"], s["kc"], s["v"], s["sdpa"], *s["small"])
    return dq, dk, dv


def layer_backward(q: Requests, a: Arch, T: int, g, x, s, grads: list, tables: list, rerun=None):
    """One layer's backward on its output's fp32 gradient ``g`` (``x``: its input, ``s``: what it kept): the MLP,
    the post-attention norm, o_proj, flash, k's and q's rotary, v_proj, k_proj, q_proj, the input norm. Returns
    its input's gradient. ``rerun`` (checkpointing): the recompute, run when down_proj's backward first unpacks
    what the layer saved, which gives ``s``."""
    qw, kw = a.heads * a.head_dim, a.kv * a.head_dim
    gb = q.get(BF16 * T * a.h)  # the residual add's bf16 share for the MLP's output
    ck = rerun is not None
    if ck:
        s = rerun()
    lin = s["lin"]
    gprod = mm_backward(q, T, gb, _saving(lin["down_proj"], s["prod"]), False, grads, ck=ck)
    gup, gact = q.get(BF16 * T * a.i), q.get(BF16 * T * a.i)
    q.put(*((s["act"], s["up"], gprod) if ck else (gprod, s["up"], s["act"])))
    into = mm_backward(q, T, gup, lin["up_proj"], True, grads, ck=ck)
    gg = q.get(BF16 * T * a.i)
    q.put(*((s["gate"], gact) if ck else (gact, s["gate"])))
    into = mm_backward(q, T, gg, lin["gate_proj"], True, grads, into, ck=ck)
    gmid = norm_backward(q, T, a.h, into, s["n2"], s["mid"], g, grads, ck, ck)
    gb = q.get(BF16 * T * a.h)
    gattn = mm_backward(q, T, gb, _saving(lin["o_proj"], None), False, grads, ck=ck)
    dq, dk, dv = flash_backward(q, a, T, gattn, s, ck)
    gq = q.get(FP32 * T * qw)
    q.put(dq)
    gk = q.get(FP32 * T * kw)
    q.put(dk)
    rk = rotary_backward(q, T, kw, gk, [])
    rq = rotary_backward(q, T, qw, gq, tables)
    into = mm_backward(q, T, dv, lin["v_proj"], True, grads, ck=ck)
    copy = q.get(BF16 * T * kw)  # k's gradient laid out (B, T, H, D) for the projection's view
    q.put(rk)
    into = mm_backward(q, T, copy, lin["k_proj"], True, grads, into, ck=ck)
    copy = q.get(BF16 * T * qw)
    q.put(rq)
    into = mm_backward(q, T, copy, lin["q_proj"], True, grads, into, ck=ck)
    return norm_backward(q, T, a.h, into, s["n1"], x, gmid, grads, ck)


def _saving(lin: Linear, x) -> Linear:
    """``lin`` with the bf16 input its matmul saved (the MLP's product for down_proj; none of o_proj's: flash
    saved its output, and frees it)."""
    return Linear(lin.w, x, lin.bias, lin.fi, lin.fo)


def parameter_groups(a: Arch) -> tuple[list, list]:
    """Each parameter's fp32 bytes in model.parameters()' order (decoder.module_order), split as the Trainer
    builds its two AdamW groups: weight decay, then none (NO_DECAY_WORDS: biases and norms)."""
    sizes = module_order(a, sizes=True)
    plain = [2 * b for n, b in sizes if not any(w in n for w in NO_DECAY_WORDS)]
    return plain, [2 * b for n, b in sizes if any(w in n for w in NO_DECAY_WORDS)]


def optimizer_step(q: Requests, a: Arch) -> None:
    """torch's foreach AdamW over the Trainer's two groups: each group's exp_avg and exp_avg_sq per parameter
    (_init_group), then its step's square root of every exp_avg_sq, freed last to first; the states freed as
    the optimizer goes."""
    states = []
    for group in parameter_groups(a):
        for n in group:
            states += [q.get(n), q.get(n)]
        roots = [q.get(n) for n in group]
        q.put(*reversed(roots))
    q.put(*states)


def step(q: Requests, a: Arch, T: int, seq: int, workspace: int, checkpointing: bool = False) -> None:
    """The full fine-tuning step after the load: the forward, the loss, the backward, the optimizer's step."""
    cache: dict = {}
    lt: list = []
    emb = q.get(FP32 * T * a.h)
    cos, sin = tables(q, a, seq, True, 0)  # the workspace is the process's already (load_master)
    x, inputs, kept = emb, [], []
    for k in range(a.L):
        inputs.append(x)
        x, s = layer_forward(q, a, T, not checkpointing, cache, k, lt)
        kept.append(s)
    head = head_forward(q, a, T, x, cache, checkpointing)
    grads: list = []
    g = loss_backward(q, a, T, head, workspace, grads)
    for k in reversed(range(a.L)):
        rerun = (lambda k=k: layer_forward(q, a, T, True, {}, k, lt, recompute=True)[1]) if checkpointing else None
        g = layer_backward(q, a, T, g, inputs[k], kept[k], grads, [cos, sin] if k == 0 else [], rerun)
    ge = q.get(FP32 * a.V * a.h)
    q.put(g)
    if a.tied:  # added into the head's gradient, out of place
        acc = q.get(FP32 * a.V * a.h)
        q.put(head["grad"], ge)
    if isinstance(q, Watched):
        q.watch()
    optimizer_step(q, a)


def loss_backward(q: Requests, a: Arch, T: int, head: dict, workspace: int, grads: list):
    """The loss's backward (nll's and log_softmax's fp32 gradients, the bf16 logits' gradient), the head's matmul
    (its weight's gradient, the backward's cuBLAS workspace after that first matmul, its input's), the two
    ToCopyBackwards to fp32, the final norm's backward. Returns the last layer's output's gradient."""
    nll = q.get(FP32 * T * a.V)
    lsm = q.get(FP32 * T * a.V)
    q.put(nll, head["lsm"])
    gl = q.get(BF16 * T * a.V)
    q.put(lsm)
    gw = q.get(BF16 * a.V * a.h)
    q.get(workspace)
    gx = q.get(BF16 * T * a.h)
    q.put(gl, head["w"], head["xc"])
    gx32 = q.get(FP32 * T * a.h)
    q.put(gx)
    head["grad"] = q.get(FP32 * a.V * a.h)
    q.put(gw)
    return norm_backward(q, T, a.h, gx32, head["nf"], head["x"], None, grads)



class Watched(Requests):
    """recorder.Requests that also keeps, from ``watch()`` on, the rests the blocks made since ``mark()`` hold
    at the allocated-bytes peak (the optimizer's step's, where step() calls watch)."""

    def __init__(self, trace: bool = False):
        super().__init__(trace)
        self.first = None  # the first key made in the step: blocks before it are the load's
        self.watching = False
        self.top = (-1, 0)

    def mark(self) -> None:
        self.first = self.n + 1

    def watch(self) -> None:
        self.watching = True

    def get(self, nbytes: int):
        k = super().get(nbytes)
        if self.watching and self.alloc.allocated > self.top[0]:
            self.top = (self.alloc.allocated, sum(b.rest for j, b in self.held.items() if j >= self.first))
        return k


_RESTS: dict = {}


def master_rests(a: Arch, T: int, seq: int, checkpointing: bool, workspace: int | None = None) -> int:
    """What the blocks the full fine-tuning step made hold past their requests at its optimizer step's
    allocated-bytes peak (its gradients, states and square roots, the backward's workspace), replayed with a
    cuBLAS ``workspace`` of that many bytes, or (None) the larger of the replays under each default
    (sequence.WORKSPACE_SIZES); once a shape."""
    if workspace is None:
        return max(master_rests(a, T, seq, checkpointing, w) for w in WORKSPACE_SIZES)
    key = (repr(a), T, seq, checkpointing, workspace)
    if key not in _RESTS:
        q = Watched()
        load_master(q, a, workspace)
        q.mark()
        step(q, a, T, seq, workspace, checkpointing)
        _RESTS[key] = q.top[1]
    return _RESTS[key]
