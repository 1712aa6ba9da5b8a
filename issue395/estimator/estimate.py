"""A corrected peak-VRAM estimate for one Soup layer-streamed LoRA step, from physical terms.

Beside it, Soup's OWN pre-flight for the same run: Soup's ``estimate_stream_peak_vram``, read
from the installed soup-cli's source with ``ast`` and executed in an isolated namespace, so
neither torch nor soup_cli is imported. Stdlib only. Evidence is cited as PEAK
(docs/PEAK.md, by section: a term's or constant's own is named for it).

peak = resident + max(loss phase, layer phase, optimizer step) [+ the optimizer's states beside every phase when
steps > 1; at step 1 they are made in its optimizer step]
"""

from __future__ import annotations

from dataclasses import dataclass

from ..constants import (CUBLAS_WORKSPACE, CUBLASLT_WORKSPACE, EXPANDABLE_PAGE_BYTES, K_MIN_LARGE_ALLOC,
                         K_ROUND_LARGE, K_SMALL_SIZE, STREAM_KEYS, block_bytes, cut_remainders,
                         layer_remainders)
from ..errors import InvalidRun, UsageError
from ..record import LORA_DROPOUT, LORA_R, QUANTS
from ..model.arm import DEFAULT_OPTIMIZER
from ..model.registry import config_json, stream_mode
from ..model.streaming import RECOMPUTES
from .arch import Arch, activation_bytes, arch_from_config, layer_bytes, lora_params, protocol_targets
from .attention import eager as eager_attention, eager_masks, eager_scores
from .layer import (LORA_DROPOUT_MASK_BYTES, checkpointed_through, kind_per_token, layer_blocks, layer_peak,
                    mask_bytes, retained_by_layer)
from ..model.targets import soup_targets
from ..tasks import PROTOCOL_TASK, task as task_named
from .releases import Features, installed_release
from .soup_number import arch_of, features, soup_preflight_from_config, vocab_matrices_resident
from .stacks import transformers_release
from .steady import LORA_WEIGHT_BYTES, adapter_bytes, gradient_terms, steady_terms, unsplit_remainders
from .recorder import ENTROPY_CHUNK_ROWS, FP32
from .gemm4bit import Dispatch
from .streamed_sequence import (nf4_step_replayed, nf4_step_rests, placed_rests, setup_replayed, step_replayed,
                                step_rests, walk_replayed, walked_rests)
from .terms import Phase, Term, phase_sum

# CUBLAS_WORKSPACE (constants) is kept on every card though torch gives less below sm 9
# (CUBLAS_WORKSPACE_PRE_HOPPER): charged at that size, most A10G record arms would be UNDER. A
# card's term only ever raises it. Evidence: docs/PEAK.md, "CUBLAS_WORKSPACE on every card".
#: Three fp32 logits-shaped buffers at the loss backward (PEAK "Loss phase"; the --snapshot
#: histories in results/record-h200x2-soup0.73.3-e7c26f7/ show exactly three fp32 logits blocks at the peak).
LOGITS_BYTES = 12
#: + the saved bf16 tanh output under final_logit_softcapping (PEAK: Gemma-2's 1.007x margin).
SOFTCAP_EXTRA_BYTES = 2
IDS_LABELS_BYTES_PER_TOKEN = 32  # input_ids, labels, attention mask, shifted labels: int64 each
POSITION_BYTES = 8  # int64 position ids, one row per position

# -- CUDA caching allocator: its constants and 512 B rounding are in issue395/constants.py --
#: Segments first made for hidden-sized tensors (4hT fp32: RMSNorm's input copy, square, product;
#: 2hT bf16), re-cut into checkpointed inputs whose last piece inherits the tail, live at the loss
#: peak: the most the measured arms show, not a traced count.
#: Evidence: docs/PEAK.md, "FP32_HIDDEN_SEGMENTS, BF16_HIDDEN_SEGMENTS".
FP32_HIDDEN_SEGMENTS, BF16_HIDDEN_SEGMENTS = 4, 3

# -- allowances: the only fitted numbers, each fitted on committed results only -------------
#: Allocated bytes the physics misses: max(real - physics, 0) over every committed arm, in
#: 0.5 MB steps (bench/estimator_checks.py leave-one-out fits it; a test checks it equals the all-family fit):
#: unattributed resident bytes and per-token bytes at batch > 1, left after the rounding is charged.
#: Evidence: docs/PEAK.md, "ALLOCATED_ALLOWANCE_BYTES".
ALLOCATED_ALLOWANCE_BYTES = 3_000_000
#: The allocator's reserve a card must hold above the allocated peak under expandable segments (what
#: `soup train` sets): the partial pages live blocks touch (at an OOM the allocator unmaps every wholly
#: free page and retries). It follows the gaps between live blocks, not their bytes: 26-216 MB at the
#: replayed peak of 8 arms of 1.25 to 14.9 GB, 54-230 MB in torch's OOM messages inside Soup's process.
#: Charged: the whole pages above the most measured. Evidence: docs/PEAK.md, "EXPANDABLE_RESERVE_PAGES".
EXPANDABLE_RESERVE_PAGES = 11
EXPANDABLE_RESERVE_BYTES = EXPANDABLE_RESERVE_PAGES * EXPANDABLE_PAGE_BYTES["large"]
#: The rests the default allocator leaves in blocks (shouldSplit), charged to the allocated peak only: `soup train`'s
#: expandable segments split every block at 512 B, so needs_free's allocated peak is without them
ADAPTER_RESTS = (Term.UNSPLIT_REMAINDERS, Term.GRADIENT_REMAINDERS, Term.TRANSIENT_REMAINDERS)
DEFAULT_ALLOCATOR_ONLY = tuple(t.key for t in (*ADAPTER_RESTS, Term.LAYER_REMAINDERS, Term.LOSS_REMAINDERS,
                                               Term.REFERENCE_REMAINDERS))


# -- The physical terms (bytes) --
def pool(a: Arch, quant: str, per_expert: bool = False, buffers: int = 2) -> int:
    """The streamed layer buffers (NF4 packed with absmax, or bf16): Soup's training.stream_buffers slots, 2 by
    default; a MoE or hybrid model's buffer holds the union of its layer kinds. Evidence: docs/PEAK.md, "pool"."""
    return buffers * layer_bytes(a, quant, per_expert)


