#!/usr/bin/env python3
"""Re-measure Soup's second-stack VRAM record (issue #395) on any CUDA box.

The claim under test
    Before a layer-streamed LoRA run, Soup predicts its peak VRAM with
    ``soup_cli.utils.layer_stream.estimate_stream_peak_vram`` and refuses the run if it will not fit. The
    contract: the prediction NEVER under-predicts ``torch.cuda.max_memory_allocated()`` of a real step. On
    an RTX 3050 Laptop it did (issue #395); the A10G record re-measured it and found a flat ~1.16x
    over-prediction instead. This harness re-measures that record here.

The protocol (one arm = one row)
    SmolLM2-135M at seq 2048, 3072, 4096, 4352, 5120, 6144 and Qwen2.5-0.5B at seq 2048, 4096, 5120, 6144,
    batch 1. Each arm is one real Soup setup (``SFTTrainerWrapper(config).setup``) with
    ``training.stream_layers: true``, LoRA r=8 on q_proj/v_proj, bf16, and ONE optimizer step. Its real peak
    is ``max_memory_allocated()`` around exactly that step, after emptying the cache and resetting the peak
    stats. The prediction is Soup's own estimator, fed the grid's shape figures.

    Soup's four other tasks (--task dpo,orpo,simpo,kto; issue395/tasks.py) run the same arm through their own
    wrapper and rows, judged against Soup's own pre-flight for the task; the step never saves a checkpoint. A
    resident arm (stream_layers false) is judged against Soup's resident gate; with --stream-vram-probe on, Soup's
    measured-fit probe runs before the step (Soup's own where its schema takes the key, else called by this tool).

The trap
    ``data.max_length`` truncates; it never pads. A row that tokenizes short runs at its own length, the
    real peak stops following seq, and the table shows a clean, growing over-prediction that is pure
    artifact. Two guards, always on: every row is 3x longer than seq (``"word "`` x 3 x seq, one token a
    word), and the realised length is read off the first collated batch into its own column (every key a
    task's forwards read; where TRL cuts the batch inside its loss, the cut, and the width each forward of
    the measured step receives). A row whose realised length differs from the requested seq is VOID: it has
    no ratio, by construction, and the process exits 1.

The package ``issue395/`` beside this file holds everything else (docs/LAYOUT.md) and never imports it: ``main``
hands it ``measure_arm``. Every number printed is measured here, computed by Soup, computed by this tool's
corrected estimator, or quoted from the record, and labelled as such. Usage and exit codes: docs/USAGE.md.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from issue395.measure.cuda import allocator_history, peak_window
from issue395.errors import last_line
from issue395.measure.measurement import ArmHooks, Measurement
from issue395.measure.probe import call_soup_probe, probe_config, watch_soup_probe
from issue395.results.extras import ResidentGate
from issue395.model.arm import Arm
from issue395.record import DATA_ROWS, LORA_ALPHA, LORA_R, OVERSHOOT, SOUP_QUANT
from issue395.model.registry import Shape
from issue395.results.row import realised_as_requested
from issue395.tasks import PROTOCOL_TASK, task
from issue395.host.arms import Protocol
from issue395.run.runner import cli

#: Where Soup builds an arm whose step is measured; the CPU tests set "cpu" and fake the step (a CUDA peak).
STEP_DEVICE = "cuda"


# -- One arm: the rows, Soup's config, the guard, the measured step, teardown --
def chat_rows(seq: int, rows: int = DATA_ROWS) -> list[dict[str, Any]]:
    """The protocol's rows: a 3x overshoot, so truncation, never padding, sets the length."""
    content = "word " * (OVERSHOOT * seq)
    return [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}]}] * rows


def task_rows(name: str, seq: int, rows: int = DATA_ROWS) -> list[dict[str, Any]]:
    """A task's rows in the shape its wrapper takes (Soup's data.format; Task.rows), each completion a 3x overshoot."""
    return chat_rows(seq, rows) if name == PROTOCOL_TASK else task(name).rows(OVERSHOOT * seq, rows)


def rows_for_batch(batch: int, steps: int = 1, val_split: float = 0.1) -> int:
    """The protocol's 4 rows, or more where Soup's validation split would leave a short batch (or too few steps)."""
    n = DATA_ROWS
    while int(n * (1 - val_split)) < batch * steps:
        n += 1
    return n


