"""The corrected estimate of a resident run (``training.stream_layers: false``): Soup loads the whole model on the
card and trains it with Hugging Face's own loop, so what a streamed step holds in its two-layer pool and its extras
is, here, every parameter at its dtype; the step's other terms are the streamed step's own, op by op, because the
decoder layers are the same modules: without gradient checkpointing every layer keeps what its backward needs
through the loss (the terms of ``stream_recompute: off``); with it, HF saves each layer's input and recomputes one
layer at a time in the backward (the terms of Soup's own per-layer recompute). One terms table (estimator/terms.py)
serves both paths; this module adds only ``resident_weights``.

Measured (tests/estimator/test_resident.py), on the 143 committed arms of these families it models, bf16 and NF4
(results/resident-map-*): never under; with checkpointing 1.0001x-1.0033x, without it 1.0021x-1.0833x, median
1.0114x (the widest: Phi-3-mini NF4, whose fused gate_up the shared count charges whole).

Known limitations
    - Without checkpointing, the retained blocks' rounding is bounded, not replayed: each 1-10 MiB block class is
      cut from 20 MiB segments whose last block keeps a rest under 1 MiB (1 MiB a segment), and each block from
      10 MiB keeps its segment's tail, or, served from a larger cached block, a rest under 1 MiB (1 MiB a block)
      (retained_rounding). The measured excess of max_memory_allocated over the requested peak was 21 MB on SmolLM2
      1024x1, 108 MB on Qwen2.5 2048x1 (75.5 MB of it the MLP blocks' tails), 0 on Llama-3.2-1B 2048x1; without the
      per-block bound SmolLM2 NF4 at 2048 tokens was 9.8 MB under. This is why the median is 1.011x, not 1.005x.
    - Past a sliding window without checkpointing it is refused: Gemma-3 and Phi-3 keep attention masks per layer
      there that the counts do not have (Gemma-3 2048x1: 48 blocks of 8 MiB; the construction was 0.978x-0.997x).
    - The steady state (steps > 1: the optimizer's states) and gradient accumulation are the streamed step's terms
      (estimator/steady.py), measured there, not yet on a resident run: every committed resident row is one step
      of one micro-batch.
    - Layers of more than one kind (MoE, latent attention, Qwen3.5's hybrid) and phi's parallel block are not yet
      modelled resident (their committed rows are 0.80x-1.15x of this construction). Refused in one line.
    - Its needs-free is the allocated peak plus the reserve measured under expandable segments: `soup train` runs a
      resident run on the default allocator (it sets expandable segments for streamed runs only), whose reserve
      has not been measured on a resident run yet (bench/gpu-next.sh resident-patch is the call that shows it).
    - Soup's own resident number is hardware_fit's (computed by Soup, from its CLI's input); it is not this
      module's business: the row carries it (results/extras.ResidentGate).
"""

from __future__ import annotations

from ..constants import K_LARGE_BUFFER, K_MIN_LARGE_ALLOC, K_SMALL_SIZE, block_bytes
from ..errors import UsageError
from ..model.targets import soup_targets
from ..tasks import PROTOCOL_TASK, task as task_named
from .arch import Arch, arch_from_config, layer_bytes, nf4_bytes, protocol_targets
from .estimate import Estimate, estimate, needs_free, segment_tail
from .terms import Phase, Term, phase_sum

#: The architectures the resident construction is held to (every committed resident row of theirs).
MODELLED_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "phi3")


def resident_weights(a: Arch, quant: str = "none") -> int:
    """Every parameter as Soup's resident load puts it on the card: each layer's tensors, the embedding and an untied
    head (both vocab matrices: nothing streams them), the final norm and a head's bias, each tensor its own block
    with its segment's tail (estimate.segment_tail: HF loads tensor by tensor). NF4: each linear as bitsandbytes packs
    it (arch.nf4_bytes), everything it does not quantise cast to fp32 (measured: within 0.1% of what every committed
    dense NF4 arm held before its step, results/resident-map-*)."""
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