def extras(a: Arch, f: Features) -> int:
    """Embedding, final norm, untied head. A release whose shard splits the untied pair (0.74.0 on)
    keeps one vocab slot for an untied model: every untied peak falls by V x h x 2
    (results/compare-untied-soup077-vs-073.txt)."""
    heads = vocab_matrices_resident(a, f)
    return 2 * a.V * a.h * heads + 2 * a.h * (2 if a.norm_bias else 1) + (
        2 * a.V if a.quirks.head_bias and not a.tied else 0)


def lora_weights(n: int, per: int = LORA_WEIGHT_BYTES) -> int:
    """LoRA A and B, ``per`` bytes a parameter (adapter_bytes; PEAK "Resident")."""
    return per * n


def logits(a: Arch, T: int) -> int:
    """The SFT loss's fp32 logits blocks at its binding moment (logits_blocks): at the loss backward 3 fp32
    buffers, 12 B/element; + 2 B under final softcapping, its saved bf16 tanh output (PEAK "Loss phase";
    --snapshot: three fp32 blocks, no bf16 one; Gemma-2 margin 1.007x)."""
    return sum(logits_blocks(a, T)) + (SOFTCAP_EXTRA_BYTES if a.softcap else 0) * T * a.V


def logits_blocks(a: Arch, T: int, entropy: bool = True) -> list[int]:
    """The fp32 logits-sized blocks SFT's loss holds at whichever of its two moments holds more with their
    segments' tails: the loss backward (the cross entropy's saved log_softmax, the gradient into it and the one
    out of it: 3 x 4TV), or, before it, TRL's entropy metric (accelerate's convert_outputs_to_fp32 copy of the
    logits beside the saved log_softmax, 2 x 4TV, and a chunk's log_softmax, exp and product, 3 x 4 x
    min(ENTROPY_CHUNK_ROWS, T) x V: more below 384 tokens a step). The H100 phi-2 NF4 512x1 trace holds both
    moments block for block (its 104,857,600 B fp32 copy, its 26,214,400 B chunks). ``entropy`` False: the
    backward's alone (Soup's chunked loss returns no logits, so no entropy is taken)."""
    backward = [4 * T * a.V] * 3
    if not entropy:
        return backward
    return heavier(backward, [4 * T * a.V] * 2 + [4 * min(ENTROPY_CHUNK_ROWS, T) * a.V] * 3)


def heavier(*moments: list[int]) -> list[int]:
    """Of a loss's moments (each the blocks it holds, requested bytes), the one holding more with its segments'
    tails: the one allocator_rounding's tails and the logits' bytes are charged at."""
    return max(moments, key=lambda b: sum(b) + sum(map(segment_tail, b)))


def checkpointed_inputs(a: Arch, quant: str, T: int) -> int:
    """Each layer's saved input, live through the loss (layer.checkpointed_through: 2hL B/token;
    phi NF4 (4L-2)h)."""
    return checkpointed_through(a, quant, T, a.L - 1)


def final_norm(a: Arch, T: int) -> int:
    """The final norm's fp32 copy of its input, 4h B/token, live at the loss peak (PEAK)."""
    return 4 * a.h * T


def ids_labels(T: int) -> int:
    """Token ids and labels, ~32 B/token (PEAK "Loss phase")."""
    return IDS_LABELS_BYTES_PER_TOKEN * T


def position_ids(seq: int) -> int:
    """int64 position ids, 8 B/position, batch-independent (PEAK)."""
    return POSITION_BYTES * seq


def rotary_tables(a: Arch, seq: int) -> int:
    """cos+sin, bf16, rotary dim x seq each: 4 x rd x seq per table; Gemma-3 keeps a global and a
    local one (PEAK "Loss phase"). DeepSeek-V3's latent attention keeps three fp32 tables of
    rd x seq (4 x rd x seq each). Evidence: docs/PEAK.md, "rotary_tables"."""
    return 4 * a.rotary_dim * seq * a.quirks.rotary_tables


def sliding_mask(a: Arch, seq: int, batch: int) -> int:
    """A bool seq x seq mask per row once seq >= the window; none below it (PEAK: Gemma-2 from
    4096, Gemma-3 from 512, Phi-3 from 2047)."""
    return seq * seq * batch if a.window and seq >= a.window else 0


