"""A streamed LoRA step's steady-state requests for the adapter-shaped blocks, built from the estimator's own shapes
(``Arch``) and replayed through estimator/allocator.py, in recorder.py's ``Requests`` (issue 52 item 1: the rests
those blocks keep, from the allocator's history, in place of steady.unsplit_remainders' bound of 1 MiB a block).
Stdlib only.

What is built, and checked request for request against the four committed H100 histories of soup-cli 0.77.0's
streamed step (bench/task_peak_anatomy.py --trace, torch's own requests; tests/estimator/test_streamed_sequence.py):
step 1's optimizer step, ``adamw_step``. The Trainer's foreach AdamW (torch.optim.adamw, ``_multi_tensor_adam``, its
one weight-decayed group: peft's LoRA matrices in ``model.parameters()``'s order, each layer's targets in the layer's
module order, lora_A then lora_B) makes each parameter's two states on its first step (``_init_group``: exp_avg,
then exp_avg_sq, each ``torch.zeros_like(p)``, parameter by parameter), then ``torch._foreach_sqrt`` of every
exp_avg_sq at once (one temporary each, in the parameters' order), updates in place, and frees the temporaries in
the same order. The fused kernel (adamw_torch_fused) makes the states alone. A request of 1 MiB or less is the small
pool's and no event (``Requests``). From the pool a history leaves at the step's start, the replay's blocks are
the history's block for block: every state and temporary the same size, so the same rest (Qwen2.5-0.5B DPO r64
all-linear, Llama-3.2-1B and Mistral-7B NF4 r256 SFT all-linear, Phi-3-mini NF4 r64 at 4 micro-batches).

The pool that step meets, built for the bf16 arms: Soup's setup (``setup``; the history starts after it, so its
start segments are the check, not its requests): soup-cli 0.77.0's build_streamed_model
(utils/layer_stream_runtime.py) on the card, in order: materialize_extras (the embedding),
materialize_meta_adapters (each LoRA matrix fp32, ``data.to(device)``, model.named_modules()'s order), the
LayerBufferPool (``stream_buffers`` slots, each a ``torch.empty`` per layer tensor in the layer spec's order), then
under DPO materialize_meta_adapter_copy (TRL 0.29's "ref" adapter: each default matrix cloned, in
named_parameters' order); both bf16 histories' start segments segment for segment (Qwen2.5-0.5B DPO r64
all-linear: 144 adapter blocks, 9,764,864 B of rests; Llama-3.2-1B SFT: 48, none). Then step 1: the forward through
the streamed layers (``layers_forward``: under Soup's recompute each keeps no graph, only its output as the next
one's checkpointed input); the loss (``sft_loss``: the final norm, the head on the resident embedding, HF's loss,
accelerate's fp32 copy, TRL's entropy chunks and token accuracy, and their backward; ``dpo_loss``: the policy's
head and selective_log_softmax, TRL 0.29's reference forward under no grad with its own head, the entropy and the
chosen and rejected logits' means, and the backward); each layer's backward last to first (``layer_backward``: the
recompute torch's non-reentrant checkpoint stops after down_proj's lora_A, then the autograd engine's order, each
LoRA target's fp32 gradients made in it; the first layer's without its input's gradient); then ``adamw_step``.
Replayed from the setup, on an allocator placing each new segment below the earlier ones (as the driver placed the
histories'; after them, the default, Qwen's own requests depart at its first backward's first gradient), every
large request up to step 1's optimizer step's last temporary gets the history's block (Llama-3.2-1B SFT 3,985,
Qwen2.5-0.5B DPO 5,688; the histories' 5,123,584 B-and-up transients left out: made and freed at once,
bench/task_peak_anatomy.py's event markers); step 1's states keep 6,094,848 B (Qwen) and 0 (Llama). ``step_rests`` is that replay;
where it was checked (``step_replayed``: the two arms' model type and task, setup_replayed's stack, one
micro-batch, foreach AdamW, a step past the first) the estimate charges its parameters' and states' rests in place
of their bound (the history's at its real peak to the byte); elsewhere where only the setup is (``setup_replayed``)
the parameters' (``placed_rests``); the gradients' and temporaries' keep the bound (but NF4's step 1 below).
Held out, the bf16 setup is fifteen more histories' start (untied Mistral-7B, Llama-3.1-8B, phi-2 and Phi-3-mini:
the head's slot after the layers'; tied Qwen2.5, Llama-3.2-1B DPO, Qwen3, Gemma-2): SETUP_TYPES. Their step 1
replayed departs under the history on three (Llama-3.1-8B SFT r64 512x1, Mistral-7B SFT r64 512x1, Qwen2.5 SFT
r64 1024x1) and is to the byte on three (Mistral-7B SFT r32 1024x1 and DPO r32, Llama-3.1-8B DPO r32): step_replayed.

The NF4 setup (``setup(quant="nf4")``, an untied model): no quantisation on the card (the shards are packed on
disk): the adapter fp32, the two slots of packed NF4 shards (nf4_slot), install_streaming's LargeLayerBufferPool
(one slot for the untied embedding and head, materialize_extras having left both on meta), then each matrix recast
to bf16 (the 4-bit model's adapter dtype) and its fp32 freed, one by one; the Mistral-7B NF4 r256 SFT history's
start segments segment for segment (new segments below the earlier ones; the default placement departs), its
adapter's rests 57,671,680 B, the history's setup-born adapter blocks' at its real peak; charged where
setup_replayed admits it (NF4_SETUPS). Every order here is the layer's registration order (arch.registration_order:
Phi-3's o_proj before its qkv_proj). Phi-3-mini NF4 r64 fused SFT 2048x1's two histories (a1 and a4, H100) start as the
setup built so lays them out segment for segment, its adapter's rests their setup-born blocks' to the byte
(8,781,824 B), only where each new segment sits as the driver put theirs: the first two adapter segments below
the pool slots made after them, the rest below one another. The descending placement alone leaves 9,437,184 B
and other segments: Phi-3 is not in NF4_SETUPS (tests/estimator/test_streamed_sequence.py).

Its step 1 (``sft_step(nf4=True)``: each base Soup's install_dequant_forward on bitsandbytes' dequantising arm,
nf4_base; recomputed, its bf16 weight saved by F.linear and freed after its input's gradient; peft's bnb clone; the
bf16 adapter's gradients made in bf16) is that history's large-pool requests and frees, each run of frees in one
order, from the embedding's output to the first layer's backward (14,909 events). Its blocks, replayed from the
built setup, depart in the backward (the driver put some of the window's new segments in the ranges the setup's
empty_cache released, which the descending placement does not model) and step 1's states keep 53,477,376 B
against the history's 54,525,952: not charged (step_replayed admits no NF4 run). Under both placements, the larger
taken (``nf4_step_rests``), the parameters' and step 1's gradients' rests are at or above four histories' own, and
charged where ``nf4_step_replayed`` admits the run (blocks over 1 MiB; the gradients in a one-step run); later steps'
gradients, the states and the temporaries keep the bound.

The layer walk (``walked_rests``, where ``walk_replayed`` admits the run): the setup and up to two steps replayed
under both placements of new segments, the most the step's own non-adapter blocks hold past their requests at
once in any layers' backward, in place of layer_remainders' bound; held against seven committed histories
(tests/estimator/test_streamed_sequence.py), and refused where adapter blocks over 1 MiB share the layers'
segments (two histories where it is under) and where a card may fuse NF4's gemm_4bit (that arm is not built).

What is not built (what is left of issue 52 item 1): the driver's reuse of released address ranges (so NF4's states,
temporaries and later steps' gradients), the other tasks, and any model type or task pair not checked above
(accumulation's held gradients are replayed where step_replayed admits the run: step_rests' ``accumulation``; at or
above three H100 histories, not to the byte). Where the
states and temporaries land there is decided as here, by the free blocks the step 1 backward leaves (Mistral-7B NF4
r256's 7 MiB gradients in freed 8 MiB hidden states and NF4 q/o weights; Phi-3's 1,179,648 B gradients in freed
1,572,864 B down_proj absmax blocks). Replayed into fresh segments instead, the parameters', gradients', states' and
temporaries' rests are under the histories' on Phi-3-mini NF4 (13,107,200 B at the loss, where the row needs
15,354,144 B past the split estimate) and Mistral-7B NF4 r256 (187,695,104 B at the optimizer step against
241,355,528 B): ``fresh_rests`` says so, and is not charged.
"""

