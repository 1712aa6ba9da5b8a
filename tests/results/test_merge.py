"""issue395.results.merge: shards of one run merge into what one unsharded run would have said: rows back in
grid order with the repeats after the sweep, never two stacks or one arm twice, a finding or a failed
control from any shard kept; map parts of different families merge in the
map's order. The allocator histories behind a control are test_cuda's hand-built ones
(no CUDA snapshot can be taken here); rows are the harness's own constructor's with a peak standing in
for a measurement; merge and Result are real."""

from __future__ import annotations

import json
import random

import pytest
from conftest import ENV, attributed, make_row, safe_peak

from issue395.model.arm import Arm, predicted_bytes
from issue395.measure.cuda import positive_control
from issue395.errors import EXIT_FINDING, EXIT_INTERRUPTED, EXIT_OK, UsageError
from issue395.host.grid import plan_arms, shard_of
from issue395.results.merge import merge, thinnest
from issue395.model.registry import SHAPES
from issue395.results.result import Result
from issue395.results.row import Row


def test_merged_map_shards_keep_each_familys_thinnest_margin_as_the_live_run_does():
    margin = dict(model="m", model_key="smol", quant="none", seq=2048, batch=1, ratio=1.2, terms=[],
                  complete=True, note=None)
    parts = [Result(environment={"torch": "t"}, kind="map", margins=[dict(margin, ratio=r)],
                      rows=[make_row(index=i, real_peak=10**9, seq=2048 + 1024 * i)])
             for i, r in enumerate((1.2, 1.1))]
    assert [m["ratio"] for m in merge(parts).margins] == [1.1]


def test_a_map_and_a_sweep_never_merge():
    parts = [Result(environment={"torch": "t"}, kind=kind, rows=[make_row(index=i)])
             for i, kind in enumerate(("map", "sweep"))]
    with pytest.raises(UsageError, match="cannot merge a map with a sweep"):
        merge(parts)


def test_the_merged_stack_says_how_its_arms_ran_and_keeps_each_parts_timings():
    parts = [Result(environment={"torch": "t", "arms": "in one process"}, rows=[make_row(index=i)],
                    timings={"total_s": i}) for i in range(2)]
    assert merge(parts).environment["arms"] == "in one process"
    merged = merge(parts, "merged from 2 result(s)")
    assert merged.environment == {"torch": "t", "arms": "merged from 2 result(s)"}
    assert merged.timings == {"parts": [{"total_s": 0}, {"total_s": 1}]}


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


def test_map_parts_of_different_families_merge_into_one_map_in_the_maps_order():
    part_a = Result(environment={"torch": "t"}, kind="map",
                      rows=[make_row("qwen", 2048, index=0, real_peak=10**9)])
    part_b = Result(environment={"torch": "t"}, kind="map",
                      rows=[make_row("smol", 2048, index=0, real_peak=10**9)])
    merged = merge([part_a, part_b])
    assert [r.model_key for r in merged.rows] == ["smol", "qwen"]
    with pytest.raises(UsageError):
        merge([part_a, part_a])


def test_of_margins_from_several_shards_each_familys_thinnest_and_every_under_are_kept():
    def m(key, seq, ratio):
        return {"model_key": key, "quant": "none", "seq": seq, "batch": 1, "ratio": ratio}

    kept = thinnest([m("smol", 2048, 1.2), m("smol", 4096, 1.1), m("qwen", 2048, 0.9), m("qwen", 4096, 0.95),
                     m("qwen", 8192, 1.3)])
    assert sorted((x["model_key"], x["seq"]) for x in kept) == [("qwen", 2048), ("qwen", 4096), ("qwen", 8192),
                                                                ("smol", 4096)]
