"""A resident LoRA step with gradient checkpointing (transformers' non-reentrant checkpoint, Soup's
``gradient_checkpointing: true``) built from the estimator's own shapes (``Arch``), op by op, in
estimator/recorder.py's ``Requests``, to the next step's loss-backward peak, and replayed through
estimator/allocator.py under expandable segments (issue 51 item 4): the pages its live blocks touch there
(``touched_pages``) less its allocated peak is the run's own allocator reserve, in place of the
EXPANDABLE_RESERVE_PAGES envelope where it was checked. Stdlib only.

The step, as the committed H100 history of Phi-3-mini bf16 SFT 2048x1, r16 on qkv_proj,o_proj, checkpointed, 2 steps
on expandable segments runs it (results/resident-traces-qwen-nf4-phi3-gc-h100-soup0.77.0-1a0b582/
res-sft-phi3-bf16-gc-2048x1-exp: its every large-pool request and free, its oracle,
tests/estimator/test_gc_sequence.py):

- the load (``load``: the warmup block, the checkpoint's tensors in sorted key order; peft's adapter is the
  small pool's at r16);
- each step's forward: the embedding's output, the sliding-window causal mask (Phi-3 at its window and past it:
  masking_utils' and of the causal and the window predicates, bool (T, T) blocks, the last kept), the rotary tables
  (the cuBLAS workspace after their first matmul, step 1 only), each layer under checkpointing: the same ops as
  decoder.layer, but nothing saved (the checkpoint keeps the layer's input and the mask alone), so every block goes
  as its last Python reference does (the LoRA's bf16 cast after lora_A, the dropout mask at once; SDPA's bf16
  additive mask after it: with a mask torch runs the memory-efficient kernel, not flash); the final norm (saved:
  outside the checkpoints), the head's bf16 logits, HF's loss (the logits' fp32 copy and log_softmax), accelerate's
  fp32 logits copy, TRL's entropy over 128-row chunks, TRL's token accuracy's (T-1, V) fp32 copy, the fp32 logits
  dropped;
- the loss's backward (nll's and log_softmax's fp32 gradients: the peak of step 2, the bf16 logits' gradient, the
  head's input gradient, the backward's cuBLAS workspace after that first matmul, step 1 only), the final norm's;
  each layer in reverse: its recompute (decoder.layer's ops with what they save kept, stopped by torch's
  non-reentrant early stop as down_proj packs its weight: the product, the post-attention norm's output and the
  residual then freed), the MLP's backward (down's input gradient, the product's two, silu's, the gate_up
  gradient's cat, its input gradient), the norm's, o_proj's LoRA and frozen base, the memory-efficient attention's
  backward (dq, dk, dv, its fp32 workspace: a grad-q accumulator and delta), k's then q's rotary, their slice and
  reshape copies, the qkv gradient built from v's, k's and q's slices, qkv's LoRA and base, the input norm; every
  gradient of the residual stream accumulated in place into one buffer (autograd's InputBuffer steals it);
- the optimizer's step and zero_grad (r16: all the small pool's: no large-pool request).

At or under the window (``masked`` false: masking_utils gives SDPA no mask) SDPA runs flash: no mask nor bias, the
same output block, and flash's backward (flash_backward: the output's contiguous copy, dq, dk, dv, softmax_d,
dq_accum) in place of the memory-efficient one's: step 1 as bench/allocator_replay.py capture --checkpointing
captures it on the meta device, request for request, its oracle there (tests/estimator/test_gc_sequence.py), less
one (T-1) x V fp32 block the H100 trace holds at TRL's token accuracy and the meta capture does not make.

phi's (phi-2's) parallel layer (phi_layer_forward, phi_layer_backward) and llama's GQA layer (llama_layer_forward,
llama_layer_backward) follow their H100 histories (results/resident-gc-traces-phi2-llama-smol-phi3nf4-h100-
soup0.77.0-07712a8: phi-2 1,088 and 1,216, Llama-3.2-1B 2,048, SmolLM2-135M 4,096), request for request in the large
pool to step 2's peak: SDPA's backward there is sdpa_backward (dq, dk, dv in k's and v's heads, one fp32 workspace:
sdpa_workspace), not the capture's flash; llama's gate and up input gradients are summed out of place (added).
phi's small pool as its histories make it: the rotary tables at rotary_dim, the LayerNorm's autocast fp32 weight
and bias casts and its mean and rstd (layernorm), cuBLASLt's workspace at each autograd thread's first biased
matmul (base_output), SDPA's philox seed and offset.

The pages a card cannot do without are the most its live blocks touch at any moment, not at the allocated peak
alone (an OOM unmaps every wholly free page, then fails where they and the request outgrow the card):
``page_need`` counts them as blocks come and go, request by request, over the replay (to step 2's peak, or through
step 2 whole), and says where the most is; on the H100 history above it is the history's own most to the byte, at
its request (step 2's token-accuracy copy, two requests before the allocated peak).

The charge (``charge``, where ``charged``: the replay is the run's, its model type has a MEASURED_RESERVE, the run
is on expandable segments): both pools' most pages over the load and two steps whole, less their allocated peak,
never under the reserve measured on that arm; estimator/resident.py's needs_free takes it in place of
EXPANDABLE_RESERVE_BYTES. Phi-3, llama and phi-2 are charged (both pools' most pages their histories' to the byte;
phi-2's with its small pool's blocks past the layers built: phi_collate, phi_positions, phi_loss, phi_metrics,
loss_seeds, clip_grad_norm, and layer 0's backward freeing the position ids and rotary tables).

A request of 1 MiB or less is the small pool's (2 MiB pages; ``recorder.Requests`` leaves it out): ``Paged`` keeps
it on an allocator of its own (``both``: the most pages of the two pools together), with the step's small requests in
the H100 history's order: the collator's int64 rows (the last step's freed once the next are made), the position
ids, the rotary tables and their fp32 makers (rotary_tables), the norms' rstd, autocast's bf16 casts of the adapter
(cached to the model forward's end; saved by each recompute's matmuls), lora_A's outputs, the attention's
logsumexp, each target's bf16 weight gradients and fp32 .grad (adapter_grads), AdamW's two states (made at step 1's
end, in model.parameters()' order: PARAM_ORDER) and square roots, zero_grad. From the history's start (its small
segment, measure.trace.seeded: ``seat_small``) the small pool touches the history's pages after every large
request to step 2's peak or one page more; and from the load built here (``load``: peft's adapter made in bf16,
then cast to fp32, which leaves the history's 393,216 B hole among the adapter's blocks) both pools' most pages
are the history's to the byte, at its request (tests/estimator/test_gc_sequence.py).
"""

