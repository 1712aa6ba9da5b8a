#!/usr/bin/env python3
"""Re-measure Soup's second-stack VRAM record (issue #395) on any CUDA box.

Requirements
    A CUDA GPU with 13 GB free for the full sweep (the largest arm, Qwen2.5-0.5B
    at seq 6144, peaks at 11.85 GB on the record's A10G 23 GB); Python 3.11 and
    requirements.txt: torch, transformers, trl, peft, soup-cli (0.73.3 is the
    record's; 0.77.0 is tested too), pyyaml, matplotlib (--plot) and jinja2>=3.1.0
    (Soup's chat template fails to render on older jinja2). No network: every
    model is built here. On an H200 a full run (--sweep --measure --sdpa) took
    39-49 s warm and 51-82 s cold; the margin map's first 129 arms (--map) 12.4
    minutes with every checkpoint built cold, 5.6 minutes with --gpus 0,1 on two
    H200s, and its seq 512/1024 arms 3.6 minutes more (results/README.md). The map's NF4 arms need bitsandbytes;
    its 7B and 8B families ran on a box with 128 GiB of RAM and a 64 GB disk (one
    family's checkpoint and shards are kept at a time in each process).

Usage
    issue395_second_stack_vram.py                          the sweep: 10 arms
    issue395_second_stack_vram.py --sweep --measure --sdpa the full record
    issue395_second_stack_vram.py --dry-run --seq 256      CPU: Soup's setup and the guard, no peak
    issue395_second_stack_vram.py --map --plot map.png     the margin map: every family Soup streams
    issue395_second_stack_vram.py --gpus 0,1               one shard per GPU, merged
    issue395_second_stack_vram.py --shard 2/4 --json s2.json   one shard of four (cluster array jobs)
    issue395_second_stack_vram.py --from-json s1.json s2.json  merge shards into one set of tables
    issue395_second_stack_vram.py --estimate --model mistral-7b --quant nf4 --seq 512 --card 24GB
                                                           does it fit? CPU, from a config, no torch
    issue395_second_stack_vram.py --map --families phi-2 --quant nf4 --seq 512 --cap soup
                                                           the arm capped at Soup's own number

The claim under test
    Before a layer-streamed LoRA run, Soup predicts its peak VRAM with
    ``soup_cli.utils.layer_stream.estimate_stream_peak_vram`` and refuses the run
    if it will not fit. The contract: the prediction NEVER under-predicts
    ``torch.cuda.max_memory_allocated()`` of a real step. On an RTX 3050 Laptop
    it did (issue #395); the A10G record re-measured it and found a flat ~1.16x
    over-prediction instead. This harness re-measures that record here.

The protocol (one arm = one row)
    SmolLM2-135M at seq 2048, 3072, 4096, 4352, 5120, 6144 and Qwen2.5-0.5B at
    seq 2048, 4096, 5120, 6144, batch 1. Each arm is one real Soup setup
    (``SFTTrainerWrapper(config).setup``) with ``training.stream_layers: true``,
    LoRA r=8 on q_proj/v_proj, bf16, and ONE optimizer step. Its real peak is
    ``max_memory_allocated()`` around exactly that step, after emptying the cache
    and resetting the peak stats. The prediction is Soup's own estimator, fed the
    grid's shape figures.

The trap
    ``data.max_length`` truncates; it never pads. A row that tokenizes short runs
    at its own length, the real peak stops following seq, and the table shows a
    clean, growing over-prediction that is pure artifact. Two guards, always on:
    every row is 3x longer than seq (``"word "`` x 3 x seq, one token a word), and
    the realised length is read off the first collated batch into its own column.
    A row whose realised length differs from the requested seq is VOID: it has no
    ratio, by construction, and the process exits 1.

What the tool adds to the record
    Architecture-exact synthetic checkpoints (peak VRAM depends on shapes and
    dtypes, not weight values; ``--weights hub`` uses the real ones); --batch;
    --model (any streamable causal LM, or just its config.json); --snapshot (which
    blocks are live at the peak, with a positive control); --determinism; --isolate;
    shards (--shard, --gpus, --from-json merges); JSON, markdown and a plot; and the
    margin map (--map): Soup's contract on every family it streams, bf16 and NF4,
    judged against Soup's own pre-flight number as its setup computes it, with the
    estimator term that eats the thinnest margins.

Beside the protocol (this file) lies the package ``issue395/``: the record's
data, the tables and outputs, the CLI, spreading arms over processes, and the
corrected estimator (docs/LAYOUT.md). The package never imports this file:
``main`` hands it ``run_arm``.

Every number printed is measured here, computed by Soup, computed by this
tool's corrected estimator, or quoted from the record, and labelled as such.
Exit codes: 0 every row ok (a dry run: every row realised as requested; REFUSED
and SKIPPED rows are not findings); 1 any row VOID, OOM, FAILED or UNDER; 2 usage
error; 130 interrupted.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from issue395.anatomy import classifier_for
from issue395.cap import apply_cap, cap_bytes
from issue395.console import soup_console
from issue395.cuda import allocator_history, attribute_peak, is_oom, oom_request, peak_window, save_snapshot
from issue395.errors import last_line
from issue395.margin import shape_classes
from issue395.record import DATA_ROWS, LORA_ALPHA, LORA_R, OVERSHOOT, SOUP_QUANT, Arm, Shape
from issue395.row import Row, arm_row, realised_as_requested
from issue395.runner import Protocol, cli
from issue395.shapes import bitsandbytes_present

#: Where Soup builds an arm whose step is measured. The CPU tests set "cpu" and fake the
#: step itself (only the CUDA peak cannot run there); nothing else changes for them.
STEP_DEVICE = "cuda"


# ---------------------------------------------------------------------------
# One arm: the rows, Soup's config, the guard, the measured step, teardown
# ---------------------------------------------------------------------------


def chat_rows(seq: int, rows: int = DATA_ROWS) -> list[dict[str, Any]]:
    """The protocol's rows: a 3x overshoot, so truncation, never padding, sets the length."""
    content = "word " * (OVERSHOOT * seq)
    return [{"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": content}]}] * rows


