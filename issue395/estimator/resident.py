"""The corrected estimate of a resident run (``training.stream_layers: false``): Soup loads the whole model on the
card and trains it with Hugging Face's own loop, so what a streamed step holds in its two-layer pool and its extras
is, here, every parameter at its dtype; the step's other terms are the streamed step's own, op by op, because the
decoder layers are the same modules: without gradient checkpointing every layer keeps what its backward needs
through the loss (the terms of ``stream_recompute: off``); with it, HF saves each layer's input and recomputes one
layer at a time in the backward (the terms of Soup's own per-layer recompute). One terms table (estimator/terms.py)
serves both paths; this module adds ``resident_weights`` and, without checkpointing, what is live at the loss peak
there and not in a streamed step: the adapter's bf16 copies its matmuls save (``adapter_casts``), no kept rest where
every block of the step is whole 2 MiB (``whole_granules``). Where the task's trainer turns dropout off, no LoRA
dropout mask is charged, by the streamed step's own rule (layer.mask_bytes), in each count and its blocks' rounding.

Measured (tests/estimator/test_resident.py), on the 187 committed arms of these families it models, bf16 and NF4
(results/resident-map-*): never under, median 1.0007x (1.0008x before qwen2 NF4 was replayed, 1.0009x before
batched NF4 llama and phi-2 NF4 were); with checkpointing 1.0001x-1.0029x, without it 1.0000x-1.0166x, median
1.0008x (the widest: SmolLM2 NF4 512x1 1.0166x, replayed under every gemm_4bit choice, its H200's own 1.0042x;
then the bounded rows, up to 1.0129x: 41, median 1.0012x).
Where the retained blocks' rests are replayed
(estimator/sequence.py: SmolLM2, Qwen2.5, Llama-3.2-1B, Llama-3.1-8B, Qwen3-0.6B, Mistral-7B, SFT bf16 without
checkpointing, 39 rows) 1.0001x-1.0049x, median 1.0007x (the larger replay of the two default cuBLAS workspaces,
the card not known: SmolLM2 2048x1 1.0047x, 1.0069x before the capture's CUDA request order; bounded they were up to
1.0237x); NF4 past 1,536 tokens on the llama, mistral, qwen3 and phi3 types (20 rows, batched llama's 8 among
them: 1.0001x-1.0240x while they kept the bound, 1.0001x-1.0016x replayed) 1.0001x-1.0018x
(Phi-3-mini 512x4 and 1024x4 1.0007x and 1.0004x; bounded, 1.0057x and 1.0138x; up to 1.0238x), at 1,536 or
fewer (12 rows, the largest replay of every choice bitsandbytes' gemm_4bit could make, the card not known)
1.0004x-1.0166x (Phi-3-mini 512x1 and 1024x1 1.0110x and 1.0013x, bounded 1.0209x and 1.0237x: at 1024x1 its
four weights, each of 4 Mi elements or more, dequantise on every card, so the one choice replayed is the H200's;
Qwen3-0.6B 512x1 and 1024x1 1.0077x and 1.0021x, bounded 1.0169x and 1.0192x; SmolLM2 512x1 1.0166x, where the
bound charged less, 1.0114x, its H200's own choice replayed 1.0042x); phi-2 bf16 replayed
1.0000x-1.0007x (bounded 1.0023x-1.0204x), its NF4 replayed 1.0002x-1.0031x (bounded 1.0056x-1.0250x: peft's
empty_cache after the load, which its H100 trace named, sequence.NF4_SEQUENCE_TYPES); Qwen2.5-0.5B NF4 replayed
1.0001x-1.0023x (bounded 1.0041x-1.0110x: its forward the H100 trace's request for request); Phi-3-mini bf16 (qkv_proj)
replayed 1.0001x-1.0007x (bounded 1.0003x-1.0157x);
Moonlight bf16 1.0023x-1.0048x, its layers' count measured on CPU: layer.latent_retained. Layers of several kinds (issue395.estimator.moe) hold each its own kind's tensors
(``kinds_weights``: Moonlight's dense layer 0 and MoE layers of 64 fused experts, Qwen3.5's delta-net and
full-attention layers; within 0.1% of what each committed row held before its step, where charging every layer
the union of the kinds was 10-30% off): Moonlight (DeepSeek-V3) 1.0003x-1.0075x on its 16 rows (its bf16 rows
without checkpointing were 1.010x-1.029x on the kinds' count, 22-27 KB a token a layer over, which
layer.latent_retained, measured on CPU under CUDA's autocast lists, names: the routed experts' gathered input,
which grouped_mm does not keep, the router's fp32 logits, the latent at 6 B a width; under NF4, not measured, the
kinds' count stays: 1.0023x-1.0075x), Qwen3.5 with
checkpointing 1.0002x-1.0008x (4), Qwen3.5-MoE without it 1.0001x-1.0040x (12). phi-2 bf16 (6 rows,
1.0000x-1.0007x; 1.0023x-1.0204x bounded, 1.0236x-1.0352x before layer.mlp_records): a resident run trains
under bf16 autocast, which
the streamed step (where the counts are measured) does not, and autocast runs layer_norm and pow in fp32 (``autocast_upcasts``). Under NF4 the rotary tables are
fp32, as the residual stream is: charged bf16, Gemma-2-2B NF4 4096x1 with checkpointing was 3.20 MB under its real
peak, the allowance aside; charged fp32, 0.99 MB over.

Known limitations
    - Without checkpointing, the retained blocks' rests are replayed (estimator/sequence.py: the step's
      large-pool requests from the Arch, op by op, through estimator/allocator.py), on the plain llama-type decoder
      (llama, mistral, qwen2, qwen3) and phi's parallel layer, SFT bf16 with the protocol's targets (q_proj,
      v_proj; on the llama-type decoder any of its linears with q_proj, k_proj or v_proj among them, held out:
      sequence.checked_targets), LoRA dropout on or off; ORPO, SimPO and DPO at their stacked rows and KTO after its
      KL batch's no-grad forward (sequence.kl_forward: bf16 on llama, mistral, qwen2, qwen3, phi3 and phi, NF4 on
      llama, qwen2, qwen3 and phi3), transformers' warmup block whole or short by a small segment's
      reserved bytes (sequence.WARMUP_UNUSED, the larger charged);
      and NF4 on llama, mistral, qwen2, qwen3, phi3 and phi (Phi-3's fused qkv_proj its target; bitsandbytes' gemm_4bit
      dequantises past 1,536 tokens, and at 1,536 or fewer chooses per card and weight shape between that and its
      fused kernel: every choice replayed, the largest charged, gemm4bit.gemm_choices; the capture runs
      bitsandbytes' own Python on the meta device, request for request at 2048x1-4096x1, and at 512x1 and 1024x1
      with its heuristic forced each way):
      the request sequence was the one bench/allocator_replay.py captures from the real model on the meta device,
      request for request, on all six such families at 512x1-4096x1 (its rests the capture's at every point but
      SmolLM2 1024x1, 0.5 MB over: a block the capture frees before its peak), and the NF4 forward is the H100
      traces' request for request (SmolLM2 1024x4, phi-2 512x1, Qwen2.5-0.5B 1024x4: bench/task_peak_anatomy.py
      --trace). ORPO, SimPO, DPO and KTO take the same forward, bf16 and NF4 (sequence.SEQUENCE_TASKS,
      NF4_SEQUENCE_TASKS; KTO's after its KL batch's no-grad forward, sequence.kl_forward, on KL_FORWARD_TYPES and
      NF4_KL_FORWARD_TYPES). Everywhere else
      (Gemma, Gemma-2, the layered families; other targets) a block of the step or
      of the weights that is not whole 2 MiB has its retained blocks' rounding bounded, not replayed: each 1-10 MiB
      block class is
      cut from 20 MiB segments whose last block keeps a rest of at most 1 MiB (1 MiB a segment), and each block
      from 10 MiB keeps its segment's tail, or, served from a larger cached block, a rest of at most 1 MiB (1 MiB
      a block); a block of 1 MiB or less is the small pool's, split at 512 B (retained_rounding, through
      constants.layer_remainders, the rule the streamed step's blocks take). The measured excess of max_memory_allocated over the requested peak was 21 MB on SmolLM2
      1024x1, 108 MB on Qwen2.5 2048x1 (75.5 MB of it the MLP blocks' tails), 0 on Llama-3.2-1B 2048x1; without the
      per-block bound SmolLM2 NF4 at 2048 tokens was 9.8 MB under. The bounded rows without checkpointing (neither
      replayed nor a layered family's) are 1.0001x-1.0129x, median 1.0012x (41 rows; 47, median 1.0043x, before
      qwen2 NF4's 6 were replayed; 61, 1.0001x-1.0250x, before
      batched NF4 llama's 8 and phi-2 NF4's 6 were replayed; 57 before batched NF4 llama's 8 kept
      the bound and Phi-3-mini bf16's 4 were replayed; 63 before phi-2 bf16 was replayed; 57,
      1.0001x-1.0186x, median 1.0054x, before phi-2 NF4 was modelled; 69 before NF4 at 1,536 tokens or fewer was
      replayed, 71 before Phi-3-mini NF4 past 1,536 tokens was).
    - Phi-3-mini bf16 is replayed since the capture laid flash's output out as q (its cat-built q's output copied:
      decoder.output_copy): its capture had been 23.3 MB under the 512x1 row, now 0.26 MB (sequence.py,
      BF16_SEQUENCE_TYPES).
    - Phi-3-mini NF4 without checkpointing is 1.0004x-1.0106x, its retained blocks' rests replayed: the
      12,288 B a token a layer it was over (1.063x-1.080x) was v, charged as a view of the fused qkv, where
      the fused output is fp32 under NF4 and autocast's SDPA keeps its own bf16 copy of v
      (layer.autocast_upcasts), measured on CPU under CUDA's autocast lists, not on a GPU anatomy (none is
      committed). Its bf16 rows are 1.0003x-1.016x and its checkpointed NF4 ones 1.0014x-1.0029x.
    - LoRA on o_proj and the MLP's linears alone (no q, k or v target: layer 0's attention records nothing up to
      SDPA) is replayed on the llama-type decoder, bf16 and NF4, and on phi in bf16 (dense, fc1, fc2:
      sequence.QUIET_BF16_TYPES): 1.0002x-1.0055x on seventeen held-out H100 arms, phi-2 bf16 fc1,fc2 1.0032x. phi's
      count charges its layer 0 whole (layer.quiet_layer leaves the parallel layer out: fc2 alone is 1.018x the
      capture's peak at 2048x1). phi NF4 and Phi-3 keep the bound there (Phi-3-mini down_proj alone 1024x2: 1.0121x
      bf16, 1.0238x NF4; its quiet attention's output copy and fused gate_up are not built).
    - Past a sliding window without checkpointing it is refused: Gemma-3 and Phi-3 keep attention masks per layer
      there that the counts do not have (Gemma-3 2048x1: 48 blocks of 8 MiB; the construction was 0.983x-1.018x on
      Gemma-3-1B's 20 committed rows, 0.984x on Phi-3-mini bf16 2048, its NF4 1.044x-1.053x).
    - The steady state (steps > 1: the optimizer's states) and gradient accumulation are the streamed step's terms
      (estimator/steady.py). On a resident run the steady state is measured by the resident-findmax probes, which
      ran 2 optimizer steps (tests/run/test_resident_estimate.py's steady-state test holds them: 1.0002x-1.0216x);
      every committed resident map row is one step of one micro-batch, and none with accumulation past 1 is
      committed. The replayed rests (sequence.replayed) are not gated on steps or accumulation: they are the
      first forward's; one committed run on the replay's path has more than one step or micro-batch (Qwen3-0.6B
      NF4 on up_proj and down_proj, 2 steps at accumulation 2: 1.0007x, results/resident-quiet2-traces-*), and a
      meta emulation of 3 AdamW steps (the review's) found the rests of steps 2-3 equal to or under step 1's.
    - The replay's cuBLAS workspace: the estimate does not know the card, so the rests charged are the larger of
      the replays under Hopper's 32 MiB and the pre-Hopper 8.125 MiB default (Mistral-7B and Llama-3.1-8B 1000x4
      keep 86,114,304 B under the first, 128,581,632 B under the second); under CUBLAS_WORKSPACE_CONFIG, another
      transformers than 5.16.1, or PYTORCH_CUDA_ALLOC_CONF's max_split_size_mb or roundup_power2_divisions, the
      bound stays. Under expandable segments max_memory_allocated keeps no rest (every block split at 512 B), and
      the rests charged (replayed or bounded) are over by what they are: the safe side.
    - phi-2 bf16 without checkpointing is 1.0000x-1.0007x (2.67-6.50 MB over), its retained blocks' rests replayed
      (sequence.forward_phi: the capture's request for request at 512x1-2048x4 once bench/allocator_replay.py ran
      layer_norm and pow under CUDA autocast's fp32 policy; 786,432 B at 512x1, 1,441,792 B charged under the
      pre-Hopper workspace) and its LayerNorms' fp32 weight and bias copies charged (norm_casts: 655,360 B, 64
      blocks the capture holds at its peak). The capture's peak is within 778,240 B of each row's (the real 26,624-
      538,624 B over it at five, 778,240 B under at 512x1, where it kept none of the capture's rests; both held
      5,569,854,464 B before the step), and the estimate less its allowance 18,432-30,720 B under the capture at
      512x4, 1024x4, 2048x1, 2048x4 (unnamed small-pool blocks): the real's excess over the capture, not named, is
      inside the allowance (estimate.ALLOCATED_ALLOWANCE_BYTES, 3,000,000 B), as the other replayed families'
      small blocks are. Bounded it was 1.0023x-1.0204x, the rest the retained blocks' rounding bound (its
      5 MiB dropout masks at 2048 tokens are not whole 2 MiB: 385.9 MB charged at 2048x1, 387.1 MB over; 1.0186x
      and 352.3 MB before the bound had gelu_new's fourth saved i-wide block, the bf16 0.5 x input). Its
      LayerNorm's fp32 input copy is saved (measured on CPU under CUDA's autocast lists: 189,608 B a token a
      layer, the count with autocast_upcasts to the byte); what was over (1.024x-1.035x) was layer 0's
      LayerNorm and parallel MLP, which record nothing there (layer.mlp_records: 153,608 B a token).
    - phi-2 NF4 without checkpointing is 1.0002x-1.0031x (6 rows, 8.9-19.5 MB over), its retained blocks' rests
      replayed (decoder_phi.layer_phi_nf4: its forward the H100 trace's request for request at 512x1; 32.7 MB charged
      there, the largest of every gemm_4bit choice, 16.3 MB under the H100's own, none fused, which leaves the row
      3.1 MB over). Bounded it was 1.0056x-1.0250x (171.97 MB charged at 512x1, 385.88 MB at 2048x1). The rest of
      the estimate is the capture's live set: a layer
      from 1 on keeps 210,088 B a token (CPU, bench/allocator_replay.py saved phi-2 --quant nf4: the LayerNorm's
      fp32 input, mean and rstd, four fp32 gelu_new tensors, and the bf16 copies autocast's linear and SDPA make of
      the fp32 residual's tensors, layer.autocast_casts), where 307,400 were charged before (1.27x-1.42x: each
      target's dropout output and lora_A output and SDPA's q, k, v and output at 4 B, the MLP backward's three
      i-wide transients and the incoming gradient taken off at 2 B); 0.68x-0.82x was an older construction's.
      The capture's own peak, 10.4 MB under the 512x1 row while the bound stayed, is 7.7 MB under it with peft's
      empty_cache after the load (within 1.7 MB of the other five rows): the load's history, named from the trace
      (sequence.NF4_SEQUENCE_TYPES: transformers' warmup block less the process's 2 MiB reserved but unused, then
      the order among free blocks of one size, cudaMalloc's addresses).
      With checkpointing it is refused (no committed row; its recompute under an fp32
      residual is not counted). The layer the backward runs is its count at 4 B an activation (fp32_over:
      343,208 B a token with autocast's; 163,976 were charged, the bf16 count, under one layer's kept 210,088).
    - phi with qk_layernorm (its per-head q and k LayerNorms) is refused, streamed too (estimate.checked_modes): its
      saved tensors are in no count (phi-2 512x1 with it, bench/allocator_replay.py's meta capture: bf16 peak
      9,307,270,144 B, estimated as without it 8,961,982,144 B, 0.963x; NF4 6,674,983,936 B, 6,505,224,640, 0.975x). phi's resid_pdrop (microsoft/phi-2's own
      config has 0.1; the registry's, which the committed rows ran, none) keeps two 1 B masks h wide a layer
      (layer.resid_masks), charged in the count streamed and resident; with it, embd_pdrop or attention_dropout
      set the retained rests are bounded, never replayed (no capture ran them); embd_pdrop with checkpointing is
      refused (its mask, kept where the embedding's output needs a gradient, is in no count).
    - Qwen3.5 (dense hybrid) without checkpointing is refused: its bf16 rows were 0.9938x-0.9995x (up to 197 MB
      under at 2048x4, in the step; its NF4 rows 1.008x-1.038x). Qwen3.5-MoE with checkpointing is refused: 1024x1
      bf16 0.9999x (its row held 34 MB more before its step than at its other rows), 4096x1 0.9986x bf16 and
      0.9990x NF4 (29 MB under, in the step). No resident anatomy of either is committed. Qwen3.5-MoE without it
      is refused where a target puts a delta-net layer on the backward's path (delta_refused: the estimate was down to
      0.83x the meta capture's peak there); its committed rows (q_proj, v_proj: the full-attention layer, last
      of the four the harness builds) are not, but the real 40-layer model's are (its layers past the fourth
      include delta-net ones after the first full-attention layer).
    - Its needs-free is the allocated peak plus the reserve measured under expandable segments: stock `soup train`
      runs a resident run on the default allocator, where runs the patched gate admitted died (OOM; their reserve
      not recorded) and a Gemma-2B search's OOM held 3.31 GB reserved but unallocated; `--soup-patch` sets
      expandable segments for every run. Evidence: docs/PEAK.md, "EXPANDABLE_RESERVE_PAGES". Where
      gc_sequence.charged admits a checkpointed run on expandable segments (Phi-3, llama), that reserve is the replayed
      one (resident_reserve), never under the one its H100 history measured.
    - Soup's own resident number is hardware_fit's (computed by Soup, from its CLI's input); it is not this
      module's business: the row carries it (results/extras.ResidentGate).
    - Full fine-tuning (Soup's ``training.lora.r: 0``): estimator/full.py's, measured at one shape only on 0.77.0's
      fp32 master weights (full.MASTER_MEASURED), not on 0.73.3's bf16 build; its docstring has its limits.
"""