from __future__ import annotations

import os
from collections import Counter
from typing import NamedTuple

from ..constants import (CUBLAS_WORKSPACE, EXPANDABLE_PAGE_BYTES, EXPANDABLE_SEGMENTS, K_SMALL_SIZE, allocator_setting,
                         block_bytes)
from .allocator import CachingAllocator
from .arch import Arch
from .recorder import BF16, ENTROPY_CHUNK_ROWS, FP32, Requests, entropy_chunks
from .decoder import cast_linear, norm, parameters
from .sequence import SEQUENCE_TRANSFORMERS, default_allocator
from .gc_layers import LAYERS, layernorm, layernorm_backward, masked, norm_backward

LARGE_PAGE, SMALL_PAGE = EXPANDABLE_PAGE_BYTES["large"], EXPANDABLE_PAGE_BYTES["small"]


#: The model types and their targets whose checkpointed step (SFT at batch 1) was checked request for request:
#: Phi-3's fused layer on its protocol-and-o_proj targets (past its sliding window the H100 trace, the
#: memory-efficient SDPA; at and under it the checkpointed capture, flash), phi's parallel layer on q, k, v and
#: dense and llama's on q and v (their H100 histories; no window).
GC_TARGETS = {"phi3": frozenset({"qkv_proj", "o_proj"}), "phi": frozenset({"q_proj", "k_proj", "v_proj", "dense"}),
              "llama": frozenset({"q_proj", "v_proj"})}


GC_SEQUENCE_TYPES = tuple(GC_TARGETS)


#: The model's module registration order where it is not the Arch's (model.parameters(), so AdamW's): Phi3Attention
#: makes o_proj before qkv_proj.
PARAM_ORDER = {"phi3": ("o_proj", "qkv_proj", "gate_up_proj", "down_proj")}


