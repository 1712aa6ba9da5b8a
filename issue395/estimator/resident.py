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

Measured (tests/estimator/test_resident.py), on the 181 committed arms of these families it models, bf16 and NF4
(results/resident-map-*): never under, median 1.0013x; with checkpointing 1.0001x-1.0029x, without it
1.0000x-1.0794x, median 1.0023x (the widest: Phi-3-mini NF4, 1.063x-1.080x, whose fused gate_up the shared count
charges whole; phi-2 bf16 1.024x-1.035x; Moonlight 1.002x-1.029x; without those at most 1.0238x, SmolLM2's
bounded rounding). Layers of several kinds (issue395.estimator.moe) hold each its own kind's tensors
(``kinds_weights``: Moonlight's dense layer 0 and MoE layers of 64 fused experts, Qwen3.5's delta-net and
full-attention layers; within 0.1% of what each committed row held before its step, where charging every layer
the union of the kinds was 10-30% off): Moonlight (DeepSeek-V3) 1.0003x-1.0286x on its 16 rows, Qwen3.5 with
checkpointing 1.0002x-1.0008x (4), Qwen3.5-MoE without it 1.0001x-1.0040x (12). phi-2 bf16 (6 rows,
1.0236x-1.0352x): a resident run trains under bf16 autocast, which the streamed step (where the counts are
measured) does not, and autocast runs layer_norm and pow in fp32 (``autocast_upcasts``). Under NF4 the rotary tables are
fp32, as the residual stream is: charged bf16, Gemma-2-2B NF4 4096x1 with checkpointing was 3.20 MB under its real
peak, the allowance aside; charged fp32, 0.99 MB over.

