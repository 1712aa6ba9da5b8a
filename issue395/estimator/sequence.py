"""A resident LoRA step's large-pool requests built from the estimator's own shapes (``Arch``), op by op as Hugging
Face's plain decoder runs them on CUDA under bf16 autocast, and replayed through estimator/allocator.py: the rests
the blocks a layer keeps through the loss hold past their requests (issue 52 item 2: a term built from the
allocator's history, block by block, with its rounding). Stdlib only.

The sequence, as bench/allocator_replay.py captures it from the real model on the meta device (its oracle):
transformers' caching_allocator_warmup (one block of every parameter's bytes, freed at once), the checkpoint's
tensors in sorted key order, peft's LoRA tensors, then the forward: the embedding, the rotary tables and the cuBLAS
workspace their first matmul makes, each layer (the norm in fp32, each projection, each LoRA target's fp32 cast,
dropout and bf16 cast, the rotary embedding of q and k, flash SDPA, the residual adds, the gated MLP), the final
norm. A request of 1 MiB or less is the small pool's, cut at 512 B (its blocks keep no rest) and never shares a
segment with a large one: it is left out. What a block keeps past its request is fixed when it is cut, so the
layers' rests at the loss peak are those of the forward's blocks still live at its end: the loss and the backward
add none of theirs to them (their own rests are the loss terms').

Built only where it was checked against the capture (``SEQUENCE_TYPES``: the plain llama-type decoder, bf16, the
protocol's SFT with LoRA dropout); everywhere else resident.py keeps its bound.
"""

from __future__ import annotations

from ..constants import CUBLAS_WORKSPACE, K_SMALL_SIZE, block_bytes
from .allocator import CachingAllocator
from .arch import Arch

#: The model types whose resident step this sequence follows (their decoder is llama's: RMSNorm, rotary, SDPA,
#: a gated SiLU MLP; qwen2's q/k/v biases and qwen3's q/k norms included).
SEQUENCE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ATTN, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")


class Requests:
    """The large pool's requests in order, replayed as they come; a small-pool request is no event."""

    def __init__(self, trace: bool = False):
        self.alloc = CachingAllocator()
        self.held: dict = {}
        self.n = 0
        self.trace = [] if trace else None  # ("alloc", bytes) and ("free", bytes), to set beside a capture

    def get(self, nbytes: int):
        if block_bytes(nbytes) <= K_SMALL_SIZE:
            return None
        self.n += 1
        self.held[self.n] = self.alloc.malloc(nbytes)
        if self.trace is not None:
            self.trace.append(("alloc", nbytes))
        return self.n

    def put(self, *keys) -> None:
        for k in keys:
            if k is not None:
                b = self.held.pop(k)
                if self.trace is not None:
                    self.trace.append(("free", b.requested))
                self.alloc.free(b)

    def rests(self, keys) -> int:
        return sum(self.held[k].rest for k in keys if k is not None and k in self.held)


def parameters(a: Arch, targets: tuple, r: int) -> tuple[list, list]:
    """Each parameter's bytes in the checkpoint's sorted key order (a tied head once), then peft's fp32 LoRA
    matrices layer by layer."""
    names = {"model.embed_tokens.weight": 2 * a.V * a.h, "model.norm.weight": 2 * a.h}
    if not a.tied:
        names["lm_head.weight"] = 2 * a.V * a.h
    for k in range(a.L):
        p = f"model.layers.{k}."
        names[p + "input_layernorm.weight"] = names[p + "post_attention_layernorm.weight"] = 2 * a.h
        if a.qk_norm:
            names[p + "self_attn.q_norm.weight"] = names[p + "self_attn.k_norm.weight"] = 2 * a.head_dim
        for m, (fi, fo, bias) in a.modules.items():
            q = p + ("self_attn." if m in ATTN else "mlp.") + m
            names[q + ".weight"] = 2 * fi * fo
            if bias:
                names[q + ".bias"] = 2 * fo
    lora = [4 * r * w for _ in range(a.L) for t in targets for w in a.modules[t][:2]]
    return [names[n] for n in sorted(names)], lora


