"""Results of shards merged into one, and a failed positive control as a result's finding: tests of
issue395.merge and issue395.result still to move to test_merge and test_result (issue 21). The
allocator histories are hand-built (test_cuda's; no CUDA snapshot can be taken here), the rows are
the harness's own constructor's with a peak standing in for a measurement; merge and Result are real.
"""

from __future__ import annotations

import json
import random

import pytest
from conftest import make_row, safe_peak
from test_cuda import attributed

from issue395.cuda import positive_control
from issue395.errors import EXIT_FINDING, EXIT_INTERRUPTED, EXIT_OK, UsageError
from issue395.grid import plan_arms, shard_of
from issue395.arm import Arm, predicted_bytes
from issue395.registry import SHAPES
from issue395.merge import merge
from issue395.result import Result
from issue395.row import Row


def test_a_failed_positive_control_is_a_finding():
    passed = positive_control(attributed(0), attributed(1))
    failed = positive_control(attributed(0), attributed(0))
    row = make_row("smol", 2048, real_peak=safe_peak(2048))
    assert Result(environment=ENV, rows=[row], control=passed).exit_code == EXIT_OK
    assert Result(environment=ENV, rows=[row], control=failed).exit_code == EXIT_FINDING


ENV = {"gpu": "NVIDIA H200", "driver": "570.1", "cuda": "13.0", "torch": "2.13.0+cu130",
       "transformers": "5.16.1", "trl": "0.29.1", "peft": "0.20.0", "soup_cli": "0.73.3",
       "python": "3.11.9", "weights": "synthetic", "dry_run": False, "arms": "shard 1/3 in one process",
       "cuda_visible_devices": "0", "date": "2025-01-01T00:00:00+00:00", "command": "x --shard 1/3"}


def grid():
    return plan_arms(["smol", "qwen"], None, [1])


def measured_row(arm: Arm, repeat=None) -> Row:
    return make_row(arm.model, arm.seq, arm.batch, arm.index, repeat=repeat,
                    real_peak=safe_peak(arm.seq, SHAPES[arm.model]))


def shard_result(k: int, n: int, **env) -> Result:
    """One shard's saved result, read back as --from-json reads it."""
    arms = shard_of(grid(), (k, n))
    res = Result(environment=dict(ENV, **env), rows=[measured_row(a) for a in arms])
    return Result.from_json(json.loads(json.dumps(res.to_json())))


def test_merge_puts_rows_from_shards_back_in_grid_order():
    parts = [shard_result(k, 3, cuda_visible_devices=str(k), date=f"2025-01-0{k}",
                          arms=f"shard {k}/3", command=f"x --shard {k}/3") for k in (1, 2, 3)]
    random.Random(395).shuffle(parts)
    merged = merge(parts, "merged from 3 result(s)")
    assert [r.index for r in merged.rows] == list(range(10))
    assert merged.rows == [measured_row(a) for a in grid()]
    assert merged.environment["arms"] == "merged from 3 result(s)"
    assert merged.exit_code == EXIT_OK


def test_merge_orders_repeats_after_the_sweep_by_arm_then_repeat():
    arms = grid()
    sweep = Result(environment=ENV, rows=[measured_row(a) for a in arms[:3]])
    reps = [Result(environment=ENV, rows=[measured_row(arms[i], repeat=r)])
            for i, r in ((2, 2), (1, 1), (2, 1), (1, 2))]
    merged = merge(reps + [sweep])
    assert [(r.index, r.repeat) for r in merged.rows] == [
        (0, None), (1, None), (2, None), (1, 1), (1, 2), (2, 1), (2, 2)]


def test_merge_refuses_overlapping_shards():
    with pytest.raises(UsageError, match="same arm"):
        merge([shard_result(1, 2), shard_result(1, 3)])  # arm 0 (and 6) in both


@pytest.mark.parametrize("key,other", [("torch", "2.12.0+cu128"), ("soup_cli", "0.77.0"),
                                       ("dry_run", True), ("gpu", "NVIDIA A10G"),
                                       ("weights", "hub"), ("transformers", "5.0.0")])
def test_merge_refuses_two_different_stacks(key, other):
    with pytest.raises(UsageError, match=key):
        merge([shard_result(1, 2), shard_result(2, 2, **{key: other})])


def test_merge_keeps_a_finding_from_any_shard():
    arms = grid()
    under = make_row(arms[3].model, arms[3].seq, index=3,
                     real_peak=predicted_bytes(SHAPES[arms[3].model], arms[3].seq) + 1)
    ok = Result(environment=ENV, rows=[measured_row(arms[0])],
                  control=positive_control(attributed(0), attributed(1)))
    bad = Result(environment=ENV, rows=[under],
                   control=positive_control(attributed(0), attributed(0)))
    merged = merge([ok, bad])
    assert [r.status for r in merged.rows] == ["ok", "UNDER"]
    assert merged.control["passed"] is False  # a failed control is never hidden by a passed one
    assert merged.exit_code == EXIT_FINDING
    stopped = Result(environment=ENV, rows=[measured_row(arms[1])], interrupted=True)
    assert merge([ok, stopped]).exit_code == EXIT_INTERRUPTED