def soup_config_yaml(base: str, data_path: Path, output: Path, seq: int, batch: int, quant: str = "none",
                     targets: Iterable[str] = ("q_proj", "v_proj"), stream: Iterable[tuple[str, Any]] = (),
                     lora_r: int = LORA_R, lora_alpha: int = LORA_ALPHA, task_name: str = PROTOCOL_TASK,
                     training: Optional[dict[str, Any]] = None, lora: Optional[dict[str, Any]] = None) -> str:
    """The protocol's Soup config, verbatim but for the paths, seq and batch (the map: quantization, the family's
    LoRA targets, streaming modes; --config: ``training`` Arm.training, ``lora`` Adapter.soup_lora, its dropout;
    --task: the task and its data.format, which SFT's names none). Soup spells NF4 "4bit"."""
    import yaml

    data_format = {} if task_name == PROTOCOL_TASK else {"format": task(task_name).data_format}
    return yaml.safe_dump({
        "base": base, "task": task_name, "backend": "transformers", "modality": "text",
        "data": {"train": str(data_path), **data_format, "max_length": seq, "chat_template": "chatml"},
        "output": str(output),
        "training": {"batch_size": batch, "gradient_accumulation_steps": 1, "epochs": 1,
                     "quantization": SOUP_QUANT[quant], "stream_layers": True, "logging_steps": 1,
                     "save_steps": 100000, **dict(stream), **(training or {}),
                     "lora": {"r": lora_r, "alpha": lora_alpha, "target_modules": list(targets), **(lora or {})}},
    }, sort_keys=False)


def realised_lengths(trainer: Any, seq: int, name: str = PROTOCOL_TASK) -> tuple[int, list[int]]:
    """The first collated batch's width (what the step runs at) and each row's token count (the second guard: with
    batch > 1 a short row hides behind its neighbours' padding), over every key the task's forwards read (Task.
    guard_keys); of the widths, the one furthest from seq. Where TRL cuts the batch inside its loss (Task.loss_cut)
    the cut is TRL's own on this very batch; the measured step checks the widths again (``forward_widths``)."""
    t = task(name)
    batch = next(iter(trainer.get_train_dataloader()))
    if t.loss_cut:
        method, keys = t.loss_cut
        batch = dict(batch, **dict(zip(keys, getattr(trainer, method)(*(batch[k] for k in keys)))))
    widths, lengths = [], []
    for key in t.guard_keys:
        ids, mask = batch[key], batch.get(key.replace("input_ids", "attention_mask"))
        widths.append(int(ids.shape[-1]))
        if mask is not None and mask.dim() == 2:
            lengths += [int(v) for v in mask.sum(dim=-1).tolist()]
        else:
            lengths += [widths[-1]] * int(ids.shape[0])
    return max(widths, key=lambda w: abs(w - seq)), lengths


