"""issue395.result: saved results read back are trusted no further than they check (issue 22), and
come back with their rows in grid order; a failed positive control is a finding (its allocator
histories test_cuda's hand-built ones: no CUDA snapshot can be taken here); a refusal by Soup's gate
is no finding."""

from __future__ import annotations

import json

import pytest
from conftest import ENV, ROOT, main, make_row, one_error_line, safe_peak
from test_cuda import attributed

from issue395.cuda import positive_control
from issue395.errors import EXIT_FINDING, EXIT_OK
from issue395.result import Result

SAVED = ROOT / "results" / "cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37" / "map-512-1024.json"


def _saved(tmp_path, **change):
    data = json.loads(SAVED.read_text())
    data.update(change)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("change, words", [
    ({"tool": "someone-else"}, ["tool", "someone-else"]),
    ({"tool": None}, ["tool"]),
    ({"rows": []}, ["margins but no rows"]),
])
def test_a_result_from_elsewhere_or_without_rows_is_refused(capfd, tmp_path, change, words):
    data = json.loads(SAVED.read_text())
    assert data.get("margins"), "the fixture must carry margins"
    one_error_line(*main(capfd, ["--from-json", _saved(tmp_path, **change)]), *words)


def test_rows_saved_out_of_order_come_back_in_grid_order_with_the_repeats_last():
    rows = [make_row(index=1, seq=4096, repeat=2), make_row(index=1, seq=4096),
            make_row(index=0, repeat=1), make_row(index=0)]
    data = Result(environment={k: "x" for k in ("torch", "transformers", "trl", "peft", "soup_cli", "weights")},
                  rows=rows).to_json()
    back = Result.from_json(json.loads(json.dumps(data)))
    assert [(r.index, r.repeat) for r in back.rows] == [(0, None), (1, None), (0, 1), (1, 2)]


def test_a_failed_positive_control_is_a_finding():
    passed = positive_control(attributed(0), attributed(1))
    failed = positive_control(attributed(0), attributed(0))
    row = make_row("smol", 2048, real_peak=safe_peak(2048))
    assert Result(environment=ENV, rows=[row], control=passed).exit_code == EXIT_OK
    assert Result(environment=ENV, rows=[row], control=failed).exit_code == EXIT_FINDING


def test_a_refused_row_is_the_gate_working_not_a_finding_and_has_no_ratio():
    row = make_row(failure="REFUSED", error="a streaming step is predicted to need 240 GB", real_peak=None)
    assert row.status == "REFUSED" and row.margin_ratio is None
    assert Result(environment={}, rows=[row]).exit_code == 0
