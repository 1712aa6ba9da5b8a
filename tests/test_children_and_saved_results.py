"""What a review of the redesign found: children started with a command line they refuse, a
shard folder deleted under a peer, bf16 and NF4 arms sharing Soup's shards, map rows labelled
as the record's, and saved results the renderer could not draw. Each test pins the fix.

Everything runs on CPU with the real harness functions; no Soup setup runs here.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from conftest import SMOL, main, make_row, one_error_line

from issue395.checkpoints import quant_base, reap_dead_partials
from issue395.options import Run
from issue395.record import QUANTS, RECORD_A10G_PEAK, Arm
from issue395.result import Result, merge
from issue395.row import arm_row
from issue395.scratch import Scratch
from issue395.spread import CHILD_JOB, Job, child_cache, child_run, read_job, write_job
from issue395.tables import compare_table, sweep_table


def child_job(tmp_path, **run):
    """A child's work as its parent hands it over (a job file) and as the child reads it back."""
    job = Job((1, 2), (Arm("smol", 2048),), gpu=1, repeat=2, extra_modes=True)
    path = tmp_path / "job.json"
    write_job(path, child_run(Run(**run), job, "out.json", "/tmp/cache"), job)
    return job, read_job(str(path))


def test_a_child_of_a_model_run_gets_its_settled_run_and_job_back_as_data(tmp_path):
    job, (run, back) = child_job(tmp_path, custom_model="/some/checkpoint", models=("custom",),
                                 seqs=(64,), weights="local", isolate=True, gpus=(0, 1), measure=True)
    assert back == job
    assert (run.custom_model, run.models, run.seqs, run.weights) == ("/some/checkpoint", ("custom",), (64,),
                                                                      "local")
    assert (run.child, run.isolate, run.gpus, run.shard, run.repeat_tag) == (True, False, None, (1, 2), 2)
    assert (run.json, run.cache_dir, run.measure) == ("out.json", "/tmp/cache", True)


def test_a_map_child_inherits_the_default_quantizations_rather_than_demanding_nf4(tmp_path):
    _, (run, _) = child_job(tmp_path, map=True, models=("smol",), quants=QUANTS, batches=(1, 4))
    assert run.map and run.quants == QUANTS and run.batches == (1, 4)


def test_an_unreadable_job_file_is_one_line_and_exit_2(capfd, tmp_path, monkeypatch):
    bad = tmp_path / "job.json"
    bad.write_text('{"run": {}, "job": {"shard": [1]}}')
    monkeypatch.setenv(CHILD_JOB, str(bad))
    one_error_line(*main(capfd, []), "child job")


def test_a_map_spread_gives_children_their_own_scratch_so_each_family_can_be_freed(tmp_path):
    with Scratch() as scratch:
        assert child_cache(Run(map=True, models=("smol",)), scratch) is None
        shared = child_cache(Run(models=("smol",)), scratch)
        assert shared is not None and Path(shared).is_relative_to(scratch.root)
        assert child_cache(Run(map=True, cache_dir=str(tmp_path)), scratch) == str(tmp_path)


def test_repair_leaves_a_shard_folder_that_a_peer_is_still_writing(tmp_path):
    import torch
    from safetensors.torch import save_file
    from soup_cli.utils.layer_shard import layer_shard_path, resolve_shard_dir

    with Scratch(str(tmp_path / "cache")) as scratch:
        base = str(tmp_path / "model")
        folder = resolve_shard_dir(base)
        save_file({"w": torch.zeros(4)}, layer_shard_path(folder, 0))  # index.json comes last
        scratch.repair_shards(base)
        assert list(__import__("pathlib").Path(folder).glob("*.safetensors"))


def test_nf4_arms_get_their_own_soup_shard_folder_and_bf16_arms_keep_theirs(tmp_path):
    from soup_cli.utils.layer_shard import resolve_shard_dir

    base = tmp_path / "model"
    base.mkdir()
    with Scratch(str(tmp_path / "cache")) as scratch:
        assert quant_base(scratch, str(base), "none") == str(base)
        nf4 = quant_base(scratch, str(base), "nf4")
        assert resolve_shard_dir(nf4) != resolve_shard_dir(str(base))
        assert __import__("pathlib").Path(nf4).resolve() == base.resolve()
        assert quant_base(scratch, str(base), "nf4") == nf4  # the same alias again


