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
add none of theirs to them (their own rests are the loss terms'). The final norm's fp32 input and bf16 output
are the forward's (in ``kept``) and also among the loss terms' hidden blocks (allocator_rounding's
loss_remainders): their rests are counted twice, at most about 1 MiB over, the safe side, left so.

Under NF4 (Soup's resident QLoRA) the load quantises each decoder linear as it lands, every other tensor is
recast to fp32 (so the residual stream is fp32) and peft's prepare_model_for_kbit_training empties the cache
(the warmup's segment, wholly free by then, goes back to the driver), each linear is bitsandbytes' Linear4bit (a
bf16 cast of its input, the dequantised weight and its absmax, a bf16 output cast back) and each target peft's bnb
LoRA layer:
``load_nf4``, ``forward_nf4``, the capture's request for request past 1,536 tokens. At 1,536 tokens or fewer
bitsandbytes' gemm_4bit chooses per card and per weight shape between its fused kernel (its output alone) and
that dequantising fallback (a weight of 4 Mi elements or more past 512 tokens the fallback on every card:
``gemm4bit.may_fuse``); the card unknown, every choice is replayed and the largest rests charged (``gemm_choices``; on a
known card its one answer, gemm4bit.fused_shapes): the
capture's request for request with the heuristic forced each way (Llama-3.2-1B and Phi-3-mini 512x1 and 1024x1,
Qwen3-0.6B's five shapes fused at 512x1), and with the H200's own mixed choice (SmolLM2 512x1: its gate and up
fused).

Phi-3 (``fused_attention``): one qkv block whose q, k, v are views (kept whole), each rotated q and k cat with its
pass-through part, one gate_up block whose halves the MLP's act and product save; the capture's request for
request at 512x1-1024x4 bf16 and 512x4-1024x4 NF4 (2048 tokens and up a sliding-window mask comes first, and the
real run's SDPA is then not flash: not built).

phi (``layer_phi_nf4``, NF4 only): one LayerNorm's fp32 output feeds the attention and the MLP (parallel), the
rotary part of q and k rotated in fp32 and cat with its pass-through part, dense, fc1's fp32 output and gelu_new's
fp32 blocks (0.5 x, tanh and 1 + tanh kept from layer 1 on, and in layer 0 under an fc1 target), fc2, attention +
MLP + residual, the final LayerNorm; every linear and the head with a bias: the capture's request for request at
phi-2 512x1 (the H200's choice, none fused, and every shape fused), 1024x1 and 2048x1 (tests/estimator/
test_sequence.py; 512x4-2048x4 not held there), and the H100 trace's forward request for request at 512x1: admitted
(NF4_SEQUENCE_TYPES).
Its bf16 step (``forward_phi``, ``layer_phi``): the LayerNorm's fp32 copy of its bf16 input (autocast's fp32
policy; what its backward keeps from layer 1 on) and fp32 output, each linear's own bf16 cast of it (peft's LoRA
casts nothing: its input is fp32 already), q and k rotated in bf16, gelu_new on fc1's bf16 output (0.5 x bf16, the
rest fp32 from pow's fp32 copy of its input), fc2 on the product's bf16 cast, the final LayerNorm's fp32 copy and
output, the head's bf16 cast of it: the capture's request for request at phi-2 512x1-2048x4, admitted
(BF16_SEQUENCE_TYPES).

Built only where it was checked against the capture (``replayed``: the plain llama-type decoder, bf16 or NF4, the
protocol's SFT with LoRA dropout (bf16 on the plain llama-type decoder, any targets with q_proj, k_proj or v_proj
among them: checked_targets), transformers 5.16.1, the default allocator; under either default cuBLAS
workspace, the larger charged; under NF4 at 1,536 tokens or fewer, the largest of every gemm_4bit choice; Phi-3
and phi bf16 and NF4: BF16_SEQUENCE_TYPES, NF4_SEQUENCE_TYPES); everywhere else resident.py keeps its bound.
Checked too against a real step's own history (tests/estimator/test_sequence.py): the NF4 forward is the H100
traces' request for request (SmolLM2 1024x4, phi-2 512x1, Qwen2.5-0.5B 1024x4; bench/task_peak_anatomy.py --trace).
ORPO, SimPO and DPO run this forward (or forward_nf4) once over their stacked rows, first (SEQUENCE_TASKS,
NF4_SEQUENCE_TASKS); KTO runs it after its KL batch's forward under no_grad (``kl_forward``: the same ops with nothing
saved, then its head and TRL's per-row logsumexp), whose freed blocks the policy's are cut from: the H100 KTO
histories' request for request. Transformers'
warmup block is short of the parameters by the bytes the process holds reserved and unallocated (``WARMUP_UNUSED``:
the H100 KTO histories' starts, where a small tensor came before the load); both warmups are replayed, the larger
rests charged.

Gemma-2 (``layer``'s Gemma-2 path, bf16): the embedding scaled into its own block, each layer's four Gemma RMSNorms
(``gemma_norm``: the fp32 copy, rstd, 1 + weight in fp32, the product's bf16 cast) around the attention and the
MLP: the capture's and the H100 trace's request for request, but not admitted: the driver's segment addresses break
best fit's ties otherwise there, and the real run's forward blocks keep 28.8 MB where either placement's replay keeps
26.2-27.3 MB (the bound stays).
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager

from ..constants import (ALLOC_CONF_VARS, CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_PRE_HOPPER, K_MIN_BLOCK_SIZE,
                         K_SMALL_SIZE, WORKSPACE_CONFIG_VAR, block_bytes)
from .allocator import K_SMALL_BUFFER, CachingAllocator
from .arch import NF4_BLOCK, Arch, protocol_targets
from .gemm4bit import GEMM_4BIT_FUSED_MAX_ROWS, Dispatch, gemm_choices

#: The model types whose resident step this sequence follows (their decoder is llama's: RMSNorm, rotary, SDPA,
#: a gated SiLU MLP; qwen2's q/k/v biases and qwen3's q/k norms included; phi's parallel LayerNorm layer, its own
#: functions).
SEQUENCE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "phi")
#: phi3's fused qkv_proj and gate_up_proj among them (its q, k, v and gate, up are views of one block); phi's
#: dense (its o_proj) and fc1, fc2
ATTN = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "dense")
MLP = ("gate_proj", "up_proj", "gate_up_proj", "down_proj", "fc1", "fc2")


class Requests:
    """The large pool's requests in order, replayed as they come; a small-pool request is no event."""

    def __init__(self, trace: bool = False, fused: frozenset = frozenset()):
        self.alloc = CachingAllocator()
        self.held: dict = {}
        self.n = 0
        self.trace = [] if trace else None  # ("alloc", bytes) and ("free", bytes), to set beside a capture
        self.fused = fused  # the (out, in) shapes whose NF4 gemm_4bit runs bitsandbytes' fused kernel (gemm_choices)
        # micro-batch 2 on under accumulation: AccumulateGrad adds each new gradient into .grad in place and frees it
        self.accumulating = False
        # autograd records (what an op saves is kept); off under torch.no_grad, where each block goes with its last
        # Python reference (KTO's KL forward: kl_forward)
        self.graph = True

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

    def unsaved(self, *keys) -> None:
        """Frees what autograd would have saved: only without a graph (``graph`` off), where a block goes with its
        last Python reference."""
        if not self.graph:
            self.put(*keys)

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache: every wholly free segment back to the driver."""
        self.alloc.empty_cache()
        if self.trace is not None:
            self.trace.append(("empty_cache",))

    def rests(self, keys) -> int:
        return sum(self.held[k].rest for k in keys if k is not None and k in self.held)

    @contextmanager
    def no_graph(self, off: bool = True):
        """Autograd records nothing inside (``off``): torch.no_grad's forward, or ops no input of which needs a
        gradient; ``graph`` as it was after."""
        graph, self.graph = self.graph, self.graph and not off
        try:
            yield
        finally:
            self.graph = graph

    def saves_input(self, name: str, lora: tuple) -> bool:
        """Whether the LoRA target ``name``'s lora_A saves the layer's input itself (``lora``: the targets, r,
        dropout): with no dropout and a graph, there is no new tensor between them."""
        return self.graph and name in lora[0] and not lora[2]


#: bytes an element of each dtype the request sequences name (every sequence module reads these)
FP32, BF16 = 4, 2

#: SDPA's backward workspace past its fp32 accumulators and row sums (sdpa_workspace), as every committed H100 history
#: requests it, streamed and checkpointed alike.
SDPA_WORKSPACE_PAD = 256


def sdpa_workspace(a: Arch, T: int) -> int:
    """SDPA's backward workspace on the H100 (one fp32 block: a gradient accumulator per head and token, a second
    where k and v have fewer heads, the softmax's row sums, and SDPA_WORKSPACE_PAD), as every committed H100 history
    requests it: the four streamed ones (GQA and not), Phi-3-mini checkpointed past its window (25,428,224 B at
    2,048), phi-2 at 1,088 and 1,216, Llama-3.2-1B at 2,048 and SmolLM2-135M at 4,096 (GQA: 9 heads, so the pad is
    not per head)."""
    return FP32 * T * a.heads * (a.head_dim * (2 if a.kv != a.heads else 1) + 1) + SDPA_WORKSPACE_PAD


#: TRL's SFTTrainer metric entropy_from_logits (trl/trainer/utils.py, chunk_size=128): rows of the flattened logits
#: a chunk takes, its log_softmax, exp and their product live at once (PEAK "Loss phase": the entropy moment)
ENTROPY_CHUNK_ROWS = 128


def entropy_chunks(q: Requests, rows: int, V: int) -> None:
    """TRL's entropy_from_logits under no grad, ENTROPY_CHUNK_ROWS rows at a time: each chunk's log-probabilities
    (the last chunk's freed as the next comes), its exp and their product (freed); the last freed at the end."""
    last = None
    for n in [min(ENTROPY_CHUNK_ROWS, rows - j) for j in range(0, rows, ENTROPY_CHUNK_ROWS)]:
        logps = q.get(FP32 * n * V)
        q.put(last)
        ex, prod = q.get(FP32 * n * V), q.get(FP32 * n * V)
        q.put(ex, prod)
        last = logps
    q.put(last)


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


#: Gemma-2's one buffer transformers' warmup counts (inv_freq it leaves out): its embedding's scale, a bf16 scalar
#: (Gemma2TextScaledWordEmbedding.embed_scale), made after the weights.
GEMMA_BUFFERS = (2,)


def load(q: Requests, a: Arch, targets: tuple, r: int, unused: int = 0) -> None:
    """The warmup block (every parameter's and counted buffer's bytes less the ``unused`` bytes the process had
    reserved beside its allocated ones: WARMUP_UNUSED; freed at once), then each tensor as the loader makes it."""
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


def rotary(q: Requests, T: int, width: int, b: int = 2):
    """x * cos + rotate_half(x) * sin, each step its own block of ``b`` B an element (bf16; fp32 under NF4);
    the sum returned."""
    xc = q.get(b * T * width)
    half = q.get(b * T * width // 2)
    cat = q.get(b * T * width)
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


def forward(q: Requests, a: Arch, T: int, seq: int, lora: tuple, workspace: int = CUBLAS_WORKSPACE) -> list:
    """The embedding, the rotary tables, every layer, the final norm: the blocks live at the forward's end that
    the layers made (phi's: forward_phi)."""
    if a.model_type == "phi":
        return forward_phi(q, a, T, seq, lora, workspace)
    gemma = a.model_type == "gemma2"
    emb = q.get(2 * T * a.h)
    if gemma:  # the lookup scaled by the hidden size's root: its own block, the lookup's freed
        scaled = q.get(2 * T * a.h)
        q.put(emb)
        emb = scaled
    cos, sin = tables(q, a, seq, False, workspace)
    kept, x = [], emb
    for k in range(a.L):
        out, held = layer(q, a, T, x, k == 0, lora)
        kept += held
        if k:
            q.put(x)
        x = out
    final, held = (gemma_norm if gemma else norm)(q, T, a.h, True)
    q.put(x, emb)  # the decoder's return drops the last layer's output and the embedding's
    return kept + held + [final, cos, sin]



def kl_forward(q: Requests, a: Arch, T: int, seq: int, lora: tuple, rows: int,
               workspace: int = CUBLAS_WORKSPACE, nf4: bool = False) -> None:
    """TRL 0.29's KTO KL batch, first in the step under torch.no_grad (the mismatched completions through the policy):
    ``forward``'s ops with nothing saved (``nf4``: forward_nf4's), each block gone with its last reference
    (``Requests.graph`` off); the head's bf16 logits (under NF4 after autocast's bf16 casts of its fp32 weight and
    input, freed with it; the final norm's output freed as the model returns), accelerate's fp32 copy (the bf16
    freed), TRL's selective_log_softmax over the shifted fp32 logits, one row's logsumexp ((seq - 1) x V fp32) at a
    time for each of the batch's ``rows``, then the fp32 logits freed. Every block it makes is freed by its end, the
    cuBLAS ``workspace`` (the process's, from its first matmul) and the free segments it leaves aside: the policy's
    forward is cut from them (phi's: layer_phi's, its final LayerNorm's unsaved fp32 copy, the head's bf16 cast of its
    fp32 output). Built for KL_FORWARD_TYPES (NF4: NF4_KL_FORWARD_TYPES) alone: Gemma-2's layer and phi's NF4 one
    have no no-grad path."""
    if a.model_type not in (NF4_KL_FORWARD_TYPES if nf4 else KL_FORWARD_TYPES) or a.layers is not None:
        raise ValueError(f"{a.model_type}: no KL forward is built for it{' under NF4' if nf4 else ''}")
    with q.no_graph():
        _kl_forward(q, a, T, seq, lora, rows, workspace, nf4)


def _kl_forward(q: Requests, a: Arch, T: int, seq: int, lora: tuple, rows: int, workspace: int, nf4: bool) -> None:
    phi = a.model_type == "phi"
    emb = q.get((4 if nf4 else 2) * T * a.h)
    cos, sin = tables(q, a, seq, nf4, workspace)
    x = emb
    for k in range(a.L):
        if phi:
            out = layer_phi(q, a, T, x, k == 0, lora)
        else:
            out = layer_nf4(q, a, T, x, k == 0, lora) if nf4 else layer(q, a, T, x, k == 0, lora)[0]
        if k:
            q.put(x)
        x = out
    if phi:  # the final LayerNorm's fp32 copy of its input, unsaved, and its fp32 output
        copy = q.get(4 * T * a.h)
        final = q.get(4 * T * a.h)
        q.put(copy)
    else:
        final = norm32(q, T, a.h, False) if nf4 else norm(q, T, a.h, False)[0]
    q.put(x, emb, cos, sin)
    if nf4:  # autocast's bf16 casts of the fp32 head's weight and input
        casts = [q.get(2 * a.V * a.h), q.get(2 * T * a.h)]
    else:  # phi's LayerNorm output is fp32: autocast's bf16 cast of it for the head
        casts = [q.get(2 * T * a.h)] if phi else []
    logits = q.get(2 * T * a.V)
    q.put(*casts)
    q.put(final)
    fp32 = q.get(FP32 * T * a.V)
    q.put(logits)
    for _ in range(rows):
        q.put(q.get(FP32 * (seq - 1) * a.V))
    q.put(fp32)

# -- NF4 (Soup's resident QLoRA: bitsandbytes' Linear4bit, NF4, double quantisation, bf16 compute) --

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
    process had reserved beside its allocated ones: WARMUP_UNUSED), each tensor in the
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


def load_rests(a: Arch) -> int:
    """What the quantised linears' blocks hold past their requests once a resident NF4 load is done: each is cut
    from the blocks the earlier linears' bf16 sources and fp32 absmax left free, and one served whole from a cached
    block up to 1 MiB larger keeps the rest (load_nf4; the LoRA matrices come after them, so no target moves them).
    Which blocks those are moves with the warmup's block, so both of WARMUP_UNUSED's are replayed and the larger
    charged. Every dense model (one kind of layer: the loader's order is the checkpoint's sorted keys whatever the
    type; checked on six types' H100 histories, tests/estimator/test_sequence.py), on any stack and allocator: no
    bound is narrower than the 1 MiB a packed block any other charge would be, and the replay's is the mechanism's
    own; expandable segments keep none (over). A model of several kinds of layer: 0 (not replayed).
    Evidence: docs/PEAK.md, "load_rests"."""
    if a.layers is not None:
        return 0
    key = ("load", repr(a))
    if key not in _RESTS:
        _RESTS[key] = max(replayed_load(a, unused) for unused in WARMUP_UNUSED)
    return _RESTS[key]


def replayed_load(a: Arch, unused: int) -> int:
    """What the quantised linears' blocks of a replayed NF4 load (load_nf4, its warmup ``unused`` bytes short) hold
    past their requests."""
    q = Requests()
    return q.rests(load_nf4(q, a, (), 0, unused))


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


def phi_attention(q: Requests, a: Arch, T: int, first: bool, lora: tuple):
    """phi's attention under bf16 autocast: q, k, v projected from the LayerNorm's fp32 output (each linear's own
    bf16 cast of it), the rotary part of q and k rotated and each cat with its pass-through part (the cats and v
    what flash saves), flash's output and logsumexp, dense (bf16 in, returned); q's and k's projections and
    rotated parts live until the attention returns (its locals), then freed. Without a graph (``Requests.graph``) the
    logsumexp goes as SDPA returns, its output as the transposed copy rebinds it, the cats and v with the locals."""
    outs = {m: projection(q, a, T, m, lora, not first, True)[0] for m in ("q_proj", "k_proj", "v_proj")}
    rotated = [rotary(q, T, a.heads * a.rotary_dim), rotary(q, T, a.kv * a.rotary_dim)]
    cats = [q.get(2 * T * a.heads * a.head_dim), q.get(2 * T * a.kv * a.head_dim)]
    sdpa = q.get(2 * T * a.heads * a.head_dim)
    lse = q.get(4 * T * a.heads)
    q.unsaved(lse)  # no backward reads the logsumexp
    copy = output_copy(q, a, T)
    q.unsaved(sdpa)  # the transposed copy rebinds SDPA's output, which nothing saved
    o = projection(q, a, T, "dense", lora, True)[0]
    q.put(copy)
    q.put(rotated[0], outs["q_proj"], rotated[1], outs["k_proj"], *([] if q.graph else [*cats, outs["v_proj"]]))
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
    o = phi_attention(q, a, T, first, lora)
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


def forward_phi(q: Requests, a: Arch, T: int, seq: int, lora: tuple, workspace: int = CUBLAS_WORKSPACE) -> list:
    """phi's bf16 forward: the embedding's output, the rotary tables, every layer (each input freed after the
    next layer: its LayerNorm keeps its own fp32 copy), the final LayerNorm's fp32 copy and output (the blocks
    live at its end that the forward made, returned), then autocast's bf16 cast of the head's input (the frozen
    head saves none; its bias's cast, first, is small)."""
    first = q.n + 1
    emb = q.get(2 * T * a.h)
    tables(q, a, seq, False, workspace)
    x = emb
    for k in range(a.L):
        out = layer_phi(q, a, T, x, k == 0, lora)
        if k:
            q.put(x)
        x = out
    q.get(4 * T * a.h), q.get(4 * T * a.h)
    q.put(x, emb)
    kept = [k for k in q.held if k >= first]
    q.get(2 * T * a.h)
    return kept


def forward_nf4(q: Requests, a: Arch, T: int, seq: int, lora: tuple, workspace: int = CUBLAS_WORKSPACE) -> list:
    """The NF4 forward: the fp32 embedding's output, the fp32 rotary tables, every layer (each output kept: the
    next norm saves it), the final norm (the blocks live at its end that it made, returned), then autocast's bf16
    casts of the head's fp32 weight and input."""
    first = q.n + 1
    emb = q.get(4 * T * a.h)
    tables(q, a, seq, True, workspace)
    x, phi = emb, a.model_type == "phi"
    for k in range(a.L):
        x = (layer_phi_nf4 if phi else layer_nf4)(q, a, T, x, k == 0, lora)
    if phi:
        q.get(4 * T * a.h)  # the final LayerNorm's fp32 output
    else:
        norm32(q, T, a.h)
    q.put(emb)
    kept = [k for k in q.held if k >= first]
    # autocast's bf16 casts for the head (its linear's weight, then its input: the wrapper's argument pack, right to
    # left), whose weight copy is HEAD_COPY's
    q.get(2 * a.V * a.h), q.get(2 * T * a.h)
    return kept


#: The model types whose NF4 step the sequence replays. qwen2 (its q/k/v biases) is: its NF4 forward is the H100
#: trace's request for request (Qwen2.5-0.5B 1024x4, 2,388 requests and frees from the embedding to the head's casts:
#: tests/estimator/test_sequence.py), its replay exact (real_peak 15,884,001,280 B, no departure). Its load leaves the
#: trace's start but for the warmup's 2 MiB (450,887,680 B there, 452,984,832 B here: transformers'
#: caching_allocator_warmup takes the process's reserved but unused bytes off its block, as on phi-2 below); with
#: that warmup the meta capture is within 1,536 B of four of the six committed NF4 rows (512x1, 1024x1, 1024x4,
#: 2048x4) and 2,360,832 B under the two at 2,048 tokens (512x4, 2048x1), unnamed (no trace there); without it
#: 162,304 B over at 1024x4 and up to 2,721,280 B under at 2048x4, the "2.72 MB under" that had kept the bound. The
#: trace's one departure from the capture before its backward is outside the forward: four (1023, 151936) fp32
#: blocks (621,722,112 B, one a batch row) made and freed right after the loss frees the shifted logits' fp32 copy,
#: inside that copy's freed block, before the peak (the logits gradient's). With the replayed rests every committed
#: qwen2 NF4 row is 1.00009x-1.00233x, 2.9-6.8 MB over (was 1.0041x-1.0110x on the bound).
#: phi is: its NF4 forward is the H100 trace's request for request (phi-2 512x1, tests/estimator/test_sequence.py),
#: and with peft's empty_cache after the load's fp32 casts (load_nf4; it released a wholly free 50 MiB segment the
#: capture had kept) the capture's peak is within 1,652,736 B of five of the six phi-2 NF4 rows (958,976 B,
#: 412,160 B, 956,416 B and 367,104 B over at 512x4, 1024x4, 2048x1, 2048x4; 1,652,736 B under at 1024x1) and
#: 7,741,440 B under the 512x1 row (10,362,880 B before). That one is the load's history, named from the trace: the
#: run's process held 2 MiB reserved but unused before its load, which transformers' caching_allocator_warmup takes
#: off its block (modeling_utils.py, ``byte_count - unused_memory``: 1,782,579,200 B, the capture's 1,784,676,352),
#: so the last packed weights overflow into other segments and the step starts among other free blocks; with that
#: warmup the capture's start is the trace's segment for segment, and it is 4,726,784 B under, from the first of
#: the step's large requests that picks among free blocks of one size by address (the 756th: cudaMalloc's
#: addresses, which allocator.py does not know). With the
#: replayed rests every phi-2 NF4 row is 1.00015x-1.00307x, 8.9-19.5 MB over (512x1 3.1 MB over under the H100's
#: own gemm_4bit choice, none fused; the largest of every choice is charged, the card not known).
NF4_SEQUENCE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "phi")
#: ...but not these at a batch over 1. None now: llama was, while SmolLM2 NF4 1024x4's capture was 24,425,984 B
#: under that row's max_memory_allocated (6,339,354,624 B against 6,363,780,608), unnamed. The H100 trace of that
#: row named it: autocast casts SDPA's fp32 q, k, v to bf16 right to left (its argument pack, as linear's: v's and
#: k's kv-wide blocks before q's), where the capture cast q first and so put every layer's 2.25 MiB dropout masks
#: in other free blocks (43 of them keep a rest at the real peak, 14 at the capture's); and peft's
#: prepare_model_for_kbit_training empties the cache after its fp32 casts (peft/utils/other.py, auto_clear_cache),
#: which released the warmup's 111 MB segment, wholly free, that the capture kept and cut the step's blocks from.
#: With both the capture is 1,264,128 B over that row, its forward the trace's request for request, and SmolLM2's
#: batched captures within 91,648 B of their rows (512x4 24,064 B under, 2048x4 91,648 B under: inside the
#: allowance, estimate.ALLOCATED_ALLOWANCE_BYTES); the batched SmolLM2 NF4 rows go 1.0190x-1.0240x (bounded) ->
#: 1.0004x-1.0016x.
NF4_BATCHED_HELD_BACK = ()


#: The model types whose bf16 step the sequence replays. phi3 is (its fused qkv and gate_up): its sequence is the
#: capture's request for request (Phi-3-mini 512x1-1024x4); before the capture laid flash's output out as q (its
#: cat-built q's output copied by transformers' transpose(1, 2).contiguous(): output_copy) its own peak at 512x1 was
#: 23,332,352 B under that row's max_memory_allocated and with the replayed rests the row would have been 16,953,152 B
#: under; now the capture is 263,680 B under at 512x1, 512x4 and 1024x4 (3,917,824 B over at 1024x1), and with the
#: replayed rests every committed Phi-3-mini bf16 row (512x1-1024x4, the 2048 ones past its window refused) is
#: 1.00012x-1.00068x, what the real exceeds the capture by inside the allowance (estimate.ALLOCATED_ALLOWANCE_BYTES),
#: as on the other replayed families.
#: phi is (forward_phi): with layer_norm and pow under autocast's fp32 policy in the capture (bench/
#: allocator_replay.py's FP32_POLICY) the capture's peak is within 778,240 B of every committed phi-2 bf16 row's
#: max_memory_allocated (the real 778,240 B under at 512x1, where it kept no rest of the capture's 786,432 B;
#: 24,064-538,624 B over at the other five, with CUDA's request order in the capture),
#: both holding 5,569,854,464 B before the step; with the replayed
#: rests and resident.norm_casts (the LayerNorms' fp32 weight copies, 655,360 B, seen in the capture) charged,
#: the estimate's physics is within 30,720 B of the capture's peak (under at 512x4, 1024x4, 2048x1, 2048x4), and
#: what the real exceeds the capture by is inside the allowance (estimate.ALLOCATED_ALLOWANCE_BYTES): every row
#: 1.0000x-1.0007x, 2.67-6.50 MB over.
BF16_SEQUENCE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi", "phi3")
#: The model types whose step the sequence replays on any LoRA targets among the layer's linears, not only the
#: protocol's, bf16 and NF4 (``layer``, ``layer_nf4`` and phi's build every target alike). Issue 51 item 3: on SmolLM2
#: bf16 777x1 with all seven linears the bound charged 23,003,136 B where the capture's blocks kept 56,182,784 B past
#: their requests (a request served whole from a cached block up to 1 MiB larger keeps its rest, one a block, which
#: the bound's "1 MiB a 20 MiB segment" for blocks under 10 MiB does not cover): 29,538,228 B under the capture's
#: peak. Issue 52: NF4, Phi-3 and phi too, once three things the protocol's targets never ran were built: under NF4
#: o_proj's (phi: dense's) LoRA layer takes SDPA's bf16 output, so its base output, peft's clone, dropout's output
#: (what lora_A saves) and the sum are bf16 (lora4bit's ``fp32``); without LoRA dropout lora_A saves its input
#: itself, the transposed copy Phi-3 and phi make of SDPA's output, which then lives to the backward; phi's MLP reads
#: the LayerNorm's output, not the attention's, so in layer 0 only an fc1 target gives it a graph. Checked against
#: the meta capture request for request (tests/estimator/test_sequence.py) and held out on the H100
#: (results/resident-anylora-traces-*: twelve arms, all seven linears, q/k/v/o, v/o, an MLP mix, 1.0002x-1.0053x
#: where these rests were what the bound had over, which was up to 1.0409x).
ANY_TARGET_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "phi")
#: ...where one of these is a target: layer 0's attention output then needs a gradient, so its SDPA saves its
#: inputs and output and its post-attention norm its fp32 input, as ``layer`` builds every layer. With none of them
#: (o_proj or the MLP's linears alone) layer 0's SDPA saves nothing and, without o_proj, neither does that norm
#: (Qwen2.5 o_proj,up_proj 1536x1; SmolLM2 gate_proj,down_proj 777x1): ``layer``'s and ``layer_nf4``'s quiet
#: attention, checked on the types below.
GRADIENT_ATTENTION = ("q_proj", "k_proj", "v_proj", "qkv_proj")
#: ...or, bf16 or NF4 on these, with none of them (o_proj and the MLP's linears alone): layer 0's q, k, v and SDPA
#: run as without a graph (``attention``'s and ``attention_nf4``'s ``quiet``), o_proj records only as a target (its
#: LoRA saves what it would elsewhere, with no mask: its input needs no gradient), and with no o_proj target the
#: post-attention norm saves nothing and the MLP only what its targets need (``mlp``'s ``grad``): the capture's request
#: for request on SmolLM2, Qwen2.5, Llama-3.2-1B and Mistral-7B, bf16 and NF4 (Llama-3.1-8B too), under
#: bitsandbytes' own gemm_4bit choice and its fallback (tests/estimator/test_sequence.py; on Qwen3 each run of frees
#: in another order, which leaves the allocator as it is), and the H100's histories request for request on nine arms
#: held out from it (results/resident-quiet-traces-*: SmolLM2, Qwen2.5, Qwen3, Llama-3.2-1B, Llama-3.1-8B, Mistral-7B;
#: SFT, ORPO, DPO). Not Phi-3, whose quiet attention (its output copy) and fused gate_up are not built.
QUIET_ATTENTION_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def checked_targets(a: Arch, quant: str, targets: tuple) -> bool:
    """Whether the sequence was checked on these LoRA targets (a set; each named once): the protocol's on every
    type it replays, or, bf16 or NF4 on ANY_TARGET_TYPES, any of the layer's linears with a GRADIENT_ATTENTION one
    among them, or, bf16 or NF4 on QUIET_ATTENTION_TYPES, o_proj and the MLP's linears alone (the capture's request
    for request: tests/estimator/test_sequence.py)."""
    if len(targets) != len(set(targets)):
        return False
    if set(targets) == set(protocol_targets(a)):
        return True
    if (quant in ("none", "nf4") and a.model_type in QUIET_ATTENTION_TYPES
            and set(targets) <= (set(MLP) | {"o_proj"}) & set(a.modules)):
        return True
    return (quant in ("none", "nf4") and a.model_type in ANY_TARGET_TYPES and set(targets) <= set(a.modules)
            and bool(set(targets) & set(GRADIENT_ATTENTION)))


#: The tasks whose resident forward is this sequence at its rows' tokens: SFT's (the captures), and the preference
#: tasks whose policy runs once over the chosen and rejected rows stacked (2 x batch rows) before anything else of
#: the step: ORPO's and SimPO's (no reference), and DPO's (TRL 0.29's _compute_loss runs the reference's no-grad
#: forward after the policy's, so the policy's blocks are placed as SFT's). Checked: at each H100 history's real
#: peak the forward's blocks keep the replay's rests (Qwen2.5-0.5B ORPO 1024x2 and DPO 1024x2 none, the replay
#: none, where the bound charged 162 MB; held out after them: Llama-3.2-1B ORPO, SmolLM2 SimPO and DPO,
#: Qwen3-0.6B SimPO and DPO; results/resident-gemma2-qwen-traces-*, heldout-orpo-simpo-setup-traces-*,
#: resident-dpo-traces-*). KTO's KL forward runs under no grad before its policy's and leaves its freed blocks in
#: the policy's way: replayed first (kl_forward, below). SmolLM2's two at 8,192 tokens keep 131,072 B in one layer-0
#: block that the fresh warmup's replay does not and WARMUP_UNUSED's short warmup does; the estimate is at or above
#: every one of the seven real peaks, 1.0003x-1.0013x.
#: Evidence: docs/PEAK.md, "SEQUENCE_TASKS".
SEQUENCE_TASKS = ("sft", "orpo", "simpo", "dpo", "kto")
#: ...KTO's on these model types alone: its KL batch's no-grad forward first (kl_forward), checked on their H100
#: histories (Qwen2.5-0.5B 1024x2 and 512x2, SmolLM2-135M 2048x2, Llama-3.2-1B 1024x2; then held out, SmolLM2
#: 1024x4, Qwen3-0.6B 1024x2, Phi-3-mini 1024x2 on qkv_proj, Mistral-7B 512x2), and phi's parallel layer (layer_phi's
#: no-grad path: phi-2 1024x2's history, results/resident-kto-nf4-phi2-traces-*).
KL_FORWARD_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "phi")
#: ...and on LoRA targets other than the protocol's, the llama-type decoder's alone: its NF4 KL forward on all seven
#: linears is Qwen3-0.6B's H100 history request for request (results/resident-anylora-traces-*); Phi-3's and phi's
#: no-grad layer on their other targets (o_proj's or dense's copy, fc1) never ran against a history.
KL_ANY_TARGET_TYPES = ("llama", "mistral", "qwen2", "qwen3")
#: ...and under NF4: SFT's forward, which ORPO, SimPO and DPO run at their stacked rows too (the H100 histories of
#: SmolLM2 DPO and ORPO 1024x2, Qwen2.5-0.5B DPO 1024x2 and SimPO 512x2 request for request: their adapter, bf16 or
#: fp32, is the small pool's), and KTO's after its KL forward (kl_forward's NF4 path, on NF4_KL_FORWARD_TYPES).
NF4_SEQUENCE_TASKS = ("sft", "orpo", "simpo", "dpo", "kto")
#: ...KTO's NF4 KL forward on these model types alone (its layer is layer_nf4, not layer): SmolLM2's history, then
#: held out, Qwen2.5-0.5B, Qwen3-0.6B and Phi-3-mini (qkv_proj) 1024x2 (results/resident-kto-nf4-phi2-traces-*), each
#: request for request.
NF4_KL_FORWARD_TYPES = ("llama", "qwen2", "qwen3", "phi3")
#: The transformers release whose modeling code every capture the sequence was checked against ran (the pinned
#: stack's): another one may order, fuse or keep the forward's tensors otherwise.
SEQUENCE_TRANSFORMERS = "5.16.1"
#: ...and the peft release they ran (its LoRA layers' casts and order): the tests that capture the real model hold
#: the sequence to it on this stack only (replayed() reads the transformers release alone).
SEQUENCE_PEFT = "0.20.0"
#: The PYTORCH_CUDA_ALLOC_CONF keys that change where a block is cut or how it is rounded (allocator.py models
#: neither): under either the replay's rests are not the run's. expandable_segments:True is not among them: it
#: splits every block at 512 B, so max_memory_allocated keeps no rest at all, and the replayed rests charged
#: there are over (the safe side; the resident-findmax probes ran so, tests/run/test_resident_estimate.py).
SPLIT_SETTINGS = ("max_split_size_mb", "roundup_power2_divisions")
#: The cuBLAS workspace a run's first matmul holds: 32 MiB from Hopper on, 8.125 MiB before it
#: (cards.cublas_workspace). The estimate does not know the card, so it replays both and charges the larger.
WORKSPACE_SIZES = (CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_PRE_HOPPER)


