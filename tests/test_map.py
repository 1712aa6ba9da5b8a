"""Tests still to move to the file of the module each pins (issue 21): the record's two models as
the map's shapes (test_registry), an NF4 arm without bitsandbytes and a refusal by Soup's gate
judged into a result (test_measurement, test_result), map parts merged (test_merge), the heatmap
(test_outputs); each builds a Result or reads SHAPES. The real Soup setup runs on CPU through
--dry-run; rows are built by the harness's own constructor with a peak standing in for a CUDA
measurement.
"""

from __future__ import annotations

import pytest
from conftest import SMOL, h, make_row

from issue395 import measurement
from issue395.errors import UsageError
from issue395.outputs import render_plot
from issue395.arm import Arm
from issue395.merge import merge
from issue395.registry import SHAPES
from issue395.result import Result
from issue395.shapes import family_shape


def test_the_record_models_in_the_map_are_the_records_shapes():
    assert family_shape("smol") is SHAPES["smol"] and family_shape("qwen") is SHAPES["qwen"]


def test_without_bitsandbytes_an_nf4_arm_is_a_skipped_row_with_its_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(measurement, "bitsandbytes_present", lambda: False)
    row = h.protocol().run_arm(Arm("smol", 64, 1, 0, "nf4"), SMOL, "unused", tmp_path, dry_run=True)
    assert row.status == "SKIPPED" and "bitsandbytes" in row.error
    assert Result(environment={}, rows=[row]).exit_code == 0


def test_a_refused_row_is_the_gate_working_not_a_finding_and_has_no_ratio():
    row = make_row(failure="REFUSED", error="a streaming step is predicted to need 240 GB", real_peak=None)
    assert row.status == "REFUSED" and row.margin_ratio is None
    assert Result(environment={}, rows=[row]).exit_code == 0


def test_map_parts_of_different_families_merge_into_one_map_in_the_maps_order():
    part_a = Result(environment={"torch": "t"}, kind="map",
                      rows=[make_row("qwen", 2048, index=0, real_peak=10**9)])
    part_b = Result(environment={"torch": "t"}, kind="map",
                      rows=[make_row("smol", 2048, index=0, real_peak=10**9)])
    merged = merge([part_a, part_b])
    assert [r.model_key for r in merged.rows] == ["smol", "qwen"]
    with pytest.raises(UsageError):
        merge([part_a, part_a])


def test_the_map_heatmap_is_a_png():
    rows = [make_row(k, q, index=i, real_peak=10**9) for i, (k, q) in enumerate([("smol", 2048), ("qwen", 4096)])]
    png = render_plot(Result(environment={"gpu": "test"}, kind="map", rows=rows))
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