def segment_tail(size: int) -> int:
    """Bytes a live block of ``size`` requested bytes holds past its request in the segment made
    for it: requests round to 512 B; from 10 MiB one gets its own segment rounded up to 2 MiB,
    split only if the rest exceeds 1 MiB, so a rest up to 1 MiB stays in the block and counts in
    memory_allocated (smaller requests are cut from shared 2/20 MiB segments: no tail).
    Evidence: docs/PEAK.md, "segment_tail"."""
    size = block_bytes(size)
    rest = -(-size // K_ROUND_LARGE) * K_ROUND_LARGE - size
    if size < K_MIN_LARGE_ALLOC:
        return 0
    return rest if rest <= K_SMALL_SIZE else 0


def resident_rounding(a: Arch, quant: str, f: Features, per_expert: bool = False, buffers: int = 2) -> int:
    """segment_tail of each resident tensor: every vocab matrix (materialize_extras) and each
    linear weight in every pool slot (LayerBufferPool: a torch.empty per tensor; NF4 packed n/2 B).
    Evidence: docs/PEAK.md, "resident_rounding"."""
    out = vocab_matrices_resident(a, f) * segment_tail(2 * a.V * a.h)
    if a.layers is not None:  # every tensor of the union buffer, in both slots
        sizes = {"bf16": 2, "fp32": 4, "expert": 0 if per_expert else 2}
        return out + sum(buffers * segment_tail(-(-n // 2) if kind == "linear" and quant == "nf4"
                                          else n * sizes.get(kind, 2))
                         for n, kind in a.layers.union if sizes.get(kind, 2))
    for fan_in, fan_out, _ in a.modules.values():
        n = fan_in * fan_out
        out += buffers * segment_tail(2 * n if quant == "none" else -(-n // 2))
    return out


def loss_blocks(a: Arch, T: int, entropy: bool = True) -> list[int]:
    """The blocks (requested bytes) the loss peak lists: the fp32 logits buffers (logits_blocks) and the
    hidden-sized ones (hidden_blocks)."""
    return logits_blocks(a, T, entropy) + hidden_blocks(a, T)


def hidden_blocks(a: Arch, T: int) -> list[int]:
    """The hidden-sized blocks live at the loss peak (*_HIDDEN_SEGMENTS): 4hT fp32 and 2hT bf16."""
    return [4 * T * a.h] * FP32_HIDDEN_SEGMENTS + [2 * T * a.h] * BF16_HIDDEN_SEGMENTS


def allocator_rounding(a: Arch, T: int, entropy: bool = True) -> int:
    """segment_tail of the large blocks live at the loss peak (loss_blocks): the logits buffers are fresh
    (nothing cached is that large; why Soup's probe reads 12.0101 B/element at vocab 151936, 12.0
    elsewhere), as are the hidden-sized segments (*_HIDDEN_SEGMENTS)."""
    return sum(map(segment_tail, loss_blocks(a, T, entropy)))


def hidden_rounding(a: Arch, T: int) -> int:
    """segment_tail of the hidden-sized segments live at the loss peak (*_HIDDEN_SEGMENTS)."""
    return sum(map(segment_tail, hidden_blocks(a, T)))


def dequantised_linear(a: Arch, quant: str, modules: dict | None = None) -> int:
    """The reference (and KTO's KL) forward under NF4: no_grad, so F.linear saves nothing and each
    linear's dequantised bf16 weight is freed after its matmul; the largest one is what is live at
    once, not the whole layer the recompute holds (dequantised_layer).
    Evidence: docs/PEAK.md, "dequantised_linear"."""
    if quant != "nf4":
        return 0
    return 2 * max(fi * fo for fi, fo, _ in (a.modules if modules is None else modules).values())


# -- A preference loss's step (issue395/tasks.py names the task; the bytes are here) --
#: Per logits element of a live fp32 block (TRL 0.29.1's losses run on fp32 logits: accelerate's
#: convert_outputs_to_fp32 hands back a fresh fp32 copy of the head's bf16 output).


def task_loss_blocks(a: Arch, name: str, seq: int, batch: int) -> list[int]:
    """The full-vocabulary fp32 blocks a preference loss holds at its peak, one entry per block
    (each is its own allocation, so each has its own segment tail). T = seq is the width, S = T - 1
    the shifted width, R the rows (2 x batch for the paired losses). What each loss keeps:
    - DPO, in ``_compute_loss`` after the reference forward: the policy's and the reference's logits
      (R x T each), each one's ``[..., :-1, :].contiguous()`` copy (R x S each), and the chosen half
      masked out for the metrics (batch x S; at batch 1 it is the size of the one-row logsumexp
      temp it outlives), or, before that, where it holds more (below 384 rows a step), TRL's entropy
      metric on the policy's shifted copy: a chunk's log_softmax, exp and product (SFT's moment,
      logits_blocks).
    - KTO, at the reference's ``index_select``: the policy's and the reference's logits (batch x T
      each), each split into its chosen and its rejected rows (copies: batch x T each, in two blocks).
    - ORPO and SimPO (one forward), in the backward of the per-row logsumexp: the logits (R x T),
      the chosen-half cross entropy's saved log_softmax (batch x S), and the per-row gradients: at the
      last row R - 1 done beside that row's sub, exp and mul temps (R + 2 rows), at
      UnbindBackward's stack all R beside the stacked R (2R rows), whichever is more.
    Evidence: docs/PEAK.md, "task_loss_blocks"."""
    T, S, row = seq, seq - 1, a.V * FP32
    if name == "dpo":
        R = 2 * batch
        held = [R * T * row] * 2 + [R * S * row] * 2
        return heavier(held + [batch * S * row], held + [min(ENTROPY_CHUNK_ROWS, R * S) * row] * 3)
    if name == "kto":
        return [batch * T * row] * 2 + [(batch + 1) // 2 * T * row, batch // 2 * T * row] * 2
    R = 2 * batch  # orpo, simpo
    grads = [S * row] * (R + 2) if R + 2 >= 2 * R else [S * row] * R + [R * S * row]
    return [R * T * row, batch * S * row] + grads


def reference_held_blocks(a: Arch, name: str, seq: int, batch: int) -> list[int]:
    """What the policy's loss holds while the reference (and KTO's KL) forward re-streams every
    layer under no_grad: DPO its logits and their shifted copy, KTO its logits and their chosen and
    rejected copies (the blocks of task_loss_blocks made before the reference forward starts)."""
    blocks = task_loss_blocks(a, name, seq, batch)
    return [blocks[0], blocks[2]] if name == "dpo" else [blocks[0]] + blocks[2::2]


def no_grad_layer_per_token(a: Arch, quant: str, targets: tuple, r: int,
                            mask: int = LORA_DROPOUT_MASK_BYTES, act: int | None = None) -> int:
    """What one decoder layer's forward under no_grad (the reference's, KTO's KL) holds per token at
    once, op by op and summed although they do not overlap: the residual stream in and its running
    sum (2 x act x h), the RMSNorm's fp32 copy and square (8h), the MLP at its product (act(gate),
    up and the product: 3 x act x i; phi's gelu_new 4), the widest LoRA target's dropout output, mask
    (``mask`` a feature: layer.mask_bytes) and lora_A output. Nothing is saved (no autograd graph), so
    the widths of attention, which the MLP's exceed on every dense family here, are not added. A MoE or hybrid model: its recompute's
    count, the bound (issue395.estimator.moe's kinds are counted with their backward). ``act``: an activation's
    bytes where the caller knows them (a resident NF4 run's fp32 residual stream), else the streamed layer's."""
    if a.layers is not None:
        return max(kind_per_token(a, k, targets, r, mask=mask) for k in a.layers.kinds)
    act = activation_bytes(a, quant) if act is None else act
    lora = max(act * a.modules[t][0] + mask * a.modules[t][0] + act * r for t in targets)
    return 2 * act * a.h + 8 * a.h + act * a.i * a.quirks.mlp_transients + lora


def reference_head(a: Arch, T: int, fp32_norm: bool = False, fp32_head: bool = False) -> int:
    """The no-grad reference forward (and KTO's KL one) at its head, a moment after its last layer's: the final norm's
    output (fp32 where ``fp32_norm``: a LayerNorm under autocast's fp32 policy, or a resident NF4 run's fp32 residual
    stream, with autocast's bf16 cast of it for the head's matmul beside it), autocast's bf16 cast of an fp32 head
    (``fp32_head``: a resident NF4 run's, peft's prepare_model_for_kbit_training; a frozen weight's cast is not cached,
    so it goes after the matmul) and the head's bf16 logits, with final softcapping a second bf16 block of them (the
    division's output beside its input; the tanh's replaces the one freed). accelerate's fp32 copy of the logits comes
    after the forward, the casts gone; the loss phase holds more than that moment (task_loss_blocks).
    Evidence: docs/PEAK.md, "reference_head"."""
    norm = (4 + 2 if fp32_norm else 2) * T * a.h
    return norm + (2 * a.V * a.h if fp32_head else 0) + (2 if a.softcap else 1) * 2 * T * a.V


def head_copy(a: Arch, f: Features, name: str) -> int:
    """0.77.0 on an untied model, DPO and KTO: the second forward refills the vocab slot the head's
    autograd view points at, so the head keeps a private bf16 copy of its weight from the policy
    forward to its backward (soup-cli 0.77.0 layer_stream_runtime ``_needs_a_private_weight``; Soup
    charges it as a second slot). Tied models stream no large key: none."""
    return 2 * a.V * a.h if task_named(name).reference and not a.tied and f.private_head_weight else 0


def reference_adapter(n: int, f: Features, name: str, per: int = LORA_WEIGHT_BYTES) -> int:
    """DPO's reference is TRL 0.29's frozen "ref" copy of the adapter, materialised by 0.77.0
    (``materialize_meta_adapter_copy``: a clone of each LoRA parameter, fp32); 0.73.3 leaves it on
    the meta skeleton. KTO's reference disables the adapter instead. ``per``: adapter_bytes of the task and the
    quant (streamed NF4: Soup clones it after the trainer's bf16 cast; a resident run, estimated at quant none, keeps
    TRL's fp32 copy while its policy is cast: estimate's ``adapter``).
    Evidence: docs/PEAK.md, "reference_adapter"."""
    return per * n if name == "dpo" and f.materialises_ref_adapter else 0


# -- The estimate --
@dataclass(frozen=True)
class Estimate:
    seq: int; batch: int; quant: str; steps: int; release: str  # noqa: E702
    soup_predicted: int
    soup_terms: dict
    corrected_predicted: int
    needs_free: int
    phase: str  # 'loss' or 'layer'
    terms: dict  # ordered as issue395.estimator.terms.Term: each physical term in bytes
    task: str = PROTOCOL_TASK
    optimizer: str = DEFAULT_OPTIMIZER  # its states count from step 2 on
    accumulation: int = 1  # training.gradient_accumulation_steps: past 1 the gradients are held
    buffers: int = 2  # training.stream_buffers: the pool's slots
    reserve: int = EXPANDABLE_RESERVE_BYTES  # needs_free's allocator reserve: the bound, or a replay's (gc_sequence)
    #: the corrected peak of the forward and backward alone, before the optimizer's step (what Soup's stream_vram_probe
    #: measures: measure_step_peak_bytes runs no optimizer step); 0: the corrected peak
    forward_backward: int = 0
    #: the allocated peak with every block split, from the phases' own binding over the terms less the remainders
    #: (the phase binding the split terms may be another than the one binding the corrected peak); 0: not computed
    split: int = 0

    @property
    def split_allocated(self) -> int:
        """The allocated peak with every block split to its request, as expandable segments (`soup train`)
        split them: the corrected peak less the unsplit remainders the default allocator leaves (the adapter's, and
        where the layer phase binds, the layer's: needs_free's allocated peak; a resident estimate's needs_free
        keeps them, its allocator being the default one), each phase's taken apart where the estimate bound them
        (``split``: a one-step run's optimizer step may bind with its rests and the layer phase without them)."""
        if self.split:
            return min(self.split, self.needs_free - self.reserve)
        rests = sum(self.terms.get(t.key, 0) for t in ADAPTER_RESTS if Phase(self.phase) in t.phases)
        return min(self.corrected_predicted - rests, self.needs_free - self.reserve)

    def to_json(self) -> dict:
        """Every field, the task always (an --estimate JSON row says which task it answers); the
        optimizer only past step 1, where its states are live, or where step 1's optimizer step binds; the
        accumulation only past 1, the pool's buffers only other than 2, the reserve only where a replay charged it
        (so rows saved before them read alike)."""
        return {k: dict(v) if isinstance(v, dict) else v for k, v in vars(self).items()
                if not (k == "optimizer" and self.steps == 1 and self.phase != "optimizer")
                and not (k == "accumulation" and v == 1)
                and not (k == "buffers" and v == 2) and not (k == "reserve" and v == EXPANDABLE_RESERVE_BYTES)
                and k not in ("split", "forward_backward")}


def _whole(name: str, v, low: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise UsageError(f"{name} is {v!r}; it must be a whole number >= {low}")
    return v


def estimate(config: dict, *, quant: str = "none", seq: int, batch: int = 1, targets=None,
             lora_r: int = LORA_R, steps: int = 1, release: str | None = None,
             allowance: int | None = None, workspace: int | None = None,
             stream: dict | None = None, soup: bool = True, task: str = PROTOCOL_TASK,
             optimizer: str = DEFAULT_OPTIMIZER, accumulation: int = 1, buffers: int = 2,
             transformers: str | None = None, lora_dropout: float = LORA_DROPOUT,
             dispatch: Dispatch | None = None, adapter: int | None = None) -> Estimate:
    """Soup's own pre-flight and the corrected peak for one (seq, batch). ``targets=None`` is the
    protocol's (q_proj, v_proj), or qkv_proj on Phi-3. ``allowance`` overrides the fitted
    ALLOCATED_ALLOWANCE_BYTES (the leave-one-family-out fit passes its own); ``workspace`` is a
    card's cuBLAS workspace per handle, charged only where it is larger than CUBLAS_WORKSPACE.
    ``stream``: soup-cli 0.77.0's training keys (stream_expert_layout, stream_loss_chunk,
    stream_recompute) and training.stream_vram_probe (Soup's measured step at setup, whose backward comes
    before the run's first); any other is refused in one line, never estimated as if absent. ``soup=False``:
    the physics alone, with no Soup number beside it (a saved row re-rendered where the installed
    Soup is another release: its own number is the one the row captured). ``release``: Soup's number
    by that release's own code (installed, or an unpacked wheel), the physics by its features
    (releases.RELEASE_FEATURES where its source is not here). ``targets`` may be Soup's own spelling
    (all-linear, auto): the physics takes the modules it resolves to, Soup's number Soup's own count.
    ``task``: one of the five tasks Soup streams (issue395/tasks.py); its step runs at 2 x batch rows
    for the paired losses and holds its loss's tensors (task_loss_blocks); Soup's own number beside
    it is computed by Soup's own code at its own rows. ``steps`` > 1: the run's steady state, with
    ``optimizer``'s states (Soup's ``training.optimizer``). ``accumulation``: Soup's
    ``training.gradient_accumulation_steps``; past 1 every phase of micro-batch 2 on holds the
    adapter's gradients (gradient_terms). ``buffers``: ``training.stream_buffers``, the pool's slots.
    ``transformers``: the release a saved row ran (None: the
    installed one, its source read), which decides whether the model runs eager attention. ``lora_dropout``:
    Soup's ``training.lora.dropout``, which decides whether the LoRA dropouts keep masks (layer.mask_bytes);
    Soup's own number does not read it. ``dispatch``: the card's SM count and compute capability where it is known
    (gemm4bit.Dispatch), which decide where NF4's gemm_4bit runs fused; None: every card's choice. ``adapter``: the
    bytes a policy LoRA parameter takes where the caller knows its trainer's cast (resident.estimate_resident under
    NF4, whose physics runs as bf16's); None: steady.adapter_bytes of the task and ``quant``, the reference copy's
    always (no replay of the adapter's blocks stands for another dtype: their rests are bounded)."""
    a = arch_of(config) if soup else arch_from_config(config)
    targets, spelled = checked_arguments(config, a, quant=quant, seq=seq, batch=batch, targets=targets, lora_r=lora_r,
                                         steps=steps, accumulation=accumulation, buffers=buffers, task=task,
                                         lora_dropout=lora_dropout)
    release = release or installed_release()
    f = features(release)
    ws = max(CUBLAS_WORKSPACE, workspace or 0)
    stream, probed = modelled_stream(stream)
    soup_number, soup_terms = soups_own_number(
        config, soup, quant=quant, seq=seq, batch=batch, targets=spelled, lora_r=lora_r, release=release,
        stream=stream, task=task, optimizer=optimizer, accumulation=accumulation, buffers=buffers)
    per_expert, chunk, recompute, tk = checked_modes(a, stream, task, batch)
    stack = dict(release=release, transformers=transformers_release(transformers), stream=stream, probed=probed,
                 buffers=buffers)
    masked = bool(mask_bytes(tk, lora_dropout))
    own = adapter in (None, adapter_bytes(tk.name, quant))  # the replays ran the adapter at its own dtype
    replayed = adapter_replayed(
        a, quant, tk, targets, lora_r, seq, batch, dropout=masked, accumulation=accumulation, optimizer=optimizer,
        steps=steps, workspace=ws, card=dispatch, stack=stack, reference=bool(reference_adapter(1, f, tk.name))
    ) if own else None
    walked = own and walk_replayed(a, quant, tk.name, seq * batch * tk.rows_per_example, targets, lora_r,
                                   optimizer=optimizer, steps=steps, workspace=ws, card=dispatch, **stack)
    t, lp, unsplit = step_terms(a, f, tk, quant=quant, targets=targets, lora_r=lora_r, seq=seq, batch=batch, ws=ws,
                                per_expert=per_expert, buffers=buffers, chunk=chunk, recompute=recompute,
                                accumulation=accumulation, steps=steps, optimizer=optimizer,
                                transformers=transformers, allowance=allowance, dropout=lora_dropout, replayed=replayed,
                                walked=walked, adapter=adapter)
    binding, peak = binding_phase(t, lp.checkpointed, tk.reference, steps, accumulation, probed, ws, unsplit)
    corrected = phase_sum(t, Phase.RESIDENT) + peak + t[Term.ALLOCATED_ALLOWANCE.key]
    # `soup train`'s expandable segments split every block: the peak without the remainders, whichever phase binds
    split = {k: v for k, v in t.items() if k not in DEFAULT_ALLOCATOR_ONLY}
    _, split_peak = binding_phase(split, lp.checkpointed, tk.reference, steps, accumulation, probed, ws, 0)
    return Estimate(seq, batch, quant, steps, release, soup_number, soup_terms, corrected,
                    needs_free(corrected - peak + split_peak), binding.value, t, tk.name, optimizer, accumulation,
                    buffers, split=corrected - peak + split_peak,
                    forward_backward=phase_sum(t, Phase.RESIDENT) + t[Term.ALLOCATED_ALLOWANCE.key] + max(step_phases(
                        t, lp.checkpointed, tk.reference, steps, accumulation, probed, ws).values()))


def checked_arguments(config: dict, a: Arch, *, quant: str, seq: int, batch: int, targets, lora_r: int, steps: int,
                      accumulation: int, buffers: int, task: str, lora_dropout: float = LORA_DROPOUT) -> tuple:
    """The run's arguments, each refused in one line where no estimate can stand for it (a quantization Soup
    does not stream, a count below 1, a seq past the model's positions, a task Soup does not stream, LoRA
    targets its layer lacks, a LoRA dropout peft's nn.Dropout refuses); the targets as the physics takes them
    and as Soup's config spells them."""
    if quant not in QUANTS:
        raise UsageError(f"quant {quant!r} is not one Soup streams ({', '.join(QUANTS)})")
    seq, batch = _whole("seq", seq), _whole("batch", batch)
    lora_r, steps = _whole("lora_r", lora_r), _whole("steps", steps)
    accumulation, buffers = _whole("gradient_accumulation_steps", accumulation), _whole("stream_buffers", buffers)
    if seq > a.max_pos:
        raise UsageError(f"seq {seq} is past the model's max_position_embeddings {a.max_pos}")
    if isinstance(lora_dropout, bool) or not isinstance(lora_dropout, (int, float)) or not lora_dropout <= 1:
        raise InvalidRun(f"training.lora.dropout {lora_dropout!r}: peft's nn.Dropout refuses it (a probability "
                         "up to 1; at or below 0 peft builds none), so no run has it")
    task_named(task)
    targets = protocol_targets(a) if targets is None else targets
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    spelled = targets
    targets = soup_targets(targets, config, a, ",".join(map(str, targets)))
    spelled = spelled[0] if spelled != targets else targets  # Soup's config holds the string itself
    missing = [t for t in targets if t not in a.modules]
    if not targets or missing:
        raise InvalidRun(f"LoRA target(s) {', '.join(missing) or '(none)'} not in a {a.model_type}"
                         f" layer (it has {', '.join(a.modules)})")
    return targets, spelled


def modelled_stream(stream: dict | None) -> tuple:
    """Soup's streaming keys as given, and whether Soup's probe runs a backward at setup
    (training.stream_vram_probe); a key this estimator does not model is refused in one line, never
    estimated as if absent."""
    stream = dict(stream or {})
    probed = bool(stream.pop("stream_vram_probe", False))  # no term of Soup's number: its formula is the same
    unknown = sorted(set(stream) - set(STREAM_KEYS))
    if unknown:
        raise UsageError(f"training.{unknown[0]} is not modelled by this estimator")
    return stream, probed


def soups_own_number(config: dict, soup: bool, **kwargs) -> tuple:
    """Soup's own pre-flight and its terms, by Soup's own code, beside the corrected peak; none where
    ``soup`` is False (the physics alone)."""
    return soup_preflight_from_config(config, **kwargs) if soup else (None, {})


def checked_modes(a: Arch, stream: dict, task: str, batch: int) -> tuple:
    """The streaming modes (per-expert layout, loss chunk, recompute) and the task, each refused in one line
    where Soup refuses it or the estimator does not model it: no number for a run that cannot be."""
    per_expert = stream.get("stream_expert_layout") == "per_expert"
    if per_expert and not a.quirks.per_expert_layout:  # Soup refuses it: no number for a run that cannot be
        raise UsageError(f"Soup refuses stream_expert_layout 'per_expert' on {a.model_type} (it admits "
                         "deepseek_v3 only)")
    chunk, recompute = stream.get("stream_loss_chunk"), stream.get("stream_recompute", "on")
    if recompute not in RECOMPUTES:
        raise UsageError(f"stream_recompute {recompute!r} is not modelled (it measures one step at setup)")
    if a.qk_layernorm:  # phi's per-head q and k LayerNorms: their saved fp32 copies, mean and rstd are in no count
        raise UsageError(f"config qk_layernorm on {a.model_type} is not modelled by this estimator (its q and k "
                         "LayerNorms' saved tensors are in no count)")
    tk = task_named(task)
    if tk.batch_refused(batch):
        raise UsageError(f"batch {batch}: {tk.batch_refused(batch)}")
    if chunk and tk.name != PROTOCOL_TASK:
        raise UsageError(f"training.stream_loss_chunk with task {tk.name} is not modelled by this estimator")
    return per_expert, chunk, recompute, tk


def step_terms(a: Arch, f: Features, tk, *, quant: str, targets: tuple, lora_r: int, seq: int, batch: int, ws: int,
               per_expert: bool, buffers: int, chunk, recompute: str, accumulation: int, steps: int, optimizer: str,
               transformers: str | None, allowance: int | None, dropout: float = LORA_DROPOUT,
               replayed: dict | None = None, walked: bool = False, adapter: int | None = None) -> tuple:
    """Every physical term of the step in bytes, in the table's order (Term), with the binding layer's peak
    and the unsplit remainders, which the phases read apart from the terms; ``replayed``: the rests a replay of the
    run keeps for the adapter's block sets it replays (adapter_replayed), charged in place of their bound;
    ``walked``: the layers' backward is replayed (streamed_sequence.walk_replayed), so the binding layer's rests are
    the walk's, not bounded; ``adapter``: estimate's (the policy adapter's bytes a parameter)."""
    rows = batch * tk.rows_per_example
    T, n = seq * rows, lora_params(a, targets, lora_r)
    ref = adapter_bytes(tk.name, quant)  # the reference copy's: its own quant's (``adapter`` overrides the policy's)
    per = adapter or ref
    eager = eager_attention(a.model_type, transformers)
    t = {Term.POOL.key: pool(a, quant, per_expert, buffers), Term.EXTRAS.key: extras(a, f),
         Term.LORA_WEIGHTS.key: lora_weights(n, per), Term.CUBLAS_WORKSPACE.key: ws, Term.LOGITS.key: logits(a, T),
         Term.RESIDENT_ROUNDING.key: resident_rounding(a, quant, f, per_expert, buffers),
         Term.ALLOCATOR_ROUNDING.key: allocator_rounding(a, T),
         Term.CHECKPOINTED_INPUTS.key: checkpointed_inputs(a, quant, T), Term.FINAL_NORM.key: final_norm(a, T),
         Term.IDS_LABELS.key: ids_labels(T), Term.POSITION_IDS.key: position_ids(seq),
         Term.ROTARY_TABLES.key: rotary_tables(a, seq),
         Term.SLIDING_MASK.key: 0 if eager else sliding_mask(a, seq, rows),
         Term.AUTOGRAD_WORKSPACE.key: ws}
    # the layer that binds in the backward's walk, at its moment: its weights, its tokens, its expert
    # no LoRA dropout mask where the task's trainer turns dropout off or p is 0 (layer.mask_bytes), in every count below
    mask = mask_bytes(tk, dropout)
    lp = layer_peak(a, quant, targets, lora_r, T, per=per, held=accumulation > 1, per_expert=per_expert,
                    recompute=recompute == "on", mask=mask)
    t[Term.DEQUANTISED_LAYER.key], t[Term.LAYER_PER_TOKEN.key] = lp.weights, lp.activations
    if walked:  # the layers' backward replayed (streamed_sequence.walk_replayed)
        remainders = walked_rests(a, targets, lora_r, tk.name, seq, batch, quant, dropout=bool(mask), steps=steps,
                                  accumulation=accumulation, optimizer=optimizer)
    else:
        remainders = layer_remainders(layer_blocks(a, quant, targets, lora_r, T, lp))
    if remainders:
        t[Term.LAYER_REMAINDERS.key] = remainders
    t[Term.LOSS_REMAINDERS.key] = cut_remainders(loss_blocks(a, T))
    if a.layers is not None:
        t[Term.EXPERT_IN_FLIGHT.key] = lp.expert
    if eager:  # its masks replace SDPA's bool sliding mask
        t[Term.EAGER_MASKS.key], t[Term.EAGER_SCORES.key] = eager_masks(a, seq, rows), eager_scores(a, seq, rows)
    if any(bias for *_, bias in a.modules.values()):  # the bias epilogue's own workspace
        t[Term.CUBLASLT_WORKSPACE.key] = CUBLASLT_WORKSPACE
    if tk.name != PROTOCOL_TASK:  # the loss's own fp32 blocks replace SFT's three
        t.update(task_terms(a, f, tk, quant, targets, lora_r, seq, batch, T, n, ref, mask))
    if chunk:
        t.update(chunked_loss_terms(a, chunk, seq, batch, T, ws))
    if recompute == "off":
        kept = retained_by_layer(a, quant, targets, lora_r, mask)
        t[Term.RETAINED_ACTIVATIONS.key] = T * sum(kept)
        t[Term.RETAINED_BESIDE_LAYER.key] = T * (sum(kept) - kept[-1])  # the last layer's backward runs first
    t.update(gradient_terms(per, n, accumulation, lp.gradients))
    # step 1's optimizer step makes the states and holds them beside the gradients and its transients: the one
    # optimizer step every run has (steady_terms; beside the other phases only from step 2: binding_phase)
    t.update(steady_terms(a, targets, lora_r, optimizer, per))
    rests = unsplit_remainders(a, targets, lora_r, optimizer, per, steps=steps, accumulation=accumulation,
                               reference=ref if t.get(Term.REFERENCE_ADAPTER.key) else 0, **(replayed or {}))
    t.update(rests)
    unsplit = sum(rests.values())  # every adapter block's, live at the optimizer's step
    for term in (Term.LOSS_REMAINDERS, Term.REFERENCE_REMAINDERS):  # listed where they charge
        if not t.get(term.key):
            t.pop(term.key, None)
    t[Term.ALLOCATED_ALLOWANCE.key] = ALLOCATED_ALLOWANCE_BYTES if allowance is None else allowance
    return {term.key: t[term.key] for term in Term if term.key in t}, lp, unsplit  # the table's order


def adapter_replayed(a: Arch, quant: str, tk, targets: tuple, r: int, seq: int, batch: int, *, dropout: bool,
                     accumulation: int, optimizer: str, steps: int, workspace: int, card, stack: dict,
                     reference: bool) -> dict:
    """The rests the replay that admits the run keeps, by the adapter's block sets, as unsplit_remainders takes them:
    the bf16 step (streamed_sequence.step_replayed: the parameters, step 1's states, the gradients held between
    micro-batches); NF4's (nf4_step_replayed: the parameters, and in a one-step run the gradients, held or not); the
    setup alone (setup_replayed: the parameters, both copies where the release makes the ``reference`` adapter);
    none."""
    if step_replayed(a, quant, tk.name, dropout=dropout, accumulation=accumulation, optimizer=optimizer, steps=steps,
                     **stack):
        rests = step_rests(a, targets, r, tk.name, seq, batch, accumulation)
        return {"placed": placed_rests(a, targets, r, reference, quant), "states": rests["states"],
                "held": rests["gradients"]}
    if nf4_step_replayed(a, quant, tk.name, seq * batch * tk.rows_per_example, targets, r, dropout=dropout,
                         optimizer=optimizer, workspace=workspace, card=card, **stack):
        if steps > 1:  # a later step's gradients land in other free blocks than step 1's: the setup's rests alone
            return {"placed": placed_rests(a, targets, r, reference, quant)}
        rests = nf4_step_rests(a, targets, r, tk.name, seq, batch, dropout=dropout, accumulation=accumulation)
        # its states depart from the histories', its temporaries are not replayed (nf4_step_rests): their bound stands
        return {"placed": rests["parameters"], ("held" if accumulation > 1 else "grads"): rests["gradients"]}
    if setup_replayed(a, quant, tk.name, **stack):
        return {"placed": placed_rests(a, targets, r, reference, quant)}
    return {}


def task_terms(a: Arch, f: Features, tk, quant: str, targets: tuple, lora_r: int, seq: int, batch: int, T: int,
               n: int, per: int, mask: int) -> dict:
    """A preference or KTO task's own terms: its loss's fp32 blocks in place of SFT's three (and their
    rounding), the reference adapter and head copy the release makes, the KL batch's ids, and where the
    task runs a reference model, what its forward holds."""
    blocks = task_loss_blocks(a, tk.name, seq, batch)
    t = {Term.LOGITS.key: sum(blocks) + (SOFTCAP_EXTRA_BYTES * T * a.V if a.softcap else 0),
         Term.ALLOCATOR_ROUNDING.key: sum(map(segment_tail, blocks)) + hidden_rounding(a, T),
         Term.LOSS_REMAINDERS.key: cut_remainders(blocks + hidden_blocks(a, T)),
         Term.REFERENCE_ADAPTER.key: reference_adapter(n, f, tk.name, per),
         Term.HEAD_COPY.key: head_copy(a, f, tk.name)}
    if tk.kl_batch:  # the KL batch's mismatched completions, collated as the batch's
        t[Term.KL_BATCH_IDS.key] = ids_labels(T)
    if tk.reference:
        held = reference_held_blocks(a, tk.name, seq, batch)
        t[Term.REFERENCE_HELD.key] = sum(held)
        t[Term.REFERENCE_LAYER.key] = T * no_grad_layer_per_token(a, quant, targets, lora_r, mask)
        t[Term.DEQUANTISED_LINEAR.key] = (dequantised_linear(a, quant) if a.layers is None else
                                          max(dequantised_linear(a, quant, k.dequant) for k in a.layers.kinds))
        t[Term.REFERENCE_HEAD.key] = head_beyond_layer(t, reference_head(a, T, fp32_norm=a.norm_bias))
        # the held blocks were made fresh for the loss (their tails, or the cut rule); the no-grad linear's
        # weight is dequantised again each layer, into a cached block or a cut one (the layer's rule)
        t[Term.REFERENCE_REMAINDERS.key] = (sum(map(segment_tail, held)) + cut_remainders(held)
                                            + layer_remainders([t[Term.DEQUANTISED_LINEAR.key]]))
    return t


def head_beyond_layer(t: dict, head: int) -> int:
    """What the no-grad forward's ``head`` moment holds beyond its layers' (the reference phase's layer terms): the
    head runs after the last layer's blocks are freed, so the reference phase, which sums its terms, charges the
    larger of the two moments."""
    return max(0, head - t[Term.REFERENCE_LAYER.key] - t[Term.DEQUANTISED_LINEAR.key])


def chunked_loss_terms(a: Arch, chunk: int, seq: int, batch: int, T: int, ws: int) -> dict:
    """The chunked loss (training.stream_loss_chunk): its logits and their rounding per chunk, and what the
    loss holds beside them."""
    # per chunk 3 fp32 + its bf16 logits (14 B), a backward's cuBLAS workspace inside the loss, Soup's
    # two [batch, seq, hidden] stream-dtype tensors;
    # measured: SmolLM2 and Moonlight chunk 512 (results/moe-and-stream-modes-*/loss-chunk.txt)
    return {"logits": (LOGITS_BYTES + 2 + (SOFTCAP_EXTRA_BYTES if a.softcap else 0)) * min(chunk, seq) * batch * a.V,
            "allocator_rounding": allocator_rounding(a, min(chunk, seq) * batch, entropy=False),
            Term.LOSS_REMAINDERS.key: cut_remainders(loss_blocks(a, min(chunk, seq) * batch, entropy=False)),
            Term.CHUNKED_LOSS.key: ws + 2 * 2 * a.h * T}


def step_phases(t: dict, checkpointed: int, reference: bool, steps: int, accumulation: int, probed: bool,
                ws: int) -> dict:
    """The forward and backward's phases (the loss, the reference's forward, the binding layer) and their bytes above
    the resident terms and the allowance, before the optimizer's step."""
    # at the binding layer only the inputs of the layers not yet run backward are live
    layer = phase_sum(t, Phase.LAYER) - t[Term.CHECKPOINTED_INPUTS.key] + checkpointed
    step = {Phase.LOSS: phase_sum(t, Phase.LOSS), Phase.REFERENCE: phase_sum(t, Phase.REFERENCE) if reference
            else 0, Phase.LAYER: layer}
    if steps > 1 or accumulation > 1 or probed:  # after a first backward its thread's cuBLAS workspace stays
        # resident beside every phase, the layer phase's too: at step 1 the layer phase's peak can come
        # before the backward makes it (measured: 3 steps add 44.7 MB on Mistral-7B NF4 512x1, the
        # workspace's 33.6 and the bf16 moments' 13.6; docs/PEAK.md "Steps after the first"); Soup's
        # probe's backward at setup is such a first one (layer_stream_runtime.measure_step_peak_bytes)
        step = {p: v + ws if v else v for p, v in step.items()}
    return step


def binding_phase(t: dict, checkpointed: int, reference: bool, steps: int, accumulation: int, probed: bool,
                  ws: int, unsplit: int) -> tuple:
    """The phase whose bytes bind the step (the loss, the reference's forward, the binding layer, or the
    optimizer's own step) and its bytes above the resident terms and the allowance. Step 1's optimizer step makes
    the states (zeros_like, then its transients) beside the gradients and the backward thread's workspace, so it
    may bind a one-step run too (Mistral-7B NF4 r64 all-linear 1024x1: step 1's peak, 2,252,526,080 B on an H100,
    is inside it); from step 2 the states are beside every phase."""
    step = step_phases(t, checkpointed, reference, steps, accumulation, probed, ws)
    binding = max(step, key=step.get)  # a tie goes to the loss, as it always has
    peak = step[binding]
    # the optimizer's own step, once the backward has freed the activations, beside the states (made in it at
    # step 1; from step 2 beside every phase)
    states = t[Term.OPTIMIZER_STATES.key]
    optimizer_step = t[Term.ADAPTER_GRADIENTS.key] + t[Term.OPTIMIZER_TRANSIENTS.key] + ws + unsplit
    if steps > 1:
        if optimizer_step > peak:
            binding, peak = Phase.OPTIMIZER, optimizer_step
        peak += states
    elif optimizer_step + states > peak:
        binding, peak = Phase.OPTIMIZER, optimizer_step + states
    return binding, peak


def estimate_key(key: str, **kwargs) -> Estimate:
    """The estimate of a map key: its family's public config under the streaming modes the key
    names (never estimated as if the mode were absent). ``release``, as a saved row records it, gives
    the physics its features (``estimate`` itself reads them)."""
    family, stream = stream_mode(key)
    return estimate(config_json(family), stream=stream, **kwargs)


def needs_free(allocated: int, reserve: int = EXPANDABLE_RESERVE_BYTES) -> int:
    """Free bytes a card must have: the allocated peak under expandable segments (every block split to
    its request: an Estimate's ``split_allocated``) plus the allocator's reserve there (the bound, or a replay's)."""
    return allocated + reserve

