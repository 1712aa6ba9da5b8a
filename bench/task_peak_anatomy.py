#!/usr/bin/env python
"""What is live at the CUDA peak of ONE streamed LoRA step of a Soup preference task (or SFT).

Builds the task's real Soup wrapper (SFT / DPO / ORPO / SimPO / KTO) on a checkpoint, runs exactly
one optimizer step inside the harness's peak window with the caching allocator's history on
(issue395.measure.cuda.peak_window / allocator_history, as issue395_second_stack_vram.real_peak does),
replays the history to the peak (the same replay as issue395.measure.cuda.attribute_peak) and prints the
blocks live there grouped by size, each group with the Python frames that allocated it, plus
each block's size as a multiple of the logits element count E = rows x T x V (rows = 2 x batch
for dpo/orpo/simpo, batch for kto/sft; T = the realised width of the first collated batch).

    python task_peak_anatomy.py --task dpo --base /path/to/ckpt --seq 2048 --batch 1 [--quant none|nf4]
                                [--r R] [--steps N] [--accum K] [--optim NAME]
                                [--work DIR] [--json OUT] [--max-entries N] [--segments] [--trace OUT.gz]

``--steps N --accum K`` runs N optimizer steps of K micro-batches each (the run's steady state and
gradient accumulation); the history is split at every model forward, at each optimizer step's start
and end and at each step's end (after ``zero_grad``), so each phase's own maximum is read (``phases``)
and each optimizer step's own peak (``step_peaks``).

``--segments`` also reads the allocator's segments (torch.cuda.memory._snapshot()) right before and right
after the LAST optimizer step, where the adapter's gradients (and, from step 2, its optimizer's states) are
live: each live block's size beside its request, and what the blocks hold past their 512 B rounding by class
and adapter-shaped or not (``segments_at``; issue 52 item 1). The history records requests only, so it cannot
say which block a cached free block was handed to whole; the segments can. Off by default: each snapshot
copies the whole history.

Without CUDA it parses its arguments, says so, and exits 0 (nothing can be measured there).
Run from /work/main (or with it on sys.path) so that ``issue395`` imports.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

TASKS = ("sft", "dpo", "orpo", "simpo", "kto")
PAIRED = ("dpo", "orpo", "simpo")
WRAPPERS = {"sft": ("soup_cli.trainer.sft", "SFTTrainerWrapper"),
            "dpo": ("soup_cli.trainer.dpo", "DPOTrainerWrapper"),
            "orpo": ("soup_cli.trainer.orpo", "ORPOTrainerWrapper"),
            "simpo": ("soup_cli.trainer.simpo", "SimPOTrainerWrapper"),
            "kto": ("soup_cli.trainer.kto", "KTOTrainerWrapper")}
OVERSHOOT = 3  # the protocol's 3x overshoot: truncation, never padding, sets the length


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--task", choices=TASKS, required=True)
    ap.add_argument("--base", required=True, help="checkpoint dir (or hub id) Soup streams")
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--batch", type=int, default=None, help="default 1 (kto: 2, Soup's minimum)")
    ap.add_argument("--quant", choices=("none", "nf4"), default="none")
    ap.add_argument("--targets", default="q_proj,v_proj")
    ap.add_argument("--r", type=int, default=8, help="LoRA rank (alpha 2r)")
    ap.add_argument("--steps", type=int, default=1, help="optimizer steps (the steady state from 2)")
    ap.add_argument("--accum", type=int, default=1, help="gradient_accumulation_steps")
    ap.add_argument("--optim", default=None, help="training.optimizer (default: Soup's)")
    ap.add_argument("--stream", action="append", default=[], metavar="KEY=VALUE",
                    help="a soup-cli 0.77.0 streaming mode (stream_expert_layout=per_expert, stream_loss_chunk=512, "
                         "stream_recompute=off); repeatable")
    ap.add_argument("--train", action="append", default=[], metavar="KEY=VALUE",
                    help="any other Soup training key: stream_layers=false (a resident run), "
                         "gradient_checkpointing=true|selective|medium|full; repeatable")
    ap.add_argument("--work", default=None)
    ap.add_argument("--json", default=None, help="write the attribution here")
    ap.add_argument("--snapshot", default=None, help="also pickle the raw snapshot here")
    ap.add_argument("--trace", default=None,
                    help="also write the device history's events, frames left out, gzipped JSON here (save_trace)")
    ap.add_argument("--max-entries", type=int, default=2_000_000)
    ap.add_argument("--expandable", action="store_true",
                    help="run under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as `soup train` does (set "
                         "before CUDA starts), and read the pages live blocks touch at the peak (page_need)")
    ap.add_argument("--segments", action="store_true",
                    help="read the allocator's segments right before and after the last optimizer step: each live "
                         "block's size and request, the rests past 512 B rounding by class (segments_at)")
    ap.add_argument("--top", type=int, default=6, help="frames shown per group")
    ap.add_argument("--stacks", choices=("python", "all"), default="python",
                    help="each block's traceback: python, or all (C++ frames too, slower: for blocks "
                         "allocated off the Python thread)")
    a = ap.parse_args(argv)
    if a.batch is None:
        a.batch = 2 if a.task == "kto" else 1
    if a.seq < 2 or a.batch < 1 or a.r < 1 or a.steps < 1 or a.accum < 1:
        ap.error("seq >= 2, batch, r, steps and accum >= 1")
    for out in (a.json, a.snapshot, a.trace):  # checked before the run, so a bad path never loses a GPU run
        if out and not Path(out).resolve().parent.is_dir():
            ap.error(f"{out}: its folder does not exist")
    return a


def task_rows(task: str, seq: int, batch: int, micro_batches: int = 1) -> list[dict[str, Any]]:
    """Rows in the shape each wrapper takes, long enough that truncation sets the width; enough of
    them for ``micro_batches`` full batches."""
    long_a, long_b = "word " * (OVERSHOOT * seq), "hi " * (OVERSHOOT * seq)
    n = max(4, 2 * batch + 2, batch * micro_batches + 2)
    if task == "sft":
        return [{"messages": [{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": long_a}]}] * n
    if task == "kto":  # both labels in every batch: KTO's KL batch needs batch >= 2
        return [{"prompt": "", "completion": long_a if i % 2 == 0 else long_b, "label": i % 2 == 0}
                for i in range(n)]
    # DPO needs a prompt (TRL indexes it); ORPO/SimPO realise seq exactly with an empty one
    return [{"prompt": "hi" if task == "dpo" else "", "chosen": long_a, "rejected": long_b}] * n


def soup_yaml(task: str, base: str, data: Path, out: Path, seq: int, batch: int, quant: str,
              targets: list[str], r: int = 8, accum: int = 1, optim: Optional[str] = None,
              stream: Optional[dict] = None) -> str:
    import yaml
    training_extra = {**({"optimizer": optim} if optim else {}), **(stream or {})}
    return yaml.safe_dump({
        "base": base, "task": task, "backend": "transformers", "modality": "text",
        "data": {"train": str(data), "max_length": seq, "chat_template": "chatml"},
        "output": str(out),
        "training": {"batch_size": batch, "gradient_accumulation_steps": accum, "epochs": 1,
                     "quantization": "4bit" if quant == "nf4" else "none", "stream_layers": True,
                     "logging_steps": 1, "save_steps": 100000, **training_extra,
                     "lora": {"r": r, "alpha": 2 * r, "target_modules": targets}},
    }, sort_keys=False)


def stream_modes(pairs: list[str]) -> dict:
    """--stream KEY=VALUE pairs as Soup's training keys (a number where it is one: stream_loss_chunk)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.startswith("stream_"):
            raise SystemExit(f"--stream {pair!r}: give KEY=VALUE with a stream_* key")
        out[key] = int(value) if value.isdigit() else value
    return out


