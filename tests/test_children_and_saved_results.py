"""What a review of the redesign found: children started with a command line they refuse, a
shard folder deleted under a peer, bf16 and NF4 arms sharing Soup's shards, map rows labelled
as the record's, and saved results the renderer could not draw. Each test pins the fix. And a saved
result re-rendered end to end through --from-json: a row edited above its prediction or short of its
seq is re-judged UNDER or VOID (exit 1), and --compare lists the byte difference of the same arm.

Everything runs on CPU with the real harness functions; no Soup setup runs here. The saved result is
conftest's (the A10G record's peaks standing in for CUDA measurements).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import main, make_row, one_error_line

from issue395.results.result import Result
from issue395.host.spread import CHILD_JOB


def test_an_unreadable_job_file_is_one_line_and_exit_2(capfd, tmp_path, monkeypatch):
    bad = tmp_path / "job.json"
    bad.write_text('{"run": {}, "job": {"shard": [1]}}')
    monkeypatch.setenv(CHILD_JOB, str(bad))
    one_error_line(*main(capfd, []), "child job")


@pytest.mark.parametrize("edit", [
    lambda d: d.update(measure={"x": 1}),
    lambda d: d["rows"][0].update(logits14=None),
    lambda d: d["rows"][0].update(predicted=0),
    lambda d: d["rows"][0].update(attribution={"a": 1}),
    lambda d: d.update(kind="map", margins=[{"x": 1}]),
], ids=["measure-block", "no-logits14", "predicted-0", "attribution-block", "margins-block"])
def test_a_saved_result_the_renderer_cannot_draw_is_one_line_and_exit_2(capfd, tmp_path, edit):
    data = Result(environment={"torch": "x", "transformers": "x", "trl": "x", "peft": "x",
                                 "soup_cli": "x", "weights": "synthetic"},
                    rows=[make_row(dry_run=True)]).to_json()
    edit(data)
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(data))
    one_error_line(*main(capfd, ["--from-json", path]), "--from-json")


def test_the_retired_child_options_are_refused_like_any_unknown_option(capfd):
    for option in ("--_repeat", "--_child"):
        one_error_line(*main(capfd, [option, "--dry-run"]), option)


# ---------------------------------------------------------------------------
# What a review of the GPU-only paths found (each would have cost a GPU session)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["--measure", "--sdpa", "--snapshot"])
def test_cap_refuses_modes_that_would_run_under_the_cap(capfd, mode):
    one_error_line(*main(capfd, ["--cap", "soup", "--models", "smol", "--seq", "2048", mode]), "--cap")


def test_a_sweep_among_map_parts_is_refused_naming_that_file(capfd):
    root = Path(__file__).resolve().parents[1] / "results/margin-map-in-4-parts-h200-soup0.73.3-3238e1a-to-b3a7891"
    line = one_error_line(*main(capfd, ["--from-json", root / "map-a.json", root / "full-cold.json",
                                        root / "map-b.json"]), "full-cold.json", "a sweep among map parts")
    assert "map-b.json is" not in line


# ---------------------------------------------------------------------------
# A saved result re-rendered end to end: verdicts re-judged, two results compared
# ---------------------------------------------------------------------------


