"""A resident LoRA SFT bf16 step's allocation sequence captured on the META device (the real transformers + peft
model at its exact shapes, no compute) and replayed through issue395.estimator.allocator (issue 52 item 1): the
rests the default caching allocator's blocks keep past their requests at the peak, which the allocator's history
(requested sizes) does not show and max_memory_allocated does. CPU only; nothing here is measured on a card.

    python bench/allocator_replay.py capture KEY SEQ [--batch 1] [--quant none] [--r 8] [--targets q_proj,v_proj]
                                     [--dropout 0.05] [--events OUT.json] [--gemm-4bit sm90|fused|fallback]
                                     [--checkpointing]
    python bench/allocator_replay.py check
    python bench/allocator_replay.py trace RUN.trace.json.gz
    python bench/allocator_replay.py saved KEY [--layers 2] [--quant none|nf4] [--r 8] [--targets ...] [--seqs 128,256]

``saved`` runs the real model (a few decoder layers, real compute on CPU; NF4 by bitsandbytes' CPU Linear4bit) under
CUDA's bf16 autocast lists applied op by op (CudaAutocast), dropout as CUDA's fused kernel (a bool mask) and SDPA as
CUDA's memory-efficient kernel saves, and prints each decoder layer's bytes a token autograd keeps for the backward
beside the loss (saved_tensors_hooks, each storage once): the count estimator/layer.py's retained_by_layer,
autocast_by_layer and latent_retained charge a resident run without checkpointing (tests/test_bench.py holds them
equal at reduced widths).

``trace`` replays a real run's device history (bench/task_peak_anatomy.py --trace: torch's own requests, in torch's
order) through the same allocator (issue395.measure.trace) and prints the model's allocated peak beside the run's
max_memory_allocated (the JSON beside the trace), the rests at that peak, and the first event where the model's block
or segment departs from torch's, if any; on expandable segments (segment_map events) the whole pages the live blocks
touch at that peak beside the run's measured page_need; where the JSON names the adapter (--segments' segments_at), the rests its
adapter-shaped blocks over 1 MiB keep at that peak, split into the blocks made before the history (the parameters)
and those cut in it, by the request last freed at each block's address (0: a segment's tail never freed).

``capture --checkpointing`` captures the LoRA bf16 step under Soup's gradient checkpointing (issue 51 item 4: the
oracle estimator/gc_sequence.py's flash path is held to; ENGINE_ORDER). ``capture --full [--checkpointing]``
captures Soup 0.77.0's resident full fine-tuning instead (capture_full: fp32
master weights, the forward and backward under bf16 autocast, the Trainer's two foreach AdamW groups' step), its
figures at the optimizer step's peak: the oracle a synthetic full fine-tuning sequence is to be held to (issue 51).
``capture`` prints the replay's figures; ``--events`` writes the sequence (("alloc", key, bytes, what),
("free", key), ("empty_cache",), ("reset_peak",)) as JSON. ``check`` captures the committed anatomy arms (CHECKS)
and prints each one's measured rests (max_memory_allocated minus the history's replayed peak, both from its JSON)
beside the replay's, exactly. "Rests" here: the replay's allocated-bytes peak minus (the resident blocks before the
step plus the step's rounded requests at their peak), the committed anatomy's real_peak - replayed_peak.

What a CUDA step does that the meta device does not, substituted (each checked against the committed anatomies'
live sets):
- Hugging Face's bf16 autocast: F.linear casts an fp32 bias, then the weight (a leaf weight's cast kept until the
  forward ends), then the input, to bf16, as CUDA's autocast lower-precision list does for linear; layer_norm and
  pow under its fp32 policy, each bf16 input cast to fp32 first (FP32_POLICY: phi's LayerNorm and gelu_new);
- SDPA runs flash: its output (B,H,T,D) in the input's dtype and q's layout, an fp32 logsumexp (B,H,T), two 8-byte
  philox tensors; its backward a contiguous (B,T,H,D) copy of the output where that layout is not it, dq, dk, dv,
  fp32 softmax_d (B,H,T128) and dq_accum (B,T128,H,Dr), a GQA's dk and dv expanded to (B,T,H,D) and summed into
  them (T128: T rounded to 128; Dr: D rounded to 32, past 128 to 64: torch's flash_api.cpp mha_bwd);
- dropout is CUDA's fused native_dropout: a bool mask, then its output;
- accelerate's convert_outputs_to_fp32 (the Trainer's bf16 mixed precision): the logits' fp32 copy replaces the
  model's bf16 logits once the forward returns;
- the cuBLAS workspace (constants.CUBLAS_WORKSPACE) after the first matmul's output on the forward's thread and
  again on the backward's; cuBLASLt's (CUBLASLT_WORKSPACE) after the first addmm;
- transformers' caching_allocator_warmup: one block of the weights' bytes, freed at once, before the load;
- the weights load in the checkpoint's sorted key order (safetensors), then peft's LoRA tensors; the
  packed-sequence check's .item() (small-pool blocks only) is skipped.
NF4 (``--quant nf4``: Soup's resident QLoRA load, bitsandbytes 0.50.2) runs bitsandbytes' own Python on the
meta device, its ops' registered fake kernels giving each output's shape; what its CUDA kernels allocate inside
is substituted:
- each decoder linear is a real ``bnb.nn.Linear4bit`` (NF4, double quantisation, bf16 compute, uint8 storage, as
  Soup's BitsAndBytesConfig), the head and the embedding not; the warmup block counts a quantised element 0.5 B
  (transformers' Bnb4bit quantizer's param_element_size); each quantised weight loads as its bf16 tensor, which
  ``Params4bit._quantize`` (quantize_4bit: the packed weight, fp32 absmax, its mean offset, the fp32 difference,
  quantize_blockwise's uint8 absmax and nested fp32 absmax) replaces, then is dropped;
- peft's prepare_model_for_kbit_training casts every other parameter to fp32 (the embedding, so the residual
  stream, and the norms) and empties the cache (its CUDA-only torch.cuda.empty_cache: an ("empty_cache",) event
  here), peft wraps each target in its bnb LoRA layer, TRL casts the adapter to bf16;
- the CUDA gemm_4bit: at more than 1,536 rows, or where bitsandbytes' sm90 heuristic (an H100/H200: 132 SMs,
  compute 9.0) declines its fused kernel (``--gemm-4bit fused`` or ``fallback`` forces the heuristic's answer
  on every shape: what another card's may be; its fused kernel allocates only its output), its dequantising fallback: the nested absmax dequantised (fp32), plus its
  offset (fp32), the bf16 weight, then F.linear's output, the three freed on return;
- ``torch.is_autocast_enabled()`` reads the emulated autocast (peft's bnb LoRA casts nothing under it), and
  SDPA under autocast casts fp32 q, k, v to bf16 first (autocast's lower-precision list).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from issue395.constants import CUBLAS_WORKSPACE, CUBLASLT_WORKSPACE  # noqa: E402
from issue395.estimator.allocator import CachingAllocator, replaying  # noqa: E402
from issue395.record import LORA_DROPOUT  # noqa: E402

ANATOMY = "results/resident-anatomy-h200-soup0.77.0-2400c0d/call-1"
#: The committed resident anatomies `check` replays: (registry key, the arm's JSON).
CHECKS = (("qwen", f"{ANATOMY}/res-sft-qwen-bf16-2048x1.json"),
          ("llama32-1b", f"{ANATOMY}/res-sft-llama1b-bf16-2048x1.json"),
          ("smol", f"{ANATOMY}/res-sft-smol-bf16-1024x1.json"),
          ("llama32-1b", f"{ANATOMY}/res-sft-llama1b-nf4-2048x1.json"))
GEMM_4BIT = None  # torch.ops.bitsandbytes.gemm_4bit.default, once an NF4 capture imports bitsandbytes
QUANTISE: set = set()  # bitsandbytes' quantize_4bit and quantize_blockwise, likewise
#: how a capture's gemm_4bit chooses its kernel at 1,536 rows or fewer (--gemm-4bit; fused_kernel)
GEMM_SM90, GEMM_FUSED, GEMM_FALLBACK = "sm90", "fused", "fallback"
MM = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
      torch.ops.aten.baddbmm.default}


class Recorder(TorchDispatchMode):
    """Each op's output storages as requests (one per StorageImpl; its free when the last tensor of it dies), and
    the cuBLAS workspaces where CUDA's first matmul of a thread makes them."""

    def __init__(self, gemm=GEMM_SM90):
        super().__init__()
        self.events, self.keys, self.live = [], itertools.count(), {}
        self.thread, self.workspace, self.lt = "fwd", set(), False
        self.gemm = gemm  # how gemm_4bit chooses its kernel at 1,536 rows or fewer (fused_kernel)

    def alloc(self, nbytes: int, what: str = "") -> int:
        k = next(self.keys)
        self.events.append(("alloc", k, nbytes, what))
        return k

    def track(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "meta":
            return
        s = t.untyped_storage()
        if s.nbytes() == 0 or id(s) in self.live:
            return
        k = self.alloc(s.nbytes(), f"{tuple(t.shape)} {t.dtype}")
        self.live[id(s)] = k

        def gone(sid=id(s), k=k):
            self.live.pop(sid, None)
            self.events.append(("free", k))
        weakref.finalize(s, gone)

    def accumulated_in_place(self, func, args) -> bool:
        """Whether ``func`` is the autograd engine's sum of two gradients of one tensor, which CUDA's run does in
        place (InputBuffer::accumulate: ``old_var.add_(var)`` where it holds the buffer's last reference, a dense
        one) but a Python dispatch mode's own reference to every tensor turns into ``old_var + var``, a new block
        (tests/test_bench.py holds this on CPU): a no-grad tensor add of two like dense gradients in the backward."""
        return (ENGINE_ORDER["on"] and func is torch.ops.aten.add.Tensor and self.thread == "bwd"
                and not torch.is_grad_enabled() and len(args) == 2
                and all(isinstance(t, torch.Tensor) for t in args) and args[0].shape == args[1].shape
                and args[0].dtype == args[1].dtype and args[0].is_contiguous())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.accumulated_in_place(func, args):
            return args[0]
        temps = self.gemm_4bit_temps(args, kwargs or {}) if func is GEMM_4BIT else None
        out = func(*args, **(kwargs or {}))
        # bitsandbytes' quantising kernels allocate their absmax before the weight they return first
        for t in reversed(tree_leaves(out)) if func in QUANTISE else tree_leaves(out):
            self.track(t)
        if temps is not None:
            for k in temps:
                self.events.append(("free", k))
        if (func in MM or temps) and self.thread not in self.workspace:
            self.workspace.add(self.thread)
            self.alloc(CUBLAS_WORKSPACE, f"cublas workspace {self.thread}")  # held for the process
        if (func is torch.ops.aten.addmm.default or temps and args[6] is not None) and not self.lt:
            self.lt = True
            self.alloc(CUBLASLT_WORKSPACE, "cublasLt workspace")
        return out

    def gemm_4bit_temps(self, args, kwargs) -> list | None:
        """What CUDA's gemm_4bit allocates before its output where it takes the dequantising fallback (the
        nested absmax dequantised, plus its offset, both fp32; the weight in A's dtype; None where it runs its
        fused kernel): bitsandbytes' own dispatch (past _gemm_4bit_custom_max_m rows, or a K off its blocksize,
        the fallback), its heuristic's choice as ``self.gemm`` says (fused_kernel)."""
        ops = cuda_ops()
        A, B, shape = args[0], args[1], args[2]
        absmax_8bit = args[7] if len(args) > 7 else kwargs.get("absmax_8bit")
        K, N = A.shape[-1], shape[0]
        M = A.numel() // K
        if M <= ops._gemm_4bit_custom_max_m and K % args[4] == 0 and fused_kernel(self.gemm, ops, A.dtype, M, N, K):
            return None
        temps = [self.alloc(4 * absmax_8bit.numel(), "absmax dequantised"),
                 self.alloc(4 * absmax_8bit.numel(), "absmax + offset")] if absmax_8bit is not None else []
        return temps + [self.alloc(N * K * A.element_size(), f"dequantised weight ({N}, {K}) {A.dtype}")]


def fused_kernel(gemm, ops, dtype, M: int, N: int, K: int) -> bool:
    """The heuristic's answer (``_gemm_4bit_use_custom_cuda``) for an (N, K) weight at M rows: bitsandbytes' own on
    an sm90 card of 132 SMs (GEMM_SM90, an H100/H200), forced (GEMM_FUSED: every shape its fused kernel;
    GEMM_FALLBACK: none), or fused on the (N, K) shapes of a set (one card's answers, as gemm4bit.gemm_choices
    replays each)."""
    if gemm == GEMM_FUSED or gemm == GEMM_FALLBACK:
        return gemm == GEMM_FUSED
    if gemm != GEMM_SM90:
        return (N, K) in gemm
    props = ops._gpu_dispatch_props
    ops._gpu_dispatch_props = lambda index: (132, 9, 0)
    try:
        return ops._gemm_4bit_use_custom_cuda(0, dtype, M, N, K)
    finally:
        ops._gpu_dispatch_props = props


def cuda_ops():
    """bitsandbytes' CUDA backend module (its gemm_4bit heuristic), imported on a build of torch without CUDA,
    which lacks the raw-stream getter it binds at import and never calls here."""
    stub = not hasattr(torch._C, "_cuda_getCurrentRawStream")
    if stub:
        torch._C._cuda_getCurrentRawStream = None
    try:
        from bitsandbytes.backends.cuda import ops
    finally:
        if stub:
            del torch._C._cuda_getCurrentRawStream
    return ops


class Flash(torch.autograd.Function):
    """Flash SDPA's requests: what it saves in the forward, what its backward makes. From torch's
    aten/src/ATen/native/transformers/cuda: flash_attn/flash_api.cpp mha_fwd (``out = at::empty_like(q_padded)``,
    q being (B,T,H,D) transposed from the caller's (B,H,T,D): q's memory layout, whichever it is) and mha_bwd, and
    attention_backward.cu _flash_attention_backward (``out.contiguous()`` before mha_bwd)."""

    @staticmethod
    def forward(ctx, q, k, v):
        B, H, T, D = q.shape
        # empty_like(q_padded): q's own memory layout (its dims outer to inner, as preserve_format keeps a dense
        # tensor's strides), at v's head size (MLA's v is narrower than its q and k). A q laid out (B,T,H,D), as a
        # rotary product of the projection's view is, gives (B,T,H,D); phi's torch.cat of its rotary and pass-through
        # halves gives a contiguous (B,H,T,D), whose output transformers' transpose(1, 2).contiguous() then copies
        order = sorted(range(4), key=lambda d: -q.stride(d))
        shape = (B, H, T, v.shape[-1])
        out = q.new_empty([shape[d] for d in order]).permute([order.index(d) for d in range(4)])
        lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
        seed = torch.empty((), dtype=torch.int64, device=q.device)
        off = torch.empty((), dtype=torch.int64, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, seed, off)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse, seed, off = ctx.saved_tensors
        B, H, T, D = q.shape
        Hk = k.shape[1]
        # mha_bwd: head_size_rounded = round_multiple(head_size, head_size <= 128 ? 32 : 64), seqlen_q_rounded to 128
        step = 32 if D <= 128 else 64
        T128, Dr = -(-T // 128) * 128, -(-D // step) * step
        out_t = out.transpose(1, 2).contiguous()  # _flash_attention_backward's contiguous_out
        dq, dk, dv = (torch.empty_like(x.transpose(1, 2)).transpose(1, 2) for x in (q, k, v))
        softmax_d = torch.empty((B, H, T128), dtype=torch.float32, device=q.device)
        dq_accum = torch.empty((B, T128, H, Dr), dtype=torch.float32, device=q.device)
        if Hk != H:  # MQA/GQA: the kernel writes (B,T,H,D) dk and dv, at::sum_out folds each group into dk, dv
            expanded = [torch.empty((B, T, H, D), dtype=q.dtype, device=q.device) for _ in range(2)]
            del expanded
        del softmax_d, dq_accum, out_t
        return dq, dk, dv


#: Where on (the checkpointed LoRA capture), the CUDA autograd engine's order where a Python mode or Function
#: departs from it: gradient sums in place (Recorder.accumulated_in_place) and dropout's mask released inside its
#: backward, before its incoming gradient (FusedDropout). The other captures keep the order their committed
#: validations were taken in.
ENGINE_ORDER = {"on": False}


class FusedDropout(torch.autograd.Function):
    """CUDA's native_dropout: a bool mask, then the output (Dropout.cu dropout_cuda: ``Tensor mask =
    at::empty_like(self, ...kBool)`` before ``Tensor ret = at::empty_like(self)``; the H100 phi-2 NF4 trace's order);
    CPU's keeps a mask in the input's dtype."""

    @staticmethod
    def forward(ctx, x, p):
        mask = torch.empty_like(x, dtype=torch.bool)
        ctx.save_for_backward(mask)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        # NativeDropoutBackward0 unpacks its mask, which goes before its incoming gradient does: under
        # checkpointing the recomputed mask is held by the checkpoint's frame until unpacked
        mask = ctx.saved_tensors if ENGINE_ORDER["on"] else ()
        out = torch.empty_like(g)
        del mask
        return out, None


def dropout(x, p=0.5, training=True, inplace=False):
    return x if not training or p == 0 else FusedDropout.apply(x, p)


def flash_sdpa(autocast: dict):
    """Flash SDPA; under autocast (its lower-precision list) fp32 q, k, v cast to bf16 first, v's first: the H100
    SmolLM2 NF4 1024x4 trace's kv-wide pair before q's (GQA), where q first put each layer's mask in another block."""
    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if autocast["on"]:  # the wrapper's argument pack cast right to left (GCC), as linear's: v, k, then q
            v, k, q = (x.to(torch.bfloat16) if x.dtype == torch.float32 else x for x in (v, k, q))
        return Flash.apply(q, k, v)
    return sdpa


#: The ops a decoder's forward reaches that CUDA's autocast runs under its fp32 policy (every floating input cast
#: to fp32 first: torch 2.13's ATen/autocast_mode.h, AT_FORALL_FP32, which autocast_mode.cpp registers for
#: AutocastCUDA: ``pow`` Tensor_Scalar, Tensor_Tensor and Scalar, ``layer_norm``, ``native_layer_norm``), as
#: (owner, attribute): phi's LayerNorm (nn.LayerNorm calls F.layer_norm) and gelu_new's torch.pow; RMSNorm's
#: Tensor.pow takes an input it has cast to fp32 itself, where the policy casts nothing.
FP32_POLICY = ((F, "layer_norm"), (torch, "pow"), (torch.Tensor, "pow"), (torch.Tensor, "__pow__"),
               (torch.Tensor, "__rpow__"))


@contextlib.contextmanager
def fp32_policy(autocast: dict):
    """FP32_POLICY's ops under autocast (while ``autocast["on"]``): each bf16 or fp16 tensor argument cast to
    fp32 before the op, in argument order (layer_norm's input, then its weight and bias); restored on the way
    out."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in FP32_POLICY]

    def up(x):
        return x.float() if isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16) else x

    def policy(op):
        def run(*args, **kwargs):
            if autocast["on"]:
                args, kwargs = tuple(up(x) for x in args), {k: up(v) for k, v in kwargs.items()}
            return op(*args, **kwargs)
        return run

    for owner, name, op in saved:
        setattr(owner, name, policy(op))
    try:
        yield
    finally:
        for owner, name, op in saved:
            setattr(owner, name, op)


@contextlib.contextmanager
def cuda_substitutes(autocast: dict, cast_cache: dict):
    """F.linear under autocast (while ``autocast["on"]``, which torch.is_autocast_enabled reads), layer_norm and
    pow under its fp32 policy (fp32_policy), fused dropout, flash SDPA and no packed-sequence check, restored on the
    way out."""
    import transformers.masking_utils as mu

    linear0, dropout0, sdpa0, packed0, enabled0 = (F.linear, F.dropout, F.scaled_dot_product_attention,
                                                   mu.find_packed_sequence_indices, torch.is_autocast_enabled)

    def linear(x, w, b=None):
        # the bias's cast, then the weight's, then the input's: the autocast wrapper's cached_cast(args)... pack,
        # evaluated right to left (GCC); the H100 phi-2 NF4 trace's fp32 head casts its bias, weight, input so
        if autocast["on"]:
            b = b.to(torch.bfloat16) if b is not None and b.dtype == torch.float32 else b
            if w.dtype == torch.float32:
                # a checkpoint's recompute (autocast["recompute"]) is its own autocast region, whose cache goes
                # when it exits: each cast there is held by what saves it alone
                w = (cast_cache.setdefault(id(w), w.to(torch.bfloat16))
                     if w.is_leaf and w.requires_grad and not autocast.get("recompute") else w.to(torch.bfloat16))
            x = x.to(torch.bfloat16) if x.dtype == torch.float32 else x
        return linear0(x, w, b)

    fp32_ops = fp32_policy(autocast)
    F.linear, F.dropout, F.scaled_dot_product_attention = linear, dropout, flash_sdpa(autocast)
    mu.find_packed_sequence_indices = lambda position_ids: None
    torch.is_autocast_enabled = lambda *device: autocast["on"]
    try:
        with fp32_ops:
            yield
    finally:
        F.linear, F.dropout, F.scaled_dot_product_attention = linear0, dropout0, sdpa0
        mu.find_packed_sequence_indices, torch.is_autocast_enabled = packed0, enabled0


def load_weights(model) -> None:
    """transformers' caching_allocator_warmup (one block of the weights' bytes, a quantised element 0.5 B, freed
    at once), then each parameter materialised in the checkpoint's sorted key order (a tied one once; a
    Linear4bit's weight as its bf16 tensor, quantised), then the buffers."""
    import bitsandbytes as bnb

    four = {id(m.weight) for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)}
    total = sum(p.numel() * (0.5 if id(p) in four else p.element_size()) for p in model.parameters())
    total += sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                 if n.rsplit(".", 1)[-1] not in ("inv_freq", "original_inv_freq"))
    warm = torch.empty(int(total // 2), dtype=torch.float16, device="meta")
    del warm
    names = dict(model.named_parameters(remove_duplicate=False))
    fresh = {}
    for name in sorted(names):
        p = names[name]
        mod, _, leaf = name.rpartition(".")
        if id(p) in four:
            fresh[id(p)] = quantised(p, model.get_submodule(mod))
        elif id(p) not in fresh:
            fresh[id(p)] = torch.nn.Parameter(torch.empty_like(p), requires_grad=p.requires_grad)
        model.get_submodule(mod)._parameters[leaf] = fresh[id(p)]
    for name, b in list(model.named_buffers()):
        mod, _, leaf = name.rpartition(".")
        model.get_submodule(mod)._buffers[leaf] = torch.empty_like(b)


def quantised(p, module):
    """transformers' Bnb4bitQuantize: the weight's bf16 tensor on the device, a Params4bit of it quantised there
    (Params4bit._quantize: bitsandbytes' quantize_4bit), the bf16 tensor dropped."""
    import bitsandbytes as bnb

    source = torch.empty(p.shape, dtype=torch.bfloat16, device="meta")
    q = bnb.nn.Params4bit(source, requires_grad=False, blocksize=p.blocksize, compress_statistics=True,
                          quant_type="nf4", quant_storage=torch.uint8, module=module)
    del source
    return q._quantize(torch.device("meta"))


def nf4_linears(model) -> None:
    """Every decoder linear of the meta model a bitsandbytes Linear4bit (NF4, double quantisation, bf16 compute;
    transformers skips the head), as transformers' replace_with_bnb_linear builds them before the load."""
    import bitsandbytes as bnb

    for name, m in list(model.named_modules()):
        if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}":
            four = bnb.nn.Linear4bit(m.in_features, m.out_features, m.bias is not None, compute_dtype=torch.bfloat16,
                                     compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8,
                                     device="meta")
            four.weight = bnb.nn.Params4bit(torch.empty_like(m.weight), requires_grad=False, quant_type="nf4",
                                            module=four)
            if m.bias is not None:
                four.bias = torch.nn.Parameter(torch.empty_like(m.bias), requires_grad=False)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, four)
    model.is_loaded_in_4bit = True


