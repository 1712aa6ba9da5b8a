"""host/arms.py: what the arms in this process say of a run: a task's mark in an arm's file names
(``Arm.stem``), what the stack says beyond the packages (``stack_notes``: the steps, the map's arms left
out, never silently), and the harness's own cost (``run_timings``). The in-process sweep itself
(``sweep``) runs end to end in test_cli.py (a real dry run's rows, Soup's text kept off the terminal)
and test_faults.py (each fault during a sweep)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import make_row

from issue395.model.arm import Arm
from issue395.results.result import Result
from issue395.host.arms import run_timings, stack_notes
from issue395.host.measured import Children, MeasureRequest


@pytest.mark.parametrize("task, tag", [("sft", ""), ("dpo", "-dpo"), ("kto", "-kto")])
def test_a_task_other_than_sft_marks_an_arms_file_names_and_sft_keeps_the_protocols(task, tag):
    """The protocol's file names stay as they were for SFT; any other task is named in them (Arm.stem)."""
    assert Arm("smol", 512, 2, 0, task=task).stem() == f"000-smol-512-b2{tag}"
    assert Arm.at("smol+chunk512", 512, 2, 3, task=task).stem(repeat=2) == f"003-smol+chunk512-512-b2-r2{tag}"


def test_the_stack_names_steps_only_when_they_are_not_the_protocols_one():
    """The protocol's one optimizer step is implied; any other count is in the stack's notes."""
    run = MeasureRequest(models=("smol",))
    assert stack_notes(run) == {}
    assert stack_notes(dataclasses.replace(run, arm=dataclasses.replace(run.arm, steps=3))) == {"steps": 3}


def test_a_maps_arm_left_out_is_named_with_its_reason_never_skipped_silently():
    """A map arm past its model's positions is named in the stack with the reason; a sweep's stack and a
    map child's (its parent names them) say nothing of it."""
    run = MeasureRequest(models=("smol",), seqs=(9000,), map=True)
    notes = stack_notes(run)
    assert "smol at seq 9000" in notes["not_on_map"] and "maximum positions (8192)" in notes["not_on_map"]
    assert "not_on_map" not in stack_notes(dataclasses.replace(run, map=False))
    assert "not_on_map" not in stack_notes(dataclasses.replace(run, children=Children(child=True)))


def _timed(seq, setup, step, teardown):
    row = make_row("smol", seq)
    return dataclasses.replace(row, ran=dataclasses.replace(row.ran, timings={
        "setup_s": setup, "step_s": step, "teardown_s": teardown}))


def test_the_timings_sum_each_phase_and_take_the_median_overhead_per_arm():
    """The run's own cost: totals rounded, arms per minute from the wall, each phase summed over the
    rows, and the median of setup plus teardown per arm."""
    rows = [_timed(512, 1.0, 0.5, 0.25), _timed(1024, 3.0, 0.5, 1.0), _timed(2048, 2.0, 0.5, 0.5)]
    t = run_timings(rows, imports_s=4.321, total_s=30.0, build_s={"smol": 2.0}, children=[])
    assert (t["total_s"], t["imports_s"], t["arms"], t["arms_per_minute"]) == (30.0, 4.32, 3, 6.0)
    assert (t["sum_setup_s"], t["sum_step_s"], t["sum_teardown_s"]) == (6.0, 1.5, 1.75)
    assert t["median_arm_overhead_s"] == 2.5 and t["build_s"] == {"smol": 2.0}
    assert "children" not in t


def test_the_timings_of_a_run_with_no_time_or_untimed_rows_say_so_without_dividing_by_zero():
    """No wall time gives no rate (not a division by zero); rows without a setup time give no median;
    a parent's timings carry each child's."""
    child = Result(environment={}, rows=[], timings={"total_s": 5.0})
    t = run_timings([make_row("smol", 512)], imports_s=0.0, total_s=0.0, build_s={}, children=[child])
    assert t["arms_per_minute"] is None and "median_arm_overhead_s" not in t
    assert t["sum_setup_s"] == 0 and t["children"] == [{"total_s": 5.0}]
