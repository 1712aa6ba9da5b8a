"""The corrected estimate of a resident full fine-tuning (Soup's ``training.lora.r: 0``): no adapter, every
parameter trains. It starts from the terms of the r 1 LoRA resident run of the same shape (resident.py's
estimate, handed in by resident.full_run: the weights on the card, the logits and the loss, the ids, the rotary
tables, the workspaces, the allowance), takes off what only an adapter holds, and adds what a trained model
holds: each layer's count as a trained layer keeps it, the head's gradient at the loss, the backward walked with
every gradient it has made, and the optimizer's step over every parameter. Two constructions, by how the
release loads the base: ``estimate_full`` at the checkpoint's own bf16 (soup-cli 0.73.3), and ``estimate_master``
on fp32 master weights under bf16 autocast (0.77.0's resolve_base_load_dtype, read from the release's source:
``loads_fp32_master``). What it does not model is refused in one line (``full_refused``). Callers ask
resident.estimate_resident (or resident.estimate_run) at lora_r 0, which dispatches here.

Known limitations
    - Full fine-tuning (Soup's ``training.lora.r: 0``, ``estimate_full``) is built from physics alone and NOT
      MEASURED: no row of this bf16 build (soup-cli 0.73.3) exists, so every figure of it is unmeasured. What it charges: the
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
      resolve_base_load_dtype, ``estimate_master``), MEASURED AT ONE SHAPE ONLY (MASTER_MEASURED: the optimizer's
      step binds there). What its gradient, state and square-root blocks hold past their requests is history,
      not a rule a block: bench/allocator_replay.py capture --full, the real step on the meta device replayed
      through allocator.py, peaks 26,624 B (Llama-3.2-1B, off and on) and 1,075,200 / 2,811,904 B (Qwen2.5-0.5B,
      checkpointing off / on) under the four rows' max_memory_allocated, with Qwen's rests 39,878,656 B off and
      18,546,688 B on (Llama's 0: every fp32 tensor a whole number of 2 MiB): its 3.0625 MiB q/o gradients and
      AdamW states land whole in the backward's freed 3.5 MiB fp32 T x h blocks, so the optimizer's requests
      alone (3,211,264 B on Qwen) are not enough. estimator/full_sequence.py builds the whole step from the Arch
      (the load, the forward, the loss, the backward, checkpointing's recompute, the two AdamW groups), the
      capture's request for request on Qwen2.5-0.5B, Llama-3.2-1B and SmolLM2 (tests/estimator/test_full.py),
      and where it was checked (master_replayed: llama and qwen2, SFT at batch 1, step 1, one micro-batch,
      torch's AdamW, transformers 5.16.1, the default allocator) its replayed rests at the optimizer step's peak
      (the larger under either default cuBLAS workspace: Qwen on 19,103,744 B under the pre-Hopper one) are
      charged (Term.OPTIMIZER_REMAINDERS) in place of the 1 MiB a block bound: the four rows 1.0472x / 1.0492x
      (Qwen off / on) and 1.0193x / 1.0193x (Llama) with the bound, 1.000351x / 1.000233x and 1.000153x /
      1.000153x replayed. Elsewhere (another decoder, a batch, step 2, accumulation, another optimizer,
      transformers or allocator setting) the bound stays. The rest is
      built from Soup's, accelerate's,
      transformers' and torch's source and held to transformers' own layers under CPU bf16 autocast
      (tests/estimator/test_full.py): every parameter, gradient and AdamW state fp32; the residual stream
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

from ..constants import block_bytes, layer_remainders, unsplit_rests
from ..errors import UsageError
from .arch import Arch, arch_from_config
from .layer import (MLP_BACKWARD_TRANSIENTS, STAGES, LayerPeak, Moment, autocast_per_token, autocast_upcasts,
                    checkpointed_through, layer_blocks, layer_per_token)
from .full_sequence import master_rests, replayed
from .recorder import FP32
from .releases import release_source
from .stacks import package_version, transformers_release
from .steady import is_bounded, optimizer_named, state_blocks
from .estimate import Estimate, needs_free, segment_tail
from .terms import Phase, Term, phase_sum

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
    widths += [(2, a.i)] * (a.quirks.mlp_saved - MLP_BACKWARD_TRANSIENTS + 1 - sum(1 for _, w in upcast if w == a.i))
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


def full_optimizer(a: Arch, optimizer: str, per: int = FULL_FT_BYTES, rests: int | None = None) -> dict:
    """The optimizer's step over every parameter (steady.OPTIMIZERS' rules, per parameter tensor): every
    gradient, the optimizer's states (torch's in the parameter's dtype, bitsandbytes' own), and its
    transients (torch's foreach AdamW: exp_avg_sq's square root, one copy of every parameter of a group
    at once; a bound: the whole model as one group). Each block as the default allocator holds it (held).
    ``per``: a parameter's bytes (fp32 master weights: 4). ``rests``: what those blocks hold past their
    requests replayed (full_sequence.master_rests), charged in place of the 1 MiB a block bound."""
    sizes = full_params(a)
    o = optimizer_named(optimizer)
    step = FP32 if is_bounded(optimizer) else per
    hold = held if rests is None else (lambda blocks: sum(map(block_bytes, blocks)))
    terms = {Term.PARAMETER_GRADIENTS.key: hold(per * n for n in sizes),
             Term.OPTIMIZER_STATES.key: hold(b for n in sizes for b in state_blocks(n, optimizer, per)),
             Term.OPTIMIZER_TRANSIENTS.key: hold(step * n for n in sizes for _ in range(o.transient))}
    return terms if rests is None else {**terms, Term.OPTIMIZER_REMAINDERS.key: rests}


def estimate_full(config: dict, base: Estimate, *, release: str | None = None, steps: int = 1,
                  checkpointing: bool = False, optimizer: str = "adamw_torch", accumulation: int = 1,
                  transformers: str | None = None) -> Estimate:
    """The corrected peak of a resident full fine-tuning (Soup's lora.r 0) that full_refused does not refuse:
    the shared terms of ``base``, the r 1 LoRA run it starts from (resident.estimate_resident's: the weights on
    the card, the logits and the loss, the ids, the rotary tables, the workspaces, the allowance) with no
    adapter, each layer's count as a trained layer keeps it, the head's gradient at the loss, the backward walked
    with every gradient it has made, and the optimizer's step over every parameter, which runs at step 1 too (its
    states are made there: AdamW's zeros_like at its first step). From step 2 the states are live beside every
    phase. Without checkpointing the full layers' retained blocks' rests replace the r 1 LoRA count's (``base``'s
    retained_remainders). Barely measured: the module docstring says what is shown and what is not."""
    a = arch_from_config(config)
    if loads_fp32_master(release_source(release)):
        return estimate_master(config, base, steps=steps, checkpointing=checkpointing,
                               optimizer=optimizer, accumulation=accumulation, transformers=transformers)
    T = base.seq * base.batch
    t = adapterless(base)
    if checkpointing:  # without it no layer is walked in its blocks (the LoRA step's rule): the retained rounding
        t[Term.LAYER_REMAINDERS.key] = full_layer_rests(a, T)
    t[Term.HEAD_INPUT.key] = T * a.h * (_norm_bytes(a) + 2)  # the final norm's normed tensor and the head's input
    t[Term.HEAD_GRADIENT.key] = head_gradient(a)
    return trained_step(t, a, base, FULL_FT_BYTES,
                        (full_backward, full_retained, full_retained_rounding), checkpointing=checkpointing,
                        steps=steps, optimizer=optimizer, accumulation=accumulation)


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
    step[Phase.OPTIMIZER] = (t[Term.PARAMETER_GRADIENTS.key] + states + t[Term.OPTIMIZER_TRANSIENTS.key] + ws
                             + t.get(Term.OPTIMIZER_REMAINDERS.key, 0))
    binding = max(step, key=step.get)
    corrected = phase_sum(t, Phase.RESIDENT) + step[binding] + phase_sum(t, Phase.ALLOWANCE)
    return Estimate(base.seq, base.batch, base.quant, steps, base.release, None, {}, corrected,
                    needs_free(corrected), binding.value, {term.key: t[term.key] for term in Term if term.key in t},
                    base.task, optimizer, accumulation)


# -- Full fine-tuning on fp32 master weights (soup-cli 0.77.0): every parameter fp32, the step under bf16 autocast --
# Evidence, besides Soup's and transformers' source: tests/estimator/test_full.py runs a tiny Llama of
# transformers 5.16.1 under torch.autocast("cpu", bfloat16) with fp32 weights and reads what autograd saves and
# which casts stay alive. CPU and CUDA autocast (torch's aten/src/ATen/autocast_mode.cpp) both list linear, mm,
# matmul and scaled_dot_product_attention as lower_precision_fp and cache a cast alike (cached_cast: an fp32 leaf
# that requires grad, the device's lower precision); CUDA's fp32 lists (pow, rsqrt, log_softmax, nll_loss) differ
# from CPU's, but here those ops read fp32 already (the norms upcast, HF's loss takes logits.float()).

#: Where a full fine-tuning has been measured (results/resident-full-h100-soup0.77.0-96b7b97, H100): soup-cli 0.77.0's
#: fp32 master weights only, SFT bf16 1024x1, one optimizer step, Qwen2.5-0.5B and Llama-3.2-1B, checkpointing off
#: and on; the optimizer's step binding on all four, corrected 1.0002x-1.0004x the real peak with its blocks' rests
#: replayed (full_sequence.py), 1.019x-1.049x with the 1 MiB a block bound.
MASTER_MEASURED = "measured at one shape only (SFT 1024x1, one step, on fp32 master weights: estimator/full.py)"


def measured_words(release: str | None = None) -> str:
    """How far a full fine-tuning's figure on ``release`` (None: the installed one) is measured, as a label says it:
    at one shape where the release loads fp32 master weights (MASTER_MEASURED), else not at all."""
    return MASTER_MEASURED if loads_fp32_master(release_source(release)) else "unmeasured"


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
    return blocks + [(2, a.i)] * (a.quirks.mlp_saved - MLP_BACKWARD_TRANSIENTS + 1)


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
    gradients, held gradients, its optimizer step's gradients and their rests, autocast's copies of it) and the r 1 layer's rests (not this one's)."""
    return {k: v for k, v in base.terms.items() if k not in (
        Term.LORA_WEIGHTS.key, Term.BACKWARD_GRADIENTS.key, Term.HELD_GRADIENTS.key, Term.UNSPLIT_REMAINDERS.key,
        Term.GRADIENT_REMAINDERS.key, Term.TRANSIENT_REMAINDERS.key, Term.ADAPTER_CASTS.key, Term.LAYER_REMAINDERS.key,
        Term.ADAPTER_GRADIENTS.key)}