@contextlib.contextmanager
def bnb_maps_kept(quant: str):
    """bitsandbytes caches its quantisation maps on the device of their first use (functional.name2qmap): one
    made on the meta device here would break a later real quantisation in the process. Restored on the way out."""
    if quant != "nf4":
        yield
        return
    import bitsandbytes.functional as bnbf

    kept = dict(bnbf.name2qmap)
    try:
        yield
    finally:
        bnbf.name2qmap.clear()
        bnbf.name2qmap.update(kept)


def nf4_load(model, rec: "Recorder"):
    """Soup's resident QLoRA load: the weights (quantised as they land), then peft's
    prepare_model_for_kbit_training (the rest cast to fp32, then the cache emptied; no checkpointing)."""
    from peft import prepare_model_for_kbit_training

    load_weights(model)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    # its torch.cuda.empty_cache() after the fp32 casts (auto_clear_cache, on CUDA only): the warmup's segment, wholly
    # free by then, goes back to the driver (the H100 traces hold no such segment at the step's start)
    rec.events.append(("empty_cache",))
    return model


def step(model, rec: Recorder, autocast: dict, cast_cache: dict, seq: int, batch: int, recompute: bool = False) -> None:
    """One SFT step to the end of its backward, as TRL's SFTTrainer runs it: the forward under autocast (all-ones
    mask: SDPA gets none), the loss, TRL's entropy and token accuracy without grad, the backward (``recompute``:
    under non-reentrant checkpointing, each layer's recompute under autocast again, uncached)."""
    from trl.trainer.utils import entropy_from_logits

    ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")
    mask = torch.ones((batch, seq), dtype=torch.long, device="meta")
    labels = torch.zeros((batch, seq), dtype=torch.long, device="meta")
    autocast["on"] = True
    out = model(input_ids=ids, attention_mask=None, labels=labels, use_cache=False)
    autocast["on"] = False
    # accelerate's convert_outputs_to_fp32 (its prepare_model under bf16 mixed precision): the logits' fp32 copy
    # replaces the bf16 ones, which then go (the H100 phi-2 NF4 trace: 104,857,600 B in, 52,428,800 B out)
    out.logits = out.logits.float()
    cast_cache.clear()
    loss = out.loss
    with torch.no_grad():
        ent = entropy_from_logits(out.logits)
        ent = torch.sum(ent * mask) / mask.sum()
        shift_logits = out.logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        predictions = shift_logits.argmax(dim=-1)
        m = shift_labels != -100
        correct = (predictions == shift_labels) & m
        acc = correct.sum() / m.sum()
        del shift_logits, shift_labels, predictions, m, correct, acc, ent
    del out
    rec.thread = "bwd"
    autocast["on"] = autocast["recompute"] = recompute
    loss.backward()
    autocast["on"] = autocast["recompute"] = False
    del loss


