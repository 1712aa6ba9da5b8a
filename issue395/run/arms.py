"""The arms in this process: the protocol the entry script hands the package (its measured arm), the
sweep over a grid's arms in grid order (a lane of the map holding its GPU's card lock), and what the
stack and the timings say of a run.
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from ..tasks import PROTOCOL_TASK
from ..model.arm import Arm
from ..model.registry import Shape, family_of
from ..results.result import Result
from ..results.row import Row
from ..measure.console import Stop
from ..measure.margin import margin_arms, margin_breakdown
from ..measure.measurement import Measurement, run_arm
from ..measure.shapes import not_on_map
from .cardlock import CardHold, CardLock, lane_order
from .checkpoints import Checkpoints, quant_base
from .grid import past_positions
from .request import MeasureRequest
from .scratch import Scratch


@dataclass(frozen=True)
class Protocol:
    """What the entry script hands the package: its measured arm, the device its step runs on
    (the CPU tests set "cpu"), the script itself, which every child process runs, and its task rows
    (--find-max's probes train on the protocol's rows)."""

    measure_arm: Callable[..., Measurement]
    step_device: str
    script: str
    task_rows: Optional[Callable[..., list]] = None

    def run_arm(self, arm: Arm, shape: Shape, base: str, work: Path, **options: Any) -> Row:
        """One arm measured by the protocol and judged into its row."""
        return run_arm(self.measure_arm, self.step_device, arm, shape, base, work, **options)


def sweep(arms: list[Arm], shapes: dict[str, Shape], bases: Checkpoints, scratch: Scratch,
          run: MeasureRequest, run_arm: Callable[..., Row], on_row: Callable[[Row], None],
          on_margin: Optional[Callable[[dict[str, Any]], None]] = None) -> None:
    """Every arm, in grid order, in this process; Ctrl-C stops after the arm in flight. With
    ``on_margin`` (the map), a model's tightest arm and any UNDER run again under the allocator
    history once its arms are done, to say where the margin goes."""
    checked: set[tuple[str, str]] = set()
    done: list[Row] = []
    lock = CardLock(run.children.card_lock) if run.children.card_lock else None
    hold = CardHold(lock)
    whole = set(run.children.whole_card)
    if lock is not None:  # a family's whole-card arms back to back: one drain of the other lanes, not one each
        arms = lane_order(arms, whole, family_of)

    def card(a: Arm, following: Optional[Arm] = None) -> Any:
        """A lane of the map holds its GPU's card for the arm, alone for a whole-card arm, from before
        Soup's setup to after the teardown, which frees the allocator, and on to ``following`` when it
        needs the card alone too. Taken outside Stop.arm: a Ctrl-C while it waits for the card stops now."""
        return hold.arm(a.index in whole, following is not None and following.index in whole)

    for i, arm in enumerate(arms):
        if Stop.requested:
            break
        # A family's streaming modes share its checkpoint: it is built once, released after the last.
        family = family_of(arm.model)
        base = quant_base(scratch, bases.get(family), arm.quant, shapes[arm.model].stream)
        first = (arm.model, arm.quant) not in checked
        if (run.cache_dir or run.shard_dir) and first:
            scratch.repair_shards(base)
        checked.add((arm.model, arm.quant))
        log = (Path(run.log_dir) / f"soup-{arm.index:03d}-{arm.model}-{arm.seq}-b{arm.batch}{task_tag(arm)}.log"
               if run.log_dir else None)
        following = arms[i + 1] if i + 1 < len(arms) and family_of(arms[i + 1].model) == family else None
        with card(arm, following), scratch.sharding(base) if first else contextlib.nullcontext(), Stop.arm():
            row = run_arm(arm, shapes[arm.model], base, scratch.path("arms", f"{arm.index:03d}"),
                          dry_run=run.dry_run, snapshot=run.snapshot, snapshot_dir=run.snapshot_dir,
                          log=log, verbose=run.verbose, repeat=run.children.repeat_tag, steps=run.steps,
                          constraint=run.constraints.for_arm(run.context),
                          **({"soup_config": run.adapter.soup_config} if run.adapter.soup_config else {}))
        on_row(row)
        done.append(row)
        if any(family_of(a.model) == family for a in arms[i + 1:]):
            continue
        if on_margin is not None:
            mine = [r for r in done if family_of(r.model_key) == family]
            again = mine if run.snapshot else []
            for a in [] if run.snapshot else margin_arms(mine):
                if Stop.requested:
                    break
                with card(a), Stop.arm():
                    again.append(run_arm(a, shapes[a.model], quant_base(scratch, bases.get(family), a.quant,
                                                                         shapes[a.model].stream),
                                         scratch.path("arms", f"{a.index:03d}-margin"), snapshot=True,
                                         log=log, verbose=run.verbose, steps=run.steps))
            for r in again:
                if r.attribution and r.measured and r.soup_predicted:
                    on_margin(margin_breakdown(r))
        bases.release(family)
    hold.release()  # a stop between two whole-card arms: the other lanes get the card back


def task_tag(arm: Arm) -> str:
    """A file name's mark of a task other than SFT (the protocol's names stay as they were)."""
    return "" if arm.task == PROTOCOL_TASK else f"-{arm.task}"


#: The row file's header of a parent of children (lanes, --gpus, --isolate): the stack is its own.
STACK_OF_PARENT = ("the parent process, which runs no arm: its children's stacks (GPU, driver, CUDA) were to be "
                   "merged into the JSON it did not write")


def stack_notes(run: MeasureRequest) -> dict[str, Any]:
    """What the stack says of the run beyond the packages: the steps, and the map's arms left out."""
    notes: dict[str, Any] = {}
    if run.steps != 1:  # the protocol's one step is implied; anything else is named (the stack settled)
        notes["steps"] = run.steps
    left_out = not_on_map() + past_positions(run.models, run.seqs) if run.map else []
    if left_out and not run.children.child:  # never skipped silently: named with the reason
        notes["not_on_map"] = " | ".join(left_out)
    return notes


def run_timings(rows: list[Row], imports_s: float, total_s: float, build_s: dict[str, float],
                children: list[Result]) -> dict[str, Any]:
    """The harness's own cost: imports, builds, and per arm setup, step and teardown."""
    t: dict[str, Any] = {"total_s": round(total_s, 2), "imports_s": round(imports_s, 2), "arms": len(rows),
                         "arms_per_minute": round(len(rows) * 60 / total_s, 2) if total_s > 0 else None,
                         "build_s": build_s}
    for key in ("setup_s", "step_s", "teardown_s"):
        t[f"sum_{key}"] = round(sum(r.ran.timings.get(key) or 0 for r in rows), 2)
    overhead = [r.ran.timings["setup_s"] + r.ran.timings["teardown_s"] for r in rows
                if r.ran.timings.get("setup_s") is not None and r.ran.timings.get("teardown_s") is not None]
    if overhead:
        t["median_arm_overhead_s"] = round(statistics.median(overhead), 3)
    if children:
        t["children"] = [c.timings for c in children]
    return t
