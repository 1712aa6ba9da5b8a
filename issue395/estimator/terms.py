"""The corrected estimator's terms, each declared once: its key, the phases of the step it is live
in, its physical class, and the words the legends use for it. The estimator sums its phases from
this table, the anatomy charges a live class against the terms of the binding phase from it, and
the fit table's legend lists the terms from it. Stdlib only.

A physical class is one of the categories torch's memory tracker documents
(``torch.distributed._tools.mem_tracker._MemRefType``: Parameter, Buffer, Gradient, Activation,
Temp, Optstate, Other); the values here are its values, so a term reads in its words.
"""

from __future__ import annotations

from enum import Enum


class Phase(Enum):
    """Where in a streamed step a term's bytes are live. ``Estimate.phase`` names the binding one
    by its value: the loss, the reference forward (a preference loss's no-grad second forward, made
    after the policy's and before its backward: the policy's graph and its loss tensors are held), the layer
    recompute and backward, or the optimizer's step (its moments, the gradients and its own transients)."""

    RESIDENT = "resident"  # allocated before the step, live through all of it
    LOSS = "loss"
    REFERENCE = "reference"
    LAYER = "layer"
    OPTIMIZER = "optimizer"
    STEADY = "steady state"  # from step 2 on, beside whichever phase binds
    ALLOWANCE = "allowance"  # added once, outside every phase


class Kind(Enum):
    """A term's physical class, as torch's mem_tracker names its categories (_MemRefType)."""

    PARAM = "Parameter"
    BUFFER = "Buffer"
    GRAD = "Gradient"
    ACT = "Activation"
    TEMP = "Temp"
    OPT = "Optstate"
    OTH = "Other"


_R, _LO, _RF, _LA, _OP, _ST, _AL = (Phase.RESIDENT, Phase.LOSS, Phase.REFERENCE, Phase.LAYER,
                                    Phase.OPTIMIZER, Phase.STEADY, Phase.ALLOWANCE)
#: live through the loss, the reference forward and the layer recompute: the step's shared terms
_STEP = frozenset({_LO, _RF, _LA})