def training_keys(pairs: list[str]) -> dict:
    """--train KEY=VALUE pairs as Soup's training keys: true/false as booleans, digits as numbers."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--train {pair!r}: give KEY=VALUE")
        out[key] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
    return out


def soup_resident_gate(config: Any, total_bytes: int) -> Optional[dict]:
    """Soup's resident pre-flight as `soup train` runs it (commands/train.py): the input its CLI builds
    from this config, estimate_peak_vram_gb's breakdown and decide_hardware_fit against the card's total
    (computed by Soup). None where Soup's CLI has no such gate or builds no input."""
    try:
        from soup_cli.commands.train import _build_hardware_fit_input
        from soup_cli.utils.hardware_fit import decide_hardware_fit, estimate_peak_vram_gb
    except ImportError:
        return None
    inp = _build_hardware_fit_input(config)
    if inp is None:
        return {"input": None}
    b = estimate_peak_vram_gb(inp)
    r = decide_hardware_fit(inp, available_vram_gb=total_bytes / 1e9)
    return {"input": {k: getattr(inp, k) for k in inp.__dataclass_fields__},
            "breakdown_gb": {k: getattr(b, k) for k in b.__dataclass_fields__}, "peak_gb": b.total_gb,
            "ok": r.ok, "required_with_margin_gb": r.required_with_margin_gb,
            "available_gb": r.available_vram_gb, "reason": r.reason,
            "applies": not getattr(config.training, "stream_layers", False)}