from __future__ import annotations

from ..constants import CUBLAS_WORKSPACE, K_SMALL_SIZE, block_bytes
from .allocator import CachingAllocator
from .arch import NF4_BLOCK, Arch, nf4_pieces, registration_order
from .gemm4bit import Dispatch, any_fused
from .recorder import FP32, Requests, entropy_chunks, sdpa_workspace
from .decoder import layer_parameters, norm, rotary
from .sequence import SEQUENCE_TRANSFORMERS, default_allocator
from .steady import OPTIMIZERS, adapter_bytes

#: The optimizers whose first step ``adamw_step`` builds: torch's AdamW, foreach (a square-root temporary per
#: parameter) and fused (none). bitsandbytes' and the others keep their states otherwise: not built.
BUILT_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")
#: The setup ``setup`` builds was checked on these (the bf16 histories' start segments, segment for segment, under
#: both placements): the model types, each with whether its embedding is tied (an untied model's head slot comes
#: after the layers'); the tasks (DPO's reference copy; SFT none), soup-cli's release, its pool's slots. Tied:
#: Llama-3.2-1B, Qwen2.5-0.5B, Gemma-2-2B; untied: Mistral-7B, Llama-3.1-8B, phi-2, Phi-3-mini (bf16-large-adapter-
#: traces-*, then held out bf16-setup-heldout-traces-*, whose Gemma-2 and Phi-3 admitted theirs, then their DPO in
#: heldout-orpo-simpo-setup-traces-*). Qwen3-0.6B's start is built too, but its adapter has no block over 1 MiB
#: whose rests a layout could show: not admitted.
SETUP_TYPES = (("llama", True), ("qwen2", True), ("gemma2", True), ("llama", False), ("mistral", False),
               ("phi", False), ("phi3", False))
SETUP_TASKS, SETUP_RELEASE, SETUP_BUFFERS = ("sft", "dpo"), "0.77.0", 2
#: ...and under NF4 (an untied model: its embedding and head share one LargeLayerBufferPool slot) on these (model
#: type, task): Mistral-7B NF4 r256 SFT's history. DPO's copy beside the recast adapter was not.
NF4_SETUPS = (("mistral", "sft"),)
#: Bytes a LoRA element takes as materialize_meta_adapters makes it (``torch.empty(..., dtype=torch.float32)``).
MATERIALISED = FP32


def adapter_elements(a: Arch, targets: tuple, r: int) -> list[int]:
    """Each LoRA matrix's elements in ``model.parameters()``'s order, the optimizer's: layer by layer, each target in
    the layer's module order (arch.registration_order; not the order the targets were named in), lora_A (r x in)
    then lora_B (out x r)."""
    ordered = [t for t in registration_order(a) if t in targets]
    return [r * w for _ in range(a.L) for t in ordered for w in a.modules[t][:2]]


def adamw_step(q: Requests, elements: list[int], per: int, optimizer: str, first: bool = True) -> list:
    """An ``optimizer.step()`` for parameters of ``elements`` (``per`` bytes an element: the states follow the
    parameter's dtype, steady.Optimizer.states_follow_param): on the ``first`` each parameter's exp_avg and exp_avg_sq
    (from step 2 on they stand), then (foreach) every square root's temporary, then those freed in order. Returns the
    states' keys made (live from here on)."""
    if optimizer not in BUILT_OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}: its step is not built (only {', '.join(BUILT_OPTIMIZERS)})")
    states = [k for n in elements for k in (q.get(per * n), q.get(per * n))] if first else []
    temporaries = [q.get(per * n) for n in elements] if OPTIMIZERS[optimizer].transient else []
    q.put(*temporaries)
    return states


def fresh_rests(a: Arch, targets: tuple, r: int, per: int, *, copies: int = 1, optimizer: str = "adamw_torch",
                recast: bool = False) -> dict:
    """The adapter's blocks replayed into fresh segments alone (no step's history before them): the parameters
    (``copies``; under ``recast`` made fp32 and recast to ``per`` one by one, as TRL recasts peft's under a 4-bit
    model), the gradients in the backward's order (last layer first), step 1's states and square-root temporaries
    (adamw_step); each set's rests, live together at the optimizer's last temporary. Not charged: under the
    committed histories on two arms (the module's docstring)."""
    elements = adapter_elements(a, targets, r)
    q = Requests()
    params = []
    for _ in range(copies):
        if recast:
            made = [q.get(4 * n) for n in elements]
            for k, n in zip(made, elements):
                params.append(q.get(per * n))
                q.put(k)
        else:
            params += [q.get(per * n) for n in elements]
    grads = [q.get(per * n) for n in reversed(elements)]
    states = [k for n in elements for k in (q.get(per * n), q.get(per * n))]
    temporaries = [q.get(per * n) for n in elements] if OPTIMIZERS[optimizer].transient else []
    return {"parameters": q.rests(params), "gradients": q.rests(grads), "states": q.rests(states),
            "temporaries": q.rests(temporaries)}


def nf4_slot(a: Arch) -> list:
    """One pool slot's tensors' bytes under Soup's NF4 shards, in the layer spec's order (the layer's
    named_parameters(): arch.registration_order): each linear's pieces (arch.nf4_pieces: the checkpoint key, then its
    sidecars), then the bf16 norms."""
    pieces = [nf4_pieces(a.modules[m][0] * a.modules[m][1]) for m in registration_order(a)]
    return [b for p in pieces for b in p] + [2 * a.h, 2 * a.h]


def setup(q: Requests, a: Arch, targets: tuple, r: int, *, reference: bool, quant: str = "none",
          buffers: int = SETUP_BUFFERS, workspace: int = CUBLAS_WORKSPACE) -> list:
    """soup-cli 0.77.0's streamed setup on the card (the module's docstring): the embedding (a tied model's one
    vocab matrix, materialize_extras), the adapter fp32, ``buffers`` slots of one layer's tensors in its modules'
    order (NF4: its packed shards, nf4_slot), an untied model's LargeLayerBufferPool (one slot of the larger of its
    embedding and head, install_streaming's, after the layers'), under ``reference`` (DPO) the adapter's copy;
    under NF4 each fp32 matrix recast to bf16 one by one (the 4-bit model's adapter dtype, adapter_bytes); the cuBLAS
    ``workspace`` (its own segment; made before the window), the window's empty_cache. Returns the adapter's
    blocks' keys, both copies."""
    elements = adapter_elements(a, targets, r)
    if a.tied:
        q.get(2 * a.V * a.h)
    made = [q.get(MATERIALISED * n) for n in elements]
    for _ in range(buffers):
        for nbytes in (nf4_slot(a) if quant == "nf4" else [b for _, b in layer_parameters(a, 0)]):
            q.get(nbytes)
    if not a.tied:
        q.get(2 * a.V * a.h)
    if reference:
        made += [q.get(MATERIALISED * n) for n in elements]
    if quant == "nf4":
        recast = []
        for k, n in zip(made, elements):
            recast.append(q.get(2 * n))
            q.put(k)
        made = recast
    q.get(workspace)
    q.empty_cache()  # the window's, before the history records: the fp32 adapter's emptied segments go back
    return made


