"""issue395.results.result: saved results read back are trusted no further than they check (issue 22), and
come back with their rows in grid order; one JSON round trip gives every row back and --from-json
prints the same tables; the exit code: 0 when every row is ok, 1 for any finding (a row's, a
repeat's, a failed positive control, a harness error), 130 when interrupted whatever else; a refusal
by Soup's gate is no finding. Rows are the harness's own constructor's with the A10G record's peaks
standing in for CUDA measurements (conftest's result); a control's allocator histories are
test_cuda's hand-built ones (no CUDA snapshot can be taken here)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import ENV, ROOT, attributed, main, make_result, make_row, one_error_line, record_row, safe_peak

from issue395.results.extras import Ran
from issue395.measure.cuda import positive_control
from issue395.errors import EXIT_FINDING, EXIT_INTERRUPTED, EXIT_OK
from issue395.results.result import Result
from issue395.report.tables import render_text

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


def test_from_json_prints_the_same_tables_after_a_round_trip(saved, result, capfd):
    back = Result.from_json(json.loads(saved.read_text()))
    assert back.rows == result.rows  # every stored field, re-read exactly
    code, out, err = main(capfd, ["--from-json", saved])
    assert out == render_text(result)
    assert err == ""
    assert code == EXIT_OK


@pytest.mark.parametrize("value", [0, float("nan"), -5], ids=["zero", "nan", "negative"])
def test_from_json_of_a_row_edited_to_an_impossible_peak_exits_2(saved, tmp_path, capfd, value):
    data = json.loads(saved.read_text())
    data["rows"][0]["real_peak"] = value
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))  # NaN is written as the bare token NaN
    code, out, err = main(capfd, ["--from-json", path])
    one_error_line(code, out, err, "--from-json", "real_peak")


def finding(row, status):
    """The same row, turned into one finding the way an arm would produce it."""
    return {"VOID": lambda: replace(row, realised_width=row.seq - 1, realised_rows=(row.seq - 1,)),
            "OOM": lambda: replace(row, real_peak=None, failure="OOM", oom_request=2**30),
            "FAILED": lambda: replace(row, real_peak=None, failure="FAILED", error="RuntimeError: x"),
            "UNDER": lambda: replace(row, real_peak=row.predicted + 1)}[status]()


def test_exit_code_zero_when_every_row_is_ok(result):
    assert result.exit_code == EXIT_OK
    dry = make_result([make_row("smol", 64, dry_run=True)], measure=None, sdpa=None)
    assert dry.rows[0].status == "dry-run" and dry.exit_code == EXIT_OK


@pytest.mark.parametrize("status", ["VOID", "OOM", "FAILED", "UNDER"])
def test_exit_code_one_for_any_finding(result, status):
    rows = list(result.rows)
    rows[3] = finding(rows[3], status)
    assert rows[3].status == status
    res = make_result(rows)
    assert res.exit_code == EXIT_FINDING
    assert Result.from_json(json.loads(json.dumps(res.to_json()))).exit_code == EXIT_FINDING


def test_exit_code_one_for_a_finding_in_a_determinism_repeat(result):
    base = record_row("smol", 4096, index=0)
    repeats = [replace(base, repeat=1, ran=Ran(pid=101)), finding(replace(base, repeat=2, ran=Ran(pid=102)), "OOM")]
    res = make_result([base] + repeats)
    assert res.exit_code == EXIT_FINDING
    assert "repeat 2 OOM" in render_text(res)
    assert make_result([base, repeats[0]]).exit_code == EXIT_OK


def test_exit_code_one_for_a_failed_control_or_a_harness_error(result):
    assert make_result(control={"passed": False}).exit_code == EXIT_FINDING
    assert make_result(control={"passed": True}).exit_code == EXIT_OK
    assert make_result(error="RuntimeError: boom").exit_code == EXIT_FINDING


def test_exit_code_130_when_interrupted_even_with_findings(result):
    assert make_result(interrupted=True).exit_code == EXIT_INTERRUPTED
    rows = list(result.rows)
    rows[0] = finding(rows[0], "VOID")
    res = make_result(rows, interrupted=True, control={"passed": False})
    assert res.exit_code == EXIT_INTERRUPTED


@pytest.mark.parametrize("kind", ["sweeps", 3, ["map"]])
def test_a_result_of_a_kind_this_tool_never_writes_is_refused_naming_it_before_its_schema(capfd, tmp_path, kind):
    """One check of the kind (Result.from_json's), and it fires before the schema's: a result of
    another kind says so, not that its version is unknown."""
    path = _saved(tmp_path, kind=kind, schema=99)
    one_error_line(*main(capfd, ["--from-json", path]), f"its kind is {kind!r}", "not sweep or map")