class Paged(Requests):
    """recorder.Requests on torch's expandable segments (what `soup train` sets), for LoRA ``targets`` at ``r``,
    keeping the large pool's allocated bytes and the pages its live blocks touch at its allocated peak (``top``)
    and the most pages they touch after any request (``most``: a Need; ``phase`` names where the step is)."""

    def __init__(self, targets: tuple, r: int, trace: bool = False):
        super().__init__(trace)
        self.alloc = CachingAllocator(expandable=True)
        self.targets, self.r = tuple(targets), r
        self.top = (-1, 0)  # (allocated, touched pages) at the allocated peak

        # the live blocks on each (segment, large page), kept as they come and go: the touched pages at every
        # request, not only at the allocated peak (an OOM can come wherever they outgrow the card)
        self.on_page: Counter = Counter()
        self.most = Need(-1, 0, 0, 0, 0, "", 0)
        self.phase = "load"
        self.lt = set()  # the threads (forward, backward) whose cuBLASLt workspace is made
        # the small pool (2 MiB pages) on an allocator of its own, so the large pool's figures stay its own
        self.small = CachingAllocator(expandable=True)
        self.small_held: dict = {}
        self.small_n = 0
        self.grads, self.states = [], []  # the adapter's .grad blocks, AdamW's states
        self.cache, self.batch = [], []  # autocast's bf16 casts of the adapter (its weight-cast cache), the batch
        self.on_small: Counter = Counter()
        self.both = Both(-1, 0, 0, 0, "")
        self.peak = 0  # both pools' allocated peak

    def get(self, nbytes: int):
        if block_bytes(nbytes) <= K_SMALL_SIZE:
            return self._get_small(nbytes)
        before = (self.alloc.allocated, len(self.on_page) * LARGE_PAGE)
        k = super().get(nbytes)
        self.on_page.update(self._pages(self.held[k]))
        touched = len(self.on_page) * LARGE_PAGE
        if touched > self.most.touched:
            self.most = Need(touched, self.alloc.allocated, self.n, nbytes, before[1] - before[0], self.phase,
                             len(self.on_small) * SMALL_PAGE - self.small.allocated)
        if self.alloc.allocated > self.top[0]:
            self.top = (self.alloc.allocated, touched)
        self._both(nbytes)
        return k

    def _get_small(self, nbytes: int):
        """A small-pool request: its own key (negative: no large-pool event, not in the large pool's trace)."""
        self.small_n += 1
        k = -self.small_n
        self.small_held[k] = self.small.malloc(nbytes)
        self.on_small.update(self._pages(self.small_held[k], self.small, SMALL_PAGE))
        self._both(nbytes)
        return k

    def seat_small(self, alloc: CachingAllocator) -> None:
        """The small pool as ``alloc`` holds it (a history's start: measure.trace.seeded), in place of the one the
        load built; the load's small blocks are never freed by the step, so their keys go."""
        self.small, self.small_held = alloc, {}
        self.on_small = Counter(p for h in alloc.segments if h.small for b in _blocks(h) if b.allocated
                                for p in self._pages(b, alloc, SMALL_PAGE))

    def _both(self, nbytes: int) -> None:
        self.peak = max(self.peak, self.alloc.allocated + self.small.allocated)
        touched = len(self.on_page) * LARGE_PAGE + len(self.on_small) * SMALL_PAGE
        if touched > self.both.touched:
            self.both = Both(touched, self.alloc.allocated + self.small.allocated, len(self.on_small) * SMALL_PAGE,
                             nbytes, self.phase)

    def put(self, *keys) -> None:
        for k in keys:
            if k is None:
                continue
            small = k < 0
            held, pages, alloc = ((self.small_held, self.on_small, self.small) if small
                                  else (self.held, self.on_page, self.alloc))
            for page in self._pages(held[k], alloc, SMALL_PAGE if small else LARGE_PAGE):
                pages[page] -= 1
                if not pages[page]:  # no live block touches it: a page the allocator can unmap
                    del pages[page]
            if small:
                self.small.free(self.small_held.pop(k))
            else:
                super().put(k)

    def _pages(self, b, alloc=None, page: int = LARGE_PAGE) -> list:
        """The (segment, page) pairs block ``b`` touches, its segment the address space it lies in."""
        base = max(h.addr for h in (alloc or self.alloc).segments if h.addr <= b.addr)
        return [(base, i) for i in range((b.addr - base) // page, (b.addr - base + b.size - 1) // page + 1)]


def _blocks(head):
    while head is not None:
        yield head
        head = head.next


class Need(NamedTuple):
    """The most large pages the live blocks touch at any moment of a replay (``touched``), just after request
    number ``index`` (``nbytes``, in ``phase``) with ``allocated`` bytes live; ``unallocated_before``: the touched
    pages less the allocated bytes just before it (what torch's OOM message reads as reserved-unallocated, after
    unmapping every wholly free page, where that request is the one that fails); ``small_unallocated``: the small
    pool's touched pages less its allocated bytes there (the rest of that reading)."""

    touched: int
    allocated: int
    index: int
    nbytes: int
    unallocated_before: int
    phase: str
    small_unallocated: int


class Both(NamedTuple):
    """The most pages the live blocks of both pools touch at any moment of a replay (``touched``), with
    ``allocated`` bytes live in both and ``small`` of it the small pool's pages, just after a request of
    ``nbytes`` in ``phase``."""

    touched: int
    allocated: int
    small: int
    nbytes: int
    phase: str


_PAGES: dict = {}


def reserve(a: Arch, targets: tuple, r: int, T: int) -> tuple[int, int]:
    """The large pool's allocated peak and the whole pages its live blocks touch there, the load and step 1 whole
    and step 2 to its loss's backward replayed under expandable segments (Paged); once a shape."""
    key = (repr(a), frozenset(targets), r, T)
    if key not in _PAGES:
        q = Paged(targets, r)
        load(q, a, q.targets, r)
        step_to_peak(q, a, T)
        _PAGES[key] = q.top
    return _PAGES[key]


def load(q: Requests, a: Arch, targets: tuple, r: int) -> None:
    """decoder.load's warmup block and checkpoint tensors, the rotary embedding's two fp32 buffers (inv_freq and
    original_inv_freq), then peft's adapter: each LoRA matrix put on the device in its base layer's dtype (bf16),
    in model.named_modules()' order (PARAM_ORDER), then cast to fp32 in that order (peft's autocast_adapter_dtype:
    the fp32 block made, the bf16 one freed): the H100 history's small segment at its start, block for block."""
    weights, _ = parameters(a, targets, r)
    q.put(q.get(sum(weights)))
    for b in weights:
        q.get(b)
    for _ in range(2):
        q.get(FP32 * (a.rotary_dim // 2))
    order = PARAM_ORDER.get(a.model_type, tuple(a.modules))
    widths = [w for _ in range(a.L) for t in sorted(targets, key=order.index) for w in a.modules[t][:2]]
    for k, w in zip([q.get(BF16 * r * w) for w in widths], widths):
        q.get(FP32 * r * w)
        q.put(k)


def rotary_tables(q: Requests, a: Arch, T: int, first: bool) -> list:
    """The rotary embedding's cos and sin (bf16, T x rotary_dim: phi's partial rotary is narrower than a head;
    returned, kept to the backward's end) from inv_freq's fp32 product with the positions, its cat, its cos and sin in fp32 (the small pool's at these
    shapes), in the H100 history's order; step 1's first matmul makes the cuBLAS workspace."""
    pos32 = q.get(FP32 * T)
    freqs = q.get(FP32 * T * a.rotary_dim // 2)
    if first:
        q.get(CUBLAS_WORKSPACE)
    emb, cat = q.get(FP32 * T * a.rotary_dim), q.get(FP32 * T * a.rotary_dim)
    cos32 = q.get(FP32 * T * a.rotary_dim)
    q.put(cat)
    cat = q.get(FP32 * T * a.rotary_dim)
    sin32 = q.get(FP32 * T * a.rotary_dim)
    q.put(cat)
    tables = [q.get(BF16 * T * a.rotary_dim) for _ in range(2)]
    q.put(pos32, freqs, emb, cos32, sin32)
    return tables


def causal_mask(q: Requests, T: int):
    """masking_utils' sliding-window causal mask, bool (T, T): the and of its predicates' blocks, the last kept."""
    m1, m2 = q.get(T * T), q.get(T * T)
    q.put(m1)
    m3, m4 = q.get(T * T), q.get(T * T)
    q.put(m3, m2)
    m5 = q.get(T * T)
    q.put(m4)
    m6 = q.get(T * T)
    q.put(m5)
    return m6


def forward(q: Requests, a: Arch, T: int, first: bool) -> dict:
    """A checkpointed forward and HF's loss, accelerate's copy, TRL's entropy and accuracy (``first``: step 1,
    whose first matmul makes the cuBLAS workspace): what the backward reads."""
    step = 1 if first else 2
    q.phase = f"step {step} forward"
    if a.model_type == "phi":
        phi_collate(q, T, first)
    else:
        old, q.batch = q.batch, [q.get(8 * T) for _ in range(3)]  # the collator's int64 rows, then the last step's go
        q.put(*old)
    emb = q.get(BF16 * T * a.h)
    # the position ids, which the rotary tables and the checkpoints read
    pos = phi_positions(q, T) if a.model_type == "phi" else q.get(8 * T)
    mask = causal_mask(q, T) if masked(a, T) else None
    tables = rotary_tables(q, a, T, first)
    inputs, x, phi = [], emb, a.model_type == "phi"
    for _ in range(a.L):
        inputs.append(x)
        x = LAYERS[a.model_type][0](q, a, T, False)["out"]
    q.phase = f"step {step} head and loss"
    if phi:  # the final LayerNorm's fp32 policy copy (saved) and fp32 output, autocast's cast for the biased head
        out, nf = layernorm(q, T, a.h, True)
        q.put(x)
        return {"inputs": inputs, "mask": mask, "nf": [nf], "tables": [pos, *tables],
                **phi_loss(q, a, T, cast_linear(q, T, a.h, a.V), out)}
    else:
        out, nf = norm(q, T, a.h, True)
        q.put(x)
        logits = q.get(BF16 * T * a.V)
    copy = q.get(FP32 * T * a.V)
    lsm = q.get(FP32 * T * a.V)
    q.put(copy, out)
    q.put(*q.cache)  # the model's forward returns: autocast's weight-cast cache cleared
    q.cache = []
    fp32 = q.get(FP32 * T * a.V)
    q.put(logits)
    entropy_chunks(q, T, a.V)
    q.put(q.get(FP32 * (T - 1) * a.V))  # TRL's token accuracy: the shifted logits' copy
    q.put(fp32)
    return {"inputs": inputs, "mask": mask, "nf": nf, "lsm": lsm, "tables": [pos, *tables]}


def optimizer_step(q: Requests, a: Arch) -> None:
    """TRL's AdamW step (torch's foreach path) and zero_grad on the adapter, all the small pool's at r16: its two
    fp32 states made param by param in model.parameters()' order at the first step (kept), the square roots of
    the second (_foreach_sqrt: one block each, freed), every .grad freed (set_to_none)."""
    q.phase = "optimizer"
    if a.model_type == "phi":
        clip_grad_norm(q, len(q.grads))
    order = PARAM_ORDER.get(a.model_type, tuple(a.modules))
    sizes = [FP32 * q.r * w for _ in range(a.L) for t in sorted(q.targets, key=order.index) for w in a.modules[t][:2]]
    if not q.states:
        q.states = [q.get(n) for n in sizes for _ in range(2)]
    q.put(*[q.get(n) for n in sizes])
    q.put(*q.grads)
    q.grads = []


def backward(q: Requests, a: Arch, T: int, f: dict, first: bool, stop: bool = False):
    """The loss's backward (to its peak where ``stop``: the log_softmax gradient's request), the head's, the final
    norm's, every layer's in reverse, the gradient buffer and the embedding's output freed."""
    step = 1 if first else 2
    q.phase = f"step {step} loss backward"
    seeds, last = loss_seeds(q) if a.model_type == "phi" else ([], None)
    nll = q.get(FP32 * T * a.V)
    if last is not None:  # phi: the seeds' last scalar, the padded labels and nll's total weight go
        q.put(last, f["pad"], f["weight"])
    lsm = q.get(FP32 * T * a.V)
    if stop:
        return
    q.put(nll, f["lsm"])
    gl = q.get(BF16 * T * a.V)
    q.put(lsm)
    gx = q.get(BF16 * T * a.h)
    if first:
        q.get(CUBLAS_WORKSPACE)  # the backward thread's, after its first matmul
    q.put(gl)
    g = (layernorm_backward if a.model_type == "phi" else norm_backward)(q, T, a.h, gx, f["nf"][0] if a.model_type == "phi" else f["nf"],
                                                                   False)
    phi = a.model_type == "phi"
    for k in reversed(range(a.L)):
        q.phase = f"step {step} backward layer {k}"
        # phi's layer 0 frees the position ids and rotary tables it was checkpointed with (the second table first)
        x = f["inputs"][k] if k else ([f["tables"][0], *f["tables"][:0:-1]] if phi else f["mask"])
        LAYERS[a.model_type][1](q, a, T, g, x)
    q.put(*seeds)
    q.put(g, f["inputs"][0], *([] if phi else f["tables"]))


def step_to_peak(q: Requests, a: Arch, T: int) -> None:
    """Step 1 whole (the optimizer's step and zero_grad are the small pool's at these shapes), then step 2's
    forward and loss to the backward's first two fp32 gradients: the peak."""
    backward(q, a, T, forward(q, a, T, True), True)
    optimizer_step(q, a)
    backward(q, a, T, forward(q, a, T, False), False, stop=True)


def step_whole(q: Requests, a: Arch, T: int) -> None:
    """Step 1's forward and backward whole (what bench/allocator_replay.py capture --checkpointing captures)."""
    backward(q, a, T, forward(q, a, T, True), True)


def two_steps_whole(a: Arch, targets: tuple, r: int, T: int) -> Paged:
    """The Paged allocator after the load and two steps whole, each with its optimizer step, for LoRA ``targets``
    at ``r`` and ``T`` tokens: what ``charge`` reads and tests/estimator/test_gc_sequence.py holds to the H100
    histories' two steps."""
    q = Paged(targets, r)
    load(q, a, q.targets, r)
    for first in (True, False):
        backward(q, a, T, forward(q, a, T, first), first)
        optimizer_step(q, a)
    return q


def replayed(a: Arch, quant: str, targets: tuple, task: str, seq: int, batch: int, *, transformers: str,
             environ=None) -> bool:
    """Whether this sequence is the run's: a model type of GC_TARGETS, bf16, LoRA on its targets, SFT at batch 1,
    transformers sequence.SEQUENCE_TRANSFORMERS, the default allocator's settings (sequence.default_allocator); past
    the sliding window (its mask, the memory-efficient SDPA: the H100 trace) or at and under it (no mask, flash:
    bench/allocator_replay.py capture --checkpointing)."""
    return (GC_TARGETS.get(a.model_type) == frozenset(targets) and quant == "none"
            and task == "sft" and batch == 1 and seq <= a.max_pos
            and transformers == SEQUENCE_TRANSFORMERS and default_allocator(environ))


def phi_collate(q: Paged, T: int, first: bool) -> None:
    """The step's inputs before the embedding: a 4 B scalar (step 1's kept for the run, later steps' freed at
    once), the collator's three int64 rows, num_items_in_batch (the shifted labels' != -100 mask, T-1 B, its int64
    sum, the labels' int64 copy, freed; the count, 8 B, kept to the next step's), then the last step's rows and
    count freed."""
    tag = q.get(4)
    if not first:
        q.put(tag)
    rows = [q.get(8 * T) for _ in range(3)]
    valid, total = q.get(T - 1), q.get(8)
    q.put(q.get(8 * (T - 1)))
    q.put(valid)
    count = q.get(8)
    q.put(total, getattr(q, "items", None), *q.batch)
    q.batch, q.items = rows, count


def phi_positions(q: Requests, T: int):
    """cache_position and the position ids (int64, T: the ids kept, returned), masking_utils' check on the
    attention mask (its T-byte bool, an 8 B and a 1 B scalar, an int64 T row), all but the ids freed."""
    cache = q.get(8 * T)
    pos = q.get(8 * T)
    q.put(cache)
    check, scalar = q.get(T), q.get(8)
    q.put(q.get(8 * T))
    one = q.get(1)
    q.put(scalar, one, check)
    return pos


def phi_loss(q: Requests, a: Arch, T: int, logits, normed) -> dict:
    """HF's ForCausalLMLoss on the bf16 ``logits`` (its fp32 copy, the labels padded by one, int64 (T+1), kept to
    the loss's backward; log_softmax; nll's output and total weight and the loss over num_items_in_batch, 4 B
    each: the output freed, the loss kept for the run), the final LayerNorm's output ``normed`` and autocast's
    cache freed, accelerate's fp32 copy, TRL's entropy and token accuracy (phi_metrics): what the backward reads."""
    copy = q.get(FP32 * T * a.V)
    pad = q.get(8 * (T + 1))
    lsm = q.get(FP32 * T * a.V)
    nll, weight, _ = q.get(4), q.get(4), q.get(4)
    q.put(nll, copy, normed)
    q.put(*q.cache)  # the model's forward returns: autocast's weight-cast cache cleared
    q.cache = []
    fp32 = q.get(FP32 * T * a.V)
    q.put(logits)
    phi_metrics(q, a, T, fp32)
    return {"lsm": lsm, "pad": pad, "weight": weight}


def phi_entropy(q: Requests, T: int, V: int):
    """recorder.entropy_chunks with each chunk's row sums (fp32, its rows: the product's sum, freed once
    negated) and entropies (kept), their cat (fp32, T: returned), the chunks' entropies freed (the list's in
    reverse, the last chunk's after its log-probabilities)."""
    last, outs = None, []
    for n in [min(ENTROPY_CHUNK_ROWS, T - j) for j in range(0, T, ENTROPY_CHUNK_ROWS)]:
        logps = q.get(FP32 * n * V)
        q.put(last)
        ex, prod = q.get(FP32 * n * V), q.get(FP32 * n * V)
        q.put(ex)
        total = q.get(FP32 * n)
        q.put(prod)
        outs.append(q.get(FP32 * n))
        q.put(total)
        last = logps
    cat = q.get(FP32 * T)
    q.put(*reversed(outs[:-1]), last, outs[-1])
    return cat


def phi_metrics(q: Requests, a: Arch, T: int, fp32) -> None:
    """TRL's entropy (phi_entropy) and its mean over the attention mask (the mask's fp32 copy, its 4 B sums and
    8 B counts), token accuracy's labels and masks (the shifted labels' int64 copies, their T-1 B != -100 masks,
    8 B and 1 B scalars), all freed; its (T-1) x V fp32 logits copy, its argmax's and compares' T-1 rows (fp32
    and bool) and 4 B sums, freed, and the fp32 logits ``fp32`` with them."""
    ent = phi_entropy(q, T, a.V)
    m = q.get(FP32 * T)
    s1 = q.get(4)
    q.put(m)
    c1, s2 = q.get(8), q.get(4)
    q.put(s1, c1)
    q.put(q.get(4), s2)
    q.put(*[q.get(8) for _ in range(2)])
    lab, v1, v2, v3 = q.get(8 * (T - 1)), q.get(T - 1), q.get(T - 1), q.get(T - 1)
    q.put(v2)
    n1 = q.get(8)
    q.put(q.get(8 * (T - 1)))
    n2 = q.get(8)
    q.put(q.get(8 * (T - 1)))
    n3 = q.get(8)
    q.put(q.get(1))
    e1, e2 = q.get(8), q.get(4)
    q.put(e1, e2, ent, lab, v1, v3, n1, n2, n3)
    logits = q.get(FP32 * (T - 1) * a.V)  # token accuracy's shifted copy
    pred, s = q.get(FP32 * (T - 1)), q.get(4)
    q.put(s, logits)
    ok = q.get(T - 1)
    hit = q.get(FP32 * (T - 1))
    q.put(ok)
    s1 = q.get(4)
    row = q.get(FP32 * (T - 1))
    s2 = q.get(4)
    q.put(row)
    q.put(*[q.get(4) for _ in range(2)])
    q.put(pred, hit, s1, s2, fp32)


def loss_seeds(q: Requests) -> tuple[list, object]:
    """The loss's backward's first 4 B scalars (the seed's ones and the loss's scaling's): two kept to the
    backward's end (returned, the second first), one freed at once, the last returned (freed after nll's
    gradient)."""
    j, k, l, m = (q.get(4) for _ in range(4))
    q.put(l)
    n = q.get(4)
    q.put(m)
    return [k, j], n


def clip_grad_norm(q: Requests, n: int) -> None:
    """torch's clip_grad_norm_ over the adapter's ``n`` .grad blocks, before AdamW: 1 B and 4 B checks, each
    grad's fp32 norm (4 B) into a 1 KiB-rounded stack, the total norm (4 B: kept for the run's log), the norms
    freed (in reverse), the clip coefficient's 4 B scalars, freed."""
    q.put(q.get(1))
    c, one = q.get(4), q.get(1)
    q.put(c, one)
    stack = q.get(4 * n)
    norms = [q.get(4) for _ in range(n)]
    q.put(stack)
    stack = q.get(4 * n)
    q.get(4)
    q.put(stack, *reversed(norms))
    x, y, z = q.get(4), q.get(4), q.get(4)
    q.put(y, x)
    w = q.get(4)
    q.put(z, w)


def page_need(a: Arch, targets: tuple, r: int, T: int, whole: bool = False) -> Need:
    """The most large pages the live blocks touch at any request of the load, step 1 whole and step 2 to its
    loss's backward peak (``whole``: step 2 whole, as a 2-step run goes on) under expandable segments: where the
    card's need is, which may be off the allocated peak (reserve's); once a shape (the large pool's: ``charge``
    takes both)."""
    key = (repr(a), frozenset(targets), r, T, whole)
    if key not in _NEEDS:
        q = Paged(targets, r)
        load(q, a, q.targets, r)
        if whole:
            step_whole(q, a, T)
            optimizer_step(q, a)
            backward(q, a, T, forward(q, a, T, False), False)
        else:
            step_to_peak(q, a, T)
        _NEEDS[key] = q.most
    return _NEEDS[key]


_NEEDS: dict = {}


#: The reserve measured on the checked arm's own card, both pools' most pages less their allocated peak, each
#: where the replay's most pages are its history's to the byte. phi3: the H100 Phi-3-mini bf16 gc 2048x1
#: expandable history's (88,866,816 B large, 7,124,480 B small; quoted from
#: results/resident-traces-qwen-nf4-phi3-gc-h100-soup0.77.0-1a0b582). llama: the H100 Llama-3.2-1B bf16 gc 2048x1
#: r8 history's (5,907,677,184 B touched less 5,852,578,304 B allocated; quoted from
#: results/resident-gc-traces-phi2-llama-smol-phi3nf4-h100-soup0.77.0-07712a8, whose SmolLM2-135M 4096x1 history
#: measures 47,177,728 B, under it). tests/estimator/test_gc_sequence.py recounts both from their traces. A charge
#: is never less. phi: the H100 phi-2 bf16 gc 1088x1 r16 history's (6,700,400,640 B touched, 136,314,880 B of it
#: small, less 6,612,477,440 B allocated; same folder; its 1216x1 history measures 70,862,336 B, under it).
MEASURED_RESERVE = {"phi3": 95_991_296, "llama": 55_098_880, "phi": 87_923_200}


def charge(a: Arch, targets: tuple, r: int, T: int) -> int:
    """The allocator's reserve a checkpointed resident run needs on expandable segments: the most pages both pools'
    live blocks touch over the load and two steps whole (each with its optimizer step), less their allocated peak,
    never under the arm's MEASURED_RESERVE; once a shape."""
    key = (repr(a), frozenset(targets), r, T)
    if key not in _CHARGES:
        q = two_steps_whole(a, targets, r, T)
        _CHARGES[key] = max(q.both.touched - q.peak, MEASURED_RESERVE[a.model_type])
    return _CHARGES[key]


_CHARGES: dict = {}


def charged(a: Arch, quant: str, targets: tuple, task: str, seq: int, batch: int, *, transformers: str,
            environ=None) -> bool:
    """Whether ``charge`` stands for the run's reserve: the replay is the run's (``replayed``), on a model type
    with a MEASURED_RESERVE, and the run is on expandable segments (allocator_setting: what --find-max's probes
    export, unless another value is; on the default allocator pages bound nothing)."""
    environ = os.environ if environ is None else environ
    setting = allocator_setting(environ).replace(" ", "").lower()
    return (a.model_type in MEASURED_RESERVE and EXPANDABLE_SEGMENTS.lower() in setting
            and replayed(a, quant, targets, task, seq, batch, transformers=transformers, environ=environ))