def capture(key: str, seq: int, batch: int = 1, r: int = 8, targets: tuple = ("q_proj", "v_proj"),
            dropout_p: float = LORA_DROPOUT, quant: str = "none", gemm=GEMM_SM90, checkpointing: bool = False) -> list:
    """The request sequence of a resident LoRA SFT step of registry model ``key``, bf16 or (``quant`` "nf4")
    Soup's QLoRA (``gemm``: how its gemm_4bit chooses its kernel, fused_kernel): the load, a ("reset_peak",)
    where the measured step's window starts, the step. ``checkpointing``: Soup's ``gradient_checkpointing: true``
    as TRL's SFTTrainer enables it on the peft model (transformers' non-reentrant checkpoint, its default; the
    embedding's output made to require grad in place), each layer recomputed in the backward."""
    global GEMM_4BIT
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from issue395.model.registry import config_json

    cfg = AutoConfig.for_model(**config_json(key))
    cfg._attn_implementation = "sdpa"
    rec, cast_cache, autocast = Recorder(gemm), {}, {"on": False}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if quant == "nf4":
        import bitsandbytes  # noqa: F401  (registers its ops)
        GEMM_4BIT = torch.ops.bitsandbytes.gemm_4bit.default
        QUANTISE.update({torch.ops.bitsandbytes.quantize_4bit.default, torch.ops.bitsandbytes.quantize_blockwise.default})
        nf4_linears(model)
    with cuda_substitutes(autocast, cast_cache), rec, bnb_maps_kept(quant):
        if quant == "nf4":
            model = nf4_load(model, rec)
        else:
            load_weights(model)
        model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout_p,
                                                 target_modules=list(targets), task_type="CAUSAL_LM"))
        if quant == "nf4":  # TRL's SFTTrainer under a 4-bit model: the adapter in bf16
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        rec.events.append(("reset_peak",))
        ENGINE_ORDER["on"] = checkpointing
        try:
            step(model, rec, autocast, cast_cache, seq, batch, recompute=checkpointing)
        finally:
            ENGINE_ORDER["on"] = False
    return list(rec.events)  # the model's own frees, once it goes, are no part of the step


