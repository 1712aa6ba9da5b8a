"""The arms in this process: the protocol the entry script hands the package (its measured arm), the
sweep over a grid's arms in grid order (a lane of the map holding its arms' bytes of its GPU's card
through the lanes' ledger), and what the
stack and the timings say of a run.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from ..model.arm import Arm
from ..model.registry import Shape
from ..model.streaming import family_of
from ..results.result import Result
from ..results.row import Row
from ..measure.console import Stop
from ..measure.margin import margin_arms, margin_breakdown
from ..measure.measurement import Measurement, run_arm
from ..measure.shapes import not_on_map
from .cardlock import CardLedger
from .checkpoints import Checkpoints, quant_base
from .grid import past_positions
from .measured import MeasureRequest
from .schedule import Need
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
    c = run.children
    ledger = CardLedger(c.ledger, c.card_total) if c.ledger and c.card_total else None
    needs = {int(i): Need(int(h), None if s is None else int(s)) for i, h, s in c.needs}
    if ledger is not None:
        ledger.join()

    def card(a: Arm) -> Any:
        """A lane of the map holds its arm's bytes of its GPU's card (an arm not packed here: the whole
        room) from before Soup's setup to after the teardown, which frees the allocator."""
        return ledger.held(needs.get(a.index)) if ledger is not None else contextlib.nullcontext(0)

    def measure(a: Arm, base: str, work: Path, sharding: Any = None, **options: Any) -> Row:
        """The arm through the ledger (the card taken outside Stop.arm: a Ctrl-C while it waits for the
        card stops now); one that raised OOM or that Soup refused while other lanes held bytes, where Soup
        admits it alone, is measured again holding the whole card: a neighbour's cache beyond its
        needs-free (the caching allocator reserves more than it allocates) is the lanes', not the arm's,
        and its row is the arm alone's."""
        with card(a) as beside, sharding or contextlib.nullcontext(), Stop.arm():
            row = run_arm(a, shapes[a.model], base, work, **options)
        need = needs.get(a.index)
        if (ledger is None or not beside or row.failure not in ("OOM", "REFUSED") or Stop.requested
                or (need is not None and ledger.room(1).refused_alone(need))):
            return row
        print(f"note: arm {a.index} ({a.model} {a.quant} {a.seq}x{a.batch}) {row.failure} beside "
              f"{beside / 1e9:.1f} GB of other lanes' arms: measured again holding the whole card",
              file=sys.stderr, flush=True)
        with ledger.held(None), Stop.arm():
            return run_arm(a, shapes[a.model], base, Path(f"{work}-alone"), **options)

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
        log = (Path(run.log_dir) / f"soup-{arm.stem()}.log"
               if run.log_dir else None)
        row = measure(arm, base, scratch.path("arms", f"{arm.index:03d}"), scratch.sharding(base) if first else None,
                      dry_run=run.dry_run, snapshot=run.snapshot, snapshot_dir=run.snapshot_dir,
                      log=log, verbose=run.verbose, repeat=run.children.repeat_tag, steps=arm.steps,
                      constraint=run.constraints.for_arm(run.context),
                      **({"soup_config": arm.adapter.soup_config} if arm.adapter.soup_config else {}))
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
                again.append(measure(a, quant_base(scratch, bases.get(family), a.quant, shapes[a.model].stream),
                                     scratch.path("arms", f"{a.index:03d}-margin"), snapshot=True,
                                     log=log, verbose=run.verbose, steps=run.arm.steps))
            for r in again:
                if r.attribution and r.measured and r.soup_predicted:
                    on_margin(margin_breakdown(r))
        bases.release(family)
    if ledger is not None:
        ledger.leave()


#: The row file's header of a parent of children (lanes, --gpus, --isolate): the stack is its own.
STACK_OF_PARENT = ("the parent process, which runs no arm: its children's stacks (GPU, driver, CUDA) were to be "
                   "merged into the JSON it did not write")


def stack_notes(run: MeasureRequest) -> dict[str, Any]:
    """What the stack says of the run beyond the packages: the steps, and the map's arms left out."""
    notes: dict[str, Any] = {}
    if run.arm.steps != 1:  # the protocol's one step is implied; anything else is named (the stack settled)
        notes["steps"] = run.arm.steps
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