from __future__ import annotations

from ..constants import K_ROUND_LARGE, K_SMALL_SIZE, block_bytes, layer_remainders
from ..errors import UsageError
from ..model.arm import DEFAULT_OPTIMIZER
from ..record import LORA_DROPOUT
from ..model.targets import soup_targets
from ..tasks import PROTOCOL_TASK, task as task_named
from .arch import NF4_BLOCK, Arch, arch_from_config, fp32_residual, layer_bytes, nf4_bytes, protocol_targets
from .layer import (AUTOCAST_BF16, LORA_DROPOUT_MASK_BYTES, MLP_BACKWARD_TRANSIENTS, RMS_RSTD_BYTES,
                    Moment, autocast_by_layer, autocast_casts, autocast_per_token, autocast_upcasts, layer_per_token,
                    mask_bytes, quiet_layer, quiet_mlp_saved, resid_masks, retained_by_layer)
from .estimate import (ADAPTER_RESTS, EXPANDABLE_RESERVE_BYTES, Estimate, binding_phase, dequantised_linear, estimate,
                       head_beyond_layer, needs_free, no_grad_layer_per_token, reference_head, segment_tail)
from .gc_sequence import charge as gc_charge, charged as gc_charged
from .steady import adapter_bytes
from .terms import BY_KEY, Phase, Term, phase_sum
from .full import estimate_full, full_refused
from .gemm4bit import Dispatch
from .decoder import GRADIENT_ATTENTION
from .sequence import SEQUENCE_TRANSFORMERS, layer_rests, load_rests, replayed
from .stacks import transformers_release

