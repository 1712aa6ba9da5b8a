"""A resident LoRA SFT bf16 step's allocation sequence captured on the META device (the real transformers + peft
model at its exact shapes, no compute) and replayed through issue395.estimator.allocator (issue 52 item 1): the
rests the default caching allocator's blocks keep past their requests at the peak, which the allocator's history
(requested sizes) does not show and max_memory_allocated does. CPU only; nothing here is measured on a card.

    python bench/allocator_replay.py capture KEY SEQ [--batch 1] [--quant none] [--r 8] [--targets q_proj,v_proj]
                                     [--dropout 0.05] [--events OUT.json]
    python bench/allocator_replay.py check

``capture`` prints the replay's figures; ``--events`` writes the sequence (("alloc", key, bytes, what),
("free", key), ("reset_peak",)) as JSON. ``check`` captures the committed anatomy arms (CHECKS) and prints each
one's measured rests (max_memory_allocated minus the history's replayed peak, both from its JSON) beside the
replay's, exactly. "Rests" here: the replay's allocated-bytes peak minus (the resident blocks before the step plus
the step's rounded requests at their peak), the committed anatomy's real_peak - replayed_peak.

What a CUDA step does that the meta device does not, substituted (each checked against the committed anatomies'
live sets):
- Hugging Face's bf16 autocast: F.linear casts an fp32 input, then the weight (a leaf weight's cast kept until the
  forward ends), then the bias, to bf16, as CUDA's autocast lower-precision list does for linear;
- SDPA runs flash: its output (B,H,T,D) in the input's dtype, an fp32 logsumexp (B,H,T), two 8-byte philox
  tensors; its backward dq, dk, dv, fp32 softmax_d (B,H,T rounded to 128) and dq_accum (B,T128,H,D8), a GQA's
  dk and dv summed over each group;
- dropout is CUDA's fused native_dropout: its output, then a bool mask;
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
  stream, and the norms), peft wraps each target in its bnb LoRA layer, TRL casts the adapter to bf16;
- the CUDA gemm_4bit: at more than 1,536 rows, or where bitsandbytes' sm90 heuristic (an H100/H200: 132 SMs,
  compute 9.0) declines its fused kernel, its dequantising fallback: the nested absmax dequantised (fp32), plus its
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
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from issue395.constants import CUBLAS_WORKSPACE, CUBLASLT_WORKSPACE  # noqa: E402
from issue395.estimator.allocator import CachingAllocator  # noqa: E402
from issue395.record import LORA_DROPOUT  # noqa: E402

ANATOMY = "results/resident-anatomy-h200-soup0.77.0-2400c0d/call-1"
#: The committed resident anatomies `check` replays: (registry key, the arm's JSON).
CHECKS = (("qwen", f"{ANATOMY}/res-sft-qwen-bf16-2048x1.json"),
          ("llama32-1b", f"{ANATOMY}/res-sft-llama1b-bf16-2048x1.json"),
          ("smol", f"{ANATOMY}/res-sft-smol-bf16-1024x1.json"),
          ("llama32-1b", f"{ANATOMY}/res-sft-llama1b-nf4-2048x1.json"))
GEMM_4BIT = None  # torch.ops.bitsandbytes.gemm_4bit.default, once an NF4 capture imports bitsandbytes
QUANTISE: set = set()  # bitsandbytes' quantize_4bit and quantize_blockwise, likewise
MM = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
      torch.ops.aten.baddbmm.default}


class Recorder(TorchDispatchMode):
    """Each op's output storages as requests (one per StorageImpl; its free when the last tensor of it dies), and
    the cuBLAS workspaces where CUDA's first matmul of a thread makes them."""

    def __init__(self):
        super().__init__()
        self.events, self.keys, self.live = [], itertools.count(), {}
        self.thread, self.workspace, self.lt = "fwd", set(), False

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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
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
        fused kernel): bitsandbytes' own choice, on an sm90 card of 132 SMs."""
        ops = cuda_ops()
        A, B, shape = args[0], args[1], args[2]
        absmax_8bit = args[7] if len(args) > 7 else kwargs.get("absmax_8bit")
        K, N = A.shape[-1], shape[0]
        M = A.numel() // K
        sm90 = ops._gpu_dispatch_props
        ops._gpu_dispatch_props = lambda index: (132, 9, 0)
        try:
            custom = (M <= ops._gemm_4bit_custom_max_m and K % args[4] == 0
                      and ops._gemm_4bit_use_custom_cuda(0, A.dtype, M, N, K))
        finally:
            ops._gpu_dispatch_props = sm90
        if custom:
            return None
        temps = [self.alloc(4 * absmax_8bit.numel(), "absmax dequantised"),
                 self.alloc(4 * absmax_8bit.numel(), "absmax + offset")] if absmax_8bit is not None else []
        return temps + [self.alloc(N * K * A.element_size(), f"dequantised weight ({N}, {K}) {A.dtype}")]


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
    """Flash SDPA's requests: what it saves in the forward, what its backward makes."""

    @staticmethod
    def forward(ctx, q, k, v):
        B, H, T, D = q.shape
        out = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device).transpose(1, 2)
        lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
        seed = torch.empty((), dtype=torch.int64, device=q.device)
        off = torch.empty((), dtype=torch.int64, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, seed, off)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse, seed, off = ctx.saved_tensors
        B, H, T, D = q.shape
        T128, D8 = -(-T // 128) * 128, -(-D // 8) * 8
        dq, dk, dv = (torch.empty((B, T, H, D), dtype=q.dtype, device=q.device).transpose(1, 2) for _ in range(3))
        softmax_d = torch.empty((B, H, T128), dtype=torch.float32, device=q.device)
        dq_accum = torch.empty((B, T128, H, D8), dtype=torch.float32, device=q.device)
        del softmax_d, dq_accum
        Hk = k.shape[1]
        if Hk != H:  # flash's GQA backward sums the expanded dk, dv over each group
            dk = dk.reshape(B, Hk, H // Hk, T, D).sum(2)
            dv = dv.reshape(B, Hk, H // Hk, T, D).sum(2)
        return dq, dk, dv


class FusedDropout(torch.autograd.Function):
    """CUDA's native_dropout: the output, then a bool mask (CPU's keeps a mask in the input's dtype)."""

    @staticmethod
    def forward(ctx, x, p):
        out = torch.empty_like(x)
        ctx.save_for_backward(torch.empty_like(x, dtype=torch.bool))
        return out

    @staticmethod
    def backward(ctx, g):
        return torch.empty_like(g), None


def dropout(x, p=0.5, training=True, inplace=False):
    return x if not training or p == 0 else FusedDropout.apply(x, p)


def flash_sdpa(autocast: dict):
    """Flash SDPA; under autocast (its lower-precision list) fp32 q, k, v cast to bf16 first."""
    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if autocast["on"]:
            q, k, v = (x.to(torch.bfloat16) if x.dtype == torch.float32 else x for x in (q, k, v))
        return Flash.apply(q, k, v)
    return sdpa


@contextlib.contextmanager
def cuda_substitutes(autocast: dict, cast_cache: dict):
    """F.linear under autocast (while ``autocast["on"]``, which torch.is_autocast_enabled reads), fused dropout,
    flash SDPA and no packed-sequence check, restored on the way out."""
    import transformers.masking_utils as mu

    linear0, dropout0, sdpa0, packed0, enabled0 = (F.linear, F.dropout, F.scaled_dot_product_attention,
                                                   mu.find_packed_sequence_indices, torch.is_autocast_enabled)

    def linear(x, w, b=None):
        if autocast["on"]:
            x = x.to(torch.bfloat16) if x.dtype == torch.float32 else x
            if w.dtype == torch.float32:
                w = (cast_cache.setdefault(id(w), w.to(torch.bfloat16)) if w.is_leaf and w.requires_grad
                     else w.to(torch.bfloat16))
            b = b.to(torch.bfloat16) if b is not None and b.dtype == torch.float32 else b
        return linear0(x, w, b)

    F.linear, F.dropout, F.scaled_dot_product_attention = linear, dropout, flash_sdpa(autocast)
    mu.find_packed_sequence_indices = lambda position_ids: None
    torch.is_autocast_enabled = lambda *device: autocast["on"]
    try:
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


def nf4_load(model):
    """Soup's resident QLoRA load: the weights (quantised as they land), then peft's
    prepare_model_for_kbit_training (the rest cast to fp32; no checkpointing)."""
    from peft import prepare_model_for_kbit_training

    load_weights(model)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def step(model, rec: Recorder, autocast: dict, cast_cache: dict, seq: int, batch: int) -> None:
    """One SFT step to the end of its backward, as TRL's SFTTrainer runs it: the forward under autocast (all-ones
    mask: SDPA gets none), the loss, TRL's entropy and token accuracy without grad, the backward."""
    from trl.trainer.utils import entropy_from_logits

    ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")
    mask = torch.ones((batch, seq), dtype=torch.long, device="meta")
    labels = torch.zeros((batch, seq), dtype=torch.long, device="meta")
    autocast["on"] = True
    out = model(input_ids=ids, attention_mask=None, labels=labels, use_cache=False)
    autocast["on"] = False
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
    loss.backward()
    del loss


def capture(key: str, seq: int, batch: int = 1, r: int = 8, targets: tuple = ("q_proj", "v_proj"),
            dropout_p: float = LORA_DROPOUT, quant: str = "none") -> list:
    """The request sequence of a resident LoRA SFT step of registry model ``key``, bf16 or (``quant`` "nf4")
    Soup's QLoRA: the load, a ("reset_peak",) where the measured step's window starts, the step."""
    global GEMM_4BIT
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from issue395.model.registry import config_json

    cfg = AutoConfig.for_model(**config_json(key))
    cfg._attn_implementation = "sdpa"
    rec, cast_cache, autocast = Recorder(), {}, {"on": False}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if quant == "nf4":
        import bitsandbytes  # noqa: F401  (registers its ops)
        GEMM_4BIT = torch.ops.bitsandbytes.gemm_4bit.default
        QUANTISE.update({torch.ops.bitsandbytes.quantize_4bit.default, torch.ops.bitsandbytes.quantize_blockwise.default})
        nf4_linears(model)
    with cuda_substitutes(autocast, cast_cache), rec:
        if quant == "nf4":
            model = nf4_load(model)
        else:
            load_weights(model)
        model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout_p,
                                                 target_modules=list(targets), task_type="CAUSAL_LM"))
        if quant == "nf4":  # TRL's SFTTrainer under a 4-bit model: the adapter in bf16
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
        model.train()
        rec.events.append(("reset_peak",))
        step(model, rec, autocast, cast_cache, seq, batch)
    return list(rec.events)  # the model's own frees, once it goes, are no part of the step


def figures(events) -> dict:
    """The replay of ``events``: the resident blocks at the window's start, the allocated-bytes peak, the replayed
    peak as the anatomy's history gives it (resident blocks plus the window's rounded requests at their peak) and
    the rests (the one less the other)."""
    a, held, resident = CachingAllocator(), {}, None
    for e in events:
        if e[0] == "reset_peak":
            a.reset_peak()
            resident = (a.allocated, a.requested)
        elif e[0] == "alloc":
            held[e[1]] = a.malloc(e[2])
        else:
            a.free(held.pop(e[1]))
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
    sub.add_parser("check", help="the committed anatomy arms: measured rests beside the replay's")
    return ap.parse_args(argv)


def refused(a: argparse.Namespace) -> str | None:
    """Why a capture's arguments are refused (None: they are not)."""
    from issue395.model.registry import known

    if not known(a.key):
        return f"unknown model key {a.key!r}"
    if a.quant not in ("none", "nf4"):
        return f"--quant {a.quant}: not captured (none or nf4)"
    if a.seq < 1 or a.batch < 1 or a.r < 1 or not 0 <= a.dropout < 1:
        return "seq, batch and r must be positive and dropout in [0, 1)"
    if a.events and Path(a.events).exists():
        return f"--events {a.events}: exists; not overwritten"
    return None


def main(argv: list) -> int:
    a = parse(argv)
    if a.command == "check":
        for label, measured, f in validations():
            print(f"{label}: measured rests {measured:,} B (max_memory_allocated - replayed peak); replayed "
                  f"{f['rests']:,} B ({f['rests'] - measured:+,} B); replayed peak {f['replayed_peak']:,} B, "
                  f"allocated peak {f['peak_allocated']:,} B, resident {f['resident']:,} B, {f['events']:,} events")
        return 0
    why = refused(a)
    if why:
        print(f"bench/allocator_replay.py: {why}", file=sys.stderr)
        return 2
    from issue395.estimator.arch import arch_from_config, protocol_targets
    from issue395.model.registry import config_json

    targets = tuple(a.targets.split(",")) if a.targets else protocol_targets(arch_from_config(config_json(a.key)))
    events = capture(a.key, a.seq, a.batch, a.r, targets, a.dropout, a.quant)
    print(json.dumps({"key": a.key, "seq": a.seq, "batch": a.batch, "quant": a.quant, "r": a.r,
                      "targets": ",".join(targets),
                      "dropout": a.dropout, **figures(events)}))
    if a.events:
        Path(a.events).write_text(json.dumps(events), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