#: The Trainer's no-decay names (transformers 5.16.1 Trainer.get_decay_parameter_names): its second AdamW group.
NO_DECAY = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")


def capture_full(key: str, seq: int, batch: int = 1, checkpointing: bool = False) -> list:
    """The request sequence of Soup 0.77.0's resident full fine-tuning (lora.r 0) of registry model ``key``: the
    cuBLAS workspace the harness's context made before the arm (a row's ``carried``), the fp32 master weights'
    load (resolve_base_load_dtype's torch.float32: the warmup block at 4 B an element, each tensor cast on the
    host), a ("reset_peak",), the SFT step's forward and backward under bf16 autocast (``checkpointing``:
    non-reentrant, each layer recomputed in the backward), then the optimizer's step as the Trainer builds it for
    Soup's adamw_torch (weight_decay 0.01): torch AdamW over two groups, decay then no-decay (NO_DECAY), foreach
    (what torch picks for CUDA parameters), each group's exp_avg and exp_avg_sq made by _init_group then its step's
    _foreach_sqrt of every exp_avg_sq. The Trainer's clip_grad_norm_ (max_grad_norm 1.0) is not run: its foreach
    norms are one scalar a tensor (the small pool), its scaling in place, and torch refuses foreach on meta."""
    import re

    from transformers import AutoConfig, AutoModelForCausalLM

    from issue395.model.registry import config_json

    cfg = AutoConfig.for_model(**config_json(key))
    cfg._attn_implementation, cfg.use_cache = "sdpa", False
    rec, cast_cache, autocast = Recorder(), {}, {"on": False}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    rec.workspace.add(rec.thread)
    rec.alloc(CUBLAS_WORKSPACE, "cublas workspace fwd (carried: made before the arm)")
    with cuda_substitutes(autocast, cast_cache), rec:
        load_weights(model)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        rec.events.append(("reset_peak",))
        step(model, rec, autocast, cast_cache, seq, batch, recompute=checkpointing)
        named = list(model.named_parameters())
        decay = [not any(re.search(p, n) for p in NO_DECAY) for n, _ in named]
        groups = [{"params": [p for (_, p), d in zip(named, decay) if d == want], "weight_decay": wd}
                  for want, wd in ((True, 0.01), (False, 0.0))]
        torch.optim.AdamW(groups, lr=2e-5, foreach=True).step()
    return list(rec.events)


