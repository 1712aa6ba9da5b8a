"""--min-free's driver: per arm, a control (no cap) for its allocated peak, then a bisection over
caps (issue395.constraints.minfree), each probe the same arm in a fresh capped child process (the --cap path:
expandable segments, as `soup train` sets them). The arm's row is the control's, with the lowest
cap that completed, the highest that raised OOM, the resolution and every probe."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from ..model.arm import Arm
from ..results.result import Result
from ..results.extras import MinFreeFound
from ..results.row import Row
from ..constraints.emulation import arm_config, tool_needs_free
from ..constraints.minfree import bisect_min_free
from ..constraints.asked import Constraints
from ..measure.console import Stop
from .measured import MeasureRequest
from .scratch import Scratch
from .spread import spread

#: No cap above this many times the control's reserved memory is worth a probe.
CEILING_OVER_RESERVED = 4


class _ProbeStopped(Exception):
    """A probe's child ended with no row: a stop (Ctrl-C, a time limit's SIGINT) reached it first."""


def min_free_arms(run: MeasureRequest, arms: list[Arm], scratch: Scratch, on_row: Callable[[Row], None],
                  script: str, spread_one: Optional[Callable] = None) -> list[Result]:
    """Each arm's row with its min-free; a control that did not complete is the row as it is."""
    results: list[Result] = []
    spread_one = spread_one or spread

    def probe(arm: Arm, cap: str) -> Row:
        got: list[Row] = []
        # Every probe of an arm is the same arm: its rows are the bisection's steps, which the arm's
        # own row keeps (min_free_probes), so a probe's result hands on its stack and errors, not
        # its row (merged with their rows, the probes read as overlapping shards and were refused).
        results.extend(replace(r, rows=[]) for r in spread_one(
            replace(run, constraints=Constraints(cap=cap), isolate=True), [arm], scratch, got.append, script))
        if not got:
            raise _ProbeStopped
        return got[-1]

    for arm in arms:
        if Stop.requested:
            break
        try:
            control = probe(arm, "off")
        except _ProbeStopped:  # nothing of this arm was measured: no row to keep
            Stop.requested = True
            break
        if not control.measured:
            on_row(replace(control, constraint=None))
            continue
        # the adapter the control ran with (a family's targets, a --config file's targets and r)
        needs = tool_needs_free(arm_config(arm.model, control.ran.base), None, replace(
            arm, adapter=replace(arm.adapter, targets=tuple(control.targets) or None, lora_r=control.rank)))
        peak = control.real_peak
        try:
            found = bisect_min_free(lambda cap: probe(arm, f"bytes:{cap}").measured, peak=peak,
                                    start=needs or peak + peak // 10,
                                    ceiling=CEILING_OVER_RESERVED * max(control.reserved or peak, peak))
        except _ProbeStopped:  # the control was measured: its row stays, with no min-free claimed
            Stop.requested = True
            on_row(replace(control, constraint=None))
            break
        on_row(replace(control, constraint=MinFreeFound(found.completes, found.fails, found.resolution,
                                                        tuple((c, ok) for c, ok in found.probes), needs)))
    return results