def realised(trainer: Any, task: str) -> dict[str, Any]:
    """Width of the first collated batch, per the keys each TRL trainer collates."""
    batch = next(iter(trainer.get_train_dataloader()))
    keys = {"sft": ("input_ids",), "dpo": ("input_ids",),
            "orpo": ("chosen_input_ids", "rejected_input_ids"),
            "simpo": ("chosen_input_ids", "rejected_input_ids"),
            "kto": ("completion_input_ids", "KL_completion_input_ids")}[task]
    shapes = {k: list(batch[k].shape) for k in keys if k in batch}
    if task in ("orpo", "simpo"):
        width = max(s[-1] for s in shapes.values())
        rows = 2 * shapes[keys[0]][0]
    else:
        width = shapes[keys[0]][-1]
        rows = shapes[keys[0]][0]
    return {"shapes": shapes, "width": int(width), "rows": int(rows)}


def user_frame(frames: list[dict]) -> str:
    """The innermost frame outside torch itself (trl / transformers / peft / soup / accelerate),
    with the torch frame just below it, as 'file:line fn <- file:line fn'."""
    def fmt(f):
        return f"{Path(f.get('filename', '?')).name}:{f.get('line', '?')} {f.get('name', '?')}"
    frames = frames or []
    for i, f in enumerate(frames):
        fn = f.get("filename", "")
        if "/torch/" not in fn and not fn.startswith("??") and fn.endswith(".py"):
            below = fmt(frames[i - 1]) if i else ""
            return fmt(f) + (f" <- {below}" if below else "")
    return fmt(frames[0]) if frames else "(no frames)"


def peak_blocks(snapshot: dict, resident: int) -> tuple[int, list[tuple[int, list]]]:
    """Replay the largest device trace to its peak (issue395.measure.cuda.attribute_peak's logic), keeping
    each live block's frames. Returns (replayed peak, [(size, frames)])."""
    from issue395.constants import block_bytes
    traces = snapshot.get("device_traces") or []
    trace = max(traces, key=len) if traces else []
    frees = ({"free_requested"} if any(e.get("action") == "free_requested" for e in trace)
             else {"free", "free_completed"})
    live: dict[int, tuple[int, list]] = {}
    base, total, best, at = resident, 0, resident, -1
    for i, e in enumerate(trace):
        act, addr, size = e.get("action"), int(e.get("addr", 0)), int(e.get("size", 0))
        if act == "alloc":
            live[addr] = (size, e.get("frames") or [])
            total += block_bytes(size)
        elif act in frees:
            if addr in live:
                total -= block_bytes(live.pop(addr)[0])
            else:
                base -= block_bytes(size)
        else:
            continue
        if base + total > best:
            best, at = base + total, i
    live = {}
    for e in trace[:at + 1]:
        act, addr, size = e.get("action"), int(e.get("addr", 0)), int(e.get("size", 0))
        if act == "alloc":
            live[addr] = (size, e.get("frames") or [])
        elif act in frees:
            live.pop(addr, None)
    return best, list(live.values())