def rows_for_batch(batch: int, steps: int = 1, val_split: float = 0.1) -> int:
    """The protocol's 4 rows, or more where Soup's validation split would leave a short batch
    (or too few batches for --steps in its one epoch)."""
    n = DATA_ROWS
    while int(n * (1 - val_split)) < batch * steps:
        n += 1
    return n


def soup_config_yaml(base: str, data_path: Path, output: Path, seq: int, batch: int,
                     quant: str = "none", targets: Iterable[str] = ("q_proj", "v_proj")) -> str:
    """The protocol's Soup config, verbatim but for the paths, seq and batch (and, on the
    margin map, the quantization and the family's own LoRA targets). Soup spells NF4 "4bit"."""
    import yaml

    return yaml.safe_dump({
        "base": base, "task": "sft", "backend": "transformers", "modality": "text",
        "data": {"train": str(data_path), "max_length": seq, "chat_template": "chatml"},
        "output": str(output),
        "training": {"batch_size": batch, "gradient_accumulation_steps": 1, "epochs": 1,
                     "quantization": SOUP_QUANT[quant], "stream_layers": True, "logging_steps": 1,
                     "save_steps": 100000,
                     "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "target_modules": list(targets)}},
    }, sort_keys=False)


def realised_lengths(trainer: Any) -> tuple[int, list[int]]:
    """The first collated batch's width (what the step runs at) and each row's token count (the
    second guard): with batch > 1 a short row would hide behind its neighbours' padding."""
    batch = next(iter(trainer.get_train_dataloader()))
    ids, mask = batch["input_ids"], batch.get("attention_mask")
    width = int(ids.shape[-1])
    if mask is not None and mask.dim() == 2:
        return width, [int(v) for v in mask.sum(dim=-1).tolist()]
    return width, [width] * int(ids.shape[0])


def real_peak(trainer: Any, snapshot: bool = False, steps: int = 1) -> dict[str, Any]:
    """Empty the cache, reset the peak, run exactly ONE optimizer step (the protocol; --steps N
    runs N), read the peak; with ``snapshot``, the allocator's history around the same step."""
    import torch

    trainer.args.max_steps = steps
    history = allocator_history(2_000_000) if snapshot else contextlib.nullcontext({})
    with peak_window() as window, history as taken:
        started = time.perf_counter()
        trainer.train()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started  # the step, not the snapshot's collection
    return {"real_peak": window.peak, "resident": window.before, "reserved": window.reserved,
            "step_s": round(seconds, 3), "snapshot": taken.get("snapshot")}


def run_arm(arm: Arm, shape: Shape, base: str, work: Path, *, dry_run: bool = False,
            snapshot: bool = False, snapshot_dir: Optional[str] = None,
            log: Optional[Path] = None, verbose: bool = False, repeat: Optional[int] = None,
            steps: int = 1, cap: Optional[str] = None) -> Row:
    """One real Soup setup and, on CUDA, the one measured step. Always returns a row.

    A failure anywhere is the row's finding (OOM with the size it asked for,
    FAILED with the error's last line); a teardown error sits beside the
    measurement and never replaces it. A row that fails the guard is never
    measured: its peak would be an artifact.
    """
    work.mkdir(parents=True, exist_ok=True)
    data_path = work / "train.jsonl"
    data_path.write_text("".join(json.dumps(r) + "\n"
                                 for r in chat_rows(arm.seq, rows_for_batch(arm.batch, steps))))
    got: dict[str, Any] = {"timings": {}, "carried": carried_bytes(dry_run)}
    wrapper = None
    t0 = time.perf_counter()
    if arm.quant == "nf4" and not bitsandbytes_present():
        return arm_row(arm, shape, base=base, dry_run=dry_run, repeat=repeat, failure="SKIPPED",
                       error="NF4 needs bitsandbytes, which is not installed here")
    preflight: dict[str, Any] = {}
    snap = None
    try:
        if cap and not dry_run:  # before Soup's setup puts anything on the card
            got.update(cap_at=cap, cap=cap_bytes(cap, arm.model, quant=arm.quant, seq=arm.seq, batch=arm.batch,
                                                 targets=shape.targets, steps=steps))
            apply_cap(got["cap"])
        with soup_console(log or work / "soup.log", verbose), soup_preflight(preflight):
            from soup_cli.config.loader import load_config_from_string
            from soup_cli.data.loader import load_dataset
            from soup_cli.trainer.sft import SFTTrainerWrapper

            config = load_config_from_string(soup_config_yaml(
                base, data_path, work / "out", arm.seq, arm.batch, arm.quant, shape.targets))
            wrapper = SFTTrainerWrapper(config, device="cpu" if dry_run else STEP_DEVICE)
            wrapper.setup(load_dataset(config.data))
            width, lengths = realised_lengths(wrapper.trainer)
            got.update(realised_width=width, realised_rows=tuple(lengths))
            got["timings"]["setup_s"] = round(time.perf_counter() - t0, 3)
            if not dry_run and realised_as_requested(arm.seq, arm.batch, width, lengths):
                step = real_peak(wrapper.trainer, snapshot=snapshot, steps=steps)
                got["timings"]["step_s"] = step.pop("step_s")
                snap = step.pop("snapshot")
                got.update(step)
                if snap is not None:
                    got["attribution"] = attribute_peak(snap, step["resident"],
                                                        arm.seq * shape.vocab * arm.batch,
                                                        step["real_peak"],
                                                        shape_classes(shape, arm.seq, arm.batch),
                                                        classifier_for(arm.model, quant=arm.quant, seq=arm.seq,
                                                                       batch=arm.batch, targets=shape.targets))
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure becomes the row's finding
        got["timings"].setdefault("setup_s", round(time.perf_counter() - t0, 3))
        fit = preflight.get("fit")
        refused = fit is not None and not fit.fits and str(exc).startswith(fit.reason)
        oom = is_oom(exc)
        got.update(failure="REFUSED" if refused else "OOM" if oom else "FAILED",
                   error=last_line(exc), oom_request=oom_request(exc) if oom else None)
    finally:
        t1 = time.perf_counter()
        got["teardown_error"] = teardown(wrapper)
        wrapper = None
        got["timings"]["teardown_s"] = round(time.perf_counter() - t1, 3)
    got.update(soup_predicted=preflight.get("predicted"), soup_terms=preflight.get("kwargs"))
    if snap is not None and snapshot_dir and got.get("attribution"):
        rep = f"-r{repeat}" if repeat is not None else ""
        got["attribution"]["snapshot_file"] = save_snapshot(
            snap, Path(snapshot_dir) / f"snapshot-{arm.index:03d}-{arm.model}-{arm.seq}-b{arm.batch}{rep}.pickle")
    if not dry_run and STEP_DEVICE == "cuda":
        import torch

        if torch.cuda.is_available():
            got["gpu"] = f"{os.environ.get('CUDA_VISIBLE_DEVICES', '0')}: {torch.cuda.get_device_name(0)}"
    return arm_row(arm, shape, base=base, dry_run=dry_run, repeat=repeat,
                   log=str(log) if log else None, **got)


@contextlib.contextmanager
def soup_preflight(seen: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Soup's own pre-flight for this setup: the number its gate compares with free VRAM. Soup
    keeps it nowhere, but its setup imports its estimator and fit decision from the module
    inside the method (0.73.3 and 0.77.0 alike), so wrapping them sees every call."""
    from soup_cli.utils import layer_stream

    estimate, decide = layer_stream.estimate_stream_peak_vram, layer_stream.decide_stream_fit

    def estimate_seen(*args: Any, **kwargs: Any) -> Any:
        result = estimate(*args, **kwargs)
        if sys._getframe(1).f_code.co_name == "_stream_budget_lines" or "predicted" not in seen:
            seen.update(predicted=int(result), kwargs={k: v for k, v in kwargs.items()
                                                      if isinstance(v, (int, float, str, type(None)))})
        return result

    def decide_seen(*args: Any, **kwargs: Any) -> Any:
        seen["fit"] = decide(*args, **kwargs)
        return seen["fit"]

    layer_stream.estimate_stream_peak_vram, layer_stream.decide_stream_fit = estimate_seen, decide_seen
    try:
        yield seen
    finally:
        layer_stream.estimate_stream_peak_vram, layer_stream.decide_stream_fit = estimate, decide


def teardown(wrapper: Any) -> Optional[str]:
    """Release the stream runtime and the model. An error here is reported beside the
    measurement, never raised: teardown must never mask a measurement."""
    error = None
    try:
        if wrapper is not None:
            wrapper._close_stream_runtime()
    except Exception as exc:
        error = last_line(exc)
    try:
        if wrapper is not None:
            wrapper.trainer = wrapper.model = None
        # bitsandbytes caches its 256-entry dynamic map on the GPU the first time Soup
        # quantizes NF4 shards, and keeps it: 1,024 bytes every later arm carried (the map's
        # Qwen2.5 bf16 peaks were 1 KiB over the sweep's; found by bench/carried.py).
        qmap = getattr(sys.modules.get("bitsandbytes.functional"), "name2qmap", {})
        if getattr(qmap.get("dynamic"), "is_cuda", False):
            del qmap["dynamic"]
        gc.collect()
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            # Each thread's cuBLAS handle keeps a workspace (32 MiB on Hopper) in the
            # caching allocator. The autograd thread's appears after the first step's
            # peak, so a fresh process never has it at the peak, but the next arm in
            # this process would: +32 MiB on every later arm, measured, before this.
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            torch.cuda.empty_cache()
    except Exception as exc:
        error = error or last_line(exc)
    return error


def carried_bytes(dry_run: bool) -> Optional[int]:
    """What earlier arms in this process left allocated: a fresh process has 0, and anything
    more is inside this arm's peak too."""
    if dry_run or STEP_DEVICE != "cuda":
        return None
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.memory_allocated())


def main(argv: Optional[list[str]] = None) -> int:
    """The command line, handed to the package with this protocol's measured arm."""
    return cli(sys.argv[1:] if argv is None else argv,
               Protocol(run_arm=run_arm, step_device=STEP_DEVICE, script=os.path.abspath(__file__)))


if __name__ == "__main__":
    sys.exit(main())
