"""The layer phase: what a streamed step holds while Soup's checkpoint recomputes one decoder layer
inside the backward and runs its backward, layer by layer and at the two moments that bound it.
Stdlib only. Evidence: docs/PEAK.md, "The NF4 layer phase, read per phase".

The backward runs the layers last to first. At layer n's turn the checkpointed inputs of layers 0..n
are live (each later one was freed by its layer's backward) and so are the adapter gradients layers
n+1.. made. Inside the layer, two moments (``Moment``):

- the forward's end: the recomputed MLP's last linear is being dequantised (NF4). Every weight the
  layer's F.linear calls saved is live, and that one with its nested absmax expanded to fp32. Also
  live: what the recompute saved, the MLP's saved tensors and its product, the residual, the MLP's
  normed input, and the incoming gradient;
- the MLP backward's mul: the last linear's weight has been freed. Its input gradient and the two
  mul gradients sit beside the saved tensors (the MLP's saved i-sized tensors plus three).

A layer whose input needs no gradient (layer 0: the embedding is frozen; and every layer before the
first that holds a LoRA target) records no op on that input. F.linear then saves the weight only of
a linear downstream of a LoRA target. The input norm keeps no fp32 copy, and a target's dropout keeps
no mask. A layer with no target at or before it records nothing, so its backward never runs.

Known limitations:

- A linear's place in the layer is its stage (``STAGES``): the stages before it decide whether its
  input needs a gradient. A module no stage names counts as reading a gradient-carrying input
  (its weight saved). So does phi's fc1, which reads the layer's input in parallel with attention,
  in the walk. Both are the safe side. Without recompute (``retained_by_layer``) phi's MLP keeps
  nothing where the layer's input needs no gradient (``mlp_records``).
- Attention's saved tensors and the MLP's are charged in a layer that records anything, even where
  only a later linear carries a target (then the earlier ops record nothing). That is the safe side.
  A resident run's first layer with targets only on o_proj and the MLP is counted as it records
  (``quiet_layer``); the streamed step keeps the charge, its layer 0 never measured on such targets.
- A MoE kind's routed experts are counted as one MLP of their summed width at both moments (a bound:
  at the forward's end only the experts already run hold their tensors).
- stream_recompute off recomputes nothing. Its layer phase is the backward of the kind that holds
  most, with every linear's weight, as before the walk (retained_by_layer carries the rest).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..record import LORA_DROPOUT
from .arch import NF4_BLOCK, Arch, activation_bytes, fp32_residual
from .moe import Kind, expert_in_flight

#: nn.Dropout's saved mask, 1 B an input element. Soup's LoRA dropout defaults to 0.05 (LORA_DROPOUT), so
#: peft puts an nn.Dropout on every targeted module.
LORA_DROPOUT_MASK_BYTES = 1
#: The masks a phi layer's resid_dropout (one nn.Dropout, run twice: on attention's output and on the MLP's, before
#: the parallel sum; transformers 5.16.1 modeling_phi.py) keeps where the config's resid_pdrop writes one
#: (arch.MODEL_DROPOUTS), each h wide at the LoRA mask's 1 B an element.
RESID_DROPOUTS = 2
#: What the MLP backward makes beside the saved tensors: the down projection's input gradient and
#: the two gradients of act(gate) x up.
MLP_BACKWARD_TRANSIENTS = 3
#: A dense kind's i-sized tensors saved by its recompute: gate, act(gate), up (moe.Kind's MLP).
KIND_MLP_SAVED = 3

#: Where each linear reads its input in a decoder layer, upstream first. 0: the normed layer input.
#: 1: a latent made at stage 0. 2: attention's output projection. 3: the MLP's input projections,
#: which read the normed residual. 4: the MLP's last linear.
STAGES = {
    **dict.fromkeys(("q_proj", "k_proj", "v_proj", "qkv_proj", "q_a_proj", "kv_a_proj_with_mqa", "in_proj_qkv",
                     "in_proj_z", "in_proj_b", "in_proj_a"), 0),
    **dict.fromkeys(("q_b_proj", "kv_b_proj"), 1),
    **dict.fromkeys(("o_proj", "dense", "out_proj"), 2),
    **dict.fromkeys(("gate_proj", "up_proj", "gate_up_proj", "fc1", "shared_experts.gate_proj",
                     "shared_experts.up_proj", "shared_expert.gate_proj", "shared_expert.up_proj",
                     "shared_expert_gate"), 3),
    **dict.fromkeys(("down_proj", "fc2", "shared_experts.down_proj", "shared_expert.down_proj"), 4),
}
LAST_STAGE = 4


def mask_bytes(task, dropout: float = LORA_DROPOUT) -> int:
    """The bytes each LoRA dropout's mask takes an input element in a run of ``task`` (issue395.tasks.Task) at
    LoRA dropout p ``dropout`` (Soup's training.lora.dropout): LORA_DROPOUT_MASK_BYTES, or none where no kernel
    writes one: where the task's trainer turns dropout off (``dropout_disabled``: TRL 0.29.1's DPO, ORPO, CPO
    and KTO set every nn.Dropout's p to 0 at their init), and whatever the task where p is not in (0, 1) (peft
    builds nn.Identity for p <= 0; nn.Dropout at p 1 multiplies by a zero scalar), since ATen's dropout at p 0
    returns its input and only the fused kernel, for 0 < p < 1, writes a mask. Streamed and resident alike:
    Soup's StreamedDecoderLayer holds the peft layer as its child ``inner``, which TRL's
    disable_dropout_in_model reaches through model.modules(), and its forward, its checkpoint's recompute and
    stream_recompute off's retained body all run that same module through functional_call, which swaps its
    parameters and leaves the Dropout's p (soup-cli 0.73.3 and 0.77.0, layer_stream_runtime). Measured
    (resident): Llama-3.2-1B SFT 2048x1 keeps 30 blocks of 4,194,304 B (1 x h x T, q_proj and v_proj in layers
    1-15) at its loss peak, DPO at the same 2048 tokens none, every other block alike
    (results/resident-anatomy-*/call-1).

    Only the mask goes: the dropout's output (act x in a target, _lora) stays charged, because what it stands
    for is the input lora_A's matmul saves for its weight's gradient, which exists whether dropout writes a new
    tensor or returns its input. peft 0.20's LoRA forward first casts the target's input to lora_A's dtype
    (``_cast_input_dtype``: the fp32 adapter's, a copy); at p 0 dropout returns that copy, and lora_A's matmul
    saves it (or, under a resident run's bf16 autocast, its own bf16 cast of it). So the two anatomies above
    keep the same 64 blocks of 8,388,608 B (2 x h x T: q's and v's saved lora_A inputs, beside q and SDPA's
    output, in each of the 16 layers) in SFT and DPO alike. Where two targets could share one saved tensor (an
    adapter of the input's own dtype, no cast), charging each its own is a bound."""
    return 0 if task.dropout_disabled or not 0 < dropout < 1 else LORA_DROPOUT_MASK_BYTES


class Moment(Enum):
    """The two moments of one layer's turn in the backward (the module's docstring)."""

    FORWARD_END = "the recomputed forward's end"
    BACKWARD = "the MLP backward"


def _stage(name: str) -> int:
    return STAGES.get(name, 0)  # a module no stage names: upstream of every other, the safe side


def input_needs_grad(name: str, targets, input_grad: bool) -> bool:
    """Whether the input of linear ``name`` carries a gradient: the layer's input does, or a LoRA
    target sits at an earlier stage. A module no stage names always does."""
    return input_grad or name not in STAGES or any(_stage(t) < STAGES[name] for t in targets)


def saved_weights(quant: str, modules: dict, targets, input_grad: bool) -> int:
    """Bytes of the dequantised bf16 weights F.linear saves in one layer's recompute, NF4 only
    (bf16 weights are the pool). A weight is saved where its input carries a gradient: the backward
    needs W to reach the input."""
    if quant != "nf4":
        return 0
    return 2 * sum(fi * fo for n, (fi, fo, _) in modules.items() if input_needs_grad(n, targets, input_grad))


def dequantised_layer(a: Arch, quant: str, modules: dict | None = None) -> int:
    """W16: under NF4 Soup's _dequant_forward dequantises each linear to bf16 and F.linear saves
    it for backward: every linear of a layer whose input carries a gradient. ``modules``: one layer
    kind's linears (issue395.estimator.moe), else the dense layer's.
    Evidence: docs/PEAK.md, "Layer phase (binds only on short NF4 arms)"."""
    modules = a.modules if modules is None else modules
    return saved_weights(quant, modules, (), True)


def forward_end_weights(quant: str, modules: dict, targets, input_grad: bool) -> int:
    """The weights live as the recomputed forward ends: the saved ones, and the last linear being
    dequantised with its nested absmax expanded to fp32 (bitsandbytes' dequantize_4bit: 4 B per
    block of NF4_BLOCK). The measured temp is i x h / 64 x 4 B (ops.py:337)."""
    if quant != "nf4":
        return 0
    last = [fi * fo for n, (fi, fo, _) in modules.items() if STAGES.get(n) == LAST_STAGE] or [
        max(fi * fo for fi, fo, _ in modules.values())]
    unsaved = [fi * fo for n, (fi, fo, _) in modules.items()
               if STAGES.get(n) == LAST_STAGE and not input_needs_grad(n, targets, input_grad)]
    return saved_weights(quant, modules, targets, input_grad) + 2 * max(unsaved, default=0) + 4 * -(
        -max(last) // NF4_BLOCK)


def backward_weights(quant: str, modules: dict, targets, input_grad: bool) -> int:
    """The weights live at the MLP backward's mul: the saved ones less the last linears', whose
    backward has run and freed them."""
    if quant != "nf4":
        return 0
    last = {n: v for n, v in modules.items() if STAGES.get(n) == LAST_STAGE}
    return saved_weights(quant, modules, targets, input_grad) - saved_weights(quant, last, targets, input_grad)


def _lora(a_act: int, modules: dict, targets, r: int, input_grad: bool, mask: int) -> int:
    """Each LoRA target's dropout output (act x in) and lora_A's output (act x r), and its dropout's
    mask (``mask`` x in: mask_bytes) where the target's input carries a gradient."""
    # the dropout's output stays charged where p is 0, an upper bound: peft's nn.Identity there makes no new
    # tensor (lora_A saves the target's input itself), but no committed anatomy has shown that run's blocks
    return sum(a_act * modules[t][0] + a_act * r + (mask * modules[t][0]
                                                   if input_needs_grad(t, targets, input_grad) else 0)
               for t in targets if t in modules)


#: What an RMSNorm's multiply by its fp32 rstd (x * rsqrt(mean(x^2) + eps): Llama's, Qwen's, Mistral's, Gemma's,
#: and Qwen3's and Gemma-3's per-head q/k norms) saves beside the fp32 input, for that input's gradient: the rstd,
#: one fp32 element a row normed (a token, or a token's head). Charged wherever a norm's fp32 input is, in the
#: phases the input is (Mistral-7B at 32,768 tokens: 131,072 B a norm, 8,388,608 B over its 32 layers' two each).
RMS_RSTD_BYTES = 4


def layer_per_token(a: Arch, quant: str, targets: tuple, r: int, *, at: Moment = Moment.BACKWARD,
                    input_grad: bool = True, mask: int = LORA_DROPOUT_MASK_BYTES) -> int:
    """What one dense layer holds a token at moment ``at``, op by op (act = 2 B, 4 B for phi NF4
    whose residual is fp32). Each RMSNorm saves an fp32 copy of its input and its fp32 rstd (4h + 4:
    RMS_RSTD_BYTES; the input norm's only where the layer's input carries a gradient). Each LoRA module saves its dropout output and
    lora_A's output, and its mask where its input carries a gradient (_lora; ``mask``: mask_bytes).
    Rotary writes new q and k (act x (q + kv)). SDPA saves q, k, v, its output and fp32 logsumexp. Qwen3/Gemma-3 q/k
    norms save fp32 q and k and a rstd a head (4 x (heads + kv)). The MLP saves gate, act(gate) and up (phi's python gelu_new: 4 i-sized).
    At the MLP backward, add the incoming gradient (act x h) and MLP_BACKWARD_TRANSIENTS i-sized
    tensors: 258 KB/token on Mistral-7B. At the forward's end, add the incoming gradient, the
    residual and the MLP's normed input (3 x act x h) and the MLP's product (i): 217,248 B/token on
    Mistral-7B NF4 512 x 1, the measured live set to the byte (docs/PEAK.md, "The NF4 layer phase,
    read per phase")."""
    act = activation_bytes(a, quant)
    qw, kw = a.heads * a.head_dim, a.kv * a.head_dim
    norms = (a.norms - (0 if input_grad else 1)) if a.quirks.norm_inputs_saved else 0
    b = (4 * a.h + RMS_RSTD_BYTES) * norms + _lora(act, a.modules, targets, r, input_grad, mask)
    v = (qw + 2 * kw) if a.quirks.fused_qkv else kw  # phi3: v is a view of the fused qkv
    b += act * (qw + kw + v + qw) + 4 * a.heads
    b += 4 * (qw + kw) + RMS_RSTD_BYTES * (a.heads + a.kv) if a.qk_norm else 0
    b += LORA_DROPOUT_MASK_BYTES * a.h * resid_masks(a, targets, input_grad)
    saved = a.quirks.mlp_saved - MLP_BACKWARD_TRANSIENTS
    if at is Moment.BACKWARD:
        return b + act * a.h + act * a.i * a.quirks.mlp_saved
    return b + 3 * act * a.h + act * a.i * (saved + 1)


def resid_masks(a: Arch, targets: tuple, input_grad: bool) -> int:
    """The resid_dropout masks a layer keeps (RESID_DROPOUTS where the config's resid_pdrop writes them): attention's
    output carries a gradient in any layer that records (its targets), the MLP's only where it records (mlp_records:
    not in the first layer holding a target, whose input needs none). Charged whatever the task: where its trainer
    turns dropout off (TRL's DPO, ORPO, CPO, KTO: layer.mask_bytes) no mask is written, and the charge is a bound.
    Measured on CPU (bench/allocator_replay.py saved, phi-2 at reduced widths with resid_pdrop 0.1, tests/test_bench.py):
    a layer from 1 on keeps 2h more, bf16 and NF4 alike."""
    if "resid_pdrop" not in a.dropouts:
        return 0
    return RESID_DROPOUTS - (0 if mlp_records(a, targets, input_grad) else 1)


def expert_forward(a: Arch, k: Kind) -> int:
    """One routed expert's forward inside Soup's per-expert _ExpertMLP (no graph: nothing saved), a
    token it serves: gate_up's output, act(gate) and the product (2 x 4 expert_width), and its
    output (2h). A bound at every token: an expert serves each token at most once."""
    return 2 * 4 * k.expert_width + 2 * a.h


def expert_backward(a: Arch, k: Kind) -> int:
    """One routed expert's backward inside _ExpertMLP, a token it serves: its local recompute's graph
    (expert_forward), as many bytes again of gradients, and the incoming gradient (2h)."""
    return 2 * expert_forward(a, k) + 2 * a.h


def _mlp(a: Arch, k: Kind, at: Moment, per_expert: bool) -> int:
    """A kind's MLP at moment ``at``, a token. Dense or fused experts: one MLP of the kind's whole
    width, KIND_MLP_SAVED saved and the moment's own (MLP_BACKWARD_TRANSIENTS at the backward, the
    product at the forward's end), and each expert's gathered input and weighted output (top_k x 2 x
    2h). Soup's per-expert layout (soup_cli.utils.expert_stream._ExpertMLP) saves only the gathered
    input, and the weighting's mul the expert's output (the same top_k x 2 x 2h). Its intermediates
    live one expert at a time beside the shared experts' MLP, which runs after the routed ones (so
    the routed output, 2h, is live at the forward's end) and whose backward runs first."""
    routed = 8 * k.routed + 2 * k.top_k * 2 * a.h  # the router's fp32 logits and scores, 8 B an expert
    if not (per_expert and k.routed):
        width = k.mlp_width
        return routed + 2 * (KIND_MLP_SAVED + (MLP_BACKWARD_TRANSIENTS if at is Moment.BACKWARD else 1)) * width
    shared = k.shared_width
    if at is Moment.BACKWARD:
        return routed + max(2 * (KIND_MLP_SAVED + MLP_BACKWARD_TRANSIENTS) * shared, expert_backward(a, k))
    return routed + max(2 * a.h + 2 * (KIND_MLP_SAVED + 1) * shared, expert_forward(a, k))


def kind_per_token(a: Arch, k: Kind, targets: tuple, r: int, *, at: Moment = Moment.BACKWARD,
                   input_grad: bool = True, per_expert: bool = False, mask: int = LORA_DROPOUT_MASK_BYTES) -> int:
    """layer_per_token for one kind of a MoE, latent or hybrid layer (issue395.estimator.moe), op by
    op on the kind's own widths. Two RMSNorms' fp32 copies and rstd (4h + 4 each; the input norm's only
    where the input carries a gradient). Each LoRA target this kind has (_lora). Attention's q, k, v and output
    with fp32 logsumexp. The latent or delta-net widths in bf16 beside an fp32 norm copy (6 B), where
    a stage-0 linear's output carries a gradient. The MLP as a dense one (KIND_MLP_SAVED saved, and
    the moment's own as layer_per_token's). Routing: the router's fp32 logits and scores (8 B an
    expert), and each token's hidden state gathered for every expert it visits with its weighted
    output (2 x top_k x 2h). Evidence: DeepSeek-V3 NF4 512x1 (both layouts) and Moonlight's
    recompute-off arms, results/moe-and-stream-modes-*; Kimi K2's dense layer 0 at its forward's end
    (docs/PEAK.md, "The NF4 layer phase, read per phase")."""
    mine = tuple(t for t in targets if t in k.dequant)
    latent = input_grad or any(_stage(t) == 0 for t in mine)
    b = (4 * a.h + RMS_RSTD_BYTES) * (2 if input_grad else 1) + _lora(2, k.dequant, mine, r, input_grad, mask)
    b += 2 * k.attention_width + 4 * a.heads + (6 * k.extra_width if latent else 0)
    return b + (2 if at is Moment.BACKWARD else 3 * 2) * a.h + _mlp(a, k, at, per_expert)


def kind_transients(a: Arch, k: Kind, per_expert: bool = False) -> int:
    """What a kind's per-token count at the MLP backward frees before the next layer runs: its three
    i-sized gradients and the incoming gradient. The routed experts' gathered input stays charged as
    kept in both layouts. Moonlight recompute-off 2048 x 1's live set holds one top_k x 2h block a MoE
    layer (transformers' grouped_mm experts save only the expert output), but without the second
    Qwen3.5-MoE recompute-off is under its committed peaks (4096 x 1 by 43 MB, 2048 x 1 by 19 MB), so
    the safe side stays until a Qwen3.5-MoE history says why (issue 52). DeepSeek-V3's layers in bf16 keep
    what latent_retained counts, measured on CPU, in place of this (retained_by_layer). ``per_expert``: unused, kept for
    the callers' signature."""
    return 2 * MLP_BACKWARD_TRANSIENTS * k.mlp_width + 2 * a.h


def retained_by_layer(a: Arch, quant: str, targets: tuple, r: int, mask: int = LORA_DROPOUT_MASK_BYTES,
                      resident: bool = False) -> list[int]:
    """stream_recompute off: what each layer keeps per token for its backward, first to last (Soup's
    _body_retained: no checkpoint, so no saved input either): its count at the MLP backward less the
    transients. A layer before the first that holds a LoRA target keeps nothing: neither its input
    nor its weights need a gradient, so autograd records no graph there (Qwen3.5's q_proj and v_proj
    are in its full-attention layers only, every fourth). The first that holds one keeps what a layer
    whose input needs no gradient saves (layer 0 on a dense model: no input norm copy, no dropout
    mask). Targets no layer kind names keep every layer charged: the safe side. Not yet measured
    under NF4 (Soup's streamed path adds no input-gradient hook there either: soup_cli's stream setup
    never calls prepare_model_for_kbit_training). The fused expert count: per_expert is not modelled
    with stream_recompute off (its per-token count is charged, the safe side). A parallel MLP (phi) in the
    first such layer keeps nothing (``mlp_records``).
    Evidence: SmolLM2 512 x 1 and Moonlight bf16 2048 x 1, the live set at the loss peak
    (results/layer-walk-modes-h200-soup0.77.0-2798321/call-1); Qwen3.5-MoE (4 of 40 layers, q_proj
    and v_proj) keeps 129.5 KB a token at 2048 and 4096, all of it from layer 3 on
    (results/pages2-soup-patch-map4-modes-*/call-5 against call-4's). ``resident``: the MLP backward's transients
    and incoming gradient taken off at the activations' dtype (phi NF4's fp32: resident.kept_per_layer, held to
    the CPU count); the streamed step's stay at 2 B, never measured under phi NF4's fp32 residual there. ``resident``
    also counts a quiet first layer (quiet_layer: LoRA on o_proj and the MLP alone) as it records, checked on CPU and
    against the resident histories; the streamed step's layer 0 keeps the full first layer's count (the safe side:
    never measured on such targets)."""
    layers = _layer_kinds(a)
    first = _first_target(a, targets)
    quiet = quiet_layer(a, targets) if resident else None
    kept = []
    for n, (_, kind) in enumerate(layers):
        grad = n > first
        if n == quiet:
            kept.append(quiet_per_token(a, quant, targets, r, mask))
        elif kind is None:
            act = activation_bytes(a, quant)
            mlp = 0 if mlp_records(a, targets, grad) else act * a.i * (a.quirks.mlp_saved - MLP_BACKWARD_TRANSIENTS)
            off = act if resident else 2  # the transients' dtype: the activations' (phi NF4: 4 B) where measured
            kept.append(layer_per_token(a, quant, targets, r, input_grad=grad, mask=mask)
                        - off * (MLP_BACKWARD_TRANSIENTS * a.i + a.h) - mlp)
        elif n < first:
            kept.append(0)
        elif kind.latent_norms and quant == "none":
            kept.append(latent_retained(a, kind, targets, r, grad, mask))
        else:
            kept.append(kind_per_token(a, kind, targets, r, input_grad=grad, mask=mask) - kind_transients(a, kind))
    return kept


#: What DeepSeek-V3's router and grouped experts keep a token for each expert it visits, beside the experts'
#: output: its top-k index (int64), the sort's permutation, the gather's index and the inverse permutation (int64
#: each, per token-expert pair), the renormalised weights and their sorted copy (bf16 each), the sentinel mask (bool).
ROUTED_BOOKKEEPING = 8 + 3 * 8 + 2 * 2 + 1
#: The linear whose output each latent LoRA target reads (through its latent norm), not the layer's input.
LATENT_SOURCE = {"kv_b_proj": "kv_a_proj_with_mqa", "q_b_proj": "q_a_proj"}


def latent_retained(a: Arch, k: Kind, targets: tuple, r: int, input_grad: bool, mask: int) -> int:
    """What one DeepSeek-V3 layer (a moe.Kind with latent_norms: its dense first layers and its MoE layers) keeps
    a token for its backward without recompute, bf16, op by op: each RMSNorm's fp32 input and rstd (4h + 4; the
    input norm's only where the layer's input carries a gradient); each LoRA target's bf16 input (autocast's cast
    of its dropout output), lora_A's output and its dropout mask where its input carries a gradient: kv_b_proj and
    q_b_proj read a latent made from the layer's input by kv_a_proj_with_mqa and q_a_proj, so q_proj's adapter
    gives them none (LATENT_SOURCE); q, k, kv_b's whole output (v is its view) and SDPA's output, its fp32
    logsumexp; each latent norm's fp32 input and rstd where its latent carries a gradient (the latent itself and
    the rotary k are not kept: the norm keeps its fp32 copy, the rotary mul its tables); the MLP's three i-wide
    (dense gate, up, act; or the shared experts' three and the routed experts' fused gate_up output and act);
    and for routed experts, transformers' grouped_mm path (integrations/moe.py): the experts' output, which the
    routing weights' mul keeps (top_k x h, bf16; the gathered input is not kept, the experts' weights being
    frozen), the router's sigmoid scores (bf16 under autocast: its F.linear is on CUDA's lower-precision list),
    the top-k bookkeeping (ROUTED_BOOKKEEPING a pair) and the renormalisation's fp32 denominator. The streamed
    step's stream_recompute off, which this count also serves, runs no autocast, yet its router is bf16 too (the
    model's bf16 weight on a bf16 input): Moonlight recompute-off 2048x1's live set holds the router's logits
    and sigmoid scores as blocks of 262,144 B (2 x 64 experts x 2,048 tokens; fp32 would be 524,288) in each
    MoE layer (modeling_deepseek_v3.py:146-147) and the renormalised weights as 24,576 B (2 x top_k 6 x 2,048),
    results/layer-walk-modes-*/call-1: the bf16 figures stand for both.

    Measured on CPU (transformers 5.16.1, peft 0.20, Moonlight's full widths, 4 layers, q_proj and kv_b_proj at
    r 8, dropout 0.05, CUDA's bf16 autocast lists applied op by op, the saved tensors alive beside the loss,
    T 128 and 256): layer 0 keeps 105,572 B a token beside the rotary tables, each MoE layer 143,310, this
    count to the byte, alike for two routings (grouped_mm's blocks are top_k x T whatever the routing). The
    kinds' count (kind_per_token less kind_transients) charged 109,536 and 169,440: the gathered input beside
    the experts' output (24,576), the router's fp32 logits and scores (512 where 354 are kept), the latent at
    6 B a width (3,456 for 2,052) and, in layer 0, a latent and a mask q_proj's adapter does not reach. The
    method reproduces to the byte every block Qwen2.5 2048x1 resident keeps
    (results/resident-anatomy-*/call-1/res-sft-qwen-bf16-2048x1) and each MoE layer's blocks in Moonlight's
    streamed recompute-off live set at 2048 (results/layer-walk-modes-*/call-1: 33,792, 24,576, 16,896 and
    3 x 5,632 B a token of routed and shared MLP, one top_k x 2h block a layer)."""
    mine = tuple(t for t in targets if t in k.dequant)

    def carries(name: str) -> bool:  # whether linear ``name``'s input carries a gradient
        if name in LATENT_SOURCE:
            return input_grad or LATENT_SOURCE[name] in mine
        return input_needs_grad(name, mine, input_grad)

    b = (4 * a.h + 4) * (2 if input_grad else 1)
    b += sum(2 * k.dequant[t][0] + 2 * r + (mask * k.dequant[t][0] if carries(t) else 0) for t in mine)
    b += 2 * k.attention_width + 4 * a.heads
    b += sum(4 * w + 4 for source, w in k.latent_norms if input_grad or source in mine)
    b += 2 * KIND_MLP_SAVED * k.mlp_width
    if k.routed:
        b += 2 * k.top_k * a.h + 2 * k.routed + ROUTED_BOOKKEEPING * k.top_k + 4
    return b


def _first_target(a: Arch, targets: tuple) -> int:
    """The first layer that holds a LoRA target (0 where no layer kind names one: the safe side)."""
    return next((n for n, (m, _) in enumerate(_layer_kinds(a)) if any(t in m for t in targets)), 0)


def quiet_layer(a: Arch, targets: tuple) -> int | None:
    """The layer whose attention records nothing up to SDPA, if any: the first that holds a LoRA target (its input
    needs no gradient: the embedding is frozen) where no target reads before o_proj (every one at STAGES 2-4: o_proj
    and the MLP's linears), on a plain decoder layer (two norms, gate and up unfused, the MLP after attention: phi's
    parallel one is ``mlp_records``'). Its q, k, v, norms and SDPA save nothing; with no o_proj target its
    post-attention norm saves nothing either, and its MLP only what its targets need (quiet_mlp_saved).
    Evidence: docs/PEAK.md, "quiet_layer"."""
    mine = [t for t in targets if t in a.modules]
    if (not mine or a.layers is not None or a.quirks.parallel_mlp or a.norms != 2 or "gate_proj" not in a.modules
            or any(STAGES.get(t, 0) < 2 for t in mine)):
        return None
    return _first_target(a, targets)


def quiet_mlp_saved(a: Arch, targets: tuple) -> int:
    """The i-wide tensors a quiet layer's MLP (quiet_layer) saves: every layer's under an o_proj target (its output
    needs a gradient); else act_fn's input and up under gate's LoRA (their outputs need one there), act(gate) under
    up's, none under down's alone."""
    if "o_proj" in targets:
        return a.quirks.mlp_saved - MLP_BACKWARD_TRANSIENTS
    return 2 * ("gate_proj" in targets) + ("up_proj" in targets)


def quiet_per_token(a: Arch, quant: str, targets: tuple, r: int, mask: int) -> int:
    """What a quiet layer (quiet_layer) keeps a token, at the activations' bytes: under an o_proj target a first
    layer's count (retained_by_layer's) less what SDPA and the q/k norms would save; else its targets' LoRA saves (a
    mask only on down's input, where gate or up is a target) and its MLP's saved tensors."""
    act = activation_bytes(a, quant)
    if "o_proj" in targets:
        qw, kw = a.heads * a.head_dim, a.kv * a.head_dim
        sdpa = act * (2 * qw + 2 * kw) + 4 * a.heads + (4 * (qw + kw) + RMS_RSTD_BYTES * (a.heads + a.kv)
                                                         if a.qk_norm else 0)
        return (layer_per_token(a, quant, targets, r, input_grad=False, mask=mask)
                - act * (MLP_BACKWARD_TRANSIENTS * a.i + a.h) - sdpa)
    return _lora(act, a.modules, targets, r, False, mask) + act * a.i * quiet_mlp_saved(a, targets)


def mlp_records(a: Arch, targets: tuple, input_grad: bool) -> bool:
    """Whether a dense layer's MLP records anything for its backward. A plain layer's MLP reads the residual
    after attention, which carries a gradient from any attention target. phi's (``parallel_mlp``) reads the
    normed layer input beside attention: where that input needs no gradient (the first layer holding a
    target: the embedding is frozen) and fc1 is not a target, neither its LayerNorm nor its fc1, gelu_new and fc2
    record an op; an fc2 target records its own LoRA alone (its input, gelu_new's output, needs no gradient there).
    Measured on CPU (transformers 5.16.1, peft 0.20, phi-2's widths, q_proj and v_proj at r 8, CUDA's bf16 autocast
    lists applied to each op): layer 0 saves 30,880 B a token, its attention's and adapters' tensors alone, where
    retained_by_layer charged 112,800 and autocast_upcasts 71,688 more; at reduced widths (bench/allocator_replay.py
    saved) on fc2 alone, 656 B a token, where the count charged the whole MLP while any MLP linear was a target
    (6,696 B; 1,696 now, layer 0's attention still counted whole: quiet_layer leaves phi out)."""
    if not a.quirks.parallel_mlp or input_grad:
        return True
    return any(STAGES.get(t, 0) == 3 for t in targets if t in a.modules)


def layer_blocks(a: Arch, quant: str, targets: tuple, r: int, T: int, peak: "LayerPeak") -> list[int]:
    """The blocks (requested bytes) a dense layer's turn holds at ``peak``'s layer and moment besides the
    checkpointed inputs and the gradients: each weight F.linear saved or is dequantising (NF4), block by
    block as forward_end_weights and backward_weights sum them, and each of the T-token tensors
    layer_per_token counts, one block a width. None for a MoE or hybrid kind, whose count sums widths as a
    bound (moe.Kind), nor for stream_recompute off (no walk)."""
    if a.layers is not None or peak.layer is None:
        return []
    act, input_grad = activation_bytes(a, quant), peak.layer > 0
    mine = tuple(t for t in targets if t in a.modules)
    weights = []
    if quant == "nf4":
        saved = {n: 2 * fi * fo for n, (fi, fo, _) in a.modules.items() if input_needs_grad(n, mine, input_grad)}
        last = {n: fi * fo for n, (fi, fo, _) in a.modules.items() if STAGES.get(n) == LAST_STAGE}
        if peak.moment is Moment.FORWARD_END:
            unsaved = [2 * v for n, v in last.items() if n not in saved]
            biggest = max(last.values(), default=0) or max(fi * fo for fi, fo, _ in a.modules.values())
            weights = list(saved.values()) + sorted(unsaved)[-1:] + [4 * -(-biggest // NF4_BLOCK)]
        else:
            weights = [v for n, v in saved.items() if n not in last]
    qw, kw = a.heads * a.head_dim, a.kv * a.head_dim
    norms = (a.norms - (0 if input_grad else 1)) if a.quirks.norm_inputs_saved else 0
    widths = [(4, a.h), (RMS_RSTD_BYTES, 1)] * norms
    for t in targets:
        fan_in = a.modules[t][0]
        widths += [(act, fan_in), (act, r)] + ([(peak.mask, fan_in)]
                                                if peak.mask and input_needs_grad(t, targets, input_grad) else [])
    widths += [(act, qw), (act, kw), (act, (qw + 2 * kw) if a.quirks.fused_qkv else kw), (act, qw), (4, a.heads)]
    widths += [(4, qw), (4, kw), (RMS_RSTD_BYTES, a.heads), (RMS_RSTD_BYTES, a.kv)] if a.qk_norm else []
    widths += [(LORA_DROPOUT_MASK_BYTES, a.h)] * resid_masks(a, targets, input_grad)
    if peak.moment is Moment.BACKWARD:
        widths += [(act, a.h)] + [(act, a.i)] * a.quirks.mlp_saved
    else:
        widths += [(act, a.h)] * 3 + [(act, a.i)] * (a.quirks.mlp_saved - MLP_BACKWARD_TRANSIENTS + 1)
    return weights + [b * w * T for b, w in widths]


def checkpointed_through(a: Arch, quant: str, T: int, n: int) -> int:
    """The saved inputs of layers 0..n, 2h B a token each; phi NF4 4h after layer 0, whose output
    makes the residual fp32 (PEAK: phi-2 NF4 2048x1 325.1 MB and 2048x4 1,300.2 MB above bf16 =
    31 T h 2)."""
    return T * a.h * ((2 + 4 * n) if fp32_residual(a, quant) else 2 * (n + 1))


@dataclass(frozen=True)
class LayerPeak:
    """The layer phase at its binding layer and moment, in bytes: the layer's weights (NF4), its
    activations (T x the moment's per-token count), Soup's expert in flight, the checkpointed inputs
    still live, and the adapter's gradients made before it. ``layer`` is None for stream_recompute
    off (no walk: the kind that holds most). ``mask``: the bytes a LoRA dropout's mask took an input
    element in its count (mask_bytes), which its blocks (layer_blocks) list alike."""

    layer: int | None
    moment: Moment
    weights: int
    activations: int
    expert: int
    checkpointed: int
    gradients: int
    mask: int = LORA_DROPOUT_MASK_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.expert + self.checkpointed + self.gradients


def _layer_kinds(a: Arch) -> list[tuple[dict, Kind | None]]:
    """Each layer's linears and its kind (None: the dense layer), first to last."""
    if a.layers is None:
        return [(a.modules, None)] * a.L
    order = a.layers.order or (0,) * a.L
    return [(a.layers.kinds[j].dequant, a.layers.kinds[j]) for j in order]


def layer_peak(a: Arch, quant: str, targets: tuple, r: int, T: int, *, per: int, held: bool,
               per_expert: bool, recompute: bool = True, mask: int = LORA_DROPOUT_MASK_BYTES) -> LayerPeak:
    """The largest of every layer's two moments in the backward's walk (the module's docstring).
    ``per``: bytes an adapter gradient takes. ``held``: gradient accumulation past 1, so micro-batch 2
    accumulates into gradients already held (estimate's held_gradients) and makes none. ``mask``: the
    bytes a LoRA dropout's mask takes an input element (mask_bytes: none where the trainer turns dropout off)."""
    layers = _layer_kinds(a)
    grads = [0 if held else per * sum(r * (m[t][0] + m[t][1]) for t in targets if t in m) for m, _ in layers]

    def count(kind, at, input_grad):
        if kind is None:
            return layer_per_token(a, quant, targets, r, at=at, input_grad=input_grad, mask=mask)
        return kind_per_token(a, kind, targets, r, at=at, input_grad=input_grad, per_expert=per_expert, mask=mask)

    def expert(kind):
        return expert_in_flight(a.layers.expert, quant) if per_expert and kind is not None and kind.routed else 0

    if not recompute:
        best = max(((dequantised_layer(a, quant, m), T * count(k, Moment.BACKWARD, True), expert(k))
                    for m, k in {id(k): (m, k) for m, k in layers}.values()), key=sum)
        # the first layer's backward runs beside every other's gradients. No checkpoint saves a layer's
        # input (SmolLM2 512 x 1's live set holds none), yet the step holds more than the count without
        # them: 3.2 MB at 512 (the allocator's blocks above their requests, 5.6 MB there) and 50-110 MB on
        # SmolLM2 2048 and Qwen3.5-MoE 2048/4096, with no history to name it. The inputs stay charged, the
        # safe side, until one does (issue 52).
        return LayerPeak(None, Moment.BACKWARD, *best, checkpointed_through(a, quant, T, a.L - 1), sum(grads[1:]),
                         mask)
    peaks = []
    for n, (modules, kind) in enumerate(layers):
        mine = [t for t in targets if t in modules]
        if not mine and not any(t in m for m, _ in layers[:n] for t in targets):
            continue  # nothing at or before it carries a gradient: its backward never runs
        input_grad = any(t in m for m, _ in layers[:n] for t in targets)
        inputs, made = checkpointed_through(a, quant, T, n), sum(grads[n + 1:])
        peaks.append(LayerPeak(n, Moment.FORWARD_END, forward_end_weights(quant, modules, mine, input_grad),
                               T * count(kind, Moment.FORWARD_END, input_grad), expert(kind), inputs, made, mask))
        peaks.append(LayerPeak(n, Moment.BACKWARD, backward_weights(quant, modules, mine, input_grad),
                               T * count(kind, Moment.BACKWARD, input_grad), expert(kind), inputs,
                               made + grads[n], mask))
    if not peaks:  # no target in any layer: estimate refuses such targets before this
        raise ValueError("no layer holds a LoRA target")
    return max(peaks, key=lambda p: p.total)


#: The bytes autocast's fp32 ops make one element of what they save: layer_norm and pow are on CUDA autocast's
#: float32 list (torch's autocast_mode.cpp), so each casts its bf16 input to fp32 and saves that copy.
AUTOCAST_FP32 = 4


#: The bytes of one element of the bf16 copy autocast's lower-precision ops (linear, SDPA) make of an fp32 input.
AUTOCAST_BF16 = 2


def autocast_upcasts(a: Arch, quant: str, mlp: bool = True) -> tuple[list[tuple[int, int]], int]:
    """The blocks, as (bytes an element, width) a token, that a layer keeps under Hugging Face's bf16 autocast (a
    resident run's: Soup's streamed step runs without it, and the shared counts are measured there) where the
    count charges other ones, and the bytes a token of the count's they replace. nn.LayerNorm (``norm_bias``:
    phi's input_layernorm, transformers 5.16.1 modeling_phi.py) runs in fp32 and saves its input's fp32 copy
    and its fp32 mean and rstd (4 B a token each), none of which the count charges (under NF4 the residual is
    fp32 already, and the input itself is what it saves). phi's python gelu_new (activations.py
    NewGELUActivation, ``mlp_saved`` 7) calls torch.pow, which autocast runs in fp32: its input's fp32 copy
    (which pow saves), tanh's output and 1 + tanh (which the last mul saves) are fp32, where the count charges
    three bf16 (0.5 x stays bf16); under NF4 the count charges them fp32 already (fp32_residual). ``mlp``
    False: a layer whose LayerNorm and MLP record nothing (mlp_records), which keeps neither.

    phi3's fused qkv under NF4: bitsandbytes' Linear4bit returns its input's dtype, the fp32 residual's, so
    the fused output is fp32, and SDPA (on CUDA autocast's lower-precision list) casts q, k and v to bf16 and
    saves those copies: v is its own kv-wide bf16 block, not a view that keeps the fused output alive (the
    count's charge, right in bf16, where v is a view of the bf16 fused output SDPA saves as it is). Measured on
    CPU (transformers 5.16.1, peft 0.20, bitsandbytes 0.50.2's Linear4bit, Phi-3-mini's widths, qkv_proj at
    r 8, CUDA's autocast lists applied to each op): a layer saves 156,824 B a token, the count 169,104 with
    v's 18,432 where 6,144 are kept."""
    blocks, replaced = [], 0
    if a.norm_bias and mlp:
        blocks += [(AUTOCAST_FP32, a.h), (AUTOCAST_FP32, 1), (AUTOCAST_FP32, 1)] * a.norms
    if a.quirks.mlp_saved == 7 and not fp32_residual(a, quant) and mlp:
        blocks += [(AUTOCAST_FP32, a.i)] * 3
        replaced += 3 * activation_bytes(a, quant) * a.i
    if a.quirks.fused_qkv and quant == "nf4" and not fp32_residual(a, quant):
        qw, kw = a.heads * a.head_dim, a.kv * a.head_dim
        blocks += [(AUTOCAST_BF16, kw)]
        replaced += activation_bytes(a, quant) * (qw + 2 * kw)
    return blocks, replaced


def autocast_per_token(a: Arch, quant: str, mlp: bool = True) -> int:
    """What autocast_upcasts adds to a layer's count a token."""
    blocks, replaced = autocast_upcasts(a, quant, mlp)
    return sum(b * w for b, w in blocks) - replaced


def autocast_casts(a: Arch, quant: str, targets: tuple, r: int) -> int:
    """What a layer's count charges a token over the bf16 copies autocast's lower-precision ops save where the
    residual stream is fp32 (phi under NF4, fp32_residual), as a (negative) addition: F.linear saves the bf16 cast
    of its fp32 input, so each LoRA target's lora_A keeps its dropout output's bf16 copy (in) and lora_B lora_A's
    bf16 output (r), and SDPA keeps its bf16 copies of q, k, v and its bf16 output, where the count charges each
    at the activations' 4 B. Measured on CPU (transformers 5.16.1, peft 0.20, bitsandbytes 0.50.2's Linear4bit,
    phi-2's widths, q_proj and v_proj at r 8, CUDA's autocast lists applied to each op: bench/allocator_replay.py
    saved phi-2 --quant nf4): a layer from 1 on saves 210,088 B a token, four fp32 gelu_new tensors (163,840), the
    LayerNorm's fp32 input, mean and rstd (10,248), 20,480 of SDPA's q, k, v and output (bf16) and 128 of its
    fp32 logsumexp (4 B x 32 heads), and 15,392 of the adapters' (bf16, and the 1 B masks); layer 0 30,880 beside
    its rotary tables."""
    if not fp32_residual(a, quant):
        return 0
    act, qw, kw = activation_bytes(a, quant), a.heads * a.head_dim, a.kv * a.head_dim
    widths = sum(a.modules[t][0] + r for t in targets if t in a.modules) + 2 * qw + 2 * kw
    return (AUTOCAST_BF16 - act) * widths


def autocast_by_layer(a: Arch, quant: str, targets: tuple, r: int = 0) -> list[int]:
    """What autocast_upcasts adds to each dense layer's retained count a token, first to last (retained_by_layer's
    layers): none before the first layer that holds a target (it records nothing), that one's without its
    LayerNorm and MLP where they record nothing (mlp_records), the full addition from the next on; and from the
    first on, where the residual is fp32, the bf16 copies its linears and SDPA save (autocast_casts, LoRA r ``r``)."""
    first = _first_target(a, targets)
    casts = autocast_casts(a, quant, targets, r)
    return [0 if n < first else autocast_per_token(a, quant, mlp_records(a, targets, n > first)) + casts
            for n in range(a.L)]