def figures(events) -> dict:
    """The replay of ``events``: the resident blocks at the window's start, the allocated-bytes peak, the replayed
    peak as the anatomy's history gives it (resident blocks plus the window's rounded requests at their peak) and
    the rests (the one less the other)."""
    a, resident = CachingAllocator(), None
    for _, e, _, _ in replaying(events, a):
        if e[0] == "reset_peak":
            resident = (a.allocated, a.requested)
    replayed = resident[0] + a.requested_peak - resident[1]
    return {"events": len(events), "resident": resident[0], "peak_allocated": a.peak, "replayed_peak": replayed,
            "rests": a.peak - replayed}


def validations() -> list:
    """Each CHECKS arm: (its label, the measured rests, the replay's figures), the replay at the arm's own seq,
    batch, r and targets."""
    out = []
    for key, path in CHECKS:
        d = json.loads((ROOT / path).read_text(encoding="utf-8"))
        events = capture(key, d["seq"], d["batch"], d["r"], tuple(d["targets"].split(",")), quant=d["quant"])
        out.append((Path(path).stem, d["real_peak"] - d["replayed_peak"], figures(events)))
    return out


# -- saved: what each decoder layer keeps for its backward, counted on CPU under CUDA's autocast lists --
BF16, FP32, T_ = torch.bfloat16, torch.float32, torch.Tensor
#: torch's aten/src/ATen/autocast_mode.cpp, CUDA: the lower-precision list (the ops a decoder reaches)
LOWER = {F.linear, torch.matmul, T_.matmul, T_.__matmul__, T_.__rmatmul__, torch.mm, T_.mm, torch.bmm, T_.bmm,
         torch.addmm, T_.addmm, torch.baddbmm, T_.baddbmm, torch.addbmm, torch.addmv, torch.mv, T_.mv, torch.einsum,
         F.conv1d, F.conv2d, F.scaled_dot_product_attention}
