"""issue395.merge: shards of one run merge into what one unsharded run would have said."""

from __future__ import annotations

import pytest
from conftest import make_row

from issue395.errors import UsageError
from issue395.merge import merge
from issue395.result import Result


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
