"""What a review of the redesign found: children started with a command line they refuse, a
shard folder deleted under a peer, bf16 and NF4 arms sharing Soup's shards, map rows labelled
as the record's, and saved results the renderer could not draw. Each test pins the fix. And a saved
result re-rendered end to end through --from-json: a row edited above its prediction or short of its
seq is re-judged UNDER or VOID (exit 1), and --compare lists the byte difference of the same arm.

Everything runs on CPU with the real harness functions; no Soup setup runs here. The saved result is
conftest's (the A10G record's peaks standing in for CUDA measurements).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from conftest import main, make_row, one_error_line, table_lines

from issue395.errors import EXIT_FINDING, EXIT_OK
from issue395.results.result import Result
from issue395.run.spread import CHILD_JOB


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
    from issue395.run import measure_mode

    child = Result(environment=json.loads((ROOT_RESULT).read_text())["environment"],
                   rows=[make_row("smol", 64, index=0, real_peak=None, dry_run=True)])

    def one_child(run, arms, scratch, on_row, script):
        on_row(child.rows[0])
        return [child]

    monkeypatch.setattr(measure_mode, "spread", one_child)
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


# ---------------------------------------------------------------------------
# A saved result re-rendered end to end: verdicts re-judged, two results compared
# ---------------------------------------------------------------------------


def test_from_json_rejudges_an_edited_row_under_and_void(saved, tmp_path, capfd):
    """The saved verdicts ("derived") are never read back: a row edited above its prediction
    re-renders UNDER, one edited to a realised width of 1000 re-renders VOID; exit 1."""
    data = json.loads(saved.read_text())
    assert data["rows"][0]["derived"]["status"] == "ok"
    under = copy.deepcopy(data)
    under["rows"][0]["real_peak"] = under["rows"][0]["predicted"] + 1
    void = copy.deepcopy(data)
    void["rows"][1]["realised_width"] = 1000
    (tmp_path / "under.json").write_text(json.dumps(under))
    (tmp_path / "void.json").write_text(json.dumps(void))

    code, out, err = main(capfd, ["--from-json", tmp_path / "under.json"])
    assert code == EXIT_FINDING, err
    line = table_lines(out, "SmolLM2-135M")[0]
    assert line.split()[0] == "2048" and line.split()[-1] == "UNDER"
    assert line.split()[5] == "1.000x"  # predicted / (predicted + 1), rounded

    code, out, err = main(capfd, ["--from-json", tmp_path / "void.json"])
    assert code == EXIT_FINDING, err
    line = table_lines(out, "SmolLM2-135M")[1]
    assert line.split()[:2] == ["3072", "1000"] and line.split()[-1] == "VOID"
    assert line.split()[5] == "VOID"
    assert "VOID - realised [3072] (width 1000) != requested 3072" in out


def test_from_json_compare_lists_the_byte_difference_of_the_same_arm(saved, tmp_path, capfd):
    other = json.loads(saved.read_text())
    other["environment"]["arms"] = "isolated, one fresh process per arm"
    other["rows"][0]["real_peak"] += 1_000_000
    other_path = tmp_path / "other.json"
    other_path.write_text(json.dumps(other))
    code, out, err = main(capfd, ["--from-json", saved, "--compare", other_path])
    assert code == EXIT_OK, err
    assert "compare: A = in one process" in out
    assert "B = isolated, one fresh process per arm" in out
    line = next(x for x in out.splitlines() if x.split()[:2] == ["SmolLM2-135M", "2048"])
    assert line.split()[5] == "1000000"
    assert "9 of 10 shared arm(s) equal to the byte" in out