def native_frames(frames: list[dict], n: int = 14) -> str:
    """The innermost native frames, allocator internals left out: with --stacks all, where a block
    allocated off the Python thread (the autograd engine's, say) came from."""
    names = [str(f.get("name", "?")) for f in frames or [] if not str(f.get("filename", "")).endswith(".py")]
    names = [x for x in names if "CachingAllocator" not in x and "c10::" not in x[:5]]
    return " <- ".join(x[:90] for x in names[:n])


#: A marker allocation at each event (MARK + 1024 k bytes for the k-th event: a model forward's start
#: and end, an optimizer step's start and end, a step's end): the replay splits the history at them,
#: so each phase's own maximum is read, not only the step's peak (the policy forward, the reference /
#: KL forwards, the loss and backward, the optimizer step).
MARK = 512 * 10007


def phase_maxima(snapshot: dict, resident: int, names: list[str]) -> list[dict]:
    """The replayed live total's maximum between consecutive markers, markers themselves left out,
    with the largest blocks live at that maximum (size, count). ``names[k]`` names the k-th marker."""
    from issue395.constants import block_bytes
    traces = snapshot.get("device_traces") or []
    trace = max(traces, key=len) if traces else []
    frees = ({"free_requested"} if any(e.get("action") == "free_requested" for e in trace)
             else {"free", "free_completed"})
    marks = {MARK + 1024 * k: k for k in range(len(names) + 2)}
    live: dict[int, int] = {}
    base, total = resident, 0
    segments, cur = [], {"from": "start", "max": resident, "live": {}}
    for e in trace:
        act, addr, size = e.get("action"), int(e.get("addr", 0)), int(e.get("size", 0))
        if act == "alloc" and size in marks:
            cur["live"] = {str(k): v for k, v in sorted(cur["live"].items(), key=lambda kv: -kv[0] * kv[1])[:8]}
            segments.append(cur)
            k = marks[size]
            cur = {"from": names[k] if k < len(names) else "?", "max": base + total, "live": {}}
            live[addr] = -1
            continue
        if act == "alloc":
            live[addr] = size
            total += block_bytes(size)
        elif act in frees:
            if addr in live:
                s_ = live.pop(addr)
                if s_ >= 0:
                    total -= block_bytes(s_)
            else:
                base -= block_bytes(size)
            continue
        else:
            continue
        if base + total > cur["max"]:
            cur["max"] = base + total
            sizes: dict[int, int] = defaultdict(int)
            for v in live.values():
                if v >= 0:
                    sizes[v] += 1
            cur["live"] = dict(sizes)
    cur["live"] = {str(k): v for k, v in sorted(cur["live"].items(), key=lambda kv: -kv[0] * kv[1])[:8]}
    segments.append(cur)
    return segments


def group(blocks: list, E: int, per_row: int, top: int) -> list[dict]:
    g: dict[int, dict] = defaultdict(lambda: {"count": 0, "bytes": 0, "frames": defaultdict(int),
                                              "native": defaultdict(int)})
    for size, frames in blocks:
        d = g[size]
        d["count"] += 1
        d["bytes"] += size
        d["frames"][user_frame(frames)] += 1
        if not any(str(f.get("filename", "")).endswith(".py") for f in frames or []) and frames:
            d["native"][native_frames(frames)] += 1
    out = []
    for size, d in sorted(g.items(), key=lambda kv: -kv[1]["bytes"]):
        out.append({"size": size, "count": d["count"], "bytes": d["bytes"],
                    "bytes_per_E": round(d["bytes"] / E, 4) if E else None,
                    "size_in_fp32_rows": round(size / (4 * per_row), 4) if per_row else None,
                    "frames": dict(sorted(d["frames"].items(), key=lambda kv: -kv[1])[:top]),
                    **({"native": dict(sorted(d["native"].items(), key=lambda kv: -kv[1])[:top])}
                       if d["native"] else {})})
    return out


