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

What is not built (what is left of issue 52 item 1, so the estimate keeps the bound): that pool. Where the states
and temporaries land is decided by the free blocks the step 1 backward leaves: the streamed layers' recompute and
backward at their activation and weight sizes (Qwen2.5 DPO's 1,245,184 B states cut from the tails of its
activations' segments, 2,228,224 B and 1,835,008 B blocks handed out whole), and before them by where the backward's
own gradients landed (Mistral-7B NF4 r256's 7 MiB gradients in freed 8 MiB hidden states) and by the load's
placement of the parameters (Soup's setup, before any history). Replayed into fresh segments instead, the
parameters', gradients', states' and temporaries' rests are under the histories' on Phi-3-mini NF4 (13,107,200 B at
the loss, where the row needs 15,354,144 B past the split estimate) and Mistral-7B NF4 r256 (187,695,104 B at the
optimizer step against 241,355,528 B): ``fresh_rests`` says so, and is not charged.
"""

from __future__ import annotations

from .arch import Arch
from .sequence import Requests
from .steady import OPTIMIZERS

#: The optimizers whose first step ``adamw_step`` builds: torch's AdamW, foreach (a square-root temporary per
#: parameter) and fused (none). bitsandbytes' and the others keep their states otherwise: not built.
BUILT_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")


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
