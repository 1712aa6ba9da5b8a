"""issue395.result: saved results read back are trusted no further than they check (issue 22), and
come back with their rows in grid order."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, main, make_row, one_error_line

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


@pytest.mark.parametrize("kind", ["sweeps", 3, ["map"]])
def test_a_result_of_a_kind_this_tool_never_writes_is_refused_naming_it_before_its_schema(capfd, tmp_path, kind):
    """One check of the kind (Result.from_json's), and it fires before the schema's: a result of
    another kind says so, not that its version is unknown."""
    path = _saved(tmp_path, kind=kind, schema=99)
    one_error_line(*main(capfd, ["--from-json", path]), f"its kind is {kind!r}", "not sweep or map")