def load(q: Requests, a: Arch, targets: tuple, r: int) -> None:
    """The warmup block (every parameter's bytes, freed at once), then each tensor as the loader makes it."""
    weights, lora = parameters(a, targets, r)
    q.put(q.get(sum(weights)))
    for b in weights + lora:
        q.get(b)


def norm(q: Requests, T: int, width: int, saved: bool):
    """HF's RMSNorm on a bf16 input: its fp32 copy (kept where its input needs a gradient), the square, the
    normalised fp32, its bf16 cast, the weight's product (returned); the rest freed."""
    x32 = q.get(4 * T * width)
    sq = q.get(4 * T * width)
    q.put(sq)
    y32 = q.get(4 * T * width)
    if not saved:
        q.put(x32)
    cast = q.get(2 * T * width)
    out = q.get(2 * T * width)
    q.put(cast, y32)
    return out, [x32] if saved else []


def lora_linear(q: Requests, T: int, fi: int, fo: int, r: int, grad: bool, dropout: bool):
    """A LoRA target: the base output, the fp32 cast of its input, dropout's output and bool mask (kept where
    the input needs a gradient; neither at LoRA dropout 0, peft's nn.Identity), autocast's bf16 cast lora_A
    saves, lora_A's and lora_B's outputs, the scaling, the sum (returned)."""
    base = q.get(2 * T * fo)
    x32 = q.get(4 * T * fi)
    drop = q.get(4 * T * fi) if dropout else None
    mask = q.get(T * fi) if dropout else None
    if not grad:
        q.put(mask)
    cast = q.get(2 * T * fi)
    a_out = q.get(2 * T * r)
    q.put(drop)
    b_out = q.get(2 * T * fo)
    scaled = q.get(2 * T * fo)
    q.put(b_out)
    out = q.get(2 * T * fo)
    q.put(scaled, base, x32)
    return out, [cast, a_out] + ([mask] if grad else [])


def projection(q: Requests, a: Arch, T: int, name: str, lora: tuple, grad: bool):
    """A linear's output: a LoRA target's (``lora``: the targets, r, whether dropout writes a mask) or a frozen
    one's (its matmul saves nothing: its weight needs no gradient)."""
    fi, fo, _ = a.modules[name]
    targets, r, dropout = lora
    if name in targets:
        return lora_linear(q, T, fi, fo, r, grad, dropout)
    return q.get(2 * T * fo), []


def rotary(q: Requests, T: int, width: int):
    """x * cos + rotate_half(x) * sin, each step its own bf16 block; the sum returned."""
    xc = q.get(2 * T * width)
    half = q.get(T * width)
    cat = q.get(2 * T * width)
    q.put(half)
    xs = q.get(2 * T * width)
    q.put(cat)
    out = q.get(2 * T * width)
    q.put(xc, xs)
    return out


def attention(q: Requests, a: Arch, T: int, x, lora: tuple, grad: bool):
    """q, k, v projected (LoRA on the targets; qwen3's q and k normed), q and k rotated, flash SDPA's output and logsumexp, o_proj;
    returns o_proj's output and what the layer keeps."""
    kept = []
    outs = {}
    for m in ("q_proj", "k_proj", "v_proj"):
        outs[m], k = projection(q, a, T, m, lora, grad)
        kept += k
        if a.qk_norm and m != "v_proj":  # qwen3's per-head RMSNorm; it saves its input where that needs a gradient
            normed, k = norm(q, T, a.modules[m][1], grad or m in lora[0])
            kept += k
            q.put(outs[m])
            outs[m] = normed
    qr = rotary(q, T, a.heads * a.head_dim)
    kr = rotary(q, T, a.kv * a.head_dim)
    q.put(outs["q_proj"], outs["k_proj"])
    sdpa = q.get(2 * T * a.heads * a.head_dim)
    lse = q.get(4 * T * a.heads)
    o, k = projection(q, a, T, "o_proj", lora, True)
    kept += k + [qr, kr, outs["v_proj"], sdpa, lse]
    return o, kept


