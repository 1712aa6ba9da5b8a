"""issue395.result: saved results read back are trusted no further than they check (issue 22)."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, main, one_error_line
from conftest import make_row
from issue395.merge import merge
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


def test_a_row_file_is_named_for_what_it_is(capfd, tmp_path):
    path = tmp_path / "x.json.rows.jsonl"
    rows = json.loads(SAVED.read_text())["rows"][:2]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    one_error_line(*main(capfd, ["--from-json", path]), "row file", "no environment")


def test_an_estimate_json_is_named_for_what_it_is(capfd, tmp_path):
    est = tmp_path / "est.json"
    assert main(capfd, ["--estimate", "--model", "smol", "--seq", "512", "--json", est])[0] == 0
    one_error_line(*main(capfd, ["--from-json", est]), "--estimate result", "measured results")


def test_merged_map_shards_keep_each_familys_thinnest_margin_as_the_live_run_does():
    margin = dict(model="m", model_key="smol", quant="none", seq=2048, batch=1, ratio=1.2, terms=[],
                  complete=True, note=None)
    parts = [Result(environment={"torch": "t"}, kind="map", margins=[dict(margin, ratio=r)],
                      rows=[make_row(index=i, real_peak=10**9, seq=2048 + 1024 * i)])
             for i, r in enumerate((1.2, 1.1))]
    assert [m["ratio"] for m in merge(parts).margins] == [1.1]