#: The architectures the resident construction is held to (every committed resident row of theirs).
MODELLED_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "phi3", "phi", "deepseek_v3",
                  "qwen3_5_text", "qwen3_5_moe_text")
#: The layered families' runs whose committed rows the shared counts leave under their real peaks (the module's
#: docstring has the figures): refused, each with why.
LAYERED_REFUSED = {
    ("qwen3_5_text", False): "its delta-net layers keep more without checkpointing than the counts name",
    ("qwen3_5_moe_text", True): "its recomputed MoE layer holds more than the count names",
}


def resident_weights(a: Arch, quant: str = "none") -> int:
    """Every parameter as Soup's resident load puts it on the card: each layer's tensors, the embedding and an untied
    head (both vocab matrices: nothing streams them), the final norm and a head's bias, each tensor its own block
    with its segment's tail (estimate.segment_tail: HF loads tensor by tensor). NF4: each linear as bitsandbytes packs
    it (arch.nf4_bytes), everything it does not quantise cast to fp32 (measured: within 0.1% of what every committed
    dense NF4 arm held before its step, results/resident-map-*)."""
    if a.layers is not None:
        return kinds_weights(a, quant)
    if quant == "nf4":
        per_layer = sum(nf4_bytes(fi * fo) + (4 * fo if bias else 0) for fi, fo, bias in a.modules.values())
        per_layer += 4 * a.h * a.norms * (2 if a.norm_bias else 1) + (4 * 2 * a.head_dim if a.qk_norm else 0)
        vocab = (1 if a.tied else 2) * (4 * a.V * a.h + segment_tail(4 * a.V * a.h))
        return a.L * per_layer + vocab + 4 * a.h * (2 if a.norm_bias else 1) + (
            4 * a.V if a.quirks.head_bias and not a.tied else 0)
    norms = 2 * a.h * (2 if a.norm_bias else 1)
    per_layer = layer_bytes(a, "none") + sum(segment_tail(2 * fi * fo) for fi, fo, _ in a.modules.values())
    vocab = (1 if a.tied else 2) * (2 * a.V * a.h + segment_tail(2 * a.V * a.h))
    return a.L * per_layer + vocab + norms + (2 * a.V if a.quirks.head_bias and not a.tied else 0)


