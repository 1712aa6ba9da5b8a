"""One arm around the protocol: what the entry script measured (``Measurement``), the hooks the
runner hands it (``ArmHooks``: the constraint's hooks, Soup's console, the phases it names), and
``run_arm``, which judges the measurement into a Row: SKIPPED, REFUSED, OOM or FAILED, the timings, the
attribution of the peak and its snapshot file, the GPU's label.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional

from ..errors import UsageError, last_line
from ..tasks import task
from ..model.arm import Arm
from ..model.registry import Shape, known
from ..estimator.anatomy import classifier_for
from ..estimator.estimate import estimate
from ..results.extras import Gate, Ran, ResidentGate, SoupProbe, UserConfig
from ..results.row import Row, arm_row
from ..constraints.constraint import ArmSetting, Constraint
from .console import soup_console
from .cuda import attribute_peak, is_oom, oom_request, save_snapshot
from .margin import shape_classes
from .shapes import bitsandbytes_present


@dataclass
class Measurement:
    """What the protocol saw for one arm. A failure is kept, not judged: ``run_arm`` sorts it."""

    realised_width: Optional[int] = None  # input_ids.shape[-1] of the first collated batch
    realised_rows: tuple = ()  # each row's tokens in it
    real_peak: Optional[int] = None  # max_memory_allocated around the step
    resident: Optional[int] = None  # allocated before the step
    reserved: Optional[int] = None  # max_memory_reserved
    step_s: Optional[float] = None
    snapshot: Optional[dict] = None  # the allocator's history around the step (--snapshot)
    soup_predicted: Optional[int] = None  # Soup's own pre-flight, as its setup computed it
    soup_terms: Optional[dict] = None  # the arguments it passed its estimator
    soup_fit: Any = None  # Soup's fit decision: a refusal by its gate is REFUSED, not FAILED
    soup_resident: Optional[ResidentGate] = None  # a resident run: Soup's resident gate, as its CLI runs it
    soup_probe: Optional[SoupProbe] = None  # training.stream_vram_probe: Soup's probe and its verdict (measure/probe.py)
    error: Optional[BaseException] = None  # what stopped the arm, if anything did
    teardown_error: Optional[str] = None

    def fail(self, exc: BaseException) -> None:
        """Keep what stopped the arm without its frames: they hold the model, and teardown must
        free it before the next arm."""
        seen = exc
        while seen is not None and seen.__traceback__ is not None:
            seen.__traceback__ = None
            seen = seen.__cause__ or seen.__context__
        self.error = exc


@dataclass
class ArmHooks:
    """What the runner asks of the protocol for one arm; the protocol calls each at its moment."""

    before_setup: Callable[[], None] = lambda: None  # before Soup puts anything on the card
    before_step: Callable[[Measurement], None] = lambda m: None  # Soup's pre-flight known, no step yet
    console: Callable[[], ContextManager[Any]] = contextlib.nullcontext  # Soup's panels to a log
    mark: Callable[[str], None] = lambda phase: None  # "setup" done, "teardown" begins


class Clock:
    """The arm's timings from the phases the protocol names."""

    def __init__(self) -> None:
        self.start, self.marks = time.perf_counter(), {}

    def mark(self, phase: str) -> None:
        self.marks.setdefault(phase, time.perf_counter())

    def timings(self, step_s: Optional[float]) -> dict[str, float]:
        end = time.perf_counter()
        teardown = self.marks.get("teardown", end)
        got = {"setup_s": round(self.marks.get("setup", teardown) - self.start, 3)}
        if step_s is not None:
            got["step_s"] = step_s
        got["teardown_s"] = round(end - teardown, 3)
        return got


def carried_bytes(dry_run: bool, step_device: str) -> Optional[int]:
    """What earlier arms in this process left allocated: a fresh process has 0, and anything
    more is inside this arm's peak too."""
    if dry_run or step_device != "cuda":
        return None
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.memory_allocated())


def failure_of(m: Measurement) -> dict[str, Any]:
    """A failure is the row's finding: REFUSED when Soup's own gate said no (its probe's too), OOM with the size it
    asked for, FAILED with the error's last line."""
    if m.error is None:
        return {}
    fit, oom, probe = m.soup_fit, is_oom(m.error), m.soup_probe
    # Soup's own probe running out of memory at setup is its gate's refusal too (it raises its own line)
    refused = (fit is not None and not fit.fits and str(m.error).startswith(fit.reason)) or (
        probe is not None and probe.path == SoupProbe.SOUP and probe.outcome == "oom")
    return {"failure": "REFUSED" if refused else "OOM" if oom else "FAILED",
            "error": last_line(m.error), "oom_request": oom_request(m.error) if oom else None}


def attribution_of(m: Measurement, arm: Arm, shape: Shape) -> Optional[dict]:
    """Which blocks are live at the peak, by logits kind and by physical class (--snapshot)."""
    if m.snapshot is None or m.real_peak is None:
        return None
    return attribute_peak(m.snapshot, m.resident, arm.seq * shape.vocab * arm.batch, m.real_peak,
                          shape_classes(shape, arm.seq, arm.batch),
                          classifier_for(arm.model, quant=arm.quant, seq=arm.seq, batch=arm.batch,
                                         targets=shape.targets, task=arm.task))