#: ...its fp32 list
TO_FP32 = {torch.pow, T_.pow, T_.__pow__, T_.__rpow__, torch.rsqrt, T_.rsqrt, torch.exp, T_.exp, torch.log, T_.log,
           torch.log1p, T_.log1p, torch.expm1, torch.reciprocal, T_.reciprocal, torch.acos, torch.asin, torch.cosh,
           torch.sinh, torch.tan, torch.erfinv, F.softplus, F.layer_norm, torch.layer_norm, F.group_norm,
           F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.kl_div,
           F.binary_cross_entropy_with_logits, F.cosine_similarity, torch.logsumexp, T_.logsumexp, torch.cdist}
#: ...its fp32_set_opt_dtype ops: run in fp32 unless a dtype is given
OPT_DTYPE = {torch.softmax, T_.softmax, F.softmax, torch.log_softmax, T_.log_softmax, F.log_softmax, torch.sum,
             T_.sum, torch.prod, T_.prod, torch.cumsum, T_.cumsum, torch.cumprod, T_.cumprod}
#: ...its promote list: the widest floating type of the inputs
PROMOTE = {torch.cat, torch.stack, torch.addcmul, torch.addcdiv, torch.atan2, torch.index_put, torch.scatter_add}


def _cast(x, dtype, cache):
    """``x`` (or each of a list's) in ``dtype``, a trainable leaf's cast kept in ``cache`` (autocast's weight cache)."""
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype not in (dtype, torch.float64):
        if cache is not None and x.is_leaf and x.requires_grad:
            return cache.setdefault(id(x), (x, x.to(dtype)))[1]
        return x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(y, dtype, cache) for y in x)
    return x


