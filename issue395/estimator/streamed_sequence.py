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
requests and frees in order (Llama-3.2-1B SFT 2,544, Qwen2.5-0.5B DPO's policy forward 2,568); and each layer's
backward but the first's (``layer_backward``: the recompute torch's non-reentrant checkpoint stops after down_proj's
lora_A, then the autograd engine's order, each LoRA target's fp32 gradients made in it), every such layer of every
step of both histories (Llama 45 x 312 events, Qwen 69 x 228), each run of frees between two requests the same set.
Not charged: the head, the loss, DPO's reference forward and the first layer's backward are not built yet, so the
pool step 1's optimizer step meets is not either.
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
MATERIALISED = FP32 = 4
#: SDPA's backward workspace past its fp32 accumulators (flash_backward), as the four H100 histories request it.
FLASH_WORKSPACE_PAD = 256


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


# -- step 1's backward: each streamed layer's recompute (early-stopped) and its backward --

def lora_recompute(q: Requests, T: int, fi: int, fo: int, r: int, dropout: bool, stop: bool = False) -> tuple:
    """A LoRA target's forward recomputed with its graph: the base output, the fp32 cast, dropout's mask and
    output, the bf16 cast lora_A saves, lora_A's output lora_B saves (dropout's output freed), then lora_B's, the
    scaling, the sum; with ``stop`` (torch's non-reentrant checkpoint stops once the last tensor the backward
    unpacks is made: down_proj's lora_A output) nothing after lora_A. Returns (output, what it saved, what the stop
    leaves to free: the fp32 cast and the base output)."""
    base, x32 = q.get(2 * T * fo), q.get(4 * T * fi)
    mask = q.get(T * fi) if dropout else None
    drop = q.get(4 * T * fi) if dropout else None
    cast, a_out = q.get(2 * T * fi), q.get(2 * T * r)
    q.put(drop)
    saved = {"cast": cast, "a": a_out, "mask": mask, "fi": fi, "fo": fo, "r": r}
    if stop:
        return None, saved, [x32, base]
    b_out = q.get(2 * T * fo)
    scaled = q.get(2 * T * fo)
    q.put(b_out)
    out = q.get(2 * T * fo)
    q.put(scaled, base, x32)
    return out, saved, []


def layer_recompute(q: Requests, a: Arch, T: int, lora: tuple) -> tuple:
    """A layer's forward recomputed when its backward first unpacks (sequence.layer's resident forward with its
    graph, the input's norm saving its fp32 copy), stopped after down_proj's lora_A. Returns what its backward
    reads and what the stop leaves, in the order the unwound frames free it (down_proj's, the MLP's product, the
    post-attention norm's output, the first residual sum)."""
    targets, r, dropout = lora

    def target(name: str, stop: bool = False) -> tuple:
        fi, fo, _ = a.modules[name]
        return lora_recompute(q, T, fi, fo, r, dropout, stop)

    s = {}
    n1, s["n1"] = norm(q, T, a.h, True)
    outs = {}
    for m in ("q_proj", "k_proj", "v_proj"):
        outs[m], s[m], _ = target(m)
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
    fi, fo, r = s["fi"], s["fo"], s["r"]
    ga, gbw = q.get(2 * T * r), q.get(2 * fo * r)
    q.put(s["a"], scaled)
    grads = [q.get(FP32 * fo * r)]
    q.put(gbw)
    gc, gaw = q.get(2 * T * fi), q.get(2 * r * fi)
    q.put(s["cast"], ga)
    g32 = q.get(FP32 * T * fi)
    q.put(gc)
    grads.append(q.get(FP32 * r * fi))
    q.put(gaw)
    if s["mask"] is not None:
        gd = q.get(FP32 * T * fi)
        q.put(s["mask"], g32)
        g32 = gd
    gx = q.get(2 * T * fi)
    q.put(g32)
    if into is not None:
        q.put(gx)
        gx = into
    return gx, q.get(2 * T * fi), grads


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


def norm_backward(q: Requests, T: int, h: int, g, saved: list, x=None) -> None:
    """HF's RMSNorm's backward (bf16 in and out, fp32 inside, its weight frozen) on ``g``: the weight's product,
    its fp32 copy, x * rsqrt's two, mean's and pow's, the input's share cast to bf16 and accumulated in place into
    the residual's gradient; ``x`` (the layer's checkpointed input, at the input norm) freed with the rest."""
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
    q.put(gx, out)


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
    """SDPA's backward: dq, dk, dv, then its one workspace (fp32: the output gradient's accumulator a head and
    token, a second for the expanded heads' where k and v have fewer, the softmax's row sums, and 256 B; read off
    the four committed H100 histories, GQA and not), freed; then ``g`` and what the forward saved."""
    dq, dk = q.get(2 * T * a.heads * a.head_dim), q.get(2 * T * a.kv * a.head_dim)
    dv = q.get(2 * T * a.kv * a.head_dim)
    q.put(q.get(FP32 * T * a.heads * (a.head_dim * (2 if a.kv != a.heads else 1) + 1) + FLASH_WORKSPACE_PAD))
    q.put(g, s["qr"], s["kr"], s["v"], s["sdpa"])
    return dq, dk, dv


def attention_backward(q: Requests, a: Arch, T: int, s: dict, g) -> tuple:
    """o_proj's backward (on the residual's gradient ``g``, which stays), SDPA's, k's and q's rotary, v_proj's,
    then k_proj's and q_proj's each on a contiguous copy of its gradient. Returns the input norm output's gradient
    and the fp32 gradients made."""
    gsd, gb, grads = lora_backward(q, T, s["o_proj"], q.get(2 * T * a.modules["o_proj"][1]), None)
    q.put(gb)
    dq, dk, dv = flash_backward(q, a, T, gsd, s)
    rk = rotary_backward(q, T, a.kv * a.head_dim, dk)
    rq = rotary_backward(q, T, a.heads * a.head_dim, dq)
    gn1, gb, made = lora_backward(q, T, s["v_proj"], q.get(2 * T * a.modules["v_proj"][1]), None)
    q.put(dv, gb)
    grads += made
    for name, rot in (("k_proj", rk), ("q_proj", rq)):
        copy = q.get(2 * T * a.modules[name][1])
        q.put(rot)
        gn1, gb, made = lora_backward(q, T, s[name], q.get(2 * T * a.modules[name][1]), gn1)
        q.put(copy, gb)
        grads += made
    return gn1, grads


def layer_backward(q: Requests, a: Arch, T: int, x, g, lora: tuple) -> list:
    """One streamed layer's backward (not the first's) on its output's gradient ``g`` (accumulated in place through
    the layer: it leaves as the input's): down_proj's scaling gradient, the recompute and the stop's frees, the MLP's,
    the post-attention norm's, the attention's, the input norm's (``x``, the checkpointed input, freed). Returns the
    fp32 gradients made (the adapter's, held until the optimizer's step)."""
    scaled = q.get(2 * T * a.h)
    s, dead = layer_recompute(q, a, T, lora)
    q.put(*dead)
    gn2, grads = mlp_backward(q, a, T, s, scaled)
    norm_backward(q, T, a.h, gn2, s["n2"])
    gn1, made = attention_backward(q, a, T, s, g)
    norm_backward(q, T, a.h, gn1, s["n1"], x)
    return grads + made
