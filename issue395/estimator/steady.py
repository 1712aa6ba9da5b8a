"""What a streamed step's optimizer and gradients hold: each optimizer's states, from step 2 on, in
the adapter's dtype or bitsandbytes' own; the adapter's gradients inside a step's phases (one
micro-batch, or held between micro-batches); the rests their blocks may hold under the default allocator, phase
by phase. Stdlib only; estimate.py sums them into the peak."""

from __future__ import annotations

from dataclasses import dataclass

from ..constants import unsplit_rests
from ..tasks import task as task_named
from .arch import Arch
from .recorder import FP32
from .terms import Term

LORA_WEIGHT_BYTES = 4  # fp32 LoRA weights (PEAK "Resident")
#: bf16 LoRA weights: the task's trainer casts them under a 4-bit model (tasks.Task.adapter_bf16_under_4bit).
#: Evidence: docs/PEAK.md, "adapter_bytes".
LORA_WEIGHT_BYTES_BF16 = 2


def adapter_bytes(task: str, quant: str) -> int:
    """Bytes a LoRA parameter takes, and with it its gradient and a torch optimizer's state of it:
    fp32, or bf16 where the task's trainer casts the adapter under a 4-bit model.
    Evidence: docs/PEAK.md, "adapter_bytes"."""
    return LORA_WEIGHT_BYTES_BF16 if quant == "nf4" and task_named(task).adapter_bf16_under_4bit else LORA_WEIGHT_BYTES


# -- The steady state: what an optimizer keeps from step 2 on --
#: bitsandbytes' 8-bit optimizers keep a tensor under 4,096 elements in fp32 (``min_8bit_size``)
#: and the rest in uint8 with an fp32 absmax per 256-element block; the paged ones put a state of
#: 100,000 elements or more in CUDA managed memory, outside torch's allocator (bitsandbytes 0.50
#: optim/optimizer.py: init_state, get_state_buffer).
BNB_MIN_8BIT, BNB_BLOCK, BNB_PAGED_FROM = 4096, 256, 100_000


@dataclass(frozen=True)
class Optimizer:
    """What one optimizer Soup names (``training.optimizer``) keeps per LoRA tensor."""

    states: int  # moments per parameter (Adam 2, Lion 1, SGD without momentum 0)
    bits: int  # 32, or 8 for bitsandbytes' blockwise states
    paged: bool  # bitsandbytes' paged variant
    #: copies of the parameter (in its dtype) made and freed inside ``step``: torch's foreach AdamW
    #: makes exp_avg_sq's square root (``_multi_tensor_adam``: ``torch._foreach_sqrt``); the fused
    #: and the bitsandbytes kernels update in place
    transient: int = 0
    #: torch's optimizers make each state ``torch.zeros_like(param)``: the parameter's dtype (bf16
    #: where the trainer cast the adapter); bitsandbytes' 32-bit states are fp32 whatever the
    #: parameter (optim/optimizer.py ``get_state_buffer(p, dtype=torch.float32)``)
    states_follow_param: bool = False


OPTIMIZERS = {
    "adamw_torch": Optimizer(2, 32, False, 1, True),
    "adamw_torch_fused": Optimizer(2, 32, False, 0, True),
    "adamw_8bit": Optimizer(2, 8, False), "adamw_bnb_8bit": Optimizer(2, 8, False),
    "paged_adamw_8bit": Optimizer(2, 8, True), "paged_adamw_32bit": Optimizer(2, 32, True),
    "lion_8bit": Optimizer(1, 8, False), "lion_32bit": Optimizer(1, 32, False),
    "paged_lion_8bit": Optimizer(1, 8, True), "paged_lion_32bit": Optimizer(1, 32, True),
    "sgd": Optimizer(0, 32, False, 0, True),
}
#: An optimizer the table has no entry for (adafactor, adamw_hf, ...) is charged as an upper bound, said as
#: one (issue 53 item 14): two fp32 states per parameter (Adam's two moments, the most any optimizer above
#: keeps; Adafactor's factored row and column states are far fewer) and two fp32 copies of every parameter
#: inside its step (Adafactor's update and its factored square, a for-each kernel's scratch), whatever the
#: adapter's dtype. No optimizer the table holds is charged more.
UPPER_BOUND = Optimizer(2, 32, False, 2, False)
#: Optimizers Soup's allowlist takes that keep more than UPPER_BOUND's states, so the bound would be under them:
#: refused, never charged as the bound. GrokAdamW (the grokadamw package transformers builds it from) makes three
#: states per parameter, each ``torch.zeros_like(p)``: exp_avg, exp_avg_sq and grok_ema.
ABOVE_BOUND = {"grokadamw": "three states per parameter (exp_avg, exp_avg_sq, grok_ema)"}


def optimizer_named(name: str) -> Optimizer:
    """``name``'s entry, or for one the table has no entry for, ``UPPER_BOUND``."""
    return OPTIMIZERS.get(name, UPPER_BOUND)


def is_bounded(name: str) -> bool:
    """Whether ``name``'s states are charged as ``UPPER_BOUND`` (the table has no entry for it)."""
    return name not in OPTIMIZERS


def bound_words(name: str) -> str:
    """The words that label every figure charged with ``UPPER_BOUND``."""
    return (f"an upper bound: training.optimizer {name} is not modelled, so its states are charged as two fp32 "
            "states per LoRA parameter and its step as two fp32 copies of the adapter, more than any optimizer the "
            f"estimator models ({', '.join(OPTIMIZERS)})")