class MemEfficientSDPA(torch.autograd.Function):
    """What CUDA's memory-efficient attention saves: q, k, v, its output and an fp32 logsumexp (B, H, T)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, gqa):
        with torch.no_grad():
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal,
                                                 scale=scale, enable_gqa=gqa).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, torch.empty(q.shape[:-1], dtype=FP32))
        return out

    @staticmethod
    def backward(ctx, grad):  # never run: only what the forward saves is counted
        raise NotImplementedError


class CudaAutocast(torch.overrides.TorchFunctionMode):
    """CUDA's bf16 autocast at the torch-function level, op by op, off inside torch.autocast(enabled=False);
    F.dropout as CUDA's fused native_dropout (a 1-byte mask), SDPA as MemEfficientSDPA."""

    def __init__(self):
        super().__init__()
        self.stack, self.cache = [True], {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout and kwargs.get("training", args[2] if len(args) > 2 else True):
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            if 0 < p < 1:
                return torch.native_dropout(args[0], p, True)[0]
        on = self.stack[-1]
        if on and func in LOWER:
            args, kwargs = _cast(args, BF16, self.cache), {k: _cast(v, BF16, self.cache) for k, v in kwargs.items()}
        elif on and func in TO_FP32:
            args, kwargs = _cast(args, FP32, None), {k: _cast(v, FP32, None) for k, v in kwargs.items()}
        elif on and func in OPT_DTYPE:
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and first.dtype == BF16 and kwargs.get("dtype") is None and not (
                    len(args) > 2 and func in (F.softmax, F.log_softmax) and args[2] is not None):
                kwargs = dict(kwargs, dtype=FP32)
        elif on and func in PROMOTE:
            ts = [t for t in (args[0] if func in (torch.cat, torch.stack) else args)
                  if isinstance(t, torch.Tensor) and t.is_floating_point()]
            args = _cast(args, FP32, None) if any(t.dtype == FP32 for t in ts) else args
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            assert kwargs.get("dropout_p", 0.0) == 0.0
            return MemEfficientSDPA.apply(q, k, v, kwargs.get("attn_mask", args[3] if len(args) > 3 else None),
                                          kwargs.get("is_causal", False), kwargs.get("scale"),
                                          kwargs.get("enable_gqa", False))
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_autocast():
    """A CudaAutocast mode whose torch.autocast(enabled=False) regions (transformers' rotary tables) switch it off
    and whose state torch.is_autocast_enabled reports (peft reads it); torch restored on the way out."""
    mode = CudaAutocast()

    class Region:
        def __init__(self, device_type=None, dtype=None, enabled=True, cache_enabled=None):
            self.enabled = enabled

        def __enter__(self):
            mode.stack.append(bool(self.enabled))

        def __exit__(self, *exc):
            mode.stack.pop()

        def __call__(self, fn):
            return fn

    saved = (torch.autocast, torch.amp.autocast, torch.is_autocast_enabled)
    torch.autocast = torch.amp.autocast = Region
    torch.is_autocast_enabled = lambda *a, **k: mode.stack[-1]
    try:
        with mode:
            yield mode
    finally:
        torch.autocast, torch.amp.autocast, torch.is_autocast_enabled = saved


def saved_model(config, quant: str, targets: tuple, r: int, dropout: float, seed: int = 0):
    """The real transformers model of ``config`` (bf16, small random weights, norms 1) with peft's LoRA, training
    mode; NF4 as Soup's resident QLoRA load makes it: each decoder linear a bitsandbytes Linear4bit (NF4, double
    quantised, bf16 compute; on CPU), every other parameter fp32 (prepare_model_for_kbit_training), the adapter
    bf16 where the SFT trainer casts it (tasks.Task.adapter_bf16_under_4bit)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=BF16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p, dtype=FP32) * 0.02)
    if quant == "nf4":
        model = nf4_on_cpu(model)
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout, target_modules=list(targets),
                                             task_type="CAUSAL_LM"))
    if quant == "nf4":
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.to(BF16)
    return model.train()


def nf4_on_cpu(model):
    """Each decoder layer's nn.Linear as bitsandbytes' Linear4bit, quantised on CPU; the rest fp32."""
    import bitsandbytes as bnb

    for name, m in list(model.named_modules()):
        if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}.":
            q = bnb.nn.Linear4bit(m.in_features, m.out_features, bias=m.bias is not None, compute_dtype=BF16,
                                  quant_type="nf4", quant_storage=torch.uint8)
            q.weight = bnb.nn.Params4bit(m.weight.data, requires_grad=False, quant_type="nf4",
                                         compress_statistics=True, quant_storage=torch.uint8)
            if m.bias is not None:
                q.bias = torch.nn.Parameter(m.bias.data.to(FP32), requires_grad=False)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, q.to("cpu"))
    for p in model.parameters():
        if p.dtype in (BF16, torch.float16):
            p.data = p.data.to(FP32)
    return model


def saved_by_layer(model, T: int, vocab: int, seed: int = 0) -> dict:
    """{decoder layer index: bytes} of every non-parameter tensor autograd saves in the forward and the loss and
    keeps beside the loss (a branch the loss does not reach dies with its nodes), each storage once, charged to
    the layer running when it was first saved."""
    layers = next(list(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)
                  and "DecoderLayer" in type(m[0]).__name__)
    where, seen, out = ["pre"], {}, {}
    hooks = [h for n, layer in enumerate(layers) for h in (
        layer.register_forward_pre_hook(lambda m, a, n=n: where.__setitem__(0, n)),
        layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, "post")))]

    def pack(t):
        s = t.untyped_storage()
        # the parameters' addresses now, not once before the forward: a parameter whose storage is swapped in it
        # frees its old address for an activation, which a set taken before would skip (seen: 1 run in 8)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        if (s.data_ptr() not in seen or seen[s.data_ptr()].expired()) and s.data_ptr() not in params and s.nbytes():
            # the storage's own weak reference, not its first tensor's: a tensor can outlive the storage it was
            # first seen with (its storage swapped), and a new storage at that address must count again
            seen[s.data_ptr()] = StorageWeakRef(s)
            out.setdefault(where[0], []).append((s.nbytes(), seen[s.data_ptr()]))
        return t

    ids = torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(seed))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cuda_autocast():
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        kept = {k: sum(n for n, ref in v if not ref.expired()) for k, v in out.items()}
        del loss
    finally:
        for h in hooks:
            h.remove()
    return kept


def saved_per_token(config, quant: str, targets: tuple, r: int = 8, dropout: float = LORA_DROPOUT,
                    seqs: tuple = (64, 128)) -> dict:
    """Each decoder layer's saved bytes a token: the slope between two sequence lengths (which drops the
    token-independent blocks)."""
    model = saved_model(config, quant, targets, r, dropout)
    a, b = (saved_by_layer(model, T, config.vocab_size) for T in seqs)
    return {k: (b[k] - a.get(k, 0)) / (seqs[1] - seqs[0]) for k in b if isinstance(k, int)}


def parse(argv: list) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/allocator_replay.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("capture", help="capture a resident LoRA SFT step on the meta device and replay it")
    c.add_argument("key")
    c.add_argument("seq", type=int)
    c.add_argument("--batch", type=int, default=1)
    c.add_argument("--quant", default="none")
    c.add_argument("--r", type=int, default=8)
    c.add_argument("--targets", default=None, help="comma list (default: the protocol's on this architecture)")
    c.add_argument("--dropout", type=float, default=LORA_DROPOUT)
    c.add_argument("--events", help="write the sequence here (JSON)")
    c.add_argument("--full", action="store_true", help="Soup 0.77.0's full fine-tuning (lora.r 0: fp32 master "
                   "weights, the optimizer's step too) in place of the LoRA step")
    c.add_argument("--checkpointing", action="store_true", help="non-reentrant gradient checkpointing (LoRA bf16 "
                   "or --full)")
    c.add_argument("--gemm-4bit", default=GEMM_SM90, choices=(GEMM_SM90, GEMM_FUSED, GEMM_FALLBACK),
                   help="NF4 at 1,536 tokens or fewer: bitsandbytes' heuristic on an sm90 card of 132 SMs (default), "
                        "or forced to its fused kernel or its dequantising fallback on every shape")
    sub.add_parser("check", help="the committed anatomy arms: measured rests beside the replay's")
    t = sub.add_parser("trace", help="a real run's device history (task_peak_anatomy --trace) through the allocator")
    t.add_argument("path", help="a .trace.json.gz (its .json beside it, where there is one, gives real_peak)")
    v = sub.add_parser("saved", help="each decoder layer's saved bytes a token, on CPU under CUDA's autocast lists")
    v.add_argument("key")
    v.add_argument("--layers", type=int, default=2)
    v.add_argument("--quant", default="none")
    v.add_argument("--r", type=int, default=8)
    v.add_argument("--targets", default=None, help="comma list (default: the protocol's on this architecture)")
    v.add_argument("--dropout", type=float, default=LORA_DROPOUT)
    v.add_argument("--seqs", default="128,256", help="two sequence lengths: the slope between them")
    return ap.parse_args(argv)


def refused(a: argparse.Namespace) -> str | None:
    """Why a capture's arguments are refused (None: they are not)."""
    from issue395.model.registry import known

    from issue395.estimator.arch import arch_from_config
    from issue395.model.registry import config_json

    if not known(a.key):
        return f"unknown model key {a.key!r}"
    if a.quant not in ("none", "nf4"):
        return f"--quant {a.quant}: not captured (none or nf4)"
    seqs = [getattr(a, "seq", 1), getattr(a, "batch", 1)] + (
        [int(x) for x in a.seqs.split(",") if x.strip().isdigit()] if a.command == "saved" else [])
    if min(seqs + [a.r]) < 1 or not 0 <= a.dropout < 1:
        return "seq, batch and r must be positive and dropout in [0, 1)"
    if a.command == "saved" and (len(seqs) != 4 or seqs[2] >= seqs[3] or a.layers < 1):
        return "--seqs takes two lengths, the shorter first, and --layers at least 1"
    arch = arch_from_config(config_json(a.key))
    missing = [t for t in (a.targets.split(",") if a.targets else ()) if t not in arch.modules]
    if missing:
        return f"--targets {','.join(missing)}: not in a {arch.model_type} layer ({', '.join(arch.modules)})"
    if max(seqs) > arch.max_pos:
        return f"a seq past the model's max_position_embeddings {arch.max_pos}"
    if getattr(a, "checkpointing", False) and a.quant != "none":
        # prepare_model_for_kbit_training's own checkpointing set-up (reentrant, input grads) is not emulated
        return f"--checkpointing under --quant {a.quant}: not captured (the bf16 LoRA or --full step only)"
    if getattr(a, "full", False) and a.quant != "none":
        return f"--full under --quant {a.quant}: Soup fine-tunes in full without quantization only"
    lora = [o for o, given in (("--targets", a.targets), ("--r", a.r != 8), ("--dropout", a.dropout != LORA_DROPOUT))
            if given]
    if getattr(a, "full", False) and lora:
        return f"{', '.join(lora)} with --full: a full fine-tuning trains no adapter (dropped, not captured)"
    if getattr(a, "events", None) and Path(a.events).exists():
        return f"--events {a.events}: exists; not overwritten"
    from issue395.estimator.gemm4bit import GEMM_4BIT_FUSED_MAX_ROWS

    gemm = getattr(a, "gemm_4bit", GEMM_SM90)
    if gemm != GEMM_SM90 and not (a.quant == "nf4" and a.seq * a.batch <= GEMM_4BIT_FUSED_MAX_ROWS):
        # no gemm_4bit runs there, or it always dequantises: the capture would be labelled with a choice never made
        return (f"--gemm-4bit {gemm}: only under --quant nf4 at {GEMM_4BIT_FUSED_MAX_ROWS:,} tokens (seq x batch) or "
                "fewer, where bitsandbytes' gemm_4bit chooses its kernel")
    return None