def kinds_weights(a: Arch, quant: str) -> int:
    """resident_weights of a model whose layers are of several kinds (issue395.estimator.moe: DeepSeek-V3's
    dense and MoE layers, Qwen3.5's delta-net and full-attention ones): each layer its own kind's tensors, in
    the model's order, beside the vocab matrices and the final norm as a dense model's. bf16: every tensor at
    2 B but DeepSeek's expert-score bias (fp32: its _keep_in_fp32_modules_strict), the fused experts (3-D
    parameters) among them. NF4: bitsandbytes packs each nn.Linear (arch.nf4_bytes); everything else, the fused
    experts too (not nn.Linear: Soup's loader quantises none), is cast to fp32 as on a dense model. Each
    tensor its own block with its segment's tail (estimate.segment_tail)."""
    def held_as(n: int, kind: str) -> int:
        b = n * (4 if quant == "nf4" or kind == "fp32" else 2)
        return b + segment_tail(b)

    def layer(k) -> int:
        linears = sum(nf4_bytes(fi * fo) if quant == "nf4" else held_as(fi * fo, "linear")
                      for fi, fo, _ in k.dequant.values())
        return linears + sum(held_as(n, kind) for n, kind in k.tensors)

    order = a.layers.order or (0,) * a.L
    each = [layer(k) for k in a.layers.kinds]
    per = 4 if quant == "nf4" else 2
    vocab = (1 if a.tied else 2) * held_as(a.V * a.h, "linear")
    return sum(each[j] for j in order) + vocab + per * a.h


def retained_rounding(a: Arch, targets: tuple, r: int, T: int, quant: str = "none", seq: int | None = None,
                      mask: int = LORA_DROPOUT_MASK_BYTES) -> int:
    """segment_tail of each block a layer keeps through the loss without checkpointing, over every layer: the
    tensors retained_by_layer counts per token (the norms' fp32 inputs and rstd, Qwen3's and Gemma-3's q/k norms'
    among them, each target's dropout output, mask
    (``mask`` B a feature: layer.mask_bytes, none where the trainer turns dropout off) and lora_A output,
    attention's q, k, v and output, the MLP's saved i-wide tensors), each its own block, by the one rule
    (constants.layer_remainders: 1 MiB a 20 MiB segment the blocks over 1 MiB and under 10 MiB fill, 1 MiB a
    block from 10 MiB, which its fresh segment's tail or a cached block's rest may hold). phi3's MLP keeps two
    blocks, its fused gate_up output (gate and up are views of it, 2i) and act(gate) (i), and under NF4 v is
    autocast's own kv-wide copy (layer.autocast_upcasts); both measured on CPU under CUDA's autocast lists
    (a Phi-3-mini NF4 layer: 65,536 and 32,768 B a token, fp32). Measured: Qwen2.5 2048x1 keeps 72 MLP blocks of 19,922,944 B, each with a 1 MiB
    tail, which the allocator's history (requested sizes) does not show and max_memory_allocated does
    (results/resident-anatomy-*/call-1/res-sft-qwen-bf16-2048x1: replayed peak 107.7 MB under the real one).
    Where every block the forward can request is a whole number of 2 MiB (``whole_granules``; ``seq`` given),
    no rest is kept but beside a weight's block (``unaligned_weight_blocks``)."""
    if seq is not None and whole_granules(a, targets, r, T, seq):
        return K_SMALL_SIZE * unaligned_weight_blocks(a, quant, targets, r)
    act, qw, kw = 2, a.heads * a.head_dim, a.kv * a.head_dim
    widths = [(4, a.h), (RMS_RSTD_BYTES, 1)] * (a.norms if a.quirks.norm_inputs_saved else 0)
    if a.qk_norm:  # Qwen3's and Gemma-3's per-head q/k norms: their fp32 inputs and rstd (layer_per_token)
        widths += [(4, qw), (4, kw), (RMS_RSTD_BYTES, a.heads), (RMS_RSTD_BYTES, a.kv)]
    widths += [w for t in targets for w in ((act, a.modules[t][0]), (mask, a.modules[t][0]), (act, r))]
    widths += [(LORA_DROPOUT_MASK_BYTES, a.h)] * resid_masks(a, targets, True)  # a layer from 1 on: its input has grad
    upcast, _ = autocast_upcasts(a, quant)  # autocast's copies in place of as many of the count's blocks
    v = (qw + 2 * kw) if a.quirks.fused_qkv else kw  # phi3's v: a view of the fused output, under NF4 its own cast
    if a.quirks.fused_qkv and (AUTOCAST_BF16, kw) in upcast:
        upcast.remove((AUTOCAST_BF16, kw))
        v = kw
    widths += [(act, qw), (act, kw), (act, v), (act, qw)]
    # the count's saved i-wide tensors (phi's gelu_new: 4, 3 of them autocast's fp32 copies in bf16, fp32 all under NF4)
    mlp = a.quirks.mlp_saved - MLP_BACKWARD_TRANSIENTS - sum(1 for _, w in upcast if w == a.i)
    b = 4 if quant == "nf4" else act
    if "gate_up_proj" in a.modules and mlp == 3:  # phi3: gate and up are views of one fused block, act(gate) its own
        widths += [(b, 2 * a.i), (b, a.i)] + upcast
    else:
        widths += [(b, a.i)] * mlp + upcast
    return layer_remainders([b * w * T for b, w in widths if b] * a.L)


