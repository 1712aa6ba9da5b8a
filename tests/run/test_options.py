"""issue395.run.options: the command line settled into its request, in process through main on CPU. An option
that does not apply, a bad value or a conflict is one usage line (the map's and --min-free's too); ~
is expanded in every path (issue 22, defects 6 and 8); --steps and --emulate-card reach the request; a
missing --compare file is named as --compare's.
Faked only where said: bitsandbytes' absence."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, main, one_error_line

from issue395.run import options
from issue395.run.options import settle
from issue395.run.parser import build_parser

SAVED = ROOT / "results" / "cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37" / "map-512-1024.json"


@pytest.mark.parametrize("extra, word", [
    (["--estimate", "--model", "smol", "--seq", "512"], "--estimate"),
    (["--map", "--dry-run"], "--map"), (["--gpus", "0,1"], "--gpus"), (["--seq", "1"], "--seq"),
    (["--models", "nonsense"], "--models"), (["--cap", "soup"], "--cap"), (["--snapshot"], "--snapshot"),
])
def test_from_json_refuses_every_option_that_does_not_apply(capfd, extra, word):
    one_error_line(*main(capfd, ["--from-json", SAVED, *extra]), "--from-json", word)


def test_estimate_refuses_weights(capfd):
    one_error_line(*main(capfd, ["--estimate", "--model", "smol", "--seq", "512", "--weights", "hub"]),
                   "--weights")


def test_tilde_is_expanded_in_output_paths(capfd, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    code, _, err = main(capfd, ["--from-json", SAVED, "--json=~/t.json", "--markdown", "~/t.md"])
    assert code in (0, 1), err
    assert json.loads((tmp_path / "t.json").read_text())["kind"] == "map"
    assert (tmp_path / "t.md").is_file() and not (tmp_path / "~").exists()


@pytest.mark.parametrize("mode", [["--estimate", "--model", "smol", "--seq", "512"], ["--map", "--dry-run"]])
def test_a_quant_named_twice_says_so(capfd, mode):
    one_error_line(*main(capfd, [*mode, "--quant", "nf4,nf4"]), "named twice")


def test_a_family_name_that_is_also_a_folder_here_says_which_was_used(capfd, tmp_path, monkeypatch):
    """Issue 22, defect 16: the family silently won over ./llama31-8b."""
    monkeypatch.chdir(tmp_path)
    code, out, err = main(capfd, ["--estimate", "--model", "llama31-8b", "--seq", "512"])
    assert code == 0 and "note:" not in err
    (tmp_path / "llama31-8b").mkdir()
    code, out, err = main(capfd, ["--estimate", "--model", "llama31-8b", "--seq", "512"])
    assert code == 0
    [line] = err.splitlines()
    assert line.startswith("note: --model llama31-8b: the family") and "./llama31-8b" in line


def test_every_run_but_a_configs_keeps_the_protocols_adapter():
    """--config is the one way to another LoRA r and alpha on a measured arm: the sweep, the map and
    --model run r 8, alpha 16 on their own targets, and name no soup.yaml."""
    for argv in (["--dry-run"], ["--dry-run", "--map"], ["--dry-run", "--model", "someorg/some-model", "--seq", "64"]):
        run = settle(build_parser().parse_args(argv), argv)
        assert {(a.adapter.lora_r, a.adapter.lora_alpha, a.adapter.targets, a.adapter.soup_config)
                for a in run.arms()} == {(8, 16, None, None)}, argv


def test_steps_reaches_every_arm_of_the_sweep_and_the_map():
    """Issue 50 item 2 (house5d): --steps is the run's Arm's, which every arm of the grid is at its point."""
    for argv in (["--dry-run", "--steps", "3"], ["--dry-run", "--map", "--steps", "3"]):
        run = settle(build_parser().parse_args(argv), argv)
        assert run.arm.steps == 3 and run.arms() and {a.steps for a in run.arms()} == {3}, argv


def test_emulate_card_is_settled_into_fresh_processes_and_bad_input_is_one_line(capfd):
    argv = ["--map", "--families", "mistral-7b", "--quant", "none", "--seq", "512", "--batch", "1",
            "--emulate-card", "L4", "--context", "0.5"]
    run = settle(build_parser().parse_args(argv), argv)
    assert run.isolate and run.constraints.emulate_card == "L4" and run.context == 500_000_000
    one_error_line(*main(capfd, ["--models", "smol", "--seq", "64", "--emulate-card", "3 bananas"]), "--emulate-card")
    one_error_line(*main(capfd, ["--models", "smol", "--seq", "64", "--emulate-card", "T4", "--dry-run"]),
                   "--emulate-card")
    one_error_line(*main(capfd, ["--models", "smol", "--seq", "64", "--context", "0.5"]), "--context")


def test_min_free_refuses_what_would_run_under_its_caps(capfd):
    for extra in (["--dry-run"], ["--cap", "soup"], ["--emulate-card", "T4"]):
        one_error_line(*main(capfd, ["--models", "smol", "--seq", "2048", "--min-free", *extra]), "--")


@pytest.mark.parametrize("argv, words", [
    (["--map", "--families", "smol,nope"], "unknown family 'nope'"),
    (["--map", "--families", "phi-2", "--seq", "4096"], "beyond phi-2's maximum positions (2048)"),
    (["--map", "--families", "phi-2,phi3-mini", "--seq", "8192"], "beyond every named family (the widest, phi3-mini)"),
    (["--map", "--quant", "nf8"], "--quant"),
    (["--map", "--models", "smol"], "exclusive"),
    (["--families", "smol"], "--families goes with --map"),
])
def test_bad_map_input_is_one_line_and_exit_2(capfd, argv, words):
    code, stdout, err = main(capfd, argv)
    assert code == 2 and stdout == ""
    assert len(err.strip().splitlines()) == 1 and words in err


@pytest.mark.parametrize("config, argv, words", [
    ({"model_type": "bert", "hidden_size": 64}, ["--seq", "512"], ["bert"]),
    ({"model_type": "llama", "hidden_size": 64}, ["--seq", "512"], ["intermediate_size"]),
    (None, ["--seq", "512", "--card", "lots"], ["--card"]),
    (None, ["--seq", "999999"], ["999999"]),
    (None, ["--seq", "512", "--targets", "q_proj,v_proj"], ["q_proj"]),
    (None, [], ["--seq"]),
])
def test_bad_estimate_input_is_one_line_and_exit_2(capfd, tmp_path, config, argv, words):
    if config is None:  # Phi-3: fused qkv_proj, 4096 positions
        model = "phi3-mini"
    else:
        model = tmp_path / "config.json"
        model.write_text(json.dumps(config))
    one_error_line(*main(capfd, ["--estimate", "--model", model, *argv]), *words)


@pytest.mark.parametrize("extra, word", [
    (["--cap", "soup"], "--cap"), (["--emulate-card", "T4"], "--emulate-card"), (["--min-free"], "--min-free"),
    (["--determinism", "2"], "--determinism"), (["--shard", "1/2"], "--shard"), (["--measure"], "--measure"),
    (["--lanes"], "--estimate"),
])
def test_lanes_refuses_what_needs_the_whole_card_or_makes_its_own_processes(capfd, extra, word):
    argv = (["--estimate", "--model", "smol", "--seq", "512"] if word == "--estimate"
            else ["--models", "smol", "--seq", "2048", *extra])
    one_error_line(*main(capfd, [*argv, "--lanes", "2"]), "--lanes", word)


@pytest.mark.parametrize("value", ["0", "two", "1,2"])
def test_a_lanes_count_that_is_not_one_whole_number_of_at_least_one_is_one_line(capfd, value):
    one_error_line(*main(capfd, ["--dry-run", "--models", "smol", "--seq", "64", "--lanes", value]), "--lanes")


def test_bare_lanes_is_left_to_the_host_and_a_number_is_kept():
    parse = build_parser().parse_args
    assert settle(parse(["--lanes", "--dry-run"]), []).children.lanes == 0
    assert settle(parse(["--lanes", "3", "--map", "--dry-run"]), []).children.lanes == 3
    assert settle(parse(["--dry-run"]), []).children.lanes is None


def test_a_shard_dir_soup_would_ignore_is_one_line_and_then_cache_dir_may_lie_anywhere(capfd, tmp_path):
    """Soup honours a shard cache only under $HOME, the working directory and the temp dir; a
    --shard-dir elsewhere is refused. With --shard-dir, --cache-dir holds only checkpoints, which
    Soup never resolves, so it is not held to those bounds."""
    import os
    import tempfile

    outside = "/var/lib/issue395-lanes-test"
    if any(os.path.realpath(outside).startswith(os.path.realpath(p) + os.sep)
           for p in (os.path.expanduser("~"), os.getcwd(), tempfile.gettempdir())):
        pytest.skip("no folder outside $HOME, the working directory and the temp dir here")
    parse = build_parser().parse_args
    one_error_line(*main(capfd, ["--dry-run", "--shard-dir", outside]), "--shard-dir", "~/.soup")
    run = settle(parse(["--dry-run", "--shard-dir", str(tmp_path / "shm"), "--cache-dir", outside]), [])
    assert run.shard_dir == str(tmp_path / "shm") and run.cache_dir == outside
    one_error_line(*main(capfd, ["--dry-run", "--cache-dir", outside]), "--cache-dir", "~/.soup")


def settled(*argv):
    argv = [str(a) for a in argv]
    return settle(build_parser().parse_args(argv), argv)


def test_task_is_an_axis_of_the_map_and_the_sweep_and_sft_by_default():
    assert settled("--dry-run").tasks == ("sft",)
    run = settled("--map", "--families", "llama32-1b", "--quant", "none", "--seq", "512", "--batch", "1,2",
                  "--task", "sft,kto", "--dry-run")
    assert [(a.batch, a.task) for a in run.arms()] == [(1, "sft"), (1, "kto"), (2, "sft"), (2, "kto")]
    assert {a.task for a in settled("--models", "smol", "--task", "dpo", "--dry-run").arms()} == {"dpo"}


def test_a_task_named_twice_is_one_line(capfd):
    one_error_line(*main(capfd, ["--task", "dpo,dpo"]), "--task dpo,dpo: a task is named twice")


@pytest.mark.parametrize("argv", [
    ["--task", "dpo", "--emulate-card", "T4", "--models", "smol", "--seq", "512"],
    ["--task", "kto", "--cap", "corrected", "--models", "smol", "--seq", "512", "--batch", "2"],
    ["--task", "kto", "--cap", "needs-free", "--models", "smol", "--seq", "512", "--batch", "2"],
    ["--task", "orpo", "--min-free", "--models", "smol", "--seq", "512"],
])
def test_a_task_settles_beside_a_constraint_that_runs_the_estimator(argv):
    """Those constraints hand the estimator the arm's task (tests/constraints: the number is the task's)."""
    run = settled(*argv)
    assert run.tasks == (argv[1],) and {a.task for a in run.arms()} == {argv[1]}


def test_a_task_runs_under_soups_own_cap():
    assert settled("--task", "dpo", "--cap", "soup").tasks == ("dpo",)