@contextlib.contextmanager
def forward_widths(model: Any) -> Iterator[list[int]]:
    """The width of every forward the model runs while held: what the step really ran at, where the collated
    batch is not what the forwards receive (TRL's cuts inside the loss)."""
    seen: list[int] = []

    def record(module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and hasattr(ids, "shape"):
            seen.append(int(ids.shape[-1]))

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def one_step(trainer: Any, steps: int = 1) -> None:
    """Exactly ONE optimizer step (--steps N: N), and no checkpoint: the protocol measures the step, not the save
    (which on soup-cli 0.73.3 raises for DPO: TRL's "ref" adapter stays on Soup's meta skeleton)."""
    trainer.args.max_steps = steps
    trainer.args.save_strategy = "no"
    trainer.train()


def real_peak(trainer: Any, snapshot: bool = False, steps: int = 1) -> dict[str, Any]:
    """Empty the cache, reset the peak, run the step (``one_step``), read the peak; ``snapshot``: the history too."""
    import torch

    history = allocator_history(2_000_000) if snapshot else contextlib.nullcontext({})
    with peak_window() as window, history as taken:
        started = time.perf_counter()
        one_step(trainer, steps)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started  # the step, not the snapshot's collection
    return {"real_peak": window.peak, "resident": window.before, "reserved": window.reserved,
            "step_s": round(seconds, 3), "snapshot": taken.get("snapshot")}


def measure_arm(arm: Arm, shape: Shape, base: str, work: Path, *, dry_run: bool = False, snapshot: bool = False,
                steps: int = 1, hooks: Optional[ArmHooks] = None) -> Measurement:
    """One real Soup setup and, on CUDA, the one measured step. A failure is kept in the measurement (the runner
    judges it), and teardown always runs. A row that fails the guard is never measured: its peak would be an
    artifact."""
    hooks = hooks or ArmHooks()
    work.mkdir(parents=True, exist_ok=True)
    data_path = work / "train.jsonl"
    data_path.write_text("".join(json.dumps(r) + "\n"
                                 for r in task_rows(arm.task, arm.seq,
                                                    rows_for_batch(arm.batch * arm.micro_batches, steps))))
    m, wrapper = Measurement(), None
    try:
        hooks.before_setup()  # the runner's cap, before Soup puts anything on the card
        with hooks.console(), watch_soup_preflight(m), watch_soup_probe(m):
            from soup_cli.config.loader import load_config_from_string
            from soup_cli.data.loader import load_dataset

            module, wrapper_class = task(arm.task).wrapper
            # training.stream_vram_probe where the arm asks for it and Soup's schema takes it (else this tool calls it)
            config, m.soup_probe = probe_config(load_config_from_string, soup_config_yaml(
                base, data_path, work / "out", arm.seq, arm.batch, arm.quant, shape.targets, shape.stream,
                shape.lora_r, shape.lora_alpha, arm.task, arm.training, arm.adapter.soup_lora()))
            if not config.training.stream_layers:  # `soup train`'s resident gate runs before any setup
                m.soup_resident = soup_resident_preflight(config, dry_run)
            wrapper = getattr(importlib.import_module(module), wrapper_class)(
                config, device="cpu" if dry_run else STEP_DEVICE)
            wrapper.setup(load_dataset(config.data))
            call_soup_probe(wrapper, config, m)  # Soup's probe where its schema refuses the key for the task (#840)
            width, lengths = realised_lengths(wrapper.trainer, arm.seq, arm.task)
            m.realised_width, m.realised_rows = width, tuple(lengths)
            hooks.mark("setup")
            hooks.before_step(m)  # a cap at Soup's own number, as this setup computed it
            if not dry_run and realised_as_requested(arm.seq, arm.batch, width, lengths, arm.task):
                with forward_widths(wrapper.trainer.model) as ran_at:
                    step = real_peak(wrapper.trainer, snapshot=snapshot, steps=steps)
                m.real_peak, m.resident, m.reserved = step["real_peak"], step["resident"], step["reserved"]
                m.step_s, m.snapshot = step["step_s"], step["snapshot"]
                # a forward at any other width: the peak is not seq's, and the row is VOID
                m.realised_width = next((w for w in ran_at if w != arm.seq), width)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure is the arm's finding
        m.fail(exc)
    finally:
        hooks.mark("teardown")
        m.teardown_error = teardown(wrapper)
        wrapper = None
    return m


@contextlib.contextmanager
def watch_soup_preflight(m: Measurement) -> Iterator[Measurement]:
    """Soup's own pre-flight as its setup computes it: the number its gate compares with free VRAM, and its fit
    decision. Soup keeps them nowhere, but its setup imports its estimator and fit decision from the module
    inside the method (0.73.3 and 0.77.0 alike), so wrapping them sees every call."""
    from soup_cli.utils import layer_stream

    estimate, decide = layer_stream.estimate_stream_peak_vram, layer_stream.decide_stream_fit

    def estimate_seen(*args: Any, **kwargs: Any) -> Any:
        result = estimate(*args, **kwargs)
        if sys._getframe(1).f_code.co_name == "_stream_budget_lines" or m.soup_predicted is None:
            m.soup_predicted = int(result)
            m.soup_terms = {k: v for k, v in kwargs.items() if isinstance(v, (int, float, str, type(None)))}
        return result

    def decide_seen(*args: Any, **kwargs: Any) -> Any:
        m.soup_fit = decide(*args, **kwargs)
        return m.soup_fit

    layer_stream.estimate_stream_peak_vram, layer_stream.decide_stream_fit = estimate_seen, decide_seen
    try:
        yield m
    finally:
        layer_stream.estimate_stream_peak_vram, layer_stream.decide_stream_fit = estimate, decide


def soup_resident_preflight(config: Any, dry_run: bool = False) -> ResidentGate:
    """A resident run's pre-flight as `soup train` runs it before any setup (commands/train.py's
    _hardware_fit_preflight): the input its CLI builds from the config, its number, and its verdict against the
    card's total memory as Soup reads it (get_gpu_info; none without CUDA, where Soup's gate does not run)."""
    from soup_cli.utils.gpu import get_gpu_info

    total = 0 if dry_run else int(get_gpu_info(backend=config.backend).get("memory_total_bytes", 0) or 0)
    return ResidentGate.computed(ResidentGate.input_of(config), total)


def teardown(wrapper: Any) -> Optional[str]:
    """Release the stream runtime and the model; an error here is reported beside the measurement, never raised."""
    error = None
    try:
        if wrapper is not None:
            wrapper._close_stream_runtime()
    except Exception as exc:
        error = last_line(exc)
    try:
        if wrapper is not None:
            wrapper.trainer = wrapper.model = None
        # bitsandbytes keeps its dynamic map on the GPU once Soup quantizes NF4: 1,024 bytes every later arm
        # carried (bench/carried.py)
        qmap = getattr(sys.modules.get("bitsandbytes.functional"), "name2qmap", {})
        if getattr(qmap.get("dynamic"), "is_cuda", False):
            del qmap["dynamic"]
        gc.collect()
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            # the autograd thread's cuBLAS workspace (32 MiB on Hopper) appears after a fresh process's peak, so
            # the next arm in this process would carry it: +32 MiB on every later arm, measured, before this
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            torch.cuda.empty_cache()
    except Exception as exc:
        error = error or last_line(exc)
    return error


def protocol() -> Protocol:
    """This protocol as the package takes it: the measured arm, the device it runs on, the script, its rows."""
    return Protocol(measure_arm=measure_arm, step_device=STEP_DEVICE, script=os.path.abspath(__file__),
                    task_rows=task_rows)


def main(argv: Optional[list[str]] = None) -> int:
    """The command line, handed to the package with this protocol."""
    return cli(sys.argv[1:] if argv is None else argv, protocol())


if __name__ == "__main__":
    sys.exit(main())