def test_an_nf4_row_of_a_record_model_quotes_no_a10g_figure():
    arm = Arm("smol", 2048, 1, 0, "nf4")
    row = arm_row(arm, SMOL, realised_width=2048, realised_rows=(2048,), real_peak=10**9)
    assert row.record_peak is None and row.vs_record is None
    assert make_row(real_peak=10**9).record_peak == RECORD_A10G_PEAK[("smol", 2048)]


def test_a_sweep_row_under_by_soups_own_number_says_so_beside_its_ratio():
    peak = 1_500_000_000
    row = make_row(real_peak=peak, soup_predicted=peak - 1)
    text = sweep_table([row])
    assert "UNDER by Soup's own pre-flight" in text and row.status == "UNDER"


def test_compare_matches_the_same_quantization_only():
    bf16 = make_row(real_peak=10**9)
    nf4 = arm_row(Arm("smol", 2048, 1, 0, "nf4"), SMOL, realised_width=2048, realised_rows=(2048,),
                    real_peak=9 * 10**8)
    a = Result(environment={"arms": "a", "date": "d"}, rows=[bf16, nf4])
    text = compare_table(a, a)
    assert "2 of 2 shared arm(s) equal to the byte" in text
    lines = [line.split() for line in text.splitlines() if line.split()[:1] == ["SmolLM2-135M"]]
    assert [cells[1] for cells in lines] == ["none", "nf4"], "two arms of one seq, told apart"
    assert "quant" not in compare_table(*[Result(environment={}, rows=[bf16])] * 2)


def test_merged_map_shards_keep_each_familys_thinnest_margin_as_the_live_run_does():
    margin = dict(model="m", model_key="smol", quant="none", seq=2048, batch=1, ratio=1.2, terms=[],
                  complete=True, note=None)
    parts = [Result(environment={"torch": "t"}, kind="map", margins=[dict(margin, ratio=r)],
                      rows=[make_row(index=i, real_peak=10**9, seq=2048 + 1024 * i)])
             for i, r in enumerate((1.2, 1.1))]
    assert [m["ratio"] for m in merge(parts).margins] == [1.1]


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


def test_a_half_built_checkpoint_of_another_host_is_left_alone(tmp_path):
    other = tmp_path / ".smol-abc.partial-elsewhere-1"
    mine_dead = tmp_path / f".smol-abc.partial-{socket.gethostname()}-999999"
    for folder in (other, mine_dead):
        folder.mkdir()
    reap_dead_partials(tmp_path)
    assert other.exists() and not mine_dead.exists()


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


def test_a_capped_map_child_shares_the_cache_and_a_lost_capped_arm_stays_in_the_cap_table():
    from issue395.spread import lost_row

    with Scratch() as scratch:
        assert child_cache(Run(map=True, models=("smol",), cap="soup"), scratch) is not None
    row = lost_row(Arm("smol", 2048), Run(cap="soup"), None, 139)
    assert row.cap_at == "soup" and row.status == "FAILED"


def test_an_attribution_that_cannot_name_classes_never_costs_the_measurement(monkeypatch):
    from issue395 import anatomy

    def broken(*a, **kw):
        raise TypeError("an estimator signature this tool cannot read")

    assert anatomy.classifier_for("smol", quant="none", seq=2048, batch=1) is not None
    assert anatomy.classifier_for("custom", quant="none", seq=2048, batch=1) is None
    monkeypatch.setattr(anatomy, "physical_classifier", broken)
    assert anatomy.classifier_for("smol", quant="none", seq=2048, batch=1) is None


def test_a_margin_of_a_release_the_estimator_does_not_know_is_left_out_of_the_anatomy():
    from issue395.anatomy import margin_anatomy

    m = {"model": "x", "model_key": "custom", "quant": "none", "seq": 64, "batch": 1, "physical": {"the rest": 1}}
    assert margin_anatomy([m], "9.9.9") == ""


def test_a_sweep_among_map_parts_is_refused_naming_that_file(capfd):
    root = Path(__file__).resolve().parents[1] / "results/margin-map-in-4-parts-h200-soup0.73.3-3238e1a-to-b3a7891"
    line = one_error_line(*main(capfd, ["--from-json", root / "map-a.json", root / "full-cold.json",
                                        root / "map-b.json"]), "full-cold.json", "a sweep among map parts")
    assert "map-b.json is" not in line