Known limitations
    - Without checkpointing, where a block of the step or of the weights is not whole 2 MiB (on the committed rows:
      SmolLM2, Qwen2.5, Gemma-2, Phi-3, Qwen3 NF4, and the 512-token rows of Qwen3 bf16), the retained blocks'
      rounding is bounded, not replayed: each 1-10 MiB block class is
      cut from 20 MiB segments whose last block keeps a rest of at most 1 MiB (1 MiB a segment), and each block
      from 10 MiB keeps its segment's tail, or, served from a larger cached block, a rest of at most 1 MiB (1 MiB
      a block); a block of 1 MiB or less is the small pool's, split at 512 B (retained_rounding, through
      constants.layer_remainders, the rule the streamed step's blocks take). The measured excess of max_memory_allocated over the requested peak was 21 MB on SmolLM2
      1024x1, 108 MB on Qwen2.5 2048x1 (75.5 MB of it the MLP blocks' tails), 0 on Llama-3.2-1B 2048x1; without the
      per-block bound SmolLM2 NF4 at 2048 tokens was 9.8 MB under. Those rows are 1.002x-1.024x, which a replay
      of the forward's requests through the allocator's rules (not built) would tighten.
    - Phi-3-mini NF4 without checkpointing is 1.064x-1.080x: about 12.3 KB a token a layer (1.5 i, or 4 h) over,
      unnamed: no anatomy of it is committed (bench/gpu-resident-1.sh ran out of its budget before
      sft-phi3-nf4-1024x1). Its bf16 rows are 1.0003x-1.019x and its checkpointed NF4 ones 1.0014x-1.0029x.
    - Past a sliding window without checkpointing it is refused: Gemma-3 and Phi-3 keep attention masks per layer
      there that the counts do not have (Gemma-3 2048x1: 48 blocks of 8 MiB; the construction was 0.983x-1.018x on
      Gemma-3-1B's 20 committed rows, 0.984x on Phi-3-mini bf16 2048, its NF4 1.044x-1.053x).
    - The steady state (steps > 1: the optimizer's states) and gradient accumulation are the streamed step's terms
      (estimator/steady.py), measured there, not yet on a resident run: every committed resident row is one step
      of one micro-batch.
    - phi-2 bf16 without checkpointing is 1.024x-1.035x: at 2048x1 (every block whole 2 MiB, no rounding
      charged) 10.35 KB a token a layer over, about the LayerNorm's fp32 input copy (4h) that autocast's fp32
      layer_norm makes and saves; without it the rows would be 0.999x-1.003x, gelu_new's fp32 tensors (6i)
      alone matching the measured slope to 620 B a token a layer. Kept: torch's autocast lists layer_norm as fp32
      and no phi anatomy is committed to show it is not saved. phi under NF4 is refused in one line: its rows were
      0.68x-0.82x of this construction (0.90x-0.95x with the dense NF4 rule's fp32 MLP charged twice over the
      fp32 count), about 71 KB a token a layer missing at 2048x1 that the counts do not name; no anatomy of it.
    - Qwen3.5 (dense hybrid) without checkpointing is refused: its bf16 rows were 0.9938x-0.9995x (up to 197 MB
      under at 2048x4, in the step; its NF4 rows 1.008x-1.038x). Qwen3.5-MoE with checkpointing is refused: 1024x1
      bf16 0.9999x (its row held 34 MB more before its step than at its other rows), 4096x1 0.9986x bf16 and
      0.9990x NF4 (29 MB under, in the step). No resident anatomy of either is committed.
    - Its needs-free is the allocated peak plus the reserve measured under expandable segments: stock `soup train`
      runs a resident run on the default allocator, where runs the patched gate admitted died of its fragmentation;
      `--soup-patch` sets expandable segments for every run. Evidence: docs/PEAK.md, "EXPANDABLE_RESERVE_PAGES".
    - Soup's own resident number is hardware_fit's (computed by Soup, from its CLI's input); it is not this
      module's business: the row carries it (results/extras.ResidentGate).
    - Full fine-tuning (Soup's ``training.lora.r: 0``, ``estimate_full``) is built from physics alone and NOT
      MEASURED: no full fine-tuning row exists, so every figure of it is unmeasured. What it charges: the
      weights at the checkpoint's bf16 (Soup 0.73.3 passes no dtype, transformers 5 loads "auto"); every
      parameter's gradient and torch AdamW's two states in that dtype (steady.OPTIMIZERS' rules per tensor; the
      states are made at step 1's optimizer step, so the optimizer's step binds from step 1); the foreach
      AdamW's square-root copy of every parameter at once (a bound: one group); each gradient/state block with
      the 1 MiB the default allocator may leave in it (constants.unsplit_bound); each layer's count with every
      linear's input and every norm's normed tensor kept for its weight's gradient (read from transformers'
      Llama and Gemma norms and SDPA attention, not from a live set); the head's gradient beside the loss (a
      bound: the loss's fp32 blocks may be freed by the head's backward); the backward walked with the
      gradients already made, each layer's own counted whole at its MLP backward (a bound); the embedding's
      backward with its fresh V x h gradient and a 4h-a-token bound on its kernel's fp32 partial sums. Refused
      in one line: any task but sft and any quantization (Soup does not build them), transformers before 5
      (fp32 by default), a config giving another dtype than bf16 or fp16, layers of several kinds (MoE, latent
      attention, delta-net: the trained tensors are counted for a plain layer), and phi on fp32 master weights
      (the fp32 count walks a Llama-like layer). Spectrum's and the freezes' partial fine-tuning are not modelled.
    - Full fine-tuning on a release that loads the base as fp32 master weights (0.77.0's
      resolve_base_load_dtype, ``estimate_master``), also NOT MEASURED, built from Soup's, accelerate's,
      transformers' and torch's source and held to transformers' own layers under CPU bf16 autocast
      (tests/estimator/test_resident.py): every parameter, gradient and AdamW state fp32; the residual stream
      fp32 from the embedding on (checkpointed inputs, rotary tables, norms' inputs and normed tensors); one bf16
      cast of a normed input per linear reading it; autocast's bf16 copy of every weight at the loss (saved by
      the matmuls without checkpointing; with it, held by the cast cache through the forward, a bound at the
      loss's backward, where only the head's remains) and in the layer phase (the recomputed layer's own
      casts). Bounds: a bias's cast, the head's bf16 and fp32 gradients at once, a layer's largest bf16 weight
      gradient beside its fp32 ones. Not charged: Gemma's (1 + weight) per norm (4h B a norm a layer, not per
      token). Phi-3's fused layer departs on CPU: its v is its own block beside one more q-sized block (2kw B a
      token under the fused qkv view charged, as the streamed count charges it), its gate and up one 2i block
      (the same bytes); not read on a card. Eager attention is refused (its softmax keeps rotary's fp32 query
      dtype).
"""

from __future__ import annotations

import ast

from ..constants import K_ROUND_LARGE, K_SMALL_SIZE, block_bytes, layer_remainders, unsplit_rests
from ..errors import UsageError
from ..record import LORA_DROPOUT
from ..model.targets import soup_targets
from ..tasks import PROTOCOL_TASK, task as task_named
from .arch import (NF4_BLOCK, Arch, activation_bytes, arch_from_config, fp32_residual, layer_bytes, nf4_bytes,
                   protocol_targets)
from .layer import (LORA_DROPOUT_MASK_BYTES, MLP_BACKWARD_TRANSIENTS, LayerPeak, Moment, checkpointed_through,
                    layer_blocks, layer_per_token, mask_bytes)
from .releases import release_source
from .stacks import package_version
from .steady import FP32, is_bounded, optimizer_named, state_blocks
from .estimate import Estimate, estimate, needs_free, segment_tail
from .steady import adapter_bytes
from .terms import Phase, Term, phase_sum
from .layer import STAGES

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
    tensors retained_by_layer counts per token (the norms' fp32 inputs, each target's dropout output, mask
    (``mask`` B a feature: layer.mask_bytes, none where the trainer turns dropout off) and lora_A output,
    attention's q, k, v and output, the MLP's saved i-wide tensors), each its own block, by the one rule
    (constants.layer_remainders: 1 MiB a 20 MiB segment the blocks over 1 MiB and under 10 MiB fill, 1 MiB a
    block from 10 MiB, which its fresh segment's tail or a cached block's rest may hold). Measured: Qwen2.5 2048x1 keeps 72 MLP blocks of 19,922,944 B, each with a 1 MiB
    tail, which the allocator's history (requested sizes) does not show and max_memory_allocated does
    (results/resident-anatomy-*/call-1/res-sft-qwen-bf16-2048x1: replayed peak 107.7 MB under the real one).
    Where every block the forward can request is a whole number of 2 MiB (``whole_granules``; ``seq`` given),
    no rest is kept but beside a weight's block (``unaligned_weight_blocks``)."""
    if seq is not None and whole_granules(a, targets, r, T, seq):
        return K_SMALL_SIZE * unaligned_weight_blocks(a, quant, targets, r)
    act, qw, kw = 2, a.heads * a.head_dim, a.kv * a.head_dim
    widths = [(4, a.h)] * (a.norms if a.quirks.norm_inputs_saved else 0)
    widths += [w for t in targets for w in ((act, a.modules[t][0]), (mask, a.modules[t][0]), (act, r))]
    widths += [(act, qw), (act, kw), (act, (qw + 2 * kw) if a.quirks.fused_qkv else kw), (act, qw)]
    upcast, _ = autocast_upcasts(a, quant)  # autocast's fp32 copies in place of as many of the count's MLP blocks
    mlp = a.quirks.mlp_saved - a.quirks.mlp_transients - sum(1 for _, w in upcast if w == a.i)
    widths += [(4 if quant == "nf4" else act, a.i)] * mlp + upcast
    return layer_remainders([b * w * T for b, w in widths if b] * a.L)


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
    sizes |= {4 * a.heads, 8, seq}
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


#: The bytes autocast's fp32 ops make one element of what they save: layer_norm and pow are on CUDA autocast's
#: float32 list (torch's autocast_mode.cpp), so each casts its bf16 input to fp32 and saves that copy.
AUTOCAST_FP32 = 4


def autocast_upcasts(a: Arch, quant: str) -> tuple[list[tuple[int, int]], int]:
    """The blocks, as (bytes an element, width) a token, that a layer keeps under Hugging Face's bf16 autocast (a
    resident run's: Soup's streamed step runs without it, and the shared counts are measured there) where the
    count charges other ones, and the bytes a token of the count's they replace. nn.LayerNorm (``norm_bias``:
    phi's input_layernorm, transformers 5.16.1 modeling_phi.py) runs in fp32 and saves its input's fp32 copy
    and its fp32 mean and rstd (4 B a token each), none of which the count charges (under NF4 the residual is
    fp32 already, and the input itself is what it saves). phi's python gelu_new (activations.py
    NewGELUActivation, ``mlp_saved`` 7) calls torch.pow, which autocast runs in fp32: its input's fp32 copy
    (which pow saves), tanh's output and 1 + tanh (which the last mul saves) are fp32, where the count charges
    three bf16 (0.5 x stays bf16); under NF4 the count charges them fp32 already (fp32_residual)."""
    blocks, replaced = [], 0
    if a.norm_bias:
        blocks += [(AUTOCAST_FP32, a.h), (AUTOCAST_FP32, 1), (AUTOCAST_FP32, 1)] * a.norms
    if a.quirks.mlp_saved == 7 and not fp32_residual(a, quant):
        blocks += [(AUTOCAST_FP32, a.i)] * 3
        replaced += 3 * activation_bytes(a, quant) * a.i
    return blocks, replaced


def autocast_per_token(a: Arch, quant: str) -> int:
    """What autocast_upcasts adds to a layer's count a token."""
    blocks, replaced = autocast_upcasts(a, quant)
    return sum(b * w for b, w in blocks) - replaced


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
    first = sum(block_bytes(2 * r * a.modules[t][0]) for t in targets if t in a.modules)
    last = sum(block_bytes(2 * r * a.modules[t][1]) for t in targets if t in a.modules)
    return a.L * last + (a.L - 1) * first


def refused(a: Arch, quant: str, checkpointing: bool = True, seq: int = 0) -> str | None:
    """Why this tool does not estimate this resident run (None: it does)."""
    if not checkpointing and a.window and seq >= a.window:
        return (f"a resident {a.model_type} run past its sliding window ({a.window}) without gradient checkpointing "
                "is not yet modelled by this estimator (its layers keep attention masks the counts do not have)")
    if quant not in ("none", "nf4"):
        return f"a resident {quant} run is not modelled by this estimator"
    if fp32_residual(a, quant):
        return (f"a resident {quant} {a.model_type} run is not yet modelled by this estimator (its fp32 residual "
                "stream under autocast keeps more a layer than the counts name)")
    if a.layers is not None and (a.model_type, checkpointing) in LAYERED_REFUSED:
        return (f"a resident {a.model_type} run {'with' if checkpointing else 'without'} gradient checkpointing "
                f"is not yet modelled by this estimator ({LAYERED_REFUSED[a.model_type, checkpointing]})")
    if a.model_type not in MODELLED_TYPES:
        return f"a resident {a.model_type} run is not yet modelled by this estimator"
    return None


def targets_of(a: Arch, targets, config: dict) -> tuple:
    """The LoRA targets as the layer's modules (Soup's spellings resolved, the protocol's by default)."""
    targets = protocol_targets(a) if targets is None else targets
    return soup_targets((targets,) if isinstance(targets, str) else tuple(targets), config, a, str(targets))


def estimate_resident(config: dict, *, quant: str = "none", seq: int, batch: int = 1, targets=None,
                      lora_r: int = 8, steps: int = 1, release: str | None = None, task: str = PROTOCOL_TASK,
                      checkpointing: bool = False, optimizer: str = "adamw_torch", accumulation: int = 1,
                      transformers: str | None = None, lora_dropout: float = LORA_DROPOUT) -> Estimate:
    """The corrected peak of a resident run: the streamed step's bf16 terms (recompute off without checkpointing, on
    with it) with every parameter on the card in place of the pool and the extras, and under NF4 what runs in fp32.
    The Estimate carries no Soup number (Soup's resident gate is hardware_fit's; the row has it)."""
    if lora_r == 0:  # Soup's full fine-tuning (lora.r 0): no adapter, every parameter trains
        return estimate_full(config, quant=quant, seq=seq, batch=batch, steps=steps, release=release, task=task,
                             checkpointing=checkpointing, optimizer=optimizer, accumulation=accumulation,
                             transformers=transformers)
    a = arch_from_config(config)
    why = refused(a, quant, checkpointing, seq)
    if why:
        raise UsageError(why)
    e = estimate(config, quant="none", seq=seq, batch=batch, targets=targets, lora_r=lora_r, release=release,
                 soup=False, task=task, transformers=transformers, steps=steps, optimizer=optimizer,
                 accumulation=accumulation, stream={} if checkpointing else {"stream_recompute": "off"},
                 lora_dropout=lora_dropout)
    t = dict(e.terms)
    for streamed in (Term.POOL.key, Term.EXTRAS.key, Term.RESIDENT_ROUNDING.key):
        t[streamed] = 0  # the pool's slots and the streamed extras: here, the whole model's tensors
    t = {Term.RESIDENT_WEIGHTS.key: resident_weights(a, quant), **t}
    T = e.seq * e.batch * task_named(task).rows_per_example
    tg = targets_of(a, targets, config)
    if not checkpointing:
        # no checkpoint saves a layer's input: what each layer's backward needs is its retained count (the
        # norms' fp32 copies among it). Measured: Qwen2.5 2048x1 keeps 45,912 B a token a layer at its loss
        # peak, retained_by_layer's count to the byte (results/resident-anatomy-*/call-1/res-sft-qwen-bf16-2048x1)
        t[Term.CHECKPOINTED_INPUTS.key] = 0
        t[Term.ALLOCATOR_ROUNDING.key] += retained_rounding(a, tg, lora_r, T, quant, e.seq,
                                                            mask_bytes(task_named(task), lora_dropout))
        t[Term.ADAPTER_CASTS.key] = adapter_casts(a, tg, lora_r, adapter_bytes(task, quant))
        t[Term.RETAINED_ACTIVATIONS.key] += T * a.L * autocast_per_token(a, quant)
        t[Term.RETAINED_BESIDE_LAYER.key] += T * (a.L - 1) * autocast_per_token(a, quant)
    # the layer the backward runs holds them too, recomputed or not
    t[Term.LAYER_PER_TOKEN.key] += T * autocast_per_token(a, quant)
    if quant == "nf4":
        # the embedding is fp32, so the residual stream is, and bitsandbytes' Linear4bit returns its input's dtype:
        # the MLP's i-wide tensors are fp32 (Llama-3.2-1B NF4 2048x1 kept 48 of 67,108,864 B, i x T x 4, where bf16
        # kept 33,554,432), and the layer inputs a checkpoint saves are fp32. The head's weight is fp32 too, so
        # autocast casts it to bf16 for the head's matmul, which saves that copy for its backward: V x h x 2 beside
        # the loss, whatever the tokens (Llama-3.2-1B NF4: real peaks 3.733 MB a token plus 561 MB at 512-8192
        # tokens; this copy is 525 MB). The backward dequantises one linear at a time.
        # (phi's residual is fp32 from layer 0's output: its count charges every activation fp32 already)
        saved = 0 if fp32_residual(a, quant) else 2 * a.i * (a.quirks.mlp_saved - a.quirks.mlp_transients)
        if checkpointing:
            t[Term.CHECKPOINTED_INPUTS.key] *= 2
        else:
            t[Term.RETAINED_ACTIVATIONS.key] += T * a.L * saved
            t[Term.RETAINED_BESIDE_LAYER.key] += T * (a.L - 1) * saved
        t[Term.LAYER_PER_TOKEN.key] += 0 if fp32_residual(a, quant) else T * 2 * a.i * a.quirks.mlp_saved
        t[Term.HEAD_COPY.key] = 2 * a.V * a.h + segment_tail(2 * a.V * a.h)
        # the rotary tables take the residual stream's dtype (transformers' rotary embeddings return
        # cos.to(x.dtype)): fp32 here, twice the streamed step's bf16 tables. Measured: Llama-3.2-1B NF4 2048x1
        # keeps cos and sin as 2 blocks of 524,288 B (rd x seq x 4) at its loss peak, bf16 2 of 262,144
        # (results/resident-anatomy-*/call-1/res-sft-llama1b-*-2048x1)
        t[Term.ROTARY_TABLES.key] *= 2
        t[Term.DEQUANTISED_LAYER.key] = 2 * max(fi * fo for fi, fo, _ in a.modules.values())
    step = {p: phase_sum(t, p) for p in (Phase.LOSS, Phase.REFERENCE, Phase.LAYER)}
    if not task_named(task).reference:
        step[Phase.REFERENCE] = 0
    ws = t[Term.AUTOGRAD_WORKSPACE.key]
    if steps > 1 or accumulation > 1:  # the steady state's phases, as estimate() composes a streamed run's: after
        # a first backward its thread's cuBLAS workspace stays beside every phase
        step = {p: v + ws if v else v for p, v in step.items()}
    binding = max(step, key=step.get)
    peak = step[binding]
    if steps > 1:  # the optimizer's states beside every phase, and its own step once the activations are freed
        optimizer_step = (t[Term.ADAPTER_GRADIENTS.key] + t[Term.OPTIMIZER_TRANSIENTS.key] + ws
                          + t.get(Term.UNSPLIT_REMAINDERS.key, 0))
        if optimizer_step > peak:
            binding, peak = Phase.OPTIMIZER, optimizer_step
        peak += t[Term.OPTIMIZER_STATES.key]
    corrected = phase_sum(t, Phase.RESIDENT) + peak + phase_sum(t, Phase.ALLOWANCE)
    # `soup train` sets expandable segments for streamed runs only (stream_setup): a resident run's allocator is
    # the default one, whose unsplit remainders stay in what it needs
    return Estimate(e.seq, e.batch, quant, e.steps, e.release, None, {}, corrected, needs_free(corrected),
                    binding.value, t, e.task, e.optimizer, e.accumulation)


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


# -- Full fine-tuning (Soup's training.lora.r 0): no adapter, every parameter trains --
#: Soup trains every parameter under lora.r 0 in its SFT trainer only (config/schema.py _validate_full_finetune:
#: sft + transformers + text + quantization none; its other trainers pass r 0 to peft, which refuses it).
FULL_FT_TASKS = ("sft",)
#: The norms that compute in fp32 and scale by ``1 + weight.float()`` (transformers' GemmaRMSNorm and its
#: heirs): a trained weight makes that mul keep the fp32 normed tensor. Every other modelled norm is Llama's
#: RMSNorm, whose ``weight * x.to(input_dtype)`` keeps the normed tensor in the model's dtype.
FP32_NORM_TYPES = ("gemma", "gemma2", "gemma3_text")
#: The bytes a parameter takes as Soup's full fine-tuning loads it on the stacks this estimate models: the
#: checkpoint's own bf16 or fp16 (Soup 0.73.3 passes no dtype to from_pretrained, and transformers 5 loads
#: dtype "auto": the config's, else the weights' own; every checkpoint this tool builds or reads is bf16).
#: Its gradient and a torch optimizer's states take the same (torch.zeros_like).
FULL_FT_BYTES = 2


def full_refused(a: Arch, config: dict, *, quant: str, task: str, release: str | None,
                 transformers: str | None) -> str | None:
    """Why this tool does not estimate this full fine-tuning (None: it does)."""
    if task not in FULL_FT_TASKS:
        return (f"full fine-tuning (lora.r 0) under task {task} is not a run Soup builds: its {task} trainer "
                "passes r 0 to peft, which refuses it (Soup fine-tunes in full under task sft only)")
    if quant != "none":
        return f"full fine-tuning (lora.r 0) under {quant}: Soup's loader refuses it (quantization none only)"
    if a.layers is not None:  # full_params counts a plain layer's modules: every expert's, each kind's, not yet
        return (f"a full fine-tuning of {a.model_type} (layers of several kinds: experts, latent attention or "
                "delta-net) is not yet modelled by this estimator: its trained tensors are counted for a plain layer")
    src = release_source(release)
    if src is None:
        return f"soup-cli {release}'s source is not here, so how it loads a fully fine-tuned base is not read"
    if loads_fp32_master(src):  # Soup passes torch.float32 whatever the checkpoint and transformers: estimate_master
        if a.model_type == "phi":  # master_blocks walks a Llama-like layer: not phi's parallel block and gelu_new
            return ("a full fine-tuning of phi on fp32 master weights is not yet modelled by this estimator (its "
                    "parallel block, LayerNorm and gelu_new's autocast fp32 copies are not in the fp32 count)")
        return None
    major = (transformers or package_version("transformers")).split(".")[0]
    if not major.isdigit() or int(major) < 5:
        return (f"transformers {transformers or package_version('transformers')} loads a base Soup passes no "
                "dtype in fp32 (its default before 5), which this estimator does not yet model")
    dtype = config.get("dtype") or config.get("torch_dtype")
    if dtype not in (None, "bfloat16", "float16"):  # none given: the weights' own, bf16 in every checkpoint read
        return (f"a full fine-tuning of a checkpoint whose config.json gives dtype {dtype} is not modelled "
                "(transformers loads it at that dtype; this estimate charges bf16 or fp16)")
    return None


def layer_tensors(a: Arch) -> list[int]:
    """One decoder layer's parameter tensors' element counts: its linears (and their biases), its norms (and
    their biases), its q/k norms."""
    per_layer = [n for fi, fo, bias in a.modules.values() for n in ((fi * fo, fo) if bias else (fi * fo,))]
    return per_layer + [a.h] * (a.norms * (2 if a.norm_bias else 1)) + ([a.head_dim] * 2 if a.qk_norm else [])


def full_params(a: Arch) -> list[int]:
    """Each parameter tensor's element count, as transformers builds the model: every layer's (layer_tensors),
    the embedding, an untied head (its bias) and the final norm."""
    vocab = [a.V * a.h] + ([] if a.tied else [a.V * a.h] + ([a.V] if a.quirks.head_bias else []))
    return layer_tensors(a) * a.L + vocab + [a.h] * (2 if a.norm_bias else 1)


def _norm_bytes(a: Arch) -> int:
    return 4 if a.model_type in FP32_NORM_TYPES else 2


def full_saved_per_token(a: Arch) -> int:
    """What a trained weight makes one layer's autograd keep a token beyond a frozen one's: each norm's normed
    tensor, which its weight's gradient reads (the q/k norms' too); each linear's input, which its weight's
    gradient reads, where nothing else keeps it: the normed input the attention's and the MLP's input
    projections share (2 x 2h), attention's output made contiguous for o_proj (2q), the MLP's product for
    down_proj (2i)."""
    qw, kw = a.heads * a.head_dim, a.kv * a.head_dim
    norms = _norm_bytes(a) * (a.norms * a.h + (qw + kw if a.qk_norm else 0))
    return norms + 2 * 2 * a.h + 2 * qw + 2 * a.i


def full_per_token(a: Arch, at: Moment) -> int:
    """One layer's count a token at moment ``at`` under full fine-tuning: layer_per_token with no adapter and
    every layer's input carrying a gradient (the embedding trains), what the trained weights keep, and
    autocast's fp32 copies (autocast_upcasts: phi's LayerNorm and gelu_new). A resident run trains under bf16
    autocast whether the weights train or not, and each of those ops saves its fp32 copy for its input's
    gradient, which a fully trained layer needs as a LoRA one from layer 1 on: at least what the LoRA layer
    keeps (phi-2: 71,688 B a token a layer)."""
    return (layer_per_token(a, "none", (), 0, at=at, input_grad=True) + full_saved_per_token(a)
            + autocast_per_token(a, "none"))


def full_retained(a: Arch) -> int:
    """What each layer keeps a token for its backward without checkpointing (retained_by_layer's rule: its
    count at the MLP backward less that moment's transients)."""
    return full_per_token(a, Moment.BACKWARD) - 2 * MLP_BACKWARD_TRANSIENTS * a.i - 2 * a.h


def full_retained_rounding(a: Arch, T: int) -> int:
    """retained_rounding's bound on the blocks each layer keeps without checkpointing, for full fine-tuning's
    blocks: the norms' fp32 inputs and normed tensors, the shared normed inputs, attention's q, k, v, output
    and o_proj's input, the MLP's saved i-wide tensors and down_proj's input; the same allocator rule
    (constants.layer_remainders)."""
    qw, kw, nb = a.heads * a.head_dim, a.kv * a.head_dim, _norm_bytes(a)
    widths = [(4, a.h)] * (a.norms if a.quirks.norm_inputs_saved else 0) + [(nb, a.h)] * a.norms
    widths += [(2, a.h)] * 2 + [(2, qw), (2, kw), (2, (qw + 2 * kw) if a.quirks.fused_qkv else kw), (2, qw), (2, qw)]
    upcast, _ = autocast_upcasts(a, "none")  # autocast's fp32 copies in place of as many of the MLP's blocks
    widths += [(2, a.i)] * (a.quirks.mlp_saved - a.quirks.mlp_transients + 1 - sum(1 for _, w in upcast if w == a.i))
    return layer_remainders([b * w * T for b, w in widths + upcast] * a.L)


def full_layer_rests(a: Arch, T: int) -> int:
    """The rests the binding layer's blocks keep under full fine-tuning with checkpointing (the layer phase's
    layer_remainders, by the one rule constants.layer_remainders): at each moment of its turn, the blocks
    layer.layer_blocks lists for a layer with no adapter whose input carries a gradient, beside what the trained
    weights keep (full_saved_per_token's blocks) and autocast's fp32 copies (autocast_upcasts, beside the bf16
    blocks they replace: a bound); the larger moment's (a bound: the walk does not say which binds)."""
    qw, kw, nb = a.heads * a.head_dim, a.kv * a.head_dim, _norm_bytes(a)
    kept = [(nb, a.h)] * a.norms + ([(nb, qw), (nb, kw)] if a.qk_norm else []) + [(2, a.h)] * 2 + [(2, qw), (2, a.i)]
    kept += autocast_upcasts(a, "none")[0]
    return max(layer_remainders(layer_blocks(a, "none", (), 0, T, LayerPeak(1, at, 0, 0, 0, 0, 0, 0))
                                + [b * w * T for b, w in kept]) for at in Moment)


def lora_retained_rounding(a: Arch, config: dict, T: int, seq: int, task: str) -> int:
    """What estimate_resident added to the allocator's rounding without checkpointing for the r 1 LoRA run a full
    fine-tuning's estimate starts from (its seq, its task's mask): exactly what that estimate takes off again."""
    return retained_rounding(a, targets_of(a, None, config), 1, T, "none", seq, mask_bytes(task_named(task)))


def held(blocks) -> int:
    """Blocks of these requested sizes as the default allocator holds them: each rounded to 512 B, and up to
    1 MiB past it where it is over 1 MiB (constants.unsplit_rests: a cached block handed over whole)."""
    blocks = list(blocks)
    return sum(map(block_bytes, blocks)) + unsplit_rests(blocks)


def full_backward(a: Arch, T: int, *, checkpointing: bool, accumulated: bool) -> dict:
    """The layer phase of a full fine-tuning, walked last layer to first, and the backward's end: the terms of
    its binding moment. At layer n's turn: the checkpointed inputs of layers 0..n (without checkpointing, what
    layers 0..n-1 keep), layer n's count at the moment, the gradients already made (the head's, the final
    norm's, layers n+1..'s; none where micro-batches accumulate into held ones) and, at its MLP backward, its
    own (a bound: every one of its tensors' at once). At the end the embedding's backward makes a fresh V x h
    gradient (untied: its own; tied: added into the head's) beside every gradient, with its kernel's fp32
    partial sums (a bound of 4h a token)."""
    own = held(FULL_FT_BYTES * n for n in layer_tensors(a))
    top = head_gradient(a) + held(FULL_FT_BYTES * n for n in [a.h] * (2 if a.norm_bias else 1))
    best = {}
    for n in range(a.L):
        made = 0 if accumulated else top + (a.L - 1 - n) * own
        before = checkpointed_through(a, "none", T, n) if checkpointing else T * full_retained(a) * n
        for at in (Moment.FORWARD_END, Moment.BACKWARD) if checkpointing else (Moment.BACKWARD,):
            mine = own if at is Moment.BACKWARD else 0
            terms = {Term.LAYER_PER_TOKEN.key: T * full_per_token(a, at), Term.BACKWARD_GRADIENTS.key: made + mine,
                     "before": before}
            if sum(terms.values()) > sum(best.values()):
                best = terms
    end = {Term.LAYER_PER_TOKEN.key: 0, "before": 0,
           Term.BACKWARD_GRADIENTS.key: 0 if accumulated else top + a.L * own,
           Term.EMBEDDING_BACKWARD.key: held([FULL_FT_BYTES * a.V * a.h]) + 4 * a.h * T}
    return end if sum(end.values()) > sum(best.values()) else best


def head_gradient(a: Arch) -> int:
    """The head's weight gradient, V x h, made at the loss's backward (tied: the embedding's gradient, made
    there first), and an untied head's bias's."""
    return held([FULL_FT_BYTES * a.V * a.h] + ([FULL_FT_BYTES * a.V] if a.quirks.head_bias and not a.tied else []))


def full_optimizer(a: Arch, optimizer: str, per: int = FULL_FT_BYTES) -> dict:
    """The optimizer's step over every parameter (steady.OPTIMIZERS' rules, per parameter tensor): every
    gradient, the optimizer's states (torch's in the parameter's dtype, bitsandbytes' own), and its
    transients (torch's foreach AdamW: exp_avg_sq's square root, one copy of every parameter of a group
    at once; a bound: the whole model as one group). Each block as the default allocator holds it (held).
    ``per``: a parameter's bytes (fp32 master weights: 4)."""
    sizes = full_params(a)
    o = optimizer_named(optimizer)
    step = FP32 if is_bounded(optimizer) else per
    return {Term.PARAMETER_GRADIENTS.key: held(per * n for n in sizes),
            Term.OPTIMIZER_STATES.key: held(b for n in sizes for b in state_blocks(n, optimizer, per)),
            Term.OPTIMIZER_TRANSIENTS.key: held(step * n for n in sizes for _ in range(o.transient))}


def estimate_full(config: dict, *, quant: str = "none", seq: int, batch: int = 1, steps: int = 1,
                  release: str | None = None, task: str = PROTOCOL_TASK, checkpointing: bool = False,
                  optimizer: str = "adamw_torch", accumulation: int = 1, transformers: str | None = None) -> Estimate:
    """The corrected peak of a resident full fine-tuning (Soup's lora.r 0): estimate_resident's shared terms
    (the weights on the card, the logits and the loss, the ids, the rotary tables, the workspaces, the
    allowance) with no adapter, each layer's count as a trained layer keeps it, the head's gradient at the
    loss, the backward walked with every gradient it has made, and the optimizer's step over every parameter,
    which runs at step 1 too (its states are made there: AdamW's zeros_like at its first step). From step 2
    the states are live beside every phase. Unmeasured: the module docstring says what is not yet shown."""
    a = arch_from_config(config)
    why = full_refused(a, config, quant=quant, task=task, release=release, transformers=transformers)
    if why:
        raise UsageError(why)
    if loads_fp32_master(release_source(release)):
        return estimate_master(config, seq=seq, batch=batch, steps=steps, release=release, task=task,
                               checkpointing=checkpointing, optimizer=optimizer, accumulation=accumulation,
                               transformers=transformers)
    base = estimate_resident(config, seq=seq, batch=batch, lora_r=1, release=release, task=task,
                             checkpointing=checkpointing, transformers=transformers)
    T = base.seq * base.batch
    t = adapterless(base)
    if checkpointing:  # without it no layer is walked in its blocks (the LoRA step's rule): the retained rounding
        t[Term.LAYER_REMAINDERS.key] = full_layer_rests(a, T)
    t[Term.HEAD_INPUT.key] = T * a.h * (_norm_bytes(a) + 2)  # the final norm's normed tensor and the head's input
    t[Term.HEAD_GRADIENT.key] = head_gradient(a)
    return trained_step(t, a, config, base, task, FULL_FT_BYTES, (full_backward, full_retained, full_retained_rounding),
                        checkpointing=checkpointing, steps=steps, optimizer=optimizer, accumulation=accumulation)


def full_phases(t: dict, base: Estimate, before: int, *, checkpointing: bool, steps: int, optimizer: str,
                accumulation: int) -> Estimate:
    """A full fine-tuning's terms ``t`` into its estimate: the loss, the layer phase (its checkpointed inputs
    those of the binding layer's turn, ``before``) and the optimizer's step, which binds from step 1 (its
    states are made there); from step 2 the states, and after a first backward its cuBLAS workspace, beside
    every phase."""
    ws = t[Term.AUTOGRAD_WORKSPACE.key]
    layer = phase_sum(t, Phase.LAYER) - (t[Term.CHECKPOINTED_INPUTS.key] - before if checkpointing else 0)
    step = {Phase.LOSS: phase_sum(t, Phase.LOSS), Phase.LAYER: layer}
    if steps > 1 or accumulation > 1:  # after a first backward its cuBLAS workspace stays beside every phase
        step = {p: v + ws for p, v in step.items()}
    states = t[Term.OPTIMIZER_STATES.key]
    if steps > 1:
        step = {p: v + states for p, v in step.items()}
    step[Phase.OPTIMIZER] = t[Term.PARAMETER_GRADIENTS.key] + states + t[Term.OPTIMIZER_TRANSIENTS.key] + ws
    binding = max(step, key=step.get)
    corrected = phase_sum(t, Phase.RESIDENT) + step[binding] + phase_sum(t, Phase.ALLOWANCE)
    return Estimate(base.seq, base.batch, base.quant, steps, base.release, None, {}, corrected,
                    needs_free(corrected), binding.value, {term.key: t[term.key] for term in Term if term.key in t},
                    base.task, optimizer, accumulation)


# -- Full fine-tuning on fp32 master weights (soup-cli 0.77.0): every parameter fp32, the step under bf16 autocast --
# Evidence, besides Soup's and transformers' source: tests/estimator/test_resident.py runs a tiny Llama of
# transformers 5.16.1 under torch.autocast("cpu", bfloat16) with fp32 weights and reads what autograd saves and
# which casts stay alive. CPU and CUDA autocast (torch's aten/src/ATen/autocast_mode.cpp) both list linear, mm,
# matmul and scaled_dot_product_attention as lower_precision_fp and cache a cast alike (cached_cast: an fp32 leaf
# that requires grad, the device's lower precision); CUDA's fp32 lists (pow, rsqrt, log_softmax, nll_loss) differ
# from CPU's, but here those ops read fp32 already (the norms upcast, HF's loss takes logits.float()).

def loads_fp32_master(src) -> bool:
    """Whether the release whose soup_cli/ is ``src`` loads a fully fine-tuned base as fp32 master weights: its
    SFT setup passes resolve_base_load_dtype as from_pretrained's torch_dtype, and that function (utils/gpu.py)
    returns torch.float32 under full_finetune (0.77.0, #339 AC2: "explicit fp32 master weights"). Its
    TrainingArguments get bf16 where the card has it (bf16_fp16_flags), so accelerate wraps the model's forward
    in torch.autocast (prepare_model). Read with ast, never imported."""
    sft, gpu = (src / "trainer" / "sft.py", src / "utils" / "gpu.py") if src is not None else (None, None)
    if sft is None or not (sft.is_file() and gpu.is_file()) or "resolve_base_load_dtype" not in sft.read_text(
            encoding="utf-8"):
        return False
    for fn in ast.walk(ast.parse(gpu.read_text(encoding="utf-8"))):
        if isinstance(fn, ast.FunctionDef) and fn.name == "resolve_base_load_dtype":
            return any(isinstance(n, ast.If) and "full_finetune" in ast.unparse(n.test) and any(
                isinstance(r, ast.Return) and ast.unparse(r.value) == "torch.float32" for b in n.body
                for r in ast.walk(b)) for n in ast.walk(fn))
    return False


def master_weights(a: Arch) -> int:
    """Every parameter as Soup's fp32 load puts it on the card: each tensor (full_params) its own block of 4 B an
    element, with its segment's tail (HF loads tensor by tensor)."""
    return sum(block_bytes(FP32 * n) + segment_tail(FP32 * n) for n in full_params(a))


def cast_sizes(a: Arch) -> list[int]:
    """The bf16 copy autocast makes of each of one layer's fp32 linear weights and biases (linear and addmm are
    lower_precision_fp ops). A bias's copy is held by the cache through the forward; its backward keeps only the
    weight's (a bound of one bias a linear)."""
    return [2 * n for fi, fo, bias in a.modules.values() for n in ((fi * fo, fo) if bias else (fi * fo,))]


def head_cast(a: Arch) -> int:
    """The head's weight as its matmul reads it under autocast, bf16 (tied: the embedding's, cast as the head's;
    the embedding's own lookup is no autocast op and reads the fp32 weight), with an untied head's bias."""
    return held([2 * a.V * a.h] + ([2 * a.V] if a.quirks.head_bias and not a.tied else []))


def weight_casts(a: Arch) -> int:
    """Autocast's bf16 copies live at the loss: every layer's (cast_sizes) and the head's. Without checkpointing
    every matmul saved its copy for the backward. With it (non-reentrant: Soup's gradient_checkpointing_kwargs
    use_reentrant False) nothing inside a layer is saved, but the cache keeps every copy until the forward's
    autocast region exits, which is after the model's own loss (accelerate wraps model.forward): at the loss's
    backward only the head's remains, so with checkpointing this is a bound on the loss's forward."""
    return a.L * held(cast_sizes(a)) + head_cast(a)


def master_blocks(a: Arch) -> list[tuple[int, int]]:
    """(bytes an element, elements a token) of each block one layer keeps for its backward on fp32 master weights
    under autocast, op by op. Each norm: its fp32 input (the residual stream itself, fp32 since the embedding is:
    ``.to(float32)`` makes no copy; a bf16 linear output's fp32 copy where a norm reads one, Gemma-2's post
    norms), its rsqrt, its fp32 normed tensor (its weight's gradient reads it). Each linear reading a normed
    input (STAGES 0 and 3: q, k, v, gate, up; phi3's fused qkv and gate_up) casts it to bf16 itself, a copy
    each, which its weight's gradient reads. SDPA saves bf16 q and k (its own casts of rotary's fp32 outputs:
    bf16 x fp32 cos promotes), v, its output (which o_proj reads in place: the kernel lays it out token-major,
    so transformers' transpose().contiguous() copies nothing) and fp32 logsumexp. q/k norms save their fp32 input
    copy, rsqrt and normed tensor. The MLP saves gate, act(gate), up and down_proj's input, bf16."""
    qw, kw = a.heads * a.head_dim, a.kv * a.head_dim
    v = (qw + 2 * kw) if a.quirks.fused_qkv else kw  # phi3: v is a view of the fused qkv output
    blocks = [(FP32, a.h), (FP32, 1), (FP32, a.h)] * a.norms
    blocks += [(2, a.h)] * sum(1 for m in a.modules if STAGES.get(m) in (0, 3))
    blocks += [(2, qw), (2, kw), (2, v), (2, qw), (FP32, a.heads)]
    if a.qk_norm:
        blocks += [(FP32, qw), (FP32, kw), (FP32, a.heads), (FP32, a.kv), (_norm_bytes(a), qw), (_norm_bytes(a), kw)]
    return blocks + [(2, a.i)] * (a.quirks.mlp_saved - a.quirks.mlp_transients + 1)


def master_retained(a: Arch) -> int:
    """What each layer keeps a token for its backward without checkpointing (master_blocks)."""
    return sum(b * w for b, w in master_blocks(a))


def master_per_token(a: Arch, at: Moment, checkpointing: bool) -> int:
    """One layer's count a token at moment ``at``: what it keeps (with checkpointing, less its input norm's input,
    which is the checkpointed input itself), and at the MLP backward the incoming fp32 gradient, its bf16 cast
    into the MLP's branch and MLP_BACKWARD_TRANSIENTS bf16 i-wide gradients; at the recomputed forward's end
    the incoming gradient, the MLP's fp32 normed input (held by the layer's frame through the MLP) and
    down_proj's bf16 output."""
    kept = master_retained(a) - (FP32 * a.h if checkpointing else 0)
    if at is Moment.BACKWARD:
        return kept + FP32 * a.h + 2 * a.h + 2 * MLP_BACKWARD_TRANSIENTS * a.i
    return kept + FP32 * a.h + FP32 * a.h + 2 * a.h


def master_retained_rounding(a: Arch, T: int) -> int:
    """full_retained_rounding's allocator bound over master_blocks' blocks (constants.layer_remainders)."""
    return layer_remainders([b * w * T for b, w in master_blocks(a)] * a.L)


def master_layer_rests(a: Arch, T: int) -> int:
    """full_layer_rests on fp32 master weights: the recomputed layer's blocks at each moment of its turn as
    master_per_token counts them (master_blocks, the incoming fp32 gradient, its bf16 cast and the MLP's bf16
    gradients at its backward; the MLP's fp32 normed input and down_proj's bf16 output at the forward's end), by
    constants.layer_remainders; the larger moment's."""
    kept = master_blocks(a)
    moments = (kept + [(FP32, a.h), (2, a.h)] + [(2, a.i)] * MLP_BACKWARD_TRANSIENTS,
               kept + [(FP32, a.h), (FP32, a.h), (2, a.h)])
    return max(layer_remainders([b * w * T for b, w in blocks]) for blocks in moments)


def master_head_gradient(a: Arch) -> int:
    """The head's fp32 weight gradient made at the loss's backward, and the bf16 gradient of its weight's copy
    that ToCopyBackward casts into it (a bound: both live at once only inside that cast)."""
    return held([FP32 * a.V * a.h] + ([FP32 * a.V] if a.quirks.head_bias and not a.tied else [])) + held(
        [2 * a.V * a.h])


def master_backward(a: Arch, T: int, *, checkpointing: bool, accumulated: bool) -> dict:
    """full_backward's walk on fp32 master weights: fp32 checkpointed inputs and gradients; at layer n's turn
    the bf16 weight copies live (with checkpointing the recomputed layer's, its recompute being an autocast
    region of its own; without, those layers 0..n saved); its own gradients at its MLP backward with the bf16
    gradient of its largest weight's copy before its cast (one at a time; a bound). The embedding's backward
    makes a fresh fp32 V x h gradient, with its kernel's partial sums (4h a token, a bound)."""
    grads = held(FP32 * n for n in layer_tensors(a))
    own = grads + held([2 * max(fi * fo for fi, fo, _ in a.modules.values())])
    top = held([FP32 * a.V * a.h] + ([FP32 * a.V] if a.quirks.head_bias and not a.tied else [])) + held(
        FP32 * n for n in [a.h] * (2 if a.norm_bias else 1))
    casts, best = held(cast_sizes(a)), {}
    for n in range(a.L):
        made = 0 if accumulated else top + (a.L - 1 - n) * grads
        before = 2 * checkpointed_through(a, "none", T, n) if checkpointing else T * master_retained(a) * n
        for at in (Moment.FORWARD_END, Moment.BACKWARD) if checkpointing else (Moment.BACKWARD,):
            terms = {Term.LAYER_PER_TOKEN.key: T * master_per_token(a, at, checkpointing),
                     Term.LAYER_WEIGHT_CASTS.key: casts * (1 if checkpointing else n + 1),
                     Term.BACKWARD_GRADIENTS.key: made + (own if at is Moment.BACKWARD else 0), "before": before}
            if sum(terms.values()) > sum(best.values()):
                best = terms
    end = {Term.LAYER_PER_TOKEN.key: 0, Term.LAYER_WEIGHT_CASTS.key: 0, "before": 0,
           Term.BACKWARD_GRADIENTS.key: 0 if accumulated else top + a.L * grads,
           Term.EMBEDDING_BACKWARD.key: held([FP32 * a.V * a.h]) + FP32 * a.h * T}
    return end if sum(end.values()) > sum(best.values()) else best



def adapterless(base: Estimate) -> dict:
    """The terms of the r 1 LoRA run a full fine-tuning starts from, less what only an adapter holds (its weights,
    gradients, held gradients and their rests, autocast's copies of it) and the r 1 layer's rests (not this one's)."""
    return {k: v for k, v in base.terms.items() if k not in (
        Term.LORA_WEIGHTS.key, Term.BACKWARD_GRADIENTS.key, Term.HELD_GRADIENTS.key, Term.UNSPLIT_REMAINDERS.key,
        Term.ADAPTER_CASTS.key, Term.LAYER_REMAINDERS.key)}


def trained_step(t: dict, a: Arch, config: dict, base: Estimate, task: str, per: int, counts: tuple, *,
                 checkpointing: bool, steps: int, optimizer: str, accumulation: int) -> Estimate:
    """What every full fine-tuning's step holds past its weights, one construction for the bf16 (estimate_full)
    and the fp32 master (estimate_master) runs, each parameter's gradient and state at ``per`` bytes and
    ``counts`` its (backward walk, retained per token, retained rounding): from micro-batch 2 every gradient of
    micro-batch 1 held; the backward walked; without checkpointing every layer's kept blocks through the loss
    (the r 1 LoRA count's rounding taken off exactly); the optimizer's step; the phases."""
    backward, retained, rounding = counts
    T = base.seq * base.batch
    if accumulation > 1:
        t[Term.HELD_GRADIENTS.key] = held(per * n for n in full_params(a))
    walk = backward(a, T, checkpointing=checkpointing, accumulated=accumulation > 1)
    before = walk.pop("before")
    t.update(walk)
    if not checkpointing:
        t[Term.RETAINED_ACTIVATIONS.key] = T * a.L * retained(a)
        t[Term.RETAINED_BESIDE_LAYER.key] = before
        t[Term.ALLOCATOR_ROUNDING.key] += rounding(a, T) - lora_retained_rounding(a, config, T, base.seq, task)
    t.update(full_optimizer(a, optimizer, per))
    return full_phases(t, base, before, checkpointing=checkpointing, steps=steps, optimizer=optimizer,
                       accumulation=accumulation)


def estimate_master(config: dict, *, seq: int, batch: int = 1, steps: int = 1, release: str | None = None,
                    task: str = PROTOCOL_TASK, checkpointing: bool = False, optimizer: str = "adamw_torch",
                    accumulation: int = 1, transformers: str | None = None) -> Estimate:
    """estimate_full's run on a release that loads the base as fp32 master weights (loads_fp32_master: soup-cli
    0.77.0) under bf16 autocast: every parameter, its gradient and torch AdamW's states fp32, and the foreach
    step's square root of every state; the residual stream fp32 from the embedding on (its checkpointed
    inputs, the rotary tables, which take its dtype, each layer's norms); autocast's bf16 copies of the weights
    (weight_casts, master_backward); each layer's kept blocks as master_blocks lists them; the head's input
    (the final norm's fp32 normed tensor, the head's own bf16 cast, the norm's rsqrt) and its gradients
    (master_head_gradient). The loss's logits are the LoRA step's (the head's matmul is bf16 under autocast
    there too). Unmeasured: no full fine-tuning row exists. Eager attention is refused (its softmax returns
    rotary's fp32 query dtype: fp32 scores the counts do not have)."""
    a = arch_from_config(config)
    base = estimate_resident(config, seq=seq, batch=batch, lora_r=1, release=release, task=task,
                             checkpointing=checkpointing, transformers=transformers)
    if base.terms.get(Term.EAGER_SCORES.key) or base.terms.get(Term.EAGER_MASKS.key):
        raise UsageError(f"a full fine-tuning of {a.model_type} on fp32 master weights under eager attention is "
                         "not yet modelled by this estimator (its softmax keeps rotary's fp32 query dtype)")
    T = base.seq * base.batch
    t = adapterless(base)
    if checkpointing:
        t[Term.LAYER_REMAINDERS.key] = master_layer_rests(a, T)
    t[Term.RESIDENT_WEIGHTS.key] = master_weights(a)
    t[Term.ROTARY_TABLES.key] *= 2  # cos.to(x.dtype), x the fp32 residual: measured fp32 on CPU
    t[Term.HEAD_INPUT.key] = T * (FP32 * a.h + 2 * a.h + FP32)
    t[Term.HEAD_GRADIENT.key] = master_head_gradient(a)
    t[Term.WEIGHT_CASTS.key] = weight_casts(a)
    if checkpointing:
        t[Term.CHECKPOINTED_INPUTS.key] *= 2  # every layer's input is the fp32 residual stream
    return trained_step(t, a, config, base, task, FP32, (master_backward, master_retained, master_retained_rounding),
                        checkpointing=checkpointing, steps=steps, optimizer=optimizer, accumulation=accumulation)