def lora_tensors(a: Arch, targets: tuple, r: int) -> list[int]:
    """Each LoRA parameter tensor's element count: lora_A (r x fan_in) and lora_B (fan_out x r) per
    target per layer."""
    return [n for t in targets for n in (r * a.modules[t][0], r * a.modules[t][1])] * a.L


def optimizer_state_bytes(sizes: list[int], name: str, per: int = FP32) -> int:
    """The bytes ``name``'s states hold in torch's allocator for LoRA tensors of ``sizes`` elements
    whose parameters take ``per`` bytes each."""
    return sum(b for n in sizes for b in state_blocks(n, name, per))


def steady_terms(a: Arch, targets: tuple, r: int, optimizer: str, per: int = FP32) -> dict:
    """From step 2 on: the optimizer's states, beside every phase of the step (made at step 1's
    ``optimizer.step``); and at each ``optimizer.step`` the adapter's gradients (in its dtype,
    ``per`` bytes; the Trainer's ``zero_grad`` sets them to None after the step, so the next step's
    first micro-batch has none) and the optimizer's own transients."""
    sizes = lora_tensors(a, targets, r)
    n = sum(sizes)
    return {Term.OPTIMIZER_STATES.key: optimizer_state_bytes(sizes, optimizer, per),
            Term.ADAPTER_GRADIENTS.key: per * n,
            Term.OPTIMIZER_TRANSIENTS.key: optimizer_named(optimizer).transient
            * (FP32 if is_bounded(optimizer) else per) * n}


def state_blocks(n: int, name: str, per: int = FP32) -> list[int]:
    """The blocks ``name``'s states of one LoRA tensor of ``n`` elements take in torch's allocator (one
    allocation each: a moment, or an 8-bit state and its absmax), as optimizer_state_bytes sums them."""
    o = optimizer_named(name)
    if o.paged and n >= BNB_PAGED_FROM:
        return []
    if o.bits == 8 and n >= BNB_MIN_8BIT:
        return [n, FP32 * -(-n // BNB_BLOCK)] * o.states
    return [(per if o.states_follow_param else FP32) * n] * o.states


def unsplit_remainders(a: Arch, targets: tuple, r: int, optimizer: str, per: int, *, steps: int,
                       reference: int, accumulation: int = 1, placed: int | None = None,
                       states: int | None = None, held: int | None = None, grads: int | None = None) -> dict:
    """The most the adapter-shaped blocks can hold past their requests under the default allocator
    (constants.unsplit_bound: up to 1 MiB each over 1 MiB), each charged in the phases its blocks are live in: beside
    every phase, the adapter's parameters (``per`` bytes each) and DPO's reference copy (``reference`` bytes a
    parameter; 0: none), the gradients held between
    micro-batches (accumulation > 1) and from step 2 on the optimizer's states (unsplit_remainders); with one
    micro-batch the gradients the backward makes, live from the layer phase to the optimizer's step (the Trainer's
    zero_grad sets them to None after it, so the next step's loss has none: gradient_remainders); the optimizer's own
    transients, inside its step only, and in a one-step run the states it makes there (transient_remainders). A block not live in a phase holds no
    rest there, so each phase's sum is the bound over the blocks live in it. ``placed``: the rests the parameters
    and the reference copy keep where the setup that places them is replayed (streamed_sequence.placed_rests), charged
    in place of their bound; ``states``: the rests step 1's optimizer states keep where that step is replayed
    (streamed_sequence.step_rests), in place of theirs; ``held``: the rests the gradients held between
    micro-batches keep where that replay ran them too, in place of theirs; ``grads``: the rests a replayed NF4 step's
    gradients keep with one micro-batch (streamed_sequence.nf4_step_rests), in place of theirs.
    Evidence: docs/PEAK.md, "unsplit_remainders"."""
    sizes = lora_tensors(a, targets, r)
    beside = [] if placed is not None else [per * n for n in sizes] + [reference * n for n in sizes if reference]
    beside += [per * n for n in sizes] * (accumulation > 1 and held is None)
    made = [b for n in sizes for b in state_blocks(n, optimizer, per)]
    if steps > 1 and states is None:
        beside += made
    # a one-step run's states are made inside its optimizer step and live only there: their rests with its transients
    made_rests = 0 if steps > 1 else (unsplit_rests(made) if states is None else states)
    transient = FP32 if is_bounded(optimizer) else per
    t = {Term.UNSPLIT_REMAINDERS.key: unsplit_rests(beside) + (placed or 0) + ((states or 0) if steps > 1 else 0)
         + ((held or 0) if accumulation > 1 else 0),
         Term.GRADIENT_REMAINDERS.key: (unsplit_rests(per * n for n in sizes) if grads is None else grads)
         if accumulation == 1 else 0,
         Term.TRANSIENT_REMAINDERS.key: unsplit_rests([transient * n for n in sizes]
                                                      * optimizer_named(optimizer).transient) + made_rests}
    return {k: v for k, v in t.items() if v}


def gradient_terms(per: int, n: int, accumulation: int, made: int) -> dict:
    """The adapter's ``n`` gradients (``per`` bytes each) inside a step's phases. With accumulation > 1,
    micro-batch 2 on runs with every gradient micro-batch 1 made (autograd accumulates into ``.grad``
    in place until the optimizer's step): live through its loss, reference forward and layer phase.
    With one micro-batch the backward makes them layer by layer, last to first, freeing each layer's
    checkpointed input as it goes: ``made`` is what the layers run before the binding one made
    (issue395.estimator.layer's walk). Evidence: docs/PEAK.md, "gradient_terms"."""
    if accumulation > 1:
        return {Term.HELD_GRADIENTS.key: per * n}
    return {Term.BACKWARD_GRADIENTS.key: made}