def default_allocator(environ=None) -> bool:
    """Whether ``environ`` (None: this process's) leaves the caching allocator's cutting and rounding as
    allocator.py replays them (no SPLIT_SETTINGS) and the cuBLAS workspace at its defaults (no
    CUBLAS_WORKSPACE_CONFIG: a size the replay does not take)."""
    environ = os.environ if environ is None else environ
    conf = ",".join(environ.get(v) or "" for v in ALLOC_CONF_VARS)
    keys = {k.strip() for k in re.findall(r"([^,:]+):", conf)}
    return not keys & set(SPLIT_SETTINGS) and not environ.get(WORKSPACE_CONFIG_VAR)


def replayed(a: Arch, quant: str, targets: tuple, task: str, *, transformers: str, environ=None,
             batch: int = 1) -> bool:
    """Whether this sequence is the run's: a plain llama-type decoder (SEQUENCE_TYPES, one kind of layer; Phi-3's fused
    qkv and gate_up at a full rotary; phi's parallel layer), bf16 (BF16_SEQUENCE_TYPES), or NF4 (NF4_SEQUENCE_TYPES)
    at any token count (at GEMM_4BIT_FUSED_MAX_ROWS or fewer layer_rests charges the largest replay of every
    gemm_4bit choice), the protocol's LoRA targets (protocol_targets: q_proj and v_proj, in any order; Phi-3's
    qkv_proj), any of the layer's linears with q_proj, k_proj, v_proj or qkv_proj among them, or on
    QUIET_ATTENTION_TYPES o_proj and the MLP's linears alone (checked_targets), and
    task (whose policy forward runs first, or after KTO's KL forward on the types it was checked on: SEQUENCE_TASKS,
    KL_FORWARD_TYPES; under NF4 NF4_SEQUENCE_TASKS, NF4_KL_FORWARD_TYPES; off the protocol's targets
    KL_ANY_TARGET_TYPES), LoRA dropout on or off, under transformers SEQUENCE_TRANSFORMERS (``transformers``: the
    release the run has, its local tag dropped) and the default allocator (``default_allocator`` of ``environ``):
    every capture it was checked against. Never phi's qk_layernorm, nor a model dropout the config turns on
    (arch.MODEL_DROPOUTS: resid_pdrop's masks, embd_pdrop's and SDPA's dropout): no capture ran them. Nor NF4 of a
    type NF4_BATCHED_HELD_BACK names at ``batch`` over 1 (none now)."""
    return (a.model_type in SEQUENCE_TYPES and a.layers is None and not a.qk_layernorm and not a.dropouts
            and (quant == "none" and a.model_type in BF16_SEQUENCE_TYPES
                 or quant == "nf4" and a.model_type in NF4_SEQUENCE_TYPES
                 and not (batch > 1 and a.model_type in NF4_BATCHED_HELD_BACK))
            # phi3's partial rotary (its pass-through part) was never captured; phi's was, at phi-2's 0.4
            and (a.rotary_dim == a.head_dim or a.model_type == "phi")
            and checked_targets(a, quant, targets)
            and task in (NF4_SEQUENCE_TASKS if quant == "nf4" else SEQUENCE_TASKS)
            and (task != "kto" or a.model_type in (NF4_KL_FORWARD_TYPES if quant == "nf4" else KL_FORWARD_TYPES)
                 and (a.model_type in KL_ANY_TARGET_TYPES or set(targets) == set(protocol_targets(a))))
            and transformers == SEQUENCE_TRANSFORMERS and default_allocator(environ))