class Term(Enum):
    """Each term: (key, the phases it is live in, its class, its words in the legend, the condition
    it appears under: None for a term every estimate carries). The order is the estimate's."""

    POOL = ("pool", {_R}, Kind.PARAM, "pool", None)
    #: a resident run (stream_layers off): every parameter on the card at its dtype, in place of the pool and
    #: the extras (issue395.estimator.resident)
    RESIDENT_WEIGHTS = ("resident_weights", {_R}, Kind.PARAM, "every layer's weights on the card",
                        "stream_layers off")
    EXTRAS = ("extras", {_R}, Kind.PARAM, "extras", None)
    LORA_WEIGHTS = ("lora_weights", {_R}, Kind.PARAM, "LoRA weights", None)
    REFERENCE_ADAPTER = ("reference_adapter", {_R}, Kind.PARAM, "the reference adapter", "DPO on 0.77.0")
    CUBLAS_WORKSPACE = ("cublas_workspace", {_R}, Kind.OTH, "cuBLAS workspace", None)
    CUBLASLT_WORKSPACE = ("cublaslt_workspace", {_R}, Kind.OTH, "cuBLASLt workspace", "linears with a bias")
    LOGITS = ("logits", {_LO}, Kind.ACT, "logits", None)
    RESIDENT_ROUNDING = ("resident_rounding", {_R}, Kind.OTH, "resident rounding", None)
    ALLOCATOR_ROUNDING = ("allocator_rounding", {_LO}, Kind.OTH, "allocator rounding", None)
    CHECKPOINTED_INPUTS = ("checkpointed_inputs", _STEP, Kind.ACT, "checkpointed inputs", None)
    FINAL_NORM = ("final_norm", {_LO, _RF}, Kind.ACT, "final norm", None)
    IDS_LABELS = ("ids_labels", _STEP, Kind.BUFFER, "ids", None)
    KL_BATCH_IDS = ("kl_batch_ids", _STEP, Kind.BUFFER, "the KL batch's ids", "KTO")
    POSITION_IDS = ("position_ids", _STEP, Kind.BUFFER, "positions", None)
    ROTARY_TABLES = ("rotary_tables", _STEP, Kind.BUFFER, "rotary tables", None)
    SLIDING_MASK = ("sliding_mask", _STEP, Kind.BUFFER, "mask", None)
    #: a model class without SDPA (the installed transformers' source): its additive masks in the
    #: model's dtype, one per kind of layer, held by every checkpointed layer through the backward
    EAGER_MASKS = ("eager_masks", _STEP, Kind.BUFFER, "eager attention's masks", "eager attention")
    #: ...and in the recomputed layer its scores, softcapped, masked and softmaxed (a bound, op by op)
    EAGER_SCORES = ("eager_scores", {_LA}, Kind.TEMP, "eager attention's scores", "eager attention")
    HEAD_COPY = ("head_copy", {_LO, _RF}, Kind.TEMP, "the head's private copy", "DPO, KTO, untied, 0.77.0")
    REFERENCE_HELD = ("reference_held", {_RF}, Kind.ACT, "the policy's loss tensors", "DPO, KTO")
    DEQUANTISED_LAYER = ("dequantised_layer", {_LA}, Kind.TEMP, "the dequantised layer", None)
    LAYER_PER_TOKEN = ("layer_per_token", {_LA}, Kind.ACT, "per-token bytes", None)
    REFERENCE_LAYER = ("reference_layer", {_RF}, Kind.TEMP, "a no-grad layer's transients", "DPO, KTO")
    DEQUANTISED_LINEAR = ("dequantised_linear", {_RF}, Kind.TEMP, "a no-grad linear's dequantised weight",
                          "DPO, KTO, NF4")
    #: the no-grad forward's head, a moment of its own after its layers: what it holds there beyond their largest
    #: (estimate.head_beyond_layer)
    REFERENCE_HEAD = ("reference_head", {_RF}, Kind.TEMP, "the no-grad head's moment beyond a layer's", "DPO, KTO")
    AUTOGRAD_WORKSPACE = ("autograd_workspace", {_LA}, Kind.OTH, "the autograd workspace", None)
    EXPERT_IN_FLIGHT = ("expert_in_flight", {_LA}, Kind.TEMP, "the expert in flight", "per_expert")
    CHUNKED_LOSS = ("chunked_loss", {_LO}, Kind.TEMP, "the chunked loss", "stream_loss_chunk")
    #: stream_recompute off: every layer's activations through the loss (from the first layer that
    #: holds a LoRA target: before it autograd records nothing), and through a preference task's no-grad reference
    #: forward, which TRL runs after the policy's and before its backward (docs/PEAK.md, "reference_head")...
    RETAINED_ACTIVATIONS = ("retained_activations", {_LO, _RF}, Kind.ACT, "retained activations",
                            "stream_recompute off")
    #: ...what their blocks hold past their requests, wherever they are live (a resident run: estimator/resident.py's
    #: kept_rests, replayed or bounded; at the backward's first layer all of them are still held)...
    RETAINED_REMAINDERS = ("retained_remainders", {_LO, _RF, _LA}, Kind.OTH, "the retained blocks' rests",
                           "no checkpointing, resident")
    #: ...and at the backward's first layer, every other layer's (the one being run is its per-token count)
    RETAINED_BESIDE_LAYER = ("retained_beside_layer", {_LA}, Kind.ACT, "the other layers' retained activations",
                             "stream_recompute off")
    #: no checkpointing: each LoRA matrix's bf16 copy that autocast makes of the fp32 adapter, which its matmul
    #: saves for the backward (a reentrant checkpoint runs the forward without grad: none is kept there)
    ADAPTER_CASTS = ("adapter_casts", {_LO, _RF, _LA}, Kind.TEMP, "the adapter's bf16 copies",
                     "an fp32 adapter, no checkpointing")
    #: DPO's fp32 reference adapter (resident): the bf16 copy of each of its LoRA matrices that autocast caches
    #: through the reference's no-grad forward (estimator/resident.py's reference_adapter_casts)
    REFERENCE_ADAPTER_CASTS = ("reference_adapter_casts", {_RF}, Kind.TEMP, "the reference adapter's bf16 copies",
                               "DPO's fp32 reference adapter, resident")
    #: no checkpointing, a bf16 nn.LayerNorm (phi's): the fp32 copies of its weight and bias that autocast's fp32
    #: policy makes for layer_norm and native_layer_norm saves for its backward, at every LayerNorm whose input
    #: needs a gradient
    NORM_CASTS = ("norm_casts", {_LO, _RF, _LA}, Kind.TEMP, "the LayerNorms' fp32 weight copies",
                  "a bf16 LayerNorm, no checkpointing")
    #: the adapter's gradients as the backward makes them, at its first layer: every other layer's
    #: (one micro-batch; the layer phase takes the larger of this with one checkpointed input and
    #: every input with none)
    BACKWARD_GRADIENTS = ("backward_gradients", {_LA}, Kind.GRAD, "the gradients of the layers already run "
                          "backward", "one micro-batch")
    #: gradient accumulation: micro-batch 2 on runs with the gradients micro-batch 1 made
    HELD_GRADIENTS = ("held_gradients", _STEP, Kind.GRAD, "the gradients held between micro-batches",
                      "gradient_accumulation_steps > 1")
    #: the optimizer's step, in every run (step 1's makes the states there; from step 2 they are beside every phase)
    OPTIMIZER_STATES = ("adam_moments", {_ST, _OP}, Kind.OPT, "the optimizer's states", None)
    ADAPTER_GRADIENTS = ("adapter_gradients", {_OP}, Kind.GRAD, "the adapter's gradients", None)
    OPTIMIZER_TRANSIENTS = ("optimizer_transients", {_OP}, Kind.TEMP, "the optimizer's transients", None)
    #: the default allocator (the harness's step) hands a large-pool request a cached block whole when the rest
    #: would be 1 MiB or less: each adapter-shaped block over 1 MiB charged that 1 MiB in the phases it is live in;
    #: beside every phase the parameters, the reference copy, the held gradients and the optimizer's states...
    UNSPLIT_REMAINDERS = ("unsplit_remainders", {_LO, _RF, _LA, _OP}, Kind.OTH,
                          "the adapter blocks' unsplit remainders", "an adapter tensor over 1 MiB")
    #: ...with one micro-batch the gradients the backward makes, from the layer phase to the optimizer's step...
    GRADIENT_REMAINDERS = ("gradient_remainders", {_LA, _OP}, Kind.OTH, "the adapter gradients' unsplit remainders",
                           "an adapter tensor over 1 MiB, one micro-batch")
    #: ...and the optimizer's transients inside its step (in a one-step run the states it makes there too); none in
    #: needs_free (`soup train`'s expandable segments split every block at 512 B)
    TRANSIENT_REMAINDERS = ("transient_remainders", {_OP}, Kind.OTH, "the optimizer step's own blocks' unsplit "
                            "remainders", "an adapter tensor over 1 MiB")
    #: ...and the same allocator's rests in the blocks the binding layer's turn holds (its dequantised weights and
    #: its tokens' tensors: constants.layer_remainders), a dense layer's, in the layer phase only; not in needs_free
    LAYER_REMAINDERS = ("layer_remainders", {_LA}, Kind.OTH, "the binding layer's blocks' unsplit remainders",
                        "a dense layer's blocks over 1 MiB")
    #: ...and in the blocks the loss phase lists (its logits and hidden-sized blocks: estimate.loss_blocks) over
    #: 1 MiB and under 10 MiB, cut from 20 MiB segments (constants.cut_remainders; from 10 MiB their fresh segments'
    #: tails are the allocator rounding's); not in needs_free
    LOSS_REMAINDERS = ("loss_remainders", {_LO}, Kind.OTH, "the loss's blocks' unsplit remainders",
                       "a loss block over 1 MiB and under 10 MiB")
    #: ...and in the blocks the reference forward lists (the policy's held loss tensors, its no-grad linear's
    #: weight), none charged there before; not in needs_free
    REFERENCE_REMAINDERS = ("reference_remainders", {_RF}, Kind.OTH, "the reference forward's blocks' remainders",
                            "DPO, KTO")
    #: full fine-tuning (Soup's lora.r 0, resident; issue395.estimator.full.estimate_full): what a trained
    #: weight makes autograd keep at the head (its input and the final norm's normed tensor), the head's weight
    #: gradient made at the loss's backward, the embedding's backward at the walk's end (its fresh V x h gradient
    #: block and its kernel's fp32 partial sums), and every parameter's gradient at the optimizer's step
    HEAD_INPUT = ("head_input", {_LO, _RF}, Kind.ACT, "the head's saved input", "lora.r 0")
    HEAD_GRADIENT = ("head_gradient", {_LO}, Kind.GRAD, "the head's weight gradient", "lora.r 0")
    EMBEDDING_BACKWARD = ("embedding_backward", {_LA}, Kind.TEMP, "the embedding's backward", "lora.r 0")
    PARAMETER_GRADIENTS = ("parameter_gradients", {_OP}, Kind.GRAD, "every parameter's gradient", "lora.r 0")
    #: full fine-tuning on fp32 master weights under bf16 autocast (soup-cli 0.77.0's resolve_base_load_dtype;
    #: full.estimate_master): the bf16 copy autocast makes of each fp32 weight a matmul reads, held by its
    #: cast cache until the forward's autocast region exits and by the matmul's saved tensors for the backward:
    #: every one at the loss...
    WEIGHT_CASTS = ("weight_casts", {_LO}, Kind.TEMP, "autocast's bf16 copies of the fp32 weights",
                    "lora.r 0 on fp32 master weights")
    #: ...and in the layer phase those of the layers not yet run backward (with checkpointing, the recomputed
    #: layer's: its recompute is an autocast region of its own)
    LAYER_WEIGHT_CASTS = ("layer_weight_casts", {_LA}, Kind.TEMP, "the layer's bf16 weight copies",
                          "lora.r 0 on fp32 master weights")
    #: ...and what the optimizer step's blocks (every gradient, state and square root) hold past their requests at
    #: its peak, replayed from the step's request sequence (full_sequence.master_rests) where it was checked, in
    #: place of the 1 MiB a block those terms' held() charges elsewhere
    OPTIMIZER_REMAINDERS = ("optimizer_remainders", {_OP}, Kind.OTH, "the optimizer step's blocks' replayed remainders",
                            "lora.r 0 on fp32 master weights, replayed")
    ALLOCATED_ALLOWANCE = ("allocated_allowance", {_AL}, Kind.OTH, "the allowance", None)

    def __init__(self, key: str, phases: set, kind: Kind, words: str, when: str | None):
        self.key, self.phases, self.kind, self.words, self.when = key, frozenset(phases), kind, words, when


BY_KEY: dict[str, Term] = {t.key: t for t in Term}


def live_in(phase: Phase) -> tuple[str, ...]:
    """The keys of the terms live in ``phase``, in the table's order."""
    return tuple(t.key for t in Term if phase in t.phases)


def phases_of(key: str) -> tuple[str, ...]:
    """The phases term ``key`` is live in, by their values, in the step's order: each answer's term line marks
    its term with them (a resident estimate's and the fit table's), and its JSON carries them."""
    return tuple(p.value for p in Phase if p in BY_KEY[key].phases)


def phase_sum(terms: dict, phase: Phase) -> int:
    """The bytes an estimate's terms hold in ``phase``."""
    return sum(v for k, v in terms.items() if phase in BY_KEY[k].phases)


def words(inside: tuple, outside: tuple = ()) -> str:
    """The legend's words for the terms every estimate carries that are live in each phase of
    ``inside`` and in none of ``outside``, in the table's order."""
    return ", ".join(t.words for t in Term if t.when is None and set(inside) <= t.phases
                     and not set(outside) & t.phases)