def print_saved(a: argparse.Namespace, targets: tuple) -> int:
    """`saved`: each decoder layer's saved bytes a token (computed on CPU, not measured on a card)."""
    from issue395.measure.builder import hf_config
    from issue395.measure.shapes import family_shape

    config = hf_config(family_shape(a.key))
    config.num_hidden_layers, config._attn_implementation = a.layers, "sdpa"
    seqs = tuple(int(x) for x in a.seqs.split(","))
    per = saved_per_token(config, a.quant, targets, a.r, a.dropout, seqs)
    print(f"{a.key} {a.quant}, {a.layers} layer(s), LoRA r {a.r} on {','.join(targets)}, dropout {a.dropout}: bytes a "
          f"token each decoder layer saves for its backward (computed on CPU under CUDA's autocast lists, the slope "
          f"between seq {seqs[0]} and {seqs[1]}; not measured on a card)")
    for layer, b in sorted(per.items()):
        print(f"  layer {layer}: {b:,.2f}")
    return 0


def print_trace(path: Path) -> int:
    """`trace`: a saved device history replayed (issue395.measure.trace), beside the run's measured peak."""
    import gzip

    from issue395.measure.trace import replay_trace

    try:
        trace = json.loads(gzip.open(path, "rt", encoding="utf-8").read())
        r = replay_trace(trace)
        row = path.with_name(path.name.removesuffix(".trace.json.gz") + ".json")
        real = json.loads(row.read_text(encoding="utf-8")).get("real_peak") if row.is_file() else None
    except (OSError, EOFError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        print(f"bench/allocator_replay.py: {path}: not a replayable device history ({exc})", file=sys.stderr)
        return 2
    print(json.dumps({"trace": str(path), "events": len(trace.get("events") or []),
                      "real_peak": real, "model_peak": r.peak,
                      "model_minus_real": None if real is None else r.peak - real,
                      "peak_event": r.peak_at, "rests_at_peak": r.rests_at_peak, "departures": len(r.divergences),
                      "first_departure": r.first, "end_blocks_differing": len(r.end_differs),
                      **({} if r.pages_at_peak is None else {
                          "model_pages_at_peak": r.pages_at_peak, "model_page_reserve": r.pages_at_peak - r.peak,
                          "measured_page_need": json.loads(row.read_text(encoding="utf-8")).get("page_need")
                          if row.is_file() else None}),
                      **adapter_rests(trace, r.peak_at, json.loads(row.read_text(encoding="utf-8"))
                                      if row.is_file() else {})}))
    return 0


def adapter_rests(trace: dict, at: int, row: dict) -> dict:
    """The rests the adapter-shaped blocks over 1 MiB hold at event ``at`` (the row's segments_at sizes: its LoRA
    tensors' elements at 1, 2 and 4 bytes), split by where each block came from: made before the history (the
    parameters), or cut in it from a block whose address last held a request of a given size (0: a new segment's
    tail, never freed). Issue 52 item 1: which blocks hold the rests, and what they were carved from. {} where the
    row names no adapter."""
    from issue395.constants import K_SMALL_SIZE, block_bytes
    from issue395.measure.trace import held_at

    ad = (row.get("segments_at") or {}).get("adapter") or {}
    sizes = {n * w for n in ad.get("elements") or () for w in ad.get("element_widths") or ()}
    if not sizes:
        return {}
    held = [h for h in held_at(trace, at) if h.requested in sizes and block_bytes(h.requested) > K_SMALL_SIZE]
    by: dict = {}
    for h in held:
        if h.rest:
            key = "before the history" if h.born < 0 else f"cut where {h.previous} B was freed"
            by[key] = by.get(key, 0) + h.rest
    return {"adapter_blocks_over_1_mib": len(held), "adapter_blocks_with_rests": sum(h.rest > 0 for h in held),
            "adapter_rests": sum(by.values()), "adapter_rests_by_origin": dict(sorted(by.items()))}


def main(argv: list) -> int:
    a = parse(argv)
    if a.command == "check":
        for label, measured, f in validations():
            print(f"{label}: measured rests {measured:,} B (max_memory_allocated - replayed peak); replayed "
                  f"{f['rests']:,} B ({f['rests'] - measured:+,} B); replayed peak {f['replayed_peak']:,} B, "
                  f"allocated peak {f['peak_allocated']:,} B, resident {f['resident']:,} B, {f['events']:,} events")
        return 0
    if a.command == "trace":
        return print_trace(Path(a.path))
    why = refused(a)
    if why:
        print(f"bench/allocator_replay.py: {why}", file=sys.stderr)
        return 2
    from issue395.estimator.arch import arch_from_config, protocol_targets
    from issue395.model.registry import config_json

    targets = tuple(a.targets.split(",")) if a.targets else protocol_targets(arch_from_config(config_json(a.key)))
    if a.command == "saved":
        return print_saved(a, targets)
    if a.full:
        events = capture_full(a.key, a.seq, a.batch, a.checkpointing)
        print(json.dumps({"key": a.key, "seq": a.seq, "batch": a.batch, "full": True,
                          "checkpointing": a.checkpointing, **figures(events)}))
    else:
        events = capture(a.key, a.seq, a.batch, a.r, targets, a.dropout, a.quant, a.gemm_4bit, a.checkpointing)
        print(json.dumps({"key": a.key, "seq": a.seq, "batch": a.batch, "quant": a.quant, "gemm_4bit": a.gemm_4bit,
                          "r": a.r, "targets": ",".join(targets), "dropout": a.dropout,
                          "checkpointing": a.checkpointing, **figures(events)}))
    if a.events:
        Path(a.events).write_text(json.dumps(events), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
