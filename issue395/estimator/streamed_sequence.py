"""A streamed LoRA step's steady-state requests for the adapter-shaped blocks, built from the estimator's own shapes
(``Arch``) and replayed through estimator/allocator.py, in sequence.py's ``Requests`` (issue 52 item 1: the rests
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

What is not built (what is left of issue 52 item 1, so the estimate keeps the bound on the gradients, states and
temporaries): that pool past the setup. Where the states and temporaries land is decided by the free blocks the
step 1 backward leaves: the streamed layers' forward, recompute and backward at their activation and weight sizes
(Qwen2.5 DPO's 1,245,184 B states cut from the tails of its activations' segments, 2,228,224 B and 1,835,008 B
blocks handed out whole), and before them by where the backward's own gradients landed (Mistral-7B NF4 r256's 7 MiB
gradients in freed 8 MiB hidden states). Replayed into fresh segments instead, the
parameters', gradients', states' and temporaries' rests are under the histories' on Phi-3-mini NF4 (13,107,200 B at
the loss, where the row needs 15,354,144 B past the split estimate) and Mistral-7B NF4 r256 (187,695,104 B at the
optimizer step against 241,355,528 B): ``fresh_rests`` says so, and is not charged.

What is built of that pool: the setup's, where the adapter's parameters sit (``setup``; the history starts after
it, so its start segments are the check, not its requests): soup-cli 0.77.0's
build_streamed_model (utils/layer_stream_runtime.py) on the card, in order: materialize_extras (the embedding),
materialize_meta_adapters (each LoRA matrix fp32, ``data.to(device)``, model.named_modules()'s order), the
LayerBufferPool (``stream_buffers`` slots, each a ``torch.empty`` per layer tensor in the layer spec's order), then
under DPO materialize_meta_adapter_copy (TRL 0.29's "ref" adapter: each default matrix cloned, in
named_parameters' order). Checked against both bf16 histories' start segments (the layout the window opened on:
tests/estimator/test_streamed_sequence.py): every large-pool segment the same blocks, requests and free rests
(Qwen2.5-0.5B DPO r64 all-linear: 144 adapter blocks, 9,764,864 B of rests; Llama-3.2-1B SFT: 48, none). Where it
is checked (``setup_replayed``) the estimate charges the parameters' rests it leaves (``placed_rests``) in place of
their bound; the gradients', states' and temporaries' keep it, their pool being the step's.

Of the step itself: step 1's forward through the streamed layers (``layers_forward``: each layer under Soup's
recompute keeps no graph, only its output as the next one's checkpointed input), both bf16 histories' large-pool
requests and frees in order (Llama-3.2-1B SFT 2,544, Qwen2.5-0.5B DPO's policy forward 2,568). Not charged: the
head, the loss, DPO's reference forward and the backward's recompute and gradients are not built yet.
"""

from __future__ import annotations

from ..constants import CUBLAS_WORKSPACE
from .arch import Arch
from .sequence import SEQUENCE_TRANSFORMERS, Requests, default_allocator, layer_parameters, norm, rotary
from .steady import OPTIMIZERS

#: The optimizers whose first step ``adamw_step`` builds: torch's AdamW, foreach (a square-root temporary per
#: parameter) and fused (none). bitsandbytes' and the others keep their states otherwise: not built.
BUILT_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")
#: The setup ``setup`` builds was checked on these (the bf16 histories' start segments): the model types, the tasks
#: (DPO's reference copy; SFT none), soup-cli's release, its pool's slots.
SETUP_TYPES, SETUP_TASKS, SETUP_RELEASE, SETUP_BUFFERS = ("llama", "qwen2"), ("sft", "dpo"), "0.77.0", 2
#: Bytes a LoRA element takes as materialize_meta_adapters makes it (``torch.empty(..., dtype=torch.float32)``).
MATERIALISED = 4


def adapter_elements(a: Arch, targets: tuple, r: int) -> list[int]:
    """Each LoRA matrix's elements in ``model.parameters()``'s order, the optimizer's: layer by layer, each target in
    the layer's module order (not the order the targets were named in), lora_A (r x in) then lora_B (out x r)."""
    ordered = [t for t in a.modules if t in targets]
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