def setup_replayed(a: Arch, quant: str, task: str, *, release: str, transformers: str, stream: dict,
                   probed: bool, buffers: int, environ=None) -> bool:
    """Whether ``setup`` is the run's: a dense bf16 decoder of a model type and tying SETUP_TYPES names, SFT or DPO, or
    an untied dense NF4 one NF4_SETUPS names (Mistral-7B's SFT: its LargeLayerBufferPool and recast adapter),
    soup-cli SETUP_RELEASE with its default streaming (no training key, no probe: stream_vram_probe runs a step at
    setup, on the card before DPO's copy), SETUP_BUFFERS slots, transformers sequence.SEQUENCE_TRANSFORMERS
    (``transformers``: the release, its local tag dropped) and the default allocator: the histories it was checked
    on."""
    checked = (quant == "none" and (a.model_type, a.tied) in SETUP_TYPES and task in SETUP_TASKS) or (
        not a.tied and quant == "nf4" and (a.model_type, task) in NF4_SETUPS)
    return checked and a.layers is None and stack_replayed(release=release, transformers=transformers, stream=stream,
                                                           probed=probed, buffers=buffers, environ=environ)


def stack_replayed(*, release: str, transformers: str, stream: dict, probed: bool, buffers: int,
                   environ=None) -> bool:
    """Whether the run's stack is the one every replay here was checked on: soup-cli SETUP_RELEASE with its default
    streaming (no training key, no probe), SETUP_BUFFERS slots, transformers SEQUENCE_TRANSFORMERS and the default
    allocator (sequence.default_allocator)."""
    return (release == SETUP_RELEASE and not stream and not probed and buffers == SETUP_BUFFERS
            and transformers == SEQUENCE_TRANSFORMERS and default_allocator(environ))


def placed_rests(a: Arch, targets: tuple, r: int, reference: bool, quant: str = "none") -> int:
    """What the adapter's parameters (and DPO's copy) keep past their requests where ``setup`` places them, under
    both placements of new segments (below the earlier ones, the driver's in most histories, and after them), the
    larger taken: live from the setup on, in every phase of every step. Mistral-7B NF4 r64's history is laid out by
    neither; its parameters keep 11,534,336 B, the descending placement's 10,747,904 and the default's 12,320,768."""
    most = 0
    for descending in (True, False):
        q = Requests()
        q.alloc = CachingAllocator(descending=descending)
        most = max(most, q.rests(setup(q, a, targets, r, reference=reference, quant=quant)))
    return most


# -- step 1's forward: Soup's streamed layers under checkpointing (no autograd graph kept) --

def lora_forward(q: Requests, T: int, fi: int, fo: int, r: int, dropout: bool):
    """A LoRA target's forward with no graph kept: the base output, peft's fp32 cast of its input, dropout's bool mask
    and output (``dropout``; none where the task's trainer turns dropout off), autocast's bf16 cast for lora_A (freed
    with dropout's output once lora_A returns), lora_A's output (freed once lora_B's is made: a small-pool block on
    every checked run), lora_B's, the scaling, the sum (returned); the rest freed."""
    base, x32 = q.get(2 * T * fo), q.get(4 * T * fi)
    mask = q.get(T * fi) if dropout else None
    drop = q.get(4 * T * fi) if dropout else None
    q.put(mask)
    cast = q.get(2 * T * fi)
    a_out = q.get(2 * T * r)
    q.put(cast, drop)
    b_out = q.get(2 * T * fo)
    q.put(a_out)
    scaled = q.get(2 * T * fo)
    q.put(b_out)
    out = q.get(2 * T * fo)
    q.put(scaled, base, x32)
    return out