def trained_step(t: dict, a: Arch, base: Estimate, per: int, counts: tuple, *,
                 checkpointing: bool, steps: int, optimizer: str, accumulation: int,
                 rests: int | None = None) -> Estimate:
    """What every full fine-tuning's step holds past its weights, one construction for the bf16 (estimate_full)
    and the fp32 master (estimate_master) runs, each parameter's gradient and state at ``per`` bytes and
    ``counts`` its (backward walk, retained per token, retained rounding): from micro-batch 2 every gradient of
    micro-batch 1 held; the backward walked; without checkpointing every layer's kept blocks through the loss
    and their rests (the r 1 LoRA count's replaced); the optimizer's step (its blocks'
    replayed ``rests`` in place of the bound, where given); the phases."""
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
        t[Term.RETAINED_REMAINDERS.key] = rounding(a, T)
    t.update(full_optimizer(a, optimizer, per, rests))
    return full_phases(t, base, before, checkpointing=checkpointing, steps=steps, optimizer=optimizer,
                       accumulation=accumulation)


def estimate_master(config: dict, base: Estimate, *, steps: int = 1, checkpointing: bool = False,
                    optimizer: str = "adamw_torch", accumulation: int = 1, transformers: str | None = None) -> Estimate:
    """estimate_full's run on a release that loads the base as fp32 master weights (loads_fp32_master: soup-cli
    0.77.0) under bf16 autocast: every parameter, its gradient and torch AdamW's states fp32, and the foreach
    step's square root of every state; the residual stream fp32 from the embedding on (its checkpointed
    inputs, the rotary tables, which take its dtype, each layer's norms); autocast's bf16 copies of the weights
    (weight_casts, master_backward); each layer's kept blocks as master_blocks lists them; the head's input
    (the final norm's fp32 normed tensor, the head's own bf16 cast, the norm's rsqrt) and its gradients
    (master_head_gradient). The loss's logits are the LoRA step's (the head's matmul is bf16 under autocast
    there too). Measured at one shape only (MASTER_MEASURED). Eager attention is refused (its softmax returns
    rotary's fp32 query dtype: fp32 scores the counts do not have). Where the step's request sequence was
    checked against the real model's (master_replayed), what the optimizer step's blocks hold past their
    requests is replayed (full_sequence.master_rests) in place of the 1 MiB a block bound (``transformers``:
    the run's release, None the installed one)."""
    a = arch_from_config(config)
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
    rests = (master_rests(a, T, base.seq, checkpointing)
             if master_replayed(a, base, transformers, steps=steps, optimizer=optimizer, accumulation=accumulation)
             else None)
    return trained_step(t, a, base, FP32, (master_backward, master_retained, master_retained_rounding),
                        checkpointing=checkpointing, steps=steps, optimizer=optimizer, accumulation=accumulation,
                        rests=rests)


def master_replayed(a: Arch, base: Estimate, transformers: str | None, *, steps: int, optimizer: str,
                    accumulation: int, environ=None) -> bool:
    """Whether full_sequence's step is the run's: its decoder, task, batch, transformers and allocator
    (full_sequence.replayed), step 1 only (from step 2 the states are made already), one micro-batch (no held
    gradients) and torch's AdamW (the Trainer's two foreach groups): the captures it was checked against."""
    return (steps == 1 and accumulation == 1 and optimizer == "adamw_torch"
            and replayed(a, base.task, base.batch, transformers=transformers_release(transformers), environ=environ))