#: What transformers' caching_allocator_warmup leaves out of its block: the bytes the process holds reserved and not
#: allocated (its ``byte_count - unused_memory``): none in a fresh process (the meta captures'), and where a small
#: tensor came before the load (the H100 KTO histories' starts are laid out so: a 2 MiB small-pool segment) all of
#: that segment but its block. The warmup's segment is then its parameters' 2 MiB granules or one fewer, and the
#: forward's first blocks are cut from what the weights leave of it; both are replayed and the larger rests charged.
#: Evidence: docs/PEAK.md, "WARMUP_UNUSED".
WARMUP_UNUSED = (0, K_SMALL_BUFFER - K_MIN_BLOCK_SIZE)

_RESTS: dict = {}


def layer_rests(a: Arch, targets: tuple, r: int, T: int, seq: int, dropout: bool = True, quant: str = "none",
                workspace: int | None = None, fused: frozenset | None = None, card: Dispatch | None = None,
                kl_rows: int = 0, unused: int | None = None) -> int:
    """What the blocks a resident forward keeps through the loss (its layers' and its final norm's, the rotary
    tables) hold past their requests, replayed (``dropout``: whether LoRA dropout writes a mask; ``quant`` none
    or nf4) with a cuBLAS ``workspace`` of that many bytes, or (None) the larger of the replays under each
    default (WORKSPACE_SIZES: the workspace moves every later block, and with it which blocks keep a rest:
    Mistral-7B 1000x4 keeps 86,114,304 B under the 32 MiB one, 128,581,632 B under the pre-Hopper one); under
    NF4 with the shapes ``fused`` whose gemm_4bit runs the fused kernel, or (None) the largest replay of every
    choice the card's heuristic could make (gemm_choices: on a known ``card`` its one answer); in bf16 with the
    warmup's block short of the parameters by ``unused`` bytes, or (None) the larger under each of WARMUP_UNUSED
    (not NF4's: peft's empty_cache releases the warmup's segment before the step, so its forward's blocks do not
    move with it; the load's own packed blocks do, load_rests);
    after KTO's KL batch of ``kl_rows`` rows (kl_forward; 0: none); once an arm (--find-max and the map ask many
    times)."""
    if workspace is None or quant == "nf4" and fused is None or unused is None and quant != "nf4":
        return max(layer_rests(a, targets, r, T, seq, dropout, quant, w, f, kl_rows=kl_rows, unused=u)
                   for w in ((workspace,) if workspace else WORKSPACE_SIZES)
                   for f in (gemm_choices(a, T, card) if quant == "nf4" and fused is None else (fused,))
                   for u in (WARMUP_UNUSED if unused is None and quant != "nf4" else (unused,)))
    targets = tuple(t for t in ATTN + MLP if t in targets)  # the layer's own order: a set, as replayed reads it
    key = (repr(a), targets, r, T, seq, dropout, quant, workspace, fused, kl_rows, unused)
    if key not in _RESTS:
        q = Requests(fused=fused or frozenset())
        if quant == "nf4":
            load_nf4(q, a, targets, r)
            if kl_rows:
                kl_forward(q, a, T, seq, (targets, r, dropout), kl_rows, workspace, nf4=True)
            kept = forward_nf4(q, a, T, seq, (targets, r, dropout), 0 if kl_rows else workspace)
        else:
            load(q, a, targets, r, unused)
            if kl_rows:  # the KL batch's forward made the process's workspace: the policy's makes none
                kl_forward(q, a, T, seq, (targets, r, dropout), kl_rows, workspace)
            kept = forward(q, a, T, seq, (targets, r, dropout), 0 if kl_rows else workspace)
        _RESTS[key] = q.rests(kept)
    return _RESTS[key]