def kept_rests(a: Arch, targets: tuple, r: int, T: int, quant: str, seq: int, task: str, dropout: float,
               transformers: str | None = None, dispatch: Dispatch | None = None) -> int:
    """What the blocks each layer keeps through the loss without checkpointing hold past their requests: replayed
    (estimator/sequence.py's layer_rests, the larger under either default cuBLAS workspace) where its sequence was
    checked against the real model's (``replayed``: under ``transformers``, None the installed, and this
    process's allocator settings; under NF4 every gemm_4bit choice, or on a known card, ``dispatch``, its one),
    else retained_rounding's bound."""
    mask = mask_bytes(task_named(task), dropout)
    if replayed(a, quant, targets, task, transformers=transformers_release(transformers), batch=T // seq):
        kl = T // seq if task_named(task).kl_batch else 0  # KTO's KL batch: as many rows, first, without grad
        return layer_rests(a, targets, r, T, seq, mask > 0, quant, card=dispatch, kl_rows=kl)
    return retained_rounding(a, targets, r, T, quant, seq, mask)


def whole_granules(a: Arch, targets: tuple, r: int, T: int, seq: int) -> bool:
    """Whether every block of the large pool a resident forward can request up to its loss is a whole number of
    2 MiB, over a superset of its tensors, per token: the residual stream and each norm's input (h) and each
    linear's output (phi3's fused qkv and gate_up among them), each target's input and lora_A's output (r), q, k
    and the MLP's i, the rotary tables, at 2 and 4 B (bf16, or fp32 under NF4); each target's dropout mask (1 B
    a feature), the heads' logsumexp (4 B), the ids and positions (8 B); eager attention's scores (2 and 4 B a
    head and position) and a mask row (1 B a position). Why it matters: every segment is a whole number of
    2 MiB (K_ROUND_LARGE), and a block is cut from the front of a free one, which keeps the rest only where it
    is at most 1 MiB (the allocator splits where more would remain). Where every request is whole 2 MiB, every
    free block cut from whole 2 MiB is too, so a rest is 0 or at least 2 MiB: none is ever kept. Blocks of
    1 MiB and less are the small pool's, cut from their own 2 MiB segments to 512 B: none is kept there either."""
    qw, kw = a.heads * a.head_dim, a.kv * a.head_dim
    widths = {a.h, a.i, qw, kw, r, a.rotary_dim, a.heads * seq} | {fo for _, fo, _ in a.modules.values()}
    widths |= {a.modules[t][0] for t in targets if t in a.modules}
    sizes = {b * w for w in widths for b in (2, 4)} | {a.modules[t][0] for t in targets if t in a.modules}
    sizes |= {4 * a.heads, 4 * a.kv, RMS_RSTD_BYTES, 8, seq}
    return all(block_bytes(s * T) <= K_SMALL_SIZE or block_bytes(s * T) % K_ROUND_LARGE == 0 for s in sizes)


def unaligned_weight_blocks(a: Arch, quant: str, targets: tuple, r: int) -> int:
    """The weights' blocks over 1 MiB (and the loading's own: the bf16 a linear is quantised from, the fp32
    embedding's bf16 source) that are not a whole number of 2 MiB. Each can leave one free block that is not
    either, in its segment, after it: a forward of whole 2 MiB requests cut from that free block keeps its rest
    (at most 1 MiB) in one block only, the one that takes its end, whose rest the segment then has no more."""
    sizes = []
    for fi, fo, _ in a.modules.values():
        n = fi * fo
        sizes += [2 * n] + ([-(-n // 2), -(-n // NF4_BLOCK)] if quant == "nf4" else [])
    sizes = a.L * sizes + a.L * [b * r * w for t in targets for w in a.modules[t][:2] for b in (2, 4)]
    sizes += (1 if a.tied else 2) * [2 * a.V * a.h] + ([4 * a.V * a.h] if quant == "nf4" else [])
    return sum(1 for s in map(block_bytes, sizes) if s > K_SMALL_SIZE and s % K_ROUND_LARGE)


def adapter_casts(a: Arch, targets: tuple, r: int, per: int) -> int:
    """The bf16 copy of each fp32 LoRA matrix (``per`` 4: adapter_bytes) that autocast makes for its matmul, which
    saves it for the backward: lora_B's in every layer (its input, lora_A's output, needs a gradient), lora_A's
    from the second (layer 0's input needs none, so its matmul saves only that input); each its own small
    block, rounded to 512 B. None where the adapter is bf16 already (per 2: TRL's cast under a 4-bit model).
    Measured: Qwen2.5 2048x1 keeps 70 blocks of 14,336 B (8 x 896 x 2: q's A and B, v's A) and 24 of 2,048
    (v's B, 128 x 8 x 2) at its loss peak (results/resident-anatomy-*/call-1/res-sft-qwen-bf16-2048x1); its
    bf16 rows at 7B and 8B were 1-2 MB under without them, the NF4 rows (a bf16 adapter) not."""
    if per != 4:
        return 0
    first, last = cast_blocks(a, targets, r)
    return a.L * last + (a.L - 1) * first


def cast_blocks(a: Arch, targets: tuple, r: int) -> tuple[int, int]:
    """One layer's bf16 copies of its LoRA matrices, each its own small block rounded to 512 B: the A's (r x fan-in),
    the B's (fan-out x r)."""
    return tuple(sum(block_bytes(2 * r * a.modules[t][k]) for t in targets if t in a.modules) for k in (0, 1))


def reference_adapter_casts(a: Arch, targets: tuple, r: int) -> int:
    """DPO's reference adapter (TRL's fp32 "ref" copy, made before the trainer's bf16 cast of the policy's under a
    4-bit model): the bf16 copy of each of its LoRA matrices that autocast makes in the reference's no-grad forward,
    every layer's A and B. Its parameters need a gradient, so torch's autocast cache keeps each copy until the
    forward's autocast exits: all of them at its head's moment, freed before the loss. Each its own small block,
    rounded to 512 B. Measured: resident Mistral-7B NF4 DPO r16 on all seven linears 512x1 holds 448 blocks made in
    that forward at its real peak (96 of 458,752 B, 288 of 131,072, 64 of 32,768: 14 a layer, its seven targets'
    A and B), and Llama-3.1-8B NF4 DPO r8 on q, v 512x1 128 (results/resident-heldout-survey3-traces-*,
    survey2-traces-*); the bf16 run's forward makes them too (Mistral-7B 512x1, survey-traces-*). Charged fp32 the
    policy's adapter had covered them on those two; with the policy bf16 (steady.adapter_bytes) they were 21.6 MB
    and 3.3 MB under. Evidence: docs/PEAK.md, "reference_adapter_casts"."""
    return a.L * sum(cast_blocks(a, targets, r))


def norm_casts(a: Arch, quant: str) -> int:
    """The fp32 copies of each nn.LayerNorm's bf16 weight and bias (``norm_bias``: phi's) that CUDA autocast's fp32
    policy makes for layer_norm (torch's ATen/autocast_mode.h, AT_FORALL_FP32) and native_layer_norm saves for its
    backward, live through the loss without checkpointing: at every LayerNorm whose input needs a gradient, each
    decoder layer's from the second (layer 0's input, the embedding's output, needs none) and the final one; each
    its own small-pool block, rounded to 512 B. None under NF4, whose norms are fp32 already (peft's
    prepare_model_for_kbit_training). Seen in bench/allocator_replay.py's capture of phi-2 bf16 (64 blocks of
    10,240 B live at its peak, 512x1-2048x4), and in no per-token count (they do not grow with the tokens)."""
    if not a.norm_bias or quant != "none":
        return 0
    return ((a.L - 1) * a.norms + 1) * 2 * block_bytes(4 * a.h)


def refused(a: Arch, quant: str, checkpointing: bool = True, seq: int = 0) -> str | None:
    """Why this tool does not estimate this resident run (None: it does)."""
    if not checkpointing and a.window and seq >= a.window:
        return (f"a resident {a.model_type} run past its sliding window ({a.window}) without gradient checkpointing "
                "is not yet modelled by this estimator (its layers keep attention masks the counts do not have)")
    if quant not in ("none", "nf4"):
        return f"a resident {quant} run is not modelled by this estimator"
    if a.qk_layernorm:
        return (f"a resident {a.model_type} run with qk_layernorm is not yet modelled by this estimator (its q and k "
                "LayerNorms' saved tensors are in no count)")
    if "embd_pdrop" in a.dropouts and checkpointing:
        return (f"a resident {a.model_type} run with embd_pdrop and gradient checkpointing is not yet modelled by this "
                "estimator (the embedding dropout's mask, kept where checkpointing makes its input need a gradient, "
                "is in no count)")
    if fp32_residual(a, quant) and checkpointing:
        return (f"a resident {quant} {a.model_type} run with gradient checkpointing is not yet modelled by this "
                "estimator (its recompute of an fp32 residual stream under autocast is not counted)")
    if a.layers is not None and (a.model_type, checkpointing) in LAYERED_REFUSED:
        return (f"a resident {a.model_type} run {'with' if checkpointing else 'without'} gradient checkpointing "
                f"is not yet modelled by this estimator ({LAYERED_REFUSED[a.model_type, checkpointing]})")
    if a.model_type not in MODELLED_TYPES:
        return f"a resident {a.model_type} run is not yet modelled by this estimator"
    return None


def delta_refused(a: Arch, targets: tuple, checkpointing: bool) -> str | None:
    """Why a resident run of a model with gated delta-net layers (Qwen3.5's linear attention: a kind holding
    in_proj_qkv) is not estimated without checkpointing where one of those layers is on the backward's path (it
    holds a LoRA target, or comes after the first layer that holds one; None: none is). What such a layer keeps
    for its backward is in no count (the dense Qwen3.5's refusal, LAYERED_REFUSED, says the same of every one of
    its runs). Issue 51 item 3: bench/allocator_replay.py's meta capture of Qwen3.5-MoE (4 of 40 layers, three
    delta-net layers first) bf16 300x1, r 8, kept 188,287,696 B more in its requests than the estimate counted
    with shared_expert.gate_proj the target (every layer on the path), 309,177,744 B with in_proj_qkv, and with
    every linear a target 9,324,171,680 B at 3000x3 (0.83x its peak); with q_proj, k_proj, v_proj and o_proj
    (the full-attention layer, last of the four) it is 7,313,936 B over."""
    if checkpointing or a.layers is None:
        return None
    kinds = [a.layers.kinds[j] for j in (a.layers.order or (0,) * a.L)]
    first = next((n for n, k in enumerate(kinds) if any(t in k.dequant for t in targets)), 0)
    if any("in_proj_qkv" in k.dequant for k in kinds[first:]):
        return (f"a resident {a.model_type} run without gradient checkpointing whose LoRA targets put a gated "
                "delta-net layer on the backward's path is not yet modelled by this estimator (what those layers "
                "keep for their backward is in no count)")
    return None


#: The model types whose resident bf16 run on LoRA targets with no attention input one is refused where the sequence
#: does not replay it (bound_refused): the plain llama-type decoder, whose bound was under the meta capture there.
#: phi3's and phi's are not: on such targets (Phi-3-mini gate_up_proj,down_proj 1024x1 and o_proj,down_proj 777x1,
#: phi-2 fc1,fc2 1024x1 and dense,fc1,fc2 777x1, r 8) the bound is 1.017x-1.024x the capture's peak, and they keep it.
#: Under NF4 the bound holds on them (1.0015x-1.0242x the capture's peak with transformers' release unchecked).
BOUND_REFUSED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def bound_refused(a: Arch, quant: str, targets: tuple, checkpointing: bool, task: str,
                  transformers: str | None) -> str | None:
    """Why a resident bf16 run of the plain llama-type decoder (BOUND_REFUSED_TYPES) without checkpointing, on LoRA
    targets with none of q_proj, k_proj, v_proj among them, is not estimated where the sequence does not replay it
    (sequence.replayed: QUIET_ATTENTION_TYPES, the transformers release and allocator it was checked under; None: it
    is estimated). Those keep retained_rounding's bound, whose "1 MiB a 20 MiB segment" for blocks of 1-10 MiB holds
    only where they are cut from fresh segments; served whole from cached blocks up to 1 MiB larger they keep a rest
    each. Issue 51 item 3 (review): bench/allocator_replay.py's meta capture of SmolLM2 bf16 777x1, r 8, peaked at
    1,403,669,504 B with gate_proj, up_proj, down_proj the targets, where the bound's estimate was 1,380,304,140 B
    (0.9834x), at 1024x1 0.9902x, and with o_proj beside them 0.9814x."""
    if (checkpointing or quant != "none" or a.model_type not in BOUND_REFUSED_TYPES
            or set(targets) & set(GRADIENT_ATTENTION)
            or replayed(a, quant, targets, task, transformers=transformers_release(transformers))):
        return None
    return (f"a resident bf16 {a.model_type} run without gradient checkpointing on LoRA targets "
            f"{','.join(targets)} (none of q_proj, k_proj, v_proj among them) is not yet modelled by this estimator "
            f"here: its blocks' rests are replayed only under transformers {SEQUENCE_TRANSFORMERS} and the default "
            "allocator, and the bound was under the step's capture")


def targets_of(a: Arch, targets, config: dict) -> tuple:
    """The LoRA targets as the layer's modules (Soup's spellings resolved, the protocol's by default)."""
    targets = protocol_targets(a) if targets is None else targets
    return soup_targets((targets,) if isinstance(targets, str) else tuple(targets), config, a, str(targets))


def estimate_resident(config: dict, *, quant: str = "none", seq: int, batch: int = 1, targets=None,
                      lora_r: int = 8, steps: int = 1, release: str | None = None, task: str = PROTOCOL_TASK,
                      checkpointing: bool = False, optimizer: str = "adamw_torch", accumulation: int = 1,
                      transformers: str | None = None, lora_dropout: float = LORA_DROPOUT,
                      dispatch: Dispatch | None = None) -> Estimate:
    """The corrected peak of a resident run: the streamed step's bf16 terms (recompute off without checkpointing, on
    with it) with every parameter on the card in place of the pool and the extras, and under NF4 what runs in fp32.
    No Soup number (Soup's resident gate is hardware_fit's; the row has it). ``dispatch``: estimate's."""
    if lora_r == 0:  # Soup's full fine-tuning (lora.r 0): no adapter, every parameter trains
        return full_run(config, quant=quant, seq=seq, batch=batch, steps=steps, release=release, task=task,
                        checkpointing=checkpointing, optimizer=optimizer, accumulation=accumulation,
                        transformers=transformers)
    a = arch_from_config(config)
    if why := refused(a, quant, checkpointing, seq):
        raise UsageError(why)
    e = estimate(config, quant="none", seq=seq, batch=batch, targets=targets, lora_r=lora_r, release=release,
                 soup=False, task=task, transformers=transformers, steps=steps, optimizer=optimizer,
                 accumulation=accumulation, stream={} if checkpointing else {"stream_recompute": "off"},
                 lora_dropout=lora_dropout, adapter=adapter_bytes(task, quant))  # the trainer's cast under 4-bit
    t = dict(e.terms)
    for streamed in (Term.POOL.key, Term.EXTRAS.key, Term.RESIDENT_ROUNDING.key):
        t[streamed] = 0  # the pool's slots and the streamed extras: here, the whole model's tensors
    if t.get(Term.HEAD_COPY.key):  # 0.77.0's private head copy is its streaming's (a refilled vocab slot): a resident
        t[Term.HEAD_COPY.key] = 0  # bf16 head is its own weight (Mistral-7B KTO 512x2, Phi-3-mini 1024x2: none)
    t = {Term.RESIDENT_WEIGHTS.key: resident_weights(a, quant), **t}
    tk = task_named(task)
    T, tg, mask = e.seq * e.batch * tk.rows_per_example, targets_of(a, targets, config), mask_bytes(tk, lora_dropout)
    if why := delta_refused(a, tg, checkpointing) or bound_refused(a, quant, tg, checkpointing, task, transformers):
        raise UsageError(why)
    if not checkpointing:
        # no checkpoint saves a layer's input: what each layer's backward needs is its retained count (the
        # norms' fp32 copies among it). Measured: Qwen2.5 2048x1 keeps 45,912 B a token a layer at its loss
        # peak, retained_by_layer's count to the byte (results/resident-anatomy-*/call-1/res-sft-qwen-bf16-2048x1)
        t[Term.CHECKPOINTED_INPUTS.key] = 0
        t[Term.RETAINED_REMAINDERS.key] = kept_rests(a, tg, lora_r, T, quant, e.seq, task, lora_dropout,
                                                     transformers, dispatch)
        t[Term.ADAPTER_CASTS.key] = adapter_casts(a, tg, lora_r, adapter_bytes(task, quant))
        t[Term.NORM_CASTS.key] = norm_casts(a, quant)
        kept = kept_per_layer(a, quant, tg, lora_r, mask)
        t[Term.RETAINED_ACTIVATIONS.key] = T * sum(kept)
        t[Term.RETAINED_BESIDE_LAYER.key] = T * (sum(kept) - kept[-1])  # the last layer's backward runs first
    # the layer the backward runs holds them too, recomputed or not
    t[Term.LAYER_PER_TOKEN.key] += T * (autocast_per_token(a, quant) + autocast_casts(a, quant, tg, lora_r))
    if quant == "nf4":
        # the embedding is fp32, so the residual stream is, and bitsandbytes' Linear4bit returns its input's dtype:
        # the MLP's i-wide tensors are fp32 (Llama-3.2-1B NF4 2048x1 kept 48 of 67,108,864 B, i x T x 4, where bf16
        # kept 33,554,432), and the layer inputs a checkpoint saves are fp32. The head's weight is fp32 too, so
        # autocast casts it to bf16 for the head's matmul, which saves that copy for its backward: V x h x 2 beside
        # the loss, whatever the tokens (Llama-3.2-1B NF4: real peaks 3.733 MB a token plus 561 MB at 512-8192
        # tokens; this copy is 525 MB). The backward dequantises one linear at a time.
        # phi's residual is fp32 from layer 0's output: every activation of its layer's count is (fp32_over)
        if checkpointing:
            t[Term.CHECKPOINTED_INPUTS.key] *= 2
        t[Term.LAYER_PER_TOKEN.key] += T * (fp32_over(a, tg, lora_r, mask) if fp32_residual(a, quant)
                                            else 2 * a.i * a.quirks.mlp_saved)
        t[Term.HEAD_COPY.key] = 2 * a.V * a.h + segment_tail(2 * a.V * a.h)
        # the rotary tables take the residual stream's dtype (transformers' rotary embeddings return
        # cos.to(x.dtype)): fp32 here, twice the streamed step's bf16 tables. Measured: Llama-3.2-1B NF4 2048x1
        # keeps cos and sin as 2 blocks of 524,288 B (rd x seq x 4) at its loss peak, bf16 2 of 262,144
        # (results/resident-anatomy-*/call-1/res-sft-llama1b-*-2048x1)
        t[Term.ROTARY_TABLES.key] *= 2
        t[Term.DEQUANTISED_LAYER.key] = 2 * max(fi * fo for fi, fo, _ in a.modules.values())
        # the packed weights' rests: the load's own history, replayed (bitsandbytes quantises on the card)
        t[Term.RESIDENT_ROUNDING.key] = load_rests(a)
        if tk.reference:
            t.update(nf4_reference(t, a, tg, lora_r, T, mask))
    if t.get(Term.REFERENCE_ADAPTER.key):  # bf16 runs' too: TRL's copy is fp32 whatever the quant
        t[Term.REFERENCE_ADAPTER_CASTS.key] = reference_adapter_casts(a, tg, lora_r)
    # the phases as estimate() composes a streamed run's (every layer's input is the layer phase's own here)
    binding, peak = binding_phase(t, t[Term.CHECKPOINTED_INPUTS.key], tk.reference, steps, accumulation,
                                  False, t[Term.AUTOGRAD_WORKSPACE.key], sum(t.get(k.key, 0) for k in ADAPTER_RESTS))
    corrected = phase_sum(t, Phase.RESIDENT) + peak + phase_sum(t, Phase.ALLOWANCE)
    # split_allocated's: the phases bound again without the adapter's rests (another phase may bind there)
    _, split_peak = binding_phase({k: v for k, v in t.items() if BY_KEY[k] not in ADAPTER_RESTS},
                                  t[Term.CHECKPOINTED_INPUTS.key], tk.reference, steps, accumulation,
                                  False, t[Term.AUTOGRAD_WORKSPACE.key], 0)
    reserve = resident_reserve(a, quant, tg, lora_r, e, checkpointing, lora_dropout, transformers)
    return Estimate(e.seq, e.batch, quant, e.steps, e.release, None, {}, corrected, needs_free(corrected, reserve),
                    binding.value, t, e.task, e.optimizer, e.accumulation, reserve=reserve,
                    split=corrected - peak + split_peak)


def nf4_reference(t: dict, a: Arch, targets: tuple, r: int, T: int, mask: int) -> dict:
    """A resident NF4 run's no-grad reference forward (DPO's, KTO's): its layer in fp32 (the residual stream, so each
    linear's output: the same count at 4 B an activation), each linear dequantised as it runs, and its head, the fp32
    norm's output and the fp32 head cast to bf16 for the matmul (estimate.reference_head); the weight's rests by the
    layer's rule beside the held blocks' (``t``'s). Evidence: docs/PEAK.md, "reference_head"."""
    out = {Term.REFERENCE_LAYER.key: T * no_grad_layer_per_token(a, "nf4", targets, r, mask, act=4),
           Term.DEQUANTISED_LINEAR.key: dequantised_linear(a, "nf4")}
    out[Term.REFERENCE_REMAINDERS.key] = (t.get(Term.REFERENCE_REMAINDERS.key, 0)
                                          + layer_remainders([out[Term.DEQUANTISED_LINEAR.key]]))
    out[Term.REFERENCE_HEAD.key] = head_beyond_layer(out, reference_head(a, T, fp32_norm=True, fp32_head=True))
    return out


def resident_reserve(a: Arch, quant: str, targets: tuple, r: int, e: Estimate, checkpointing: bool, dropout: float,
                     transformers: str | None) -> int:
    """needs_free's allocator reserve for a resident run: the checkpointed step's replayed one (gc_sequence.charge)
    where gc_sequence.charged admits the run (the replayed step: two steps or more of AdamW, no accumulation, LoRA
    dropout on) and it is on expandable segments, else the bound (EXPANDABLE_RESERVE_BYTES). `soup train` sets
    expandable segments for streamed runs only (stream_setup): a resident run's allocator is the default one, whose
    unsplit remainders stay in what it needs; --find-max's probes export expandable segments."""
    if (checkpointing and e.steps > 1 and e.accumulation == 1 and e.optimizer == DEFAULT_OPTIMIZER and dropout
            and gc_charged(a, quant, targets, e.task, e.seq, e.batch, transformers=transformers_release(transformers))):
        return gc_charge(a, targets, r, e.seq * e.batch)
    return EXPANDABLE_RESERVE_BYTES


#: The model types whose o_proj takes SDPA's bf16 output as it is (transformers' sdpa_attention_forward transposes and
#: reshapes it without a copy), so under autocast its lora_A saves nothing more there, whatever the adapter's dtype
#: (peft casts no input while autocast is on): measured on CPU (bench/allocator_replay.py saved, NF4, bf16 adapter, no
#: dropout) on every one, and on the H100 with an fp32 adapter (KTO, ORPO: resident Qwen3-0.6B NF4 KTO on all seven
#: linears, SmolLM2 NF4 ORPO on q/k/v/o, whose histories hold no such copy and whose estimates were over by it, 235 MB
#: and 283 MB); Phi-3's o_proj and phi's dense take a copy, which the count keeps (tests/test_bench.py).
#: Evidence: docs/PEAK.md, "SHARED_ATTENTION_OUTPUT".
SHARED_ATTENTION_OUTPUT = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")


def kept_per_layer(a: Arch, quant: str, targets: tuple, r: int, mask: int) -> list[int]:
    """Bytes a token each layer keeps for its backward without checkpointing, first to last, as estimate_resident
    charges them (retained_activations is the tokens times their sum): the shared bf16 count (layer.retained_by_layer,
    DeepSeek-V3's layer.latent_retained among it), what Hugging Face's bf16 autocast adds to it (autocast_by_layer),
    and under NF4 each layer's MLP tensors in fp32 (the bytes over bf16; phi's fp32 residual is charged fp32 by the
    count already) and on DeepSeek-V3 the kinds' bound in place of latent_retained, which is measured in bf16 only.
    `python bench/allocator_replay.py saved KEY` counts the same on CPU (tests/test_bench.py holds them equal; with an
    fp32 NF4 adapter its emulated autocast keeps o_proj's copy, which the card does not: SHARED_ATTENTION_OUTPUT).
    A first layer with LoRA on o_proj and the MLP alone keeps what layer.quiet_per_token counts (docs/PEAK.md,
    "quiet_layer"), its MLP's fp32 tensors too, and none of SDPA's.
    Under NF4 with no LoRA dropout (``mask`` 0), o_proj's lora_A takes SDPA's bf16 output as it is, already saved by
    SDPA (SHARED_ATTENTION_OUTPUT): the count's bf16 copy of its input is not made, the adapter bf16 or fp32 (under
    autocast peft casts no input). Every other target's input is the fp32 residual stream's, cast to bf16 and saved
    as counted."""
    bf16 = retained_by_layer(a, "none", targets, r, mask, resident=True)
    kept = [n + u for n, u in zip(bf16, autocast_by_layer(a, quant, targets, r))]
    if quant != "nf4":
        return kept
    saved = 0 if fp32_residual(a, quant) else 2 * a.i * (a.quirks.mlp_saved - MLP_BACKWARD_TRANSIENTS)
    quiet = quiet_layer(a, targets)
    fp32 = [2 * a.i * quiet_mlp_saved(a, targets) if n == quiet else saved for n in range(len(kept))]
    bound = [o - n for o, n in zip(retained_by_layer(a, "nf4", targets, r, mask, resident=True), bf16)]
    shared = (2 * a.modules["o_proj"][0] if not mask and "o_proj" in targets
              and a.model_type in SHARED_ATTENTION_OUTPUT else 0)
    # a quiet layer's SDPA saves nothing (quiet_per_token charges it none): its output is o_proj's lora_A's own
    return [k + s + b - (0 if n == quiet else shared) for n, (k, s, b) in enumerate(zip(kept, fp32, bound))]


def fp32_over(a: Arch, targets: tuple, r: int, mask: int) -> int:
    """What the layer the backward runs holds a token over its bf16 count (layer.layer_per_token at the MLP
    backward, whose bf16 figure the streamed step's terms charge) where the residual stream is fp32 (phi NF4): the
    same count at the activations' 4 B. Without it phi-2 NF4's layer term was 163,976 B a token, under the
    210,088 one layer keeps (the CPU count); with it, and autocast's additions, 343,208."""
    at = dict(at=Moment.BACKWARD, input_grad=True, mask=mask)
    return layer_per_token(a, "nf4", targets, r, **at) - layer_per_token(a, "none", targets, r, **at)


def estimate_run(arm, config: dict | None = None, **extra) -> Estimate:
    """This tool's corrected estimate of an arm's run (issue395.model.arm.Arm), streamed or resident, in one place: a
    resident arm (stream_layers off) is ``estimate_resident``'s at its checkpointing, with only the settings a
    resident run reads (a streamed-only one, stream_buffers, left out) and no Soup number (Soup's resident gate is
    hardware_fit's, which the row carries); any other is ``estimate``'s under its streaming modes. ``config``: the
    checkpoint's own config.json where the arm's base has no public one (--model, --config); ``extra``: what is not
    the run's (the release, a card's workspace, ``soup``, the transformers a saved row ran)."""
    from ..model.arm import SETTINGS
    from ..model.registry import config_json

    config = config_json(arm.base) if config is None else config
    kwargs = dict(arm.estimator(), **extra)
    if arm.streaming.resident:
        streamed = {s.estimator for s in SETTINGS if s.streamed_only} | {"soup", "allowance", "workspace"}
        return estimate_resident(config, checkpointing=arm.streaming.checkpointing,
                                 **{k: v for k, v in kwargs.items() if k not in streamed})
    return estimate(config, stream=arm.streaming.stream(), **kwargs)


# -- Full fine-tuning (Soup's training.lora.r 0): estimator/full.py's, from the r 1 LoRA run it starts from --

def full_run(config: dict, *, quant: str, seq: int, batch: int, steps: int, release: str | None, task: str,
             checkpointing: bool, optimizer: str, accumulation: int, transformers: str | None) -> Estimate:
    """A full fine-tuning (Soup's lora.r 0) as estimator/full.py estimates it: refused in one line where it does not
    model it (full.full_refused), before anything is estimated; else full.estimate_full from the r 1 LoRA run it
    starts from (this module's estimate of it, ``base``)."""
    a = arch_from_config(config)
    why = full_refused(a, config, quant=quant, task=task, release=release, transformers=transformers)
    if why:
        raise UsageError(why)
    base = estimate_resident(config, seq=seq, batch=batch, lora_r=1, release=release, task=task,
                             checkpointing=checkpointing, transformers=transformers)
    return estimate_full(config, base, release=release, steps=steps, checkpointing=checkpointing,
                         optimizer=optimizer, accumulation=accumulation, transformers=transformers)