def nf4_base(q: Requests, T: int, fi: int, fo: int):
    """A streamed NF4 linear's output (soup-cli 0.77.0's install_dequant_forward on bitsandbytes' dequantising arm,
    no scale cache): dequantize_4bit's fp32 absmax (the nested codes expanded, its offset added in place), the bf16
    weight, the absmax freed, F.linear's output, the weight freed."""
    absmax = q.get(FP32 * -(-fi * fo // NF4_BLOCK))
    w = q.get(2 * fi * fo)
    q.put(absmax)
    out = q.get(2 * T * fo)
    q.put(w)
    return out


def lora_forward_nf4(q: Requests, T: int, fi: int, fo: int, r: int, dropout: bool):
    """A LoRA target over a streamed NF4 base with no graph kept: the base output (nf4_base), peft's bnb layer's
    defensive clone (the base freed), dropout's bool mask and bf16 output (the adapter is bf16: no cast), freed once
    lora_A returns, lora_B's, the scaling, the sum (returned); the rest freed."""
    base = nf4_base(q, T, fi, fo)
    clone = q.get(2 * T * fo)
    q.put(base)
    mask = q.get(T * fi) if dropout else None
    drop = q.get(2 * T * fi) if dropout else None
    q.put(mask)
    a_out = q.get(2 * T * r)
    q.put(drop)
    b_out = q.get(2 * T * fo)
    q.put(a_out)
    scaled = q.get(2 * T * fo)
    q.put(b_out)
    out = q.get(2 * T * fo)
    q.put(scaled, clone)
    return out


def projection_forward(q: Requests, a: Arch, T: int, name: str, lora: tuple, nf4: bool = False):
    """A linear's output with no graph kept: a LoRA target's (``lora``: targets, r, dropout) or a frozen one's,
    over a bf16 or (``nf4``) a streamed NF4 base."""
    fi, fo, _ = a.modules[name]
    targets, r, dropout = lora
    if nf4:
        return lora_forward_nf4(q, T, fi, fo, r, dropout) if name in targets else nf4_base(q, T, fi, fo)
    return lora_forward(q, T, fi, fo, r, dropout) if name in targets else q.get(2 * T * fo)


def layer_forward(q: Requests, a: Arch, T: int, lora: tuple, nf4: bool = False):
    """One streamed decoder layer's checkpointed forward (transformers' llama-type layer, no graph kept): the input
    norm, q, k, v, q and k rotated (q's and k's projections freed), flash's output, o_proj, then as the attention's
    frame goes flash's output, the rotated q and k, v, and the normed input; the residual add, the post-attention
    norm, gate, its activation (gate freed), up, their product (the activation and up freed), down (the product and
    the normed input freed), the residual add (down and the first sum freed). Returns the layer's output: the next
    layer's checkpointed input, kept. Under ``nf4`` each base is a streamed NF4 linear (projection_forward)."""
    normed, _ = norm(q, T, a.h, False)
    qo, ko, vo = (projection_forward(q, a, T, m, lora, nf4) for m in ("q_proj", "k_proj", "v_proj"))
    qr, kr = rotary(q, T, a.heads * a.head_dim), rotary(q, T, a.kv * a.head_dim)
    q.put(qo, ko)
    sdpa = q.get(2 * T * a.heads * a.head_dim)
    o = projection_forward(q, a, T, "o_proj", lora, nf4)
    q.put(sdpa, qr, kr, vo, normed)
    mid = q.get(2 * T * a.h)
    q.put(o)
    normed2, _ = norm(q, T, a.h, False)
    gate = projection_forward(q, a, T, "gate_proj", lora, nf4)
    act = q.get(2 * T * a.i)
    q.put(gate)
    up = projection_forward(q, a, T, "up_proj", lora, nf4)
    prod = q.get(2 * T * a.i)
    q.put(act, up)
    down = projection_forward(q, a, T, "down_proj", lora, nf4)
    q.put(prod, normed2)
    out = q.get(2 * T * a.h)
    q.put(down, mid)
    return out


def layers_forward(q: Requests, a: Arch, T: int, lora: tuple, nf4: bool = False) -> list:
    """Every layer's checkpointed forward in turn; returns their outputs (each kept as the next one's input)."""
    return [layer_forward(q, a, T, lora, nf4) for _ in range(a.L)]


# -- step 1's backward: each streamed layer's recompute (early-stopped) and its backward --

def lora_recompute(q: Requests, T: int, fi: int, fo: int, r: int, dropout: bool, stop: bool = False,
                   needs_input: bool = True) -> tuple:
    """A LoRA target's forward recomputed with its graph: the base output, the fp32 cast, dropout's mask and
    output, the bf16 cast lora_A saves, lora_A's output lora_B saves (dropout's output freed), then lora_B's, the
    scaling, the sum; with ``stop`` (torch's non-reentrant checkpoint stops once the last tensor the backward
    unpacks is made: down_proj's lora_A output) nothing after lora_A. Where its input ``needs_input`` no gradient
    (the first layer's q, k, v: the embedding is frozen) dropout saves no mask. Returns (output, what it saved, what
    the stop leaves to free: the fp32 cast and the base output)."""
    base, x32 = q.get(2 * T * fo), q.get(4 * T * fi)
    mask = q.get(T * fi) if dropout else None
    drop = q.get(4 * T * fi) if dropout else None
    if not needs_input:
        q.put(mask)
        mask = None
    cast, a_out = q.get(2 * T * fi), q.get(2 * T * r)
    q.put(drop)
    saved = {"cast": cast, "a": a_out, "mask": mask, "fi": fi, "fo": fo, "r": r, "input": needs_input}
    if stop:
        return None, saved, [x32, base]
    b_out = q.get(2 * T * fo)
    scaled = q.get(2 * T * fo)
    q.put(b_out)
    out = q.get(2 * T * fo)
    q.put(scaled, base, x32)
    return out, saved, []


def lora_recompute_nf4(q: Requests, T: int, fi: int, fo: int, r: int, dropout: bool, stop: bool = False,
                       needs_input: bool = True) -> tuple:
    """lora_recompute over a streamed NF4 base: the dequantised bf16 weight F.linear saves (its fp32 absmax freed),
    the base output, peft's bnb clone (the base freed), dropout's mask and bf16 output (lora_A's saved input: the
    adapter is bf16, no cast), lora_A's output; then, but past the ``stop``, lora_B's, the scaling, the sum. Returns
    (output, what it saved, what the stop leaves to free: the clone). Where its input ``needs_input`` no gradient
    the base is out of the graph and its weight goes at once."""
    absmax = q.get(FP32 * -(-fi * fo // NF4_BLOCK))
    w = q.get(2 * fi * fo)
    q.put(absmax)
    base = q.get(2 * T * fo)
    if not needs_input:  # no graph through the base: F.linear saves nothing
        q.put(w)
        w = None
    clone = q.get(2 * T * fo)
    q.put(base)
    mask = q.get(T * fi) if dropout else None
    drop = q.get(2 * T * fi) if dropout else None
    if not needs_input:
        q.put(mask)
        mask = None
    a_out = q.get(2 * T * r)
    saved = {"cast": drop, "a": a_out, "mask": mask, "w": w, "fi": fi, "fo": fo, "r": r, "input": needs_input}
    if stop:
        return None, saved, [clone]
    b_out = q.get(2 * T * fo)
    scaled = q.get(2 * T * fo)
    q.put(b_out)
    out = q.get(2 * T * fo)
    q.put(scaled, clone)
    return out, saved, []


def layer_recompute(q: Requests, a: Arch, T: int, lora: tuple, first: bool = False, nf4: bool = False) -> tuple:
    """A layer's forward recomputed when its backward first unpacks (decoder.layer's resident forward with its
    graph, the input's norm saving its fp32 copy), stopped after down_proj's lora_A. Returns what its backward
    reads and what the stop leaves, in the order the unwound frames free it (down_proj's, the MLP's product, the
    post-attention norm's output, the first residual sum). The ``first`` layer's input (the frozen embedding's
    output) needs no gradient: its norm saves nothing, and q, k, v's inputs none."""
    targets, r, dropout = lora

    def target(name: str, stop: bool = False, needs_input: bool = True) -> tuple:
        fi, fo, _ = a.modules[name]
        return (lora_recompute_nf4 if nf4 else lora_recompute)(q, T, fi, fo, r, dropout, stop, needs_input)

    s = {}
    n1, s["n1"] = norm(q, T, a.h, not first)
    outs = {}
    for m in ("q_proj", "k_proj", "v_proj"):
        outs[m], s[m], _ = target(m, needs_input=not first)
    s["qr"], s["kr"] = rotary(q, T, a.heads * a.head_dim), rotary(q, T, a.kv * a.head_dim)
    q.put(outs["q_proj"], outs["k_proj"])
    s["v"], s["sdpa"] = outs["v_proj"], q.get(2 * T * a.heads * a.head_dim)
    o, s["o_proj"], _ = target("o_proj")
    q.put(n1)
    mid = q.get(2 * T * a.h)
    q.put(o)
    n2, s["n2"] = norm(q, T, a.h, True)
    s["gate"], s["gate_proj"], _ = target("gate_proj")
    s["act"] = q.get(2 * T * a.i)
    s["up"], s["up_proj"], _ = target("up_proj")
    prod = q.get(2 * T * a.i)
    _, s["down_proj"], dead = target("down_proj", stop=True)
    return s, dead + [prod, n2, mid]


def lora_backward(q: Requests, T: int, s: dict, scaled, into) -> tuple:
    """A LoRA target's backward from its scaling's gradient ``scaled``: lora_B's mm (a_out saved, ``scaled`` freed),
    B's fp32 gradient, lora_A's mm (the cast saved freed), the cast's ToCopy to fp32, A's fp32 gradient, dropout's
    (its mask freed), the fp32 cast's ToCopy back to bf16, accumulated in place into ``into`` where the input's
    buffer holds a gradient (freed), then the frozen base's input gradient. Returns (the input's gradient, the base's
    share to accumulate and free, the fp32 gradients made)."""
    if "w" in s:  # over a streamed NF4 base
        return lora_backward_nf4(q, T, s, scaled, into)
    fi, fo, r = s["fi"], s["fo"], s["r"]
    ga, gbw = q.get(2 * T * r), q.get(2 * fo * r)
    q.put(s["a"], scaled)
    grads = [q.get(FP32 * fo * r)]
    q.put(gbw, *accumulated(q, grads))
    if not s["input"]:  # lora_A's weight gradient alone
        gaw = q.get(2 * r * fi)
        q.put(s["cast"], ga)
        grads.append(q.get(FP32 * r * fi))
        q.put(gaw, *accumulated(q, grads[1:]))
        return None, None, kept(q, grads)
    gc, gaw = q.get(2 * T * fi), q.get(2 * r * fi)
    q.put(s["cast"], ga)
    g32 = q.get(FP32 * T * fi)
    q.put(gc)
    grads.append(q.get(FP32 * r * fi))
    q.put(gaw, *accumulated(q, grads[1:]))
    if s["mask"] is not None:
        gd = q.get(FP32 * T * fi)
        q.put(s["mask"], g32)
        g32 = gd
    gx = q.get(2 * T * fi)
    q.put(g32)
    if into is not None:
        q.put(gx)
        gx = into
    return gx, q.get(2 * T * fi), kept(q, grads)


def lora_backward_nf4(q: Requests, T: int, s: dict, scaled, into) -> tuple:
    """lora_backward over a streamed NF4 base (a bf16 adapter: each weight's gradient made in bf16, no fp32 copy):
    lora_B's mm and B's gradient (``scaled`` freed), A's gradient, lora_A's input gradient (dropout's output
    freed), dropout's (its mask freed), accumulated in place into ``into`` where given, then the frozen base's input
    gradient on the dequantised weight, which goes. Returns (the input's gradient, the base's share to accumulate
    and free, the gradients made)."""
    fi, fo, r = s["fi"], s["fo"], s["r"]
    ga, gb = q.get(2 * T * r), q.get(2 * fo * r)
    q.put(s["a"], scaled, *accumulated(q, [gb]))
    grads = [gb, q.get(2 * r * fi)]
    if not s["input"]:
        q.put(s["cast"], ga, s["w"], *accumulated(q, grads[1:]))
        return None, None, kept(q, grads)
    gc = q.get(2 * T * fi)
    q.put(s["cast"], ga, *accumulated(q, grads[1:]))
    if s["mask"] is not None:
        gd = q.get(2 * T * fi)
        q.put(s["mask"], gc)
        gc = gd
    if into is not None:
        q.put(gc)
        gc = into
    base = q.get(2 * T * fi)
    q.put(s["w"])
    return gc, base, kept(q, grads)


def accumulated(q: Requests, grads: list) -> list:
    """The new gradients AccumulateGrad frees with the next run of frees once it has added them into .grad in place
    (``q.accumulating``: micro-batch 2 on; it runs as soon as its input is made, its sequence number the highest),
    or none (micro-batch 1: the gradient becomes .grad itself)."""
    return list(grads) if q.accumulating else []


def kept(q: Requests, grads: list) -> list:
    """The gradients a LoRA target's backward leaves live: none where each was added into .grad and freed."""
    return [] if q.accumulating else grads


def mlp_backward(q: Requests, a: Arch, T: int, s: dict, scaled) -> tuple:
    """The gated MLP's backward (down_proj's scaling gradient ``scaled`` made before the recompute): down_proj, the
    product's (the activation and up freed), up_proj, the activation's (gate freed), gate_proj; each base's share
    accumulated in place. Returns the post-attention norm output's gradient and the fp32 gradients made."""
    gprod, gb, grads = lora_backward(q, T, s["down_proj"], scaled, None)
    q.put(gb)
    gact, gup = q.get(2 * T * a.i), q.get(2 * T * a.i)
    q.put(s["act"], s["up"], gprod)
    gn2, gb, made = lora_backward(q, T, s["up_proj"], q.get(2 * T * a.i), None)
    q.put(gup, gb)
    gg = q.get(2 * T * a.i)
    q.put(s["gate"], gact)
    gn2, gb, more = lora_backward(q, T, s["gate_proj"], q.get(2 * T * a.i), gn2)
    q.put(gg, gb)
    return gn2, grads + made + more


def norm_backward(q: Requests, T: int, h: int, g, saved: list, x=None, residual: bool = True):
    """HF's RMSNorm's backward (bf16 in and out, fp32 inside, its weight frozen) on ``g``: the weight's product,
    its fp32 copy, x * rsqrt's two, mean's and pow's, the input's share cast to bf16 and accumulated in place into
    the residual's gradient; ``x`` (the layer's checkpointed input, at the input norm) freed with the rest. The
    final norm's (no ``residual``) is the last layer's output gradient, returned."""
    x32, r = saved
    gw = q.get(2 * T * h)
    q.put(g)
    g32 = q.get(FP32 * T * h)
    q.put(gw)
    gx, t = q.get(FP32 * T * h), q.get(FP32 * T * h)
    q.put(t, g32)
    m = q.get(FP32 * T * h)
    p = [q.get(FP32 * T * h) for _ in range(3)]
    q.put(p[1], p[0], x32, r, m, x, p[2])
    out = q.get(2 * T * h)
    q.put(gx)
    if not residual:
        return out
    q.put(out)
    return None


def rotary_backward(q: Requests, T: int, w: int, g):
    """x * cos + rotate_half(x) * sin's backward in bf16 on ``g``: the sin product's, the negated half, each slice's
    zero-padded gradient (the second accumulated in place into the first), the cos product's, accumulated too."""
    c, n = q.get(2 * T * w), q.get(T * w)
    s1 = q.get(2 * T * w)
    q.put(n)
    s2 = q.get(2 * T * w)
    q.put(c, s2)
    gc = q.get(2 * T * w)
    q.put(g, gc)
    return s1


def flash_backward(q: Requests, a: Arch, T: int, g, s: dict) -> tuple:
    """SDPA's backward: dq, dk, dv, then its one workspace (recorder.sdpa_workspace, read off the four committed
    streamed H100 histories, GQA and not), freed; then ``g`` and what the forward saved."""
    dq, dk = q.get(2 * T * a.heads * a.head_dim), q.get(2 * T * a.kv * a.head_dim)
    dv = q.get(2 * T * a.kv * a.head_dim)
    q.put(q.get(sdpa_workspace(a, T)))
    q.put(g, s["qr"], s["kr"], s["v"], s["sdpa"])
    return dq, dk, dv


def attention_backward(q: Requests, a: Arch, T: int, s: dict, g, first: bool = False) -> tuple:
    """o_proj's backward (on the residual's gradient ``g``, which stays), SDPA's, k's and q's rotary, v_proj's,
    then k_proj's and q_proj's each on a contiguous copy of its gradient. Returns the input norm output's gradient
    and the fp32 gradients made. In the ``first`` layer q, k and v's bases are out of the graph: each gradient is
    freed once its scaling's is made, and no input gradient follows; the residual's ``g`` goes after o_proj."""
    gsd, gb, grads = lora_backward(q, T, s["o_proj"], q.get(2 * T * a.modules["o_proj"][1]), None)
    q.put(gb, *([g] if first else []))  # the first layer's residual gradient: o_proj's base was its last reader
    dq, dk, dv = flash_backward(q, a, T, gsd, s)
    rk = rotary_backward(q, T, a.kv * a.head_dim, dk)
    rq = rotary_backward(q, T, a.heads * a.head_dim, dq)
    gn1 = None
    for name, g_in in (("v_proj", dv), ("k_proj", rk), ("q_proj", rq)):
        if name != "v_proj":  # k's and q's gradients laid out for the projection's view
            copy = q.get(2 * T * a.modules[name][1])
            q.put(g_in)
            g_in = copy
        scaled = q.get(2 * T * a.modules[name][1])
        if first:
            q.put(g_in)
        gn1, gb, made = lora_backward(q, T, s[name], scaled, gn1)
        if not first:
            q.put(g_in, gb)
        grads += made
    return gn1, grads


def layer_backward(q: Requests, a: Arch, T: int, x, g, lora: tuple, first: bool = False, nf4: bool = False) -> list:
    """One streamed layer's backward (not the first's) on its output's gradient ``g`` (accumulated in place through
    the layer: it leaves as the input's): down_proj's scaling gradient, the recompute and the stop's frees, the MLP's,
    the post-attention norm's, the attention's, the input norm's (``x``, the checkpointed input, freed). Returns the
    fp32 gradients made (the adapter's, held until the optimizer's step). The ``first`` layer's input norm has no
    backward: the residual's gradient goes after o_proj's, its input at the end."""
    scaled = q.get(2 * T * a.h)
    s, dead = layer_recompute(q, a, T, lora, first, nf4)
    q.put(*dead)
    gn2, grads = mlp_backward(q, a, T, s, scaled)
    norm_backward(q, T, a.h, gn2, s["n2"])
    gn1, made = attention_backward(q, a, T, s, g, first)
    if first:
        q.put(x)
    else:
        norm_backward(q, T, a.h, gn1, s["n1"], x)
    return grads + made


# -- the head and the loss (TRL's SFT), and step 1 whole --


def sft_loss(q: Requests, a: Arch, T: int, x, workspace: int = CUBLAS_WORKSPACE):
    """The final norm on the last layer's output ``x`` (its fp32 copy saved; ``x`` freed), the head on a tied
    model's resident embedding (the bf16 logits), HF's loss (the fp32 copy, log_softmax; the copy and the norm's
    output freed as the model returns), accelerate's fp32 logits in place of the bf16, TRL's entropy in
    ENTROPY_CHUNK_ROWS-row chunks and its token accuracy's shifted copy (T - 1 rows), the fp32 logits dropped; then the
    backward: nll's and log_softmax's, the logits' bf16 gradient, the head's input gradient, the autograd thread's
    cuBLAS ``workspace`` at that first matmul (kept: the thread's), the final norm's. Returns the last layer's output
    gradient (full_sequence.head_forward and loss_backward, the resident full step's, less the head's weight copy
    and gradient: the head is frozen and bf16)."""
    out, nf = norm(q, T, a.h, True)
    q.put(x)
    logits, copy = q.get(2 * T * a.V), q.get(FP32 * T * a.V)
    lsm = q.get(FP32 * T * a.V)
    q.put(copy, out)
    fp32 = q.get(FP32 * T * a.V)
    q.put(logits)
    entropy_chunks(q, T, a.V)
    q.put(q.get(FP32 * (T - 1) * a.V), fp32)
    nll, l2 = q.get(FP32 * T * a.V), q.get(FP32 * T * a.V)
    q.put(nll, lsm)
    gl = q.get(2 * T * a.V)
    q.put(l2)
    gx = q.get(2 * T * a.h)
    q.get(workspace)
    q.put(gl)
    return norm_backward(q, T, a.h, gx, nf, residual=False)


def sft_step(q: Requests, a: Arch, T: int, lora: tuple, workspace: int = CUBLAS_WORKSPACE,
             nf4: bool = False) -> list:
    """Step 1 of a streamed SFT run up to its optimizer's step: the embedding's output, every layer's checkpointed
    forward, the loss (sft_loss; an untied head's weight sits in the large pool's slot), every layer's backward last
    to first, over streamed NF4 bases where ``nf4``. Returns the adapter's gradients (fp32; bf16 under NF4: the
    optimizer's step reads them; zero_grad frees them after it)."""
    x = [q.get(2 * T * a.h)] + layers_forward(q, a, T, lora, nf4)
    g = sft_loss(q, a, T, x[-1], workspace)
    return layers_backward(q, a, T, x, g, lora, nf4)


def layers_backward(q: Requests, a: Arch, T: int, x: list, g, lora: tuple, nf4: bool = False) -> list:
    """Every layer's backward, last to first (layer_backward; ``x`` each layer's checkpointed input), the first's
    without its input's gradient. Returns the adapter's gradients made."""
    return [k for i in reversed(range(a.L)) for k in layer_backward(q, a, T, x[i], g, lora, first=i == 0, nf4=nf4)]


def dpo_head(q: Requests, a: Arch, T: int, rows: int, x, saved: bool, embedded=None) -> tuple:
    """A forward's end under TRL 0.29's DPO _compute_loss: the final norm (its fp32 copy saved under the policy's
    graph; ``x`` and the reference forward's ``embedded`` output freed), the bf16 logits (the norm's output freed as
    the model returns), the fp32 logits, the
    shifted copy (``rows`` x (seq - 1)), selective_log_softmax's logsumexp a row at a time (its temporary freed).
    Returns (the fp32 logits, the shifted copy, the final norm's saved)."""
    out, nf = norm(q, T, a.h, saved)
    q.put(x, embedded)
    logits = q.get(2 * T * a.V)
    q.put(out)
    l32 = q.get(FP32 * T * a.V)
    q.put(logits)
    shifted = q.get(FP32 * (T - rows) * a.V)
    for _ in range(rows):
        q.put(q.get(FP32 * (T // rows - 1) * a.V))
    return l32, shifted, nf


def dpo_loss(q: Requests, a: Arch, T: int, rows: int, lora: tuple, x: list, workspace: int = CUBLAS_WORKSPACE,
             nf4: bool = False):
    """TRL 0.29's DPO step after the policy's layers (``x``: the embedding's output and each layer's): the policy's
    head (dpo_head), the reference forward under no grad (each layer's input freed after it but the embedding's,
    its head), the entropy of the policy's shifted logits, the chosen and rejected logits' means (every token a
    completion token: one (seq - 1)-row copy each), the reference's and the policy's fp32 logits and the
    reference's shifted copy freed as the function returns; the backward: each row's logsumexp's, unbind's (the
    shifted copy's gradient), gather's (accumulated in place), the slice's, the bf16 cast's, the head's input's
    and the autograd thread's cuBLAS ``workspace``, the final norm's. Returns the last layer's output gradient."""
    l32, shifted, nf = dpo_head(q, a, T, rows, x[-1], True)
    e = q.get(2 * T * a.h)
    prev = e
    for k in range(a.L):
        out = layer_forward(q, a, T, lora, nf4)
        if k:
            q.put(prev)
        prev = out
    rl32, rshifted, _ = dpo_head(q, a, T, rows, prev, False, e)
    entropy_chunks(q, T - rows, a.V)
    for _ in range(rows):
        q.put(q.get(FP32 * (T // rows - 1) * a.V))
    q.put(rl32, l32, rshifted)
    per_row = []
    for _ in range(rows):
        t = [q.get(FP32 * (T // rows - 1) * a.V) for _ in range(3)]
        q.put(t[0], t[1])
        per_row.append(t[2])
    g = q.get(FP32 * (T - rows) * a.V)
    q.put(*per_row)
    q.put(q.get(FP32 * (T - rows) * a.V), shifted)
    gl32 = q.get(FP32 * T * a.V)
    q.put(g)
    gl = q.get(2 * T * a.V)
    q.put(gl32)
    gx = q.get(2 * T * a.h)
    q.get(workspace)
    q.put(gl)
    return norm_backward(q, T, a.h, gx, nf, residual=False)


def dpo_step(q: Requests, a: Arch, T: int, rows: int, lora: tuple, workspace: int = CUBLAS_WORKSPACE,
             nf4: bool = False) -> list:
    """Step 1 of a streamed DPO run (``rows``: chosen and rejected, T tokens in all) up to its optimizer's step: the
    policy's checkpointed forward, dpo_loss, every layer's backward last to first, over streamed NF4 bases where
    ``nf4``. Returns the adapter's gradients (fp32; bf16 under NF4)."""
    x = [q.get(2 * T * a.h)] + layers_forward(q, a, T, lora, nf4)
    g = dpo_loss(q, a, T, rows, lora, x, workspace, nf4=nf4)
    return layers_backward(q, a, T, x, g, lora, nf4)


# -- what the estimate charges: the parameters' and step 1's AdamW states' rests, replayed --
#: The (model type, task) pairs whose whole step 1 was checked against a history through its optimizer's step
#: (Llama-3.2-1B SFT with LoRA dropout, Qwen2.5-0.5B DPO without), at one micro-batch; at 2 and 4 (``accumulated``)
#: the adapter's rests at the peak are at or below the replay's (accumulation-and-fused-traces-h100-*).
STEP_CHECKED = (("llama", "sft"), ("qwen2", "dpo"))


def step_replayed(a: Arch, quant: str, task: str, *, dropout: bool, accumulation: int, optimizer: str,
                  steps: int, **stack) -> bool:
    """Whether ``step_rests`` is the run's: its setup is (setup_replayed, ``stack`` its keywords), it is tied, its
    model type and task a pair STEP_CHECKED names, with LoRA dropout as checked (SFT keeping masks; TRL's DPO turns
    it off), any number of micro-batches (from the second on each gradient added into .grad in place:
    ``accumulated``), torch's foreach AdamW and a GQA model (SDPA's workspace, flash_backward); any number of steps
    (the replay runs through step 1's optimizer step, where a one-step run's states are made and may bind), but a
    one-step run with one micro-batch only (its held gradients are step 1's first micro-batch's, which the replay
    does not key). Checked on tied models only (Llama-3.2-1B SFT r64 2048x1 and, held out, r32 1024x1; Qwen2.5-0.5B
    DPO r64 2048x1 and r128 1024x1). Held out on other pairs, the replayed states depart under the history with the
    shape, not the tying: Llama-3.1-8B SFT r64 512x1 (untied: 3,670,016 B against 4,194,304; its DPO r32 1024 to the
    byte), Mistral-7B SFT r64 512x1 (4,194,304 against 6,291,456; its r32 at 1,024 to the byte), Qwen2.5-0.5B SFT
    r64 1024x1 (tied: 3,604,480 against 5,242,880). So only STEP_CHECKED's pairs, tied, are admitted; an untied
    llama's SFT keeps its setup's charge alone."""
    return (setup_replayed(a, quant, task, **stack) and a.tied and (a.model_type, task) in STEP_CHECKED
            and dropout == (task == "sft") and optimizer == "adamw_torch" and a.kv != a.heads
            and (steps > 1 or accumulation == 1))


def step_rests(a: Arch, targets: tuple, r: int, task: str, seq: int, batch: int, accumulation: int = 1) -> dict:
    """The setup, step 1 (sft_step or dpo_step, ``accumulation`` micro-batches: from the second on each new gradient
    added into .grad and freed, ``accumulated``) and its AdamW step replayed on an allocator whose new segments go
    below the earlier ones (the histories' driver placement): what the adapter's parameters (both copies under DPO)
    and step 1's states keep past their requests, live together from step 2 on, and the gradients: step 1's, or
    under accumulation step 2's first micro-batch's, held through its others. Checked: both bf16 histories' to the
    byte at one micro-batch (Llama-3.2-1B SFT 0 and 0; Qwen2.5-0.5B DPO 9,764,864 and 6,094,848 B); at 2 and 4
    micro-batches at or above the H100 histories' adapter rests at their peaks (Qwen's states and held gradients
    3,014,656 B over)."""
    q = Requests()
    q.alloc = CachingAllocator(descending=True)
    dpo = task == "dpo"
    params = setup(q, a, targets, r, reference=dpo)
    rows = batch * (2 if dpo else 1)
    lora = (targets, r, not dpo)

    def micro_batch(later: bool) -> list:
        q.accumulating = later
        return (dpo_step if dpo else sft_step)(q, a, seq * rows, *((rows,) if dpo else ()), lora)

    grads = [g for m in range(accumulation) for g in micro_batch(m > 0)]
    states = adamw_step(q, adapter_elements(a, targets, r), MATERIALISED, "adamw_torch")
    if accumulation > 1:
        q.put(*grads)  # zero_grad(set_to_none)
        grads = micro_batch(False)
    return {"parameters": q.rests(params), "states": q.rests(states), "gradients": q.rests(grads)}


# -- the layer walk: what the blocks the step makes keep past their requests while the layers' backward binds --
#: The runs whose layer walk was held against a history of their own (model type, quant, task; an untied model):
#: Mistral-7B NF4 SFT (1024x2) and DPO (512x1), Llama-3.1-8B NF4 SFT (1024x1, 512x1 r16 all-linear), H100. A tied
#: model's setup and a bf16 run with a small-pool adapter have none: the bound.
WALK_CHECKED = (("mistral", "nf4", "sft"), ("mistral", "nf4", "dpo"), ("llama", "nf4", "sft"))


class Watched(Requests):
    """Requests that keep, while ``watching``, the most the blocks made once ``counting`` hold past their requests
    at once, less the ``skip`` keys' (the adapter's gradients and states: their own terms charge them)."""

    def __init__(self, alloc: CachingAllocator, skip: frozenset = frozenset()):
        super().__init__()
        self.alloc, self.skip = alloc, skip
        self.counting, self.watching, self.live, self.most, self.counted = False, False, 0, 0, {}

    def get(self, nbytes: int):
        k = super().get(nbytes)
        if k is not None and self.counting and k not in self.skip and self.held[k].rest:
            self.counted[k] = self.held[k].rest
            self.live += self.counted[k]
        if self.watching:
            self.most = max(self.most, self.live)
        return k

    def put(self, *keys) -> None:
        super().put(*keys)
        for k in keys:
            self.live -= self.counted.pop(k, 0)


def small_pool_adapter(a: Arch, targets: tuple, r: int, task: str, quant: str) -> bool:
    """Whether every LoRA matrix, and so its gradient and its states, is a small-pool block (1 MiB or less): such an
    adapter never shares a segment with the layers' blocks."""
    return block_bytes(adapter_bytes(task, quant) * max(adapter_elements(a, targets, r))) <= K_SMALL_SIZE


def walk_replayed(a: Arch, quant: str, task: str, T: int, targets: tuple, r: int, *, optimizer: str, steps: int,
                  workspace: int, card: Dispatch | None = None, **stack) -> bool:
    """Whether ``walked_rests`` is the run's: an untied run WALK_CHECKED names (its setup and step held against a
    history: dense, GQA, no per-head q/k norm), with or without LoRA dropout's masks (the SFT histories keep them,
    the DPO one has none, TRL turning dropout off: the layer's requests without them are its), a small-pool adapter
    (small_pool_adapter; on the two committed histories whose adapter blocks are over 1 MiB and share the layers'
    segments, Qwen2.5-0.5B DPO bf16 r128 and Mistral-7B NF4 r64, both 3 steps, the walk came out 0.25 and 0.5 MiB
    under), any number of micro-batches (walked: a later micro-batch's large-pool requests are the first's), an
    optimizer whose step is built where a second step runs, the default cuBLAS ``workspace``, the stack
    stack_replayed takes (``stack``: soup-cli SETUP_RELEASE's default streaming, its two slots, transformers
    SEQUENCE_TRANSFORMERS, the default allocator), and a token count at which no decoder shape runs bitsandbytes'
    fused gemm_4bit (that arm's forward makes no dequantised weight; it is not built): on ``card`` where it is known
    (its one answer, gemm4bit.fused_shapes: Mistral-7B at 512 tokens dequantises on an H100 or H200), else on any
    card (gemm4bit.may_fuse: the walk is refused at 512 tokens or fewer)."""
    checked = ((a.model_type, quant, task) in WALK_CHECKED and not a.tied and a.layers is None and not a.qk_norm
               and a.kv != a.heads and small_pool_adapter(a, targets, r, task, quant))
    unfused = quant != "nf4" or not any_fused(a, T, card)
    stepped = steps == 1 or optimizer in BUILT_OPTIMIZERS
    return checked and unfused and stepped and workspace == CUBLAS_WORKSPACE and stack_replayed(**stack)


def _walk(a: Arch, targets: tuple, r: int, task: str, seq: int, batch: int, nf4: bool, dropout: bool, steps: int,
          accumulation: int, optimizer: str, descending: bool, skip: frozenset = frozenset()) -> tuple:
    """The setup, then (at most two) steps of (at most two) micro-batches: the forward, the loss, every layer's
    backward watched (from the second micro-batch on each gradient added into .grad: ``accumulated``), the optimizer's
    step past step 1's (its states), zero_grad. Returns (the most watched, the adapter's gradient and state keys)."""
    dpo = task == "dpo"
    rows = batch * (2 if dpo else 1)
    q = Watched(CachingAllocator(descending=descending), skip)
    setup(q, a, targets, r, reference=dpo, quant="nf4" if nf4 else "none")
    q.counting, lora, adapter = True, (targets, r, dropout), []
    for step in range(min(steps, 2)):
        grads = []
        for micro in range(min(accumulation, 2)):
            q.accumulating = micro > 0
            x = [q.get(2 * seq * rows * a.h)] + layers_forward(q, a, seq * rows, lora, nf4)
            g = dpo_loss(q, a, seq * rows, rows, lora, x, nf4=nf4) if dpo else sft_loss(q, a, seq * rows, x[-1])
            q.watching = True
            grads += layers_backward(q, a, seq * rows, x, g, lora, nf4)
            q.watching = False
        if steps > 1:
            per = adapter_bytes(task, "nf4" if nf4 else "none")
            adapter += adamw_step(q, adapter_elements(a, targets, r), per, optimizer, first=step == 0)
        q.put(*grads)  # zero_grad(set_to_none)
        adapter += grads
    return q.most, adapter


# -- NF4's step: the adapter's rests, replayed under both placements --
#: The (model type, task) pairs of untied NF4 runs whose adapter's rests were held against histories of their own
#: through step 1 (nf4_step_rests): Mistral-7B SFT (r64 1024x1, r64 1024x2 accumulating) and Llama-3.1-8B SFT (r64
#: 1024x1, r64 2048x1 one step), H100, LoRA dropout on (their masks kept). DPO is not: on Mistral-7B r64 512x1 its
#: gradients keep 25,165,824 B, the replay's 24,117,248. Other ranks and targets are admitted on the same build.
NF4_STEP_CHECKED = (("mistral", "sft"), ("llama", "sft"))


def nf4_step_replayed(a: Arch, quant: str, task: str, T: int, targets: tuple, r: int, *, dropout: bool,
                      optimizer: str, workspace: int, card: Dispatch | None = None, **stack) -> bool:
    """Whether ``nf4_step_rests`` is the run's through step 1 (a later step's gradients land in other free blocks
    than step 1's, and the replay's do not settle: 22-24.6 MB over ten Mistral-7B r64 1024x1 steps; from step 2 on only
    the parameters' rests are the replay's, placed_rests'): an untied NF4 run
    NF4_STEP_CHECKED names (dense, GQA, no per-head q/k norm: the layers walk_replayed builds) with its LoRA dropout
    masks, an adapter with blocks over 1 MiB (a small-pool one has no rest to replay), torch's foreach AdamW
    (adamw_step's), the default cuBLAS ``workspace``, stack_replayed's stack, and a token count at which no decoder
    shape runs bitsandbytes' fused gemm_4bit on ``card`` (or on any card where it is not known: walk_replayed's
    rule)."""
    checked = (quant == "nf4" and (a.model_type, task) in NF4_STEP_CHECKED and not a.tied and a.layers is None
               and not a.qk_norm and a.kv != a.heads and dropout and not small_pool_adapter(a, targets, r, task, quant))
    return (checked and optimizer == "adamw_torch" and workspace == CUBLAS_WORKSPACE
            and not any_fused(a, T, card) and stack_replayed(**stack))


def _nf4_step(a: Arch, targets: tuple, r: int, task: str, seq: int, batch: int, dropout: bool, accumulation: int,
              descending: bool) -> dict:
    """The NF4 setup and step 1 (up to two micro-batches: sft_step or dpo_step, from the second on each gradient
    added into .grad and freed; then foreach AdamW's step, adamw_step) on one placement of new segments: the rests
    the adapter's parameters (both copies under DPO), step 1's gradients (its first micro-batch's: held through the
    others) and its states keep."""
    dpo = task == "dpo"
    rows = batch * (2 if dpo else 1)
    q = Requests()
    q.alloc = CachingAllocator(descending=descending)
    params, lora, grads = setup(q, a, targets, r, reference=dpo, quant="nf4"), (targets, r, dropout), []
    for micro in range(min(accumulation, 2)):
        q.accumulating = micro > 0
        grads += (dpo_step(q, a, seq * rows, rows, lora, nf4=True) if dpo
                  else sft_step(q, a, seq * rows, lora, nf4=True))
    states = adamw_step(q, adapter_elements(a, targets, r), adapter_bytes(task, "nf4"), "adamw_torch")
    return {"parameters": q.rests(params), "gradients": q.rests(grads), "states": q.rests(states)}


_NF4_STEPS: dict = {}


def nf4_step_rests(a: Arch, targets: tuple, r: int, task: str, seq: int, batch: int, *, dropout: bool,
                   accumulation: int = 1) -> dict:
    """What an NF4 run's adapter blocks keep past their requests through step 1 (the parameters, step 1's gradients
    and its states: _nf4_step), replayed under both placements of new segments (below the earlier ones, as the
    driver placed most of the committed histories', and after them, the default), each set's larger taken. The
    driver's own placement (it reuses ranges empty_cache released) is neither. Charged where nf4_step_replayed admits
    the run, in place of steady.unsplit_remainders' bound of 1 MiB a block: the parameters,
    and in a one-step run step 1's gradients, at or above the four committed H100 histories' own whose sets can be told
    apart by their sizes. Not charged: the states (and the optimizer's temporaries after them, not replayed), made in
    one burst at the optimizer's step in the free blocks step 1's backward leaves. Started from a history's own free
    blocks there, the burst keeps that history's states' rests to the byte; but the replayed backward leaves other
    free blocks (Mistral-7B r64 1024x1: 9 and 10 lone freed 8 MiB hidden-state blocks against the history's 12, each
    a 1.75 MiB state's 1 MiB rest), so the histories' states keep more on three of four (Mistral-7B r64 1024x1
    15,990,784 B against 13,631,488; Llama-3.1-8B r64 2048x1 6,815,744 against 5,505,024;
    tests/estimator/test_streamed_sequence.py)."""
    key = (repr(a), targets, r, task, seq, batch, dropout, min(accumulation, 2))
    if key not in _NF4_STEPS:
        each = [_nf4_step(a, targets, r, task, seq, batch, dropout, accumulation, d) for d in (True, False)]
        _NF4_STEPS[key] = {k: max(e[k] for e in each) for k in each[0]}
    return _NF4_STEPS[key]


_WALKED: dict = {}


def walked_rests(a: Arch, targets: tuple, r: int, task: str, seq: int, batch: int, quant: str, *, dropout: bool,
                 steps: int = 1, accumulation: int = 1, optimizer: str = "adamw_torch") -> int:
    """The most the blocks a streamed step makes hold past their requests at once while its layers' backward runs
    (the layer phase), the adapter's gradients and states left out (their terms charge theirs), replayed from the
    setup through step 1 (and step 2 where ``steps`` > 1, each of up to two micro-batches) under both placements of
    new segments (below the earlier ones, as the driver placed the committed histories', and after them, the
    default), the larger taken: in place of layer_remainders' bound where walk_replayed admits the run. It counts
    every block the step made live at that moment, not only the binding layer's, so it may exceed the bound."""
    key = (repr(a), targets, r, task, seq, batch, quant, dropout, min(steps, 2), min(accumulation, 2),
           optimizer if steps > 1 else None)  # an Arch holds dicts: its repr keys it
    if key not in _WALKED:
        most = []
        for descending in (True, False):
            args = (a, targets, r, task, seq, batch, quant == "nf4", dropout, steps, accumulation, optimizer,
                    descending)
            # a small-pool adapter's blocks are never keys (recorder.Requests): nothing to leave out
            skip = () if small_pool_adapter(a, targets, r, task, quant) else _walk(*args)[1]
            most.append(_walk(*args, skip=frozenset(skip))[0])
        _WALKED[key] = max(most)
    return _WALKED[key]
