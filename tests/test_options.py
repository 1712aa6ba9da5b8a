"""issue395.options: an option that does not apply is a usage error; ~ is expanded in every path
(issue 22, defects 6 and 8)."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, main, one_error_line

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


def test_steps_reaches_the_sweep_and_the_map():
    from issue395.options import build_parser, settle

    for argv in (["--dry-run", "--steps", "3"], ["--dry-run", "--map", "--steps", "3"]):
        assert settle(build_parser().parse_args(argv), argv).steps == 3, argv