def retained_rounding(a: Arch, targets: tuple, r: int, T: int, quant: str = "none") -> int:
    """segment_tail of each block a layer keeps through the loss without checkpointing, over every layer: the
    tensors retained_by_layer counts per token (the norms' fp32 inputs, each target's dropout output, mask and
    lora_A output, attention's q, k, v and output, the MLP's saved i-wide tensors), each its own block; from 10 MiB
    a block's segment rounds to 2 MiB and a rest up to 1 MiB stays in it. Measured: Qwen2.5 2048x1 keeps 72 MLP
    blocks of 19,922,944 B, each with a 1 MiB tail, which the allocator's history (requested sizes) does not show
    and max_memory_allocated does (results/resident-anatomy-*/call-1/res-sft-qwen-bf16-2048x1: replayed peak
    107.7 MB under the real one)."""
    act, qw, kw = 2, a.heads * a.head_dim, a.kv * a.head_dim
    widths = [(4, a.h)] * (a.norms if a.quirks.norm_inputs_saved else 0)
    widths += [w for t in targets for w in ((act, a.modules[t][0]), (1, a.modules[t][0]), (act, r))]
    widths += [(act, qw), (act, kw), (act, (qw + 2 * kw) if a.quirks.fused_qkv else kw), (act, qw)]
    widths += [(4 if quant == "nf4" else act, a.i)] * (a.quirks.mlp_saved - a.quirks.mlp_transients)
    sizes = [block_bytes(b * w * T) for b, w in widths]
    # requests from 1 MiB to 10 MiB are cut from 20 MiB segments, and a segment's last block keeps a rest under
    # 1 MiB unsplit (the allocator splits a large block only where more than 1 MiB would remain): at most 1 MiB a
    # segment those blocks fill
    cut = a.L * sum(s for s in sizes if K_SMALL_SIZE <= s < K_MIN_LARGE_ALLOC)
    own = a.L * sum(segment_tail(s) or K_SMALL_SIZE for s in sizes if s >= K_MIN_LARGE_ALLOC)
    return own + -(-cut // K_LARGE_BUFFER) * K_SMALL_SIZE


def refused(a: Arch, quant: str, checkpointing: bool = True, seq: int = 0) -> str | None:
    """Why this tool does not estimate this resident run (None: it does)."""
    if not checkpointing and a.window and seq >= a.window:
        return (f"a resident {a.model_type} run past its sliding window ({a.window}) without gradient checkpointing "
                "is not yet modelled by this estimator (its layers keep attention masks the counts do not have)")
    if quant not in ("none", "nf4"):
        return f"a resident {quant} run is not modelled by this estimator"
    if a.layers is not None or a.model_type not in MODELLED_TYPES:
        return f"a resident {a.model_type} run is not yet modelled by this estimator"
    return None


def targets_of(a: Arch, targets, config: dict) -> tuple:
    """The LoRA targets as the layer's modules (Soup's spellings resolved, the protocol's by default)."""
    targets = protocol_targets(a) if targets is None else targets
    return soup_targets((targets,) if isinstance(targets, str) else tuple(targets), config, a, str(targets))


def estimate_resident(config: dict, *, quant: str = "none", seq: int, batch: int = 1, targets=None,
                      lora_r: int = 8, steps: int = 1, release: str | None = None, task: str = PROTOCOL_TASK,
                      checkpointing: bool = False, optimizer: str = "adamw_torch", accumulation: int = 1,
                      transformers: str | None = None) -> Estimate:
    """The corrected peak of a resident run: the streamed step's bf16 terms (recompute off without checkpointing, on
    with it) with every parameter on the card in place of the pool and the extras, and under NF4 what runs in fp32.
    The Estimate carries no Soup number (Soup's resident gate is hardware_fit's; the row has it)."""
    a = arch_from_config(config)
    why = refused(a, quant, checkpointing, seq)
    if why:
        raise UsageError(why)
    e = estimate(config, quant="none", seq=seq, batch=batch, targets=targets, lora_r=lora_r, release=release,
                 soup=False, task=task, transformers=transformers, steps=steps, optimizer=optimizer,
                 accumulation=accumulation, stream={} if checkpointing else {"stream_recompute": "off"})
    t = dict(e.terms)
    for streamed in (Term.POOL.key, Term.EXTRAS.key, Term.RESIDENT_ROUNDING.key):
        t[streamed] = 0  # the pool's slots and the streamed extras: here, the whole model's tensors
    t = {Term.RESIDENT_WEIGHTS.key: resident_weights(a, quant), **t}
    T = e.seq * e.batch * task_named(task).rows_per_example
    if not checkpointing:
        # no checkpoint saves a layer's input: what each layer's backward needs is its retained count (the
        # norms' fp32 copies among it). Measured: Qwen2.5 2048x1 keeps 45,912 B a token a layer at its loss
        # peak, retained_by_layer's count to the byte (results/resident-anatomy-*/call-1/res-sft-qwen-bf16-2048x1)
        t[Term.CHECKPOINTED_INPUTS.key] = 0
        t[Term.ALLOCATOR_ROUNDING.key] += retained_rounding(a, targets_of(a, targets, config), lora_r, T, quant)
    if quant == "nf4":
        # the embedding is fp32, so the residual stream is, and bitsandbytes' Linear4bit returns its input's dtype:
        # the MLP's i-wide tensors are fp32 (Llama-3.2-1B NF4 2048x1 kept 48 of 67,108,864 B, i x T x 4, where bf16
        # kept 33,554,432), and the layer inputs a checkpoint saves are fp32. The head's weight is fp32 too, so
        # autocast casts it to bf16 for the head's matmul, which saves that copy for its backward: V x h x 2 beside
        # the loss, whatever the tokens (Llama-3.2-1B NF4: real peaks 3.733 MB a token plus 561 MB at 512-8192
        # tokens; this copy is 525 MB). The backward dequantises one linear at a time.
        saved = 2 * a.i * (a.quirks.mlp_saved - a.quirks.mlp_transients)
        if checkpointing:
            t[Term.CHECKPOINTED_INPUTS.key] *= 2
        else:
            t[Term.RETAINED_ACTIVATIONS.key] += T * a.L * saved
            t[Term.RETAINED_BESIDE_LAYER.key] += T * (a.L - 1) * saved
        t[Term.LAYER_PER_TOKEN.key] += T * 2 * a.i * a.quirks.mlp_saved
        t[Term.HEAD_COPY.key] = 2 * a.V * a.h + segment_tail(2 * a.V * a.h)
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