def soup_config(a: argparse.Namespace) -> Any:
    """The run's Soup config, loaded by Soup's own loader from the soup.yaml the flags give, its data file
    (the task's rows, enough for every micro-batch of every step) written in the work folder, where
    Soup's shards go too."""
    work = Path(a.work or tempfile.mkdtemp(prefix=f"anatomy-{a.task}-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("SOUP_LAYER_STREAM_CACHE_DIR", str(work / "shards"))
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in task_rows(a.task, a.seq, a.batch, a.steps * a.accum)))
    from soup_cli.config.loader import load_config_from_string
    # before the estimator is wrapped, as the measured runs imported it (a module bound to it keeps Soup's own)
    from soup_cli.data.loader import load_dataset  # noqa: F401
    return load_config_from_string(soup_yaml(a.task, a.base, data, work / "out", a.seq, a.batch,
                                             a.quant, a.targets.split(","), a.r, a.accum, a.optim,
                                             {**stream_modes(a.stream), **training_keys(a.train)}))


def watch_soup_number() -> dict:
    """Soup's own streamed estimate as its setup computes it: its estimator wrapped, so that the number
    (the gate's call, _stream_budget_lines', over any earlier one) and its plain keyword arguments are
    kept in the dict returned."""
    from soup_cli.utils import layer_stream
    seen: dict = {}
    _est = layer_stream.estimate_stream_peak_vram

    def _est_seen(*args, **kwargs):
        r = _est(*args, **kwargs)
        if sys._getframe(1).f_code.co_name == "_stream_budget_lines" or "soup" not in seen:
            seen["soup"] = int(r)
            seen["kwargs"] = {k: v for k, v in kwargs.items() if isinstance(v, (int, float, str, type(None)))}
        return r
    layer_stream.estimate_stream_peak_vram = _est_seen
    return seen