def mlp(q: Requests, a: Arch, T: int, x, lora: tuple):
    """gate, act(gate), up, their product (freed after down), down (returned)."""
    kept = []
    gate, k = projection(q, a, T, "gate_proj", lora, True)
    kept += k
    act = q.get(2 * T * a.i)
    up, k = projection(q, a, T, "up_proj", lora, True)
    kept += k
    prod = q.get(2 * T * a.i)
    down, k = projection(q, a, T, "down_proj", lora, True)
    kept += k
    q.put(prod)
    return down, kept + [gate, act, up]


def layer(q: Requests, a: Arch, T: int, x, first: bool, lora: tuple):
    """One decoder layer's forward: returns its output and the blocks it keeps for its backward."""
    normed, kept = norm(q, T, a.h, not first)
    o, k = attention(q, a, T, normed, lora, not first)
    kept += k
    q.put(normed)
    mid = q.get(2 * T * a.h)
    q.put(o)
    normed2, k = norm(q, T, a.h, True)
    kept += k
    down, k = mlp(q, a, T, normed2, lora)
    kept += k
    q.put(normed2)
    out = q.get(2 * T * a.h)
    q.put(down, mid)
    return out, kept


def forward(q: Requests, a: Arch, T: int, seq: int, lora: tuple) -> list:
    """The embedding, the rotary tables (the cuBLAS workspace after their first matmul), every layer, the final
    norm: the blocks live at the forward's end that the layers made."""
    emb = q.get(2 * T * a.h)
    freqs = q.get(4 * seq * a.rotary_dim // 2)
    q.get(CUBLAS_WORKSPACE)  # held for the process
    tables = [q.get(4 * seq * a.rotary_dim) for _ in range(3)]
    q.put(tables[1])
    tables += [q.get(4 * seq * a.rotary_dim) for _ in range(2)]
    q.put(tables[3])
    cos, sin = q.get(2 * seq * a.rotary_dim), q.get(2 * seq * a.rotary_dim)
    q.put(freqs, tables[0], tables[2], tables[4])
    kept, x = [], emb
    for k in range(a.L):
        out, held = layer(q, a, T, x, k == 0, lora)
        kept += held
        if k:
            q.put(x)
        x = out
    final, held = norm(q, T, a.h, True)
    q.put(x, emb)  # the decoder's return drops the last layer's output and the embedding's
    return kept + held + [final, cos, sin]


def replayed(a: Arch, quant: str, targets: tuple, task: str) -> bool:
    """Whether this sequence is the run's: a plain llama-type decoder (SEQUENCE_TYPES, one kind of layer), bf16,
    the protocol's LoRA targets (q_proj and v_proj) and task (SFT: one forward, no reference), LoRA dropout on or
    off: every capture it was checked against."""
    return (a.model_type in SEQUENCE_TYPES and a.layers is None and quant == "none"
            and targets == ("q_proj", "v_proj") and task == "sft")


_RESTS: dict = {}


def layer_rests(a: Arch, targets: tuple, r: int, T: int, seq: int, dropout: bool = True) -> int:
    """What the blocks a resident forward keeps through the loss (its layers' and its final norm's, the rotary
    tables) hold past their requests, replayed (``dropout``: whether LoRA dropout writes a mask); once an arm
    (--find-max and the map ask many times)."""
    key = (repr(a), targets, r, T, seq, dropout)
    if key not in _RESTS:
        q = Requests()
        load(q, a, targets, r)
        _RESTS[key] = q.rests(forward(q, a, T, seq, (targets, r, dropout)))
    return _RESTS[key]
