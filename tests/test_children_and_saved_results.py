"""What a review of the redesign found: children started with a command line they refuse, a
shard folder deleted under a peer, bf16 and NF4 arms sharing Soup's shards, map rows labelled
as the record's, and saved results the renderer could not draw. Each test pins the fix.

Everything runs on CPU with the real harness functions; no Soup setup runs here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import main, make_row, one_error_line

from issue395.result import Result
from issue395.spread import CHILD_JOB


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


def test_a_parent_of_children_with_steps_keeps_the_childrens_stack_and_writes_its_json(
        capfd, tmp_path, monkeypatch):
    """--isolate --steps 2: the parent has no stack of its own; naming the steps must not stand in
    for the children's (it did: the render raised KeyError 'torch' and no JSON was written). The
    children are stood in for by one saved child result (no process is started here)."""
    from issue395 import runner

    child = Result(environment=json.loads((ROOT_RESULT).read_text())["environment"],
                   rows=[make_row("smol", 64, index=0, real_peak=None, dry_run=True)])

    def one_child(run, arms, scratch, on_row, script):
        on_row(child.rows[0])
        return [child]

    monkeypatch.setattr(runner, "spread", one_child)
    out = tmp_path / "o.json"
    code, stdout, err = main(capfd, ["--dry-run", "--isolate", "--steps", "2", "--models", "smol", "--seq", "64",
                                     "--json", out])
    assert "Traceback" not in err and code == 0, err
    env = json.loads(out.read_text())["environment"]
    assert env["steps"] == 2 and env["torch"] == child.environment["torch"]
    assert "2 optimizer steps per arm" in stdout.splitlines()[0]


ROOT_RESULT = Path(__file__).resolve().parents[1] / "results/split-check-h200x2-soup0.73.3-b5bee37/full-cold.json"


@pytest.mark.parametrize("mode", ["--measure", "--sdpa", "--snapshot"])
def test_cap_refuses_modes_that_would_run_under_the_cap(capfd, mode):
    one_error_line(*main(capfd, ["--cap", "soup", "--models", "smol", "--seq", "2048", mode]), "--cap")


def test_a_sweep_among_map_parts_is_refused_naming_that_file(capfd):
    root = Path(__file__).resolve().parents[1] / "results/margin-map-in-4-parts-h200-soup0.73.3-3238e1a-to-b3a7891"
    line = one_error_line(*main(capfd, ["--from-json", root / "map-a.json", root / "full-cold.json",
                                        root / "map-b.json"]), "full-cold.json", "a sweep among map parts")
    assert "map-b.json is" not in line