def setup(q: Requests, a: Arch, targets: tuple, r: int, *, reference: bool, buffers: int = SETUP_BUFFERS,
          workspace: int = CUBLAS_WORKSPACE) -> list:
    """soup-cli 0.77.0's streamed setup on the card (the module's docstring): the embedding (a tied model's one
    vocab matrix), the adapter fp32, ``buffers`` slots of one layer's tensors in its modules' order, under
    ``reference`` (DPO) the adapter's copy, and the cuBLAS workspace (its own segment; made before the window).
    Returns the adapter's blocks' keys, both copies."""
    elements = adapter_elements(a, targets, r)
    q.get(2 * a.V * a.h)
    made = [q.get(MATERIALISED * n) for n in elements]
    for _ in range(buffers):
        for _, nbytes in layer_parameters(a, 0):
            q.get(nbytes)
    if reference:
        made += [q.get(MATERIALISED * n) for n in elements]
    q.get(workspace)
    return made


def setup_replayed(a: Arch, quant: str, task: str, *, release: str, transformers: str, stream: dict,
                   probed: bool, buffers: int, environ=None) -> bool:
    """Whether ``setup`` is the run's: a tied dense bf16 llama-type decoder (SETUP_TYPES), SFT or DPO, soup-cli
    SETUP_RELEASE with its default streaming (no training key, no probe: stream_vram_probe runs a step at setup, on
    the card before DPO's copy), SETUP_BUFFERS slots, transformers sequence.SEQUENCE_TRANSFORMERS (``transformers``:
    the release, its local tag dropped) and the default allocator: the two histories it was checked on."""
    return (a.model_type in SETUP_TYPES and a.layers is None and a.tied and quant == "none" and task in SETUP_TASKS
            and release == SETUP_RELEASE and not stream and not probed and buffers == SETUP_BUFFERS
            and transformers == SEQUENCE_TRANSFORMERS and default_allocator(environ))


def placed_rests(a: Arch, targets: tuple, r: int, reference: bool) -> int:
    """What the adapter's parameters (and DPO's copy) keep past their requests where ``setup`` places them: live
    from the setup on, in every phase of every step."""
    q = Requests()
    return q.rests(setup(q, a, targets, r, reference=reference))


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


def projection_forward(q: Requests, a: Arch, T: int, name: str, lora: tuple):
    """A linear's output with no graph kept: a LoRA target's (``lora``: targets, r, dropout) or a frozen one's."""
    fi, fo, _ = a.modules[name]
    targets, r, dropout = lora
    return lora_forward(q, T, fi, fo, r, dropout) if name in targets else q.get(2 * T * fo)


def layer_forward(q: Requests, a: Arch, T: int, lora: tuple):
    """One streamed decoder layer's checkpointed forward (transformers' llama-type layer, no graph kept): the input
    norm, q, k, v, q and k rotated (q's and k's projections freed), flash's output, o_proj, then as the attention's
    frame goes flash's output, the rotated q and k, v, and the normed input; the residual add, the post-attention
    norm, gate, its activation (gate freed), up, their product (the activation and up freed), down (the product and
    the normed input freed), the residual add (down and the first sum freed). Returns the layer's output: the next
    layer's checkpointed input, kept."""
    normed, _ = norm(q, T, a.h, False)
    qo, ko, vo = (projection_forward(q, a, T, m, lora) for m in ("q_proj", "k_proj", "v_proj"))
    qr, kr = rotary(q, T, a.heads * a.head_dim), rotary(q, T, a.kv * a.head_dim)
    q.put(qo, ko)
    sdpa = q.get(2 * T * a.heads * a.head_dim)
    o = projection_forward(q, a, T, "o_proj", lora)
    q.put(sdpa, qr, kr, vo, normed)
    mid = q.get(2 * T * a.h)
    q.put(o)
    normed2, _ = norm(q, T, a.h, False)
    gate = projection_forward(q, a, T, "gate_proj", lora)
    act = q.get(2 * T * a.i)
    q.put(gate)
    up = projection_forward(q, a, T, "up_proj", lora)
    prod = q.get(2 * T * a.i)
    q.put(act, up)
    down = projection_forward(q, a, T, "down_proj", lora)
    q.put(prod, normed2)
    out = q.get(2 * T * a.h)
    q.put(down, mid)
    return out


def layers_forward(q: Requests, a: Arch, T: int, lora: tuple) -> list:
    """Every layer's checkpointed forward in turn; returns their outputs (each kept as the next one's input)."""
    return [layer_forward(q, a, T, lora) for _ in range(a.L)]