def gpu_label(dry_run: bool, step_device: str) -> Optional[str]:
    if dry_run or step_device != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return f"{os.environ.get('CUDA_VISIBLE_DEVICES', '0')}: {torch.cuda.get_device_name(0)}"


def run_arm(measure_arm: Callable[..., Measurement], step_device: str, arm: Arm, shape: Shape,
            base: str, work: Path, *, dry_run: bool = False, snapshot: bool = False,
            snapshot_dir: Optional[str] = None, log: Optional[Path] = None, verbose: bool = False,
            repeat: Optional[int] = None, steps: int = 1, constraint: Optional[Constraint] = None,
            soup_config: Optional[str] = None) -> Row:
    """One arm measured by the protocol and judged. Always returns a row: a failure anywhere is
    the row's finding, and a teardown error sits beside the measurement, never replacing it. A
    --config arm's row names the file and the LoRA r and alpha it ran with (its shape's)."""
    carried = carried_bytes(dry_run, step_device)
    config = UserConfig(soup_config, shape.lora_r, shape.lora_alpha, arm.adapter.dropout) if soup_config else None
    refused = task(arm.task).batch_refused(arm.batch)
    if refused:  # planned, never dropped: the row says why it did not run
        return arm_row(arm, shape, ran=Ran(base=base), dry_run=dry_run, repeat=repeat, failure="SKIPPED",
                       error=f"batch {arm.batch}: {refused}", config=config)
    if arm.quant == "nf4" and not bitsandbytes_present():
        return arm_row(arm, shape, ran=Ran(base=base), dry_run=dry_run, repeat=repeat, failure="SKIPPED",
                       error="NF4 needs bitsandbytes, which is not installed here", config=config)
    setting = ArmSetting(arm, shape, base, steps, dry_run)
    if constraint is not None:
        constraint.before_arm(setting)
    clock = Clock()
    hooks = ArmHooks(before_setup=lambda: constraint and constraint.before_setup(setting),
                     # Soup's own number for the arm as this setup computed it: a resident run's is its resident gate's
                     before_step=lambda m: constraint and constraint.before_step(
                         setting, m.soup_resident.peak if m.soup_resident is not None else m.soup_predicted),
                     mark=clock.mark,
                     console=lambda: soup_console(log or work / "soup.log", verbose))
    try:
        m = measure_arm(arm, shape, base, work, dry_run=dry_run, snapshot=snapshot, steps=steps, hooks=hooks)
    finally:  # a constraint's hold (the ballast) goes back however the arm ended
        unfreed = constraint.release() if constraint is not None else None
    if unfreed:
        m.teardown_error = "; ".join(filter(None, (m.teardown_error, unfreed)))
    timings = clock.timings(m.step_s)
    try:
        attribution = attribution_of(m, arm, shape)
    except Exception as exc:  # noqa: BLE001 - FAILED beside the measurement, as any arm's error
        attribution = None
        if m.error is None:
            m.fail(exc)
    if attribution and snapshot_dir:
        name = f"snapshot-{arm.stem(repeat)}.pickle"
        attribution["snapshot_file"] = save_snapshot(m.snapshot, Path(snapshot_dir) / name)
    ran = Ran(base=base, gpu=gpu_label(dry_run, step_device), log=str(log) if log else None, timings=timings,
              teardown_error=m.teardown_error)
    gate = Gate(m.soup_terms, gate_free(m)) if m.soup_terms is not None or gate_free(m) is not None else None
    return arm_row(arm, shape, ran=ran, dry_run=dry_run, repeat=repeat, carried=carried,
                   corrected_custom=custom_corrected(arm, shape, base, steps),
                   realised_width=m.realised_width,
                   realised_rows=m.realised_rows, real_peak=m.real_peak, resident=m.resident,
                   reserved=m.reserved, attribution=attribution,
                   soup_predicted=m.soup_predicted, gate=gate, soup_resident=m.soup_resident,
                   soup_probe=m.soup_probe, constraint=constraint.record() if constraint else None, config=config,
                   **failure_of(m))


def custom_corrected(arm: Arm, shape: Shape, base: str, steps: int) -> Optional[int]:
    """This tool's corrected estimate of an arm whose model has no public config here (--model, a
    --config's folder base): from the checkpoint's own config.json, at the arm's adapter and task, as
    --estimate computes it; None for a registry model (recomputed when rendered) or one it does not model."""
    if known(arm.model):
        return None
    try:
        config = json.loads((Path(base) / "config.json").read_text(encoding="utf-8"))
        return estimate(config, quant=arm.quant, seq=arm.seq, batch=arm.batch, targets=tuple(shape.targets) or None,
                        lora_r=shape.lora_r, lora_dropout=arm.adapter.dropout, steps=steps, task=arm.task, soup=False,
                        **arm.run).corrected_predicted
    except (OSError, ValueError, TypeError, KeyError, UsageError):
        return None


def gate_free(m: Measurement) -> Optional[int]:
    """What Soup's gate read (None where it never ran: a dry run, an arm stopped before it)."""
    value = getattr(m.soup_fit, "available_bytes", None)
    return int(value) if isinstance(value, int) and value > 0 else None