def mark_steps(trainer: Any) -> tuple[list[dict], list[str], list]:
    """Marks in the allocator's history where each forward and optimizer step starts and ends (a
    uniquely sized allocation each, which phase_maxima finds): the forwards in order (grad mode, the
    logits' shape and dtype, allocated after), the marks' names, and the hooks' handles to remove."""
    import torch
    # forwards in order, with grad mode and the logits' shape/dtype
    calls: list[dict] = []
    events: list[str] = []

    def mark(name: str) -> None:
        events.append(name)
        torch.empty(MARK + 1024 * (len(events) - 1), dtype=torch.uint8, device="cuda").zero_()

    def pre(mod_, args, kwargs):
        mark(f"forward {len(calls) + 1} ({'grad' if torch.is_grad_enabled() else 'no grad'}) start")

    def post(mod_, args, kwargs, out):
        lg = getattr(out, "logits", None)
        calls.append({"grad": torch.is_grad_enabled(),
                      "logits": None if lg is None else [list(lg.shape), str(lg.dtype)],
                      "allocated_after": int(torch.cuda.memory_allocated())})
        mark(f"forward {len(calls)} ({'grad' if calls[-1]['grad'] else 'no grad'}) end")
    handles = [trainer.model.register_forward_pre_hook(pre, with_kwargs=True),
               trainer.model.register_forward_hook(post, with_kwargs=True)]
    from transformers import TrainerCallback

    class Marks(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            mark(f"optimizer step {state.global_step + 1} start")

        def on_optimizer_step(self, args, state, control, **kw):
            mark(f"optimizer step {state.global_step + 1} end")

        def on_step_end(self, args, state, control, **kw):
            mark(f"step {state.global_step} end")
    trainer.add_callback(Marks())
    return calls, events, handles


#: A block's class by its request: the small pool's (kSmallSize or less: always split at 512 B), a large-pool
#: block cut from a shared segment (under kMinLargeAlloc), or one of kMinLargeAlloc or more.
SEGMENT_CLASSES = ("<=1MiB", "1-10MiB", ">=10MiB")
#: The bytes an element of an adapter-shaped block takes: an 8-bit optimizer state, a 16-bit parameter or
#: gradient, an fp32 one or an fp32 state or transient.
ELEMENT_WIDTHS = (1, 2, 4)
#: A live block's row in ``segments_at`` (a row, not a dict: a steady state holds thousands of blocks).
BLOCK_FIELDS = ("size", "requested_size", "offset", "segment_size", "pool", "adapter")


def block_class(requested: int) -> str:
    from issue395.constants import K_MIN_LARGE_ALLOC, K_SMALL_SIZE
    if requested <= K_SMALL_SIZE:
        return SEGMENT_CLASSES[0]
    return SEGMENT_CLASSES[1] if requested < K_MIN_LARGE_ALLOC else SEGMENT_CLASSES[2]


def read_segments(snapshot: dict, adapter_bytes) -> dict:
    """Every live block (state active_allocated: the allocated-bytes stat counts these, whole) in a snapshot's
    segments (the dict torch.cuda.memory._snapshot() returns) as a row of BLOCK_FIELDS: its size and request, its
    offset in its segment, the segment's total size and pool, and whether its request is adapter-shaped (one of
    ``adapter_bytes``); then ``rests``: per adapter-shaped or other, per SEGMENT_CLASSES, the blocks, those holding more than their
    512 B rounding (``whole``: handed a cached block whole, or a segment's tail), what they hold past it
    (``rest``: size - block_bytes(request)) and the estimator's bound on the same blocks (constants.unsplit_bound)."""
    from issue395.constants import block_bytes, unsplit_bound
    adapter = set(adapter_bytes)
    rests = {kind: {c: {"blocks": 0, "whole": 0, "rest": 0, "bound": 0} for c in SEGMENT_CLASSES}
             for kind in ("adapter", "other")}
    blocks = []
    for seg in snapshot.get("segments") or []:
        for b in seg.get("blocks") or []:
            if b.get("state") != "active_allocated":  # free, or freed and waiting on a stream: not counted
                continue
            size, req = int(b["size"]), int(b["requested_size"])
            kind = "adapter" if req in adapter else "other"
            blocks.append([size, req, int(b["address"]) - int(seg["address"]), int(seg["total_size"]),
                           seg.get("segment_type"), kind == "adapter"])
            cell, rest = rests[kind][block_class(req)], size - block_bytes(req)
            cell["blocks"] += 1
            cell["whole"] += rest > 0
            cell["rest"] += rest
            cell["bound"] += unsplit_bound(req)
    return {"allocated": sum(b[0] for b in blocks), "requested": sum(b[1] for b in blocks),
            "rest": {kind: sum(c["rest"] for c in rests[kind].values()) for kind in rests},
            "rests": rests, "block_fields": list(BLOCK_FIELDS), "blocks": blocks}


def adapter_shapes(trainer: Any, targets: str, r: int) -> dict:
    """The adapter as live: each trainable tensor's element count (LoRA A and B, every target, every layer),
    the element widths its blocks may take, and whether the estimator's lora_tensors counts the same tensors
    (None, with the reason, where the estimator cannot read the model's config or a target)."""
    from issue395.errors import UsageError
    from issue395.estimator.arch import arch_from_config
    from issue395.estimator.steady import lora_tensors
    live = sorted(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    try:
        est = sorted(lora_tensors(arch_from_config(trainer.model.config.to_dict()), tuple(targets.split(",")), r))
        matches, why = est == live, None
    except (UsageError, KeyError) as exc:
        matches, why = None, f"{type(exc).__name__}: {exc}"
    return {"tensors": len(live), "elements": sorted(set(live)), "element_widths": list(ELEMENT_WIDTHS),
            "estimator_matches": matches, **({"estimator_unread": why} if why else {})}


def watch_segments(trainer: Any, last: int, adapter_bytes: set) -> list[dict]:
    """--segments: the segments read (read_segments) at the Trainer's on_pre_optimizer_step and on_optimizer_step
    of step ``last``. transformers 5.16.1's inner loop calls them just before and just after
    ``self.optimizer.step()``, before ``lr_scheduler.step()`` and ``model.zero_grad()``: the gradients are live
    at both, the states of the earlier steps before and this step's after. on_step_end runs after zero_grad
    (the gradients are None there); an optimizer step hook would sit on the torch optimizer inside accelerate's
    wrapper at the same points, and these are where mark_steps splits the history too."""
    import torch
    from transformers import TrainerCallback
    moments: list[dict] = []

    def take(name: str) -> None:
        moments.append({"name": name, "memory_allocated": int(torch.cuda.memory_allocated()),
                        **read_segments(torch.cuda.memory._snapshot(), adapter_bytes)})

    class Segments(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            if state.global_step + 1 == last:
                take(f"before optimizer step {last}")

        def on_optimizer_step(self, args, state, control, **kw):
            if state.global_step + 1 == last:
                take(f"after optimizer step {last}")
    trainer.add_callback(Segments())
    return moments


def step_peaks_of(phases: list[dict]) -> list[int]:
    """Each optimizer step's own peak: the maximum of the phases up to its "step N end" mark."""
    step_peaks, k = [], 0
    for seg in phases:
        if k >= len(step_peaks):
            step_peaks.append(0)
        step_peaks[k] = max(step_peaks[k], seg["max"])
        if seg["from"].startswith("step ") and seg["from"].endswith(" end"):
            k += 1
    return step_peaks


def anatomy(a: argparse.Namespace, trainer: Any, gate: Optional[dict], seen: dict) -> dict:
    """The measured run's record: the trainer's steps run under the peak window and the allocator's
    history, then the peak attributed (logits, groups of live blocks, the phases between the marks, the
    pages it touches) beside Soup's numbers and the run's settings."""
    import torch
    from issue395.measure.cuda import allocator_history, attribute_peak, page_need, peak_window

    width = realised(trainer, a.task)
    vocab = int(trainer.model.config.vocab_size) if hasattr(trainer.model, "config") else 0
    E, per_row = width["rows"] * width["width"] * vocab, width["width"] * vocab
    calls, events, handles = mark_steps(trainer)
    adapter = adapter_shapes(trainer, a.targets, a.r) if a.segments else None
    moments = (watch_segments(trainer, a.steps, {n * w for n in adapter["elements"] for w in ELEMENT_WIDTHS})
               if adapter else None)
    trainer.args.max_steps = a.steps
    start = segments_of(torch.cuda.memory._snapshot()) if a.trace else []
    step_error = None
    with peak_window() as window, allocator_history(a.max_entries, stacks=a.stacks) as taken:
        try:
            trainer.train()
        except Exception as exc:  # 0.73.3 DPO: the end-of-run save of a meta ref adapter
            step_error = f"{type(exc).__name__}: {str(exc)[:200]}"
        torch.cuda.synchronize()
        # the window's requested peak (what the tensors asked for), beside its allocated one (block
        # sizes): their difference is the blocks' unsplit remainders, which the history cannot see
        requested_peak = int(torch.cuda.memory_stats().get("requested_bytes.all.peak", 0))
    for h in handles:
        h.remove()
    snap = taken["snapshot"]
    if a.snapshot:
        from issue395.measure.cuda import save_snapshot
        save_snapshot(snap, Path(a.snapshot))
    if a.trace:
        save_trace(snap, Path(a.trace), start)
    summary = attribute_peak(snap, window.before, E, window.peak)
    pages = page_need(snap)
    replayed, blocks = peak_blocks(snap, window.before)
    phases = phase_maxima(snap, window.before, events)
    return {"task": a.task, "seq": a.seq, "batch": a.batch, "quant": a.quant, "realised": width,
            "r": a.r, "targets": a.targets, "steps": a.steps, "accum": a.accum, "optim": a.optim,
            "stream": stream_modes(a.stream), "train": training_keys(a.train),
            "soup_resident_gate": gate, "step_peaks": step_peaks_of(phases),
            "vocab": vocab, "E": E, "step_error": step_error, "soup_predicted": seen.get("soup"),
            "soup_kwargs": seen.get("kwargs"), "real_peak": window.peak, "requested_peak": requested_peak,
            "resident_before": window.before, "reserved_peak": window.reserved,
            "expandable": a.expandable,
            "page_need": None if pages is None else {"allocated": pages.allocated, "mapped": pages.mapped,
                                                     "pages": pages.pages, "reserve": pages.reserve},
            "dynamic_over_E": round((window.peak - window.before) / E, 4) if E else None,
            "replayed_peak": replayed, "forwards": calls,
            "phases": phases,
            "attribute_peak": {k: summary[k] for k in ("complete", "logits_fp32", "logits_bf16",
                                                       "other_groups", "events")},
            "groups": group(blocks, E, per_row, a.top),
            **({"segments_at": {"adapter": adapter, "moments": moments}} if a.segments else {})}


def segments_of(snapshot: dict) -> list[dict]:
    """A snapshot's segments without frames: each segment's address, size and stream, and its blocks'
    address, size, request and state (what a replay of the history after it starts from)."""
    return [{"address": g.get("address"), "total_size": g.get("total_size"), "stream": g.get("stream", 0),
             "blocks": [{k: b.get(k) for k in ("address", "size", "requested_size", "state")}
                        for b in g.get("blocks") or []]} for g in snapshot.get("segments") or []]


def save_trace(snapshot: dict, path: Path, start: list) -> None:
    """The device history as [action, addr, size, stream] rows, with ``start`` (segments_of the snapshot taken
    before recording began: the blocks the history frees but never allocated) and the end's segments, gzipped
    JSON: the real request sequence a synthetic one is checked against (issue 52 item 1, the streamed steady
    state), small enough to bring back where a raw snapshot, frames and all, is not. Torch's actions and
    addresses, as recorded: a converter turns them into estimator.allocator's events."""
    import gzip
    from issue395.measure.cuda import device_history
    trace, _ = device_history(snapshot)
    with gzip.open(path, "wt") as f:
        json.dump({"start_segments": start, "end_segments": segments_of(snapshot),
                   "events": [[e.get("action"), e.get("addr"), e.get("size"), e.get("stream", 0)] for e in trace]},
                  f)


def main(argv=None) -> int:
    a = parse(argv)
    if a.expandable:  # read once, when CUDA starts: before torch is imported
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch
    if not torch.cuda.is_available():
        print(f"task_peak_anatomy: no CUDA device here; nothing measured "
              f"(task {a.task}, seq {a.seq}, batch {a.batch}, quant {a.quant})."
              + (" --segments: no snapshot taken, no segments recorded." if a.segments else ""))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout this script is in
    import importlib
    # first, before Soup's modules, as the measured runs imported it
    import issue395.measure.cuda  # noqa: F401

    config = soup_config(a)
    gate = soup_resident_gate(config, torch.cuda.mem_get_info()[1])
    seen = watch_soup_number()
    mod, cls = WRAPPERS[a.task]
    wrapper = getattr(importlib.import_module(mod), cls)(config, device="cuda")
    try:
        from soup_cli.data.loader import load_dataset
        wrapper.setup(load_dataset(config.data))
        res = anatomy(a, wrapper.trainer, gate, seen)
        shown = res if not a.segments else {  # the console without the blocks' rows: --json keeps them
            **res, "segments_at": {**res["segments_at"], "moments": [
                {k: v for k, v in m.items() if k != "blocks"} for m in res["segments_at"]["moments"]]}}
        print(json.dumps(shown, indent=1, default=str))
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    finally:
        try:
            wrapper._close_stream_runtime()
        except Exception as exc:  # teardown never masks the measurement
            print(f"teardown: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
