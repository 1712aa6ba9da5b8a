"""issue395.run.checks: what --model names, said as what it is (issue 22, defect 16: a FIFO, a
device or a dangling symlink said "no such config.json")."""

from __future__ import annotations

import os

import pytest
from conftest import BASE_YAML, main, one_error_line, readme_yaml


@pytest.mark.parametrize("make, words", [
    (lambda p: os.mkfifo(p), ["a FIFO (named pipe)"]),
    (lambda p: os.symlink("/nonexistent-issue395", p), ["a symlink to nothing", "/nonexistent-issue395"]),
    (None, ["a character device"]),
])
@pytest.mark.parametrize("mode", [["--estimate"], ["--dry-run"]])
def test_a_model_that_is_no_file_is_said_as_what_it_is(capfd, tmp_path, make, words, mode):
    path = "/dev/null" if make is None else str(tmp_path / "config.json")
    if make is not None:
        make(path)
    line = one_error_line(*main(capfd, [*mode, "--model", path, "--seq", "512"]), *words)
    assert "no such" not in line

"""issue395.checks: what the command line names, checked before anything runs."""

import pytest


def test_whole_numbers_keep_their_plain_spellings():
    from issue395.run.checks import parse_ints

    assert parse_ints("--batch", " 5 , 6") == (5, 6)
    assert parse_ints("--batch", "007") == (7,)
    assert parse_ints("--gpus", "0,1", minimum=0) == (0, 1)
    assert parse_ints("--seq", "1048576", minimum=64) == (1048576,)
    assert parse_ints("--batch", "1024") == (1024,)


def test_hub_ids_and_real_paths_still_reach_the_model_loader(tmp_path):
    from issue395.run.checks import local_or_hub
    from issue395.errors import UsageError

    for hub_id in ("HuggingFaceTB/SmolLM2-135M", "Qwen/Qwen2.5-0.5B", "gpt2", "org/name.v1"):
        assert local_or_hub(hub_id) == hub_id
    cfg = tmp_path / "config.json"
    cfg.write_text("{}")
    assert local_or_hub(str(cfg)) == str(cfg) and local_or_hub(str(tmp_path)) == str(tmp_path)
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    with pytest.raises(UsageError, match="symlink"):
        local_or_hub(str(tmp_path / "dangling"))
    for bad in ("a b", "org/name/x", "-x", "a--b"):
        with pytest.raises(UsageError, match="no such file"):
            local_or_hub(bad)


def test_a_choice_list_names_a_repeat_only_when_every_name_is_known():
    """--quant's one parser (--map and --estimate both read it through it)."""
    from issue395.run.checks import distinct_choices
    from issue395.errors import UsageError

    assert distinct_choices("--quant", " nf4,none", ("none", "nf4"), "quantization") == ("nf4", "none")
    with pytest.raises(UsageError, match="^--quant nf4,nf4: a quantization is named twice$"):
        distinct_choices("--quant", "nf4,nf4", ("none", "nf4"), "quantization")
    with pytest.raises(UsageError, match="^--quant 'int8,int8': choose from none,nf4$"):
        distinct_choices("--quant", "int8,int8", ("none", "nf4"), "quantization")


@pytest.mark.parametrize("mode", [["--map", "--dry-run"], ["--estimate", "--model", "smol", "--seq", "512"]])
def test_both_modes_refuse_a_quantization_named_twice_in_one_line(capfd, mode):
    one_error_line(*main(capfd, [*mode, "--quant", "none,none"]), "--quant none,none: a quantization is named twice")


BLOCKER = '''import os, sys
BLOCK = set(os.environ["ISSUE395_TEST_BLOCK"].split(","))
class Blocker:  # stands for a venv that lacks these (a `pip install --no-deps soup-cli`)
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCK:
            raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}", name=name.split(".")[0])
sys.meta_path.insert(0, Blocker())
'''


def without(run_cli, tmp_path, modules, argv):
    """The command line in a fresh process where ``modules`` cannot be imported (a sitecustomize
    finder refuses them, as a venv without them would)."""
    import os

    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), ISSUE395_TEST_BLOCK=",".join(modules))
    return run_cli(argv, cwd=tmp_path, env=env, timeout=120)


# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


@pytest.mark.parametrize("spelling", ["same", "dot", "dotdot", "symlink", "dry-run"])
def test_json_onto_the_soup_yaml_is_one_line_and_the_file_is_kept(capfd, tmp_path, monkeypatch, spelling):
    """Issue 29 item 1: --json never overwrites the user's soup.yaml, however the path is spelled (the same
    path, ./.., ../x/.., a symlink, a --dry-run): one line naming --json and --config, and the file is kept
    byte for byte."""
    sub = tmp_path / "sub"
    sub.mkdir()
    config = readme_yaml(tmp_path)
    before = config.read_text()
    monkeypatch.chdir(sub)
    out = {"same": str(config), "dot": "./../soup.yaml", "dotdot": f"../sub/../soup.yaml",
           "symlink": "link.yaml", "dry-run": "../soup.yaml"}[spelling]
    if spelling == "symlink":
        os.symlink(config, sub / "link.yaml")
    argv = (["--dry-run"] if spelling == "dry-run" else ["--estimate"]) + ["--config", config, "--json", out]
    one_error_line(*main(capfd, argv), "--json", "--config", "overwrite")
    assert config.read_text() == before


@pytest.mark.parametrize("context, card", [("20", "T4"), ("16", "T4"), ("4.2", "RTX3050-Laptop-4GB"), ("3", "3GB")])
def test_a_context_as_large_as_the_card_is_one_line(capfd, tmp_path, context, card):
    """Issue 29 item 9: a --context that leaves a card no free memory for a step is one line naming --context
    and that card."""
    argv = ["--estimate", "--config", readme_yaml(tmp_path), "--card", f"A10G,{card}", "--context", context]
    one_error_line(*main(capfd, argv), "--context", card)


@pytest.mark.parametrize("mode", [["--estimate", "--model", "mistral-7b", "--seq", "512"], ["--map", "--dry-run"]])
def test_quant_4bit_is_told_soups_4bit_is_nf4_here(capfd, mode):
    """Issue 29 item 12: --quant 4bit is one line saying Soup's 4bit is nf4 here, in --estimate and --map
    alike."""
    one_error_line(*main(capfd, mode + ["--quant", "4bit"]), "--quant", "nf4", "Soup's 4bit")


@pytest.mark.parametrize("argv", [["--dry-run", "--models", "smol", "--seq", "64"],
                                  ["--map", "--dry-run", "--families", "smol", "--quant", "none"],
                                  ["--dry-run", "--config", "soup.yaml"],
                                  ["--models", "smol", "--seq", "64", "--isolate", "--dry-run"]])
@pytest.mark.parametrize("missing", [["torch"], ["trl", "peft"], ["datasets"]])
def test_a_run_of_arms_without_its_packages_is_one_line_naming_them_and_pip(run_cli, tmp_path, argv, missing):
    """Issue 36 item 6: a run of arms in a venv without torch, trl and peft, or datasets is one line naming
    them and pip, before any build (a fresh process)."""
    readme_yaml(tmp_path, base="HuggingFaceTB/SmolLM2-135M", seq=64)
    out = without(run_cli, tmp_path, missing, argv)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1 and out.stdout == "", (out.stdout, out.stderr)
    assert all(m in lines[0] for m in missing) and "pip install" in lines[0] and "Traceback" not in out.stderr
    assert "building" not in out.stderr


def test_plot_without_matplotlib_says_so_before_the_run(run_cli, tmp_path):
    """Issue 36 item 6: --plot without matplotlib is one line naming it and pip, before the run."""
    out = without(run_cli, tmp_path, ["matplotlib"], ["--dry-run", "--models", "smol", "--seq", "64", "--plot",
                                                      tmp_path / "p.png"])
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "matplotlib" in lines[0] and "pip install" in lines[0], out.stderr
    assert out.stdout == ""


def test_estimate_needs_none_of_them(run_cli, tmp_path):
    """Issue 36 item 6: --estimate runs without torch, transformers, trl, peft, datasets and accelerate."""
    out = without(run_cli, tmp_path, ["torch", "transformers", "trl", "peft", "datasets", "accelerate"],
                  ["--estimate", "--model", "smol", "--seq", "512", "--card", "T4"])
    assert out.returncode == 0, out.stderr
# Issue 53, item 1: --json (and --markdown, --plot) never replace a file this tool did not write.



def test_json_naming_the_bases_config_json_is_refused_and_the_next_estimate_still_runs(capfd, tmp_path):
    """The user's --json pointed at the config.json of the soup.yaml's base folder: one line, exit 2, the
    config.json byte for byte as it was, and the next --estimate answers (before, it was overwritten)."""
    import json

    from issue395.model.registry import config_json

    base = tmp_path / "base"
    base.mkdir()
    config = base / "config.json"
    config.write_text(json.dumps(config_json("qwen")))
    before = config.read_bytes()
    yaml = tmp_path / "soup.yaml"
    yaml.write_text(BASE_YAML.format(base=base))
    one_error_line(*main(capfd, ["--estimate", "--config", yaml, "--json", config]),
                   f"--json {config}", "not this tool's own output", "never replaced")
    assert config.read_bytes() == before
    code, out, err = main(capfd, ["--estimate", "--config", yaml])
    assert code == 0, err


@pytest.mark.parametrize("flag", ["--json", "--markdown", "--plot"])
def test_an_output_on_a_users_file_is_one_line_and_the_file_is_untouched(capfd, tmp_path, flag):
    """The tool's own entry script, a soup.yaml, any file it did not write: never replaced by any output
    in any mode, refused before anything runs."""
    from conftest import SCRIPT

    victim = tmp_path / ("entry.png" if flag == "--plot" else "entry.py")
    victim.write_bytes(SCRIPT.read_bytes())
    for argv in (["--estimate", "--model", "qwen", "--seq", "512"], ["--dry-run", "--models", "smol", "--seq", "64"]):
        if flag != "--json" and argv[0] == "--estimate":
            continue  # --estimate writes --json alone
        one_error_line(*main(capfd, [*argv, flag, victim]), f"{flag} {victim}", "not this tool's own output")
    assert victim.read_bytes() == SCRIPT.read_bytes()


def test_json_replaces_this_tools_own_json_and_an_empty_file(capfd, tmp_path):
    """What may be replaced: a JSON this tool wrote (a second run on the same path) and an empty file."""
    out = tmp_path / "fit.json"
    for _ in range(2):
        code, _, err = main(capfd, ["--estimate", "--model", "qwen", "--seq", "512", "--json", out])
        assert code == 0, err
    empty = tmp_path / "empty.json"
    empty.write_bytes(b"")
    code, _, err = main(capfd, ["--estimate", "--model", "qwen", "--seq", "512", "--json", empty])
    assert code == 0 and empty.read_text().startswith('{\n  "tool": "issue395_second_stack_vram"'), err


def test_an_output_spelled_as_a_folder_is_refused_not_written_beside_it(capfd, tmp_path):
    """Issue 53 item 11: --json out.json/ wrote out.json; a trailing '/' names a folder."""
    path = f"{tmp_path / 'out.json'}/"
    one_error_line(*main(capfd, ["--estimate", "--model", "qwen", "--seq", "512", "--json", path]),
                   "ends in '/'", "give a file path")
    assert list(tmp_path.iterdir()) == []


# Issue 53 items 6 and 7: --config names a file to read, said as what it is when it is not one.

@pytest.mark.parametrize("make, words", [
    (lambda p: os.mkfifo(p), ["a FIFO (named pipe)"]),
    (lambda p: os.mkdir(p), ["is a folder"]),
    (None, ["a character device"]),
    (lambda p: None, ["no such file"]),
])
@pytest.mark.parametrize("mode", [["--estimate"], ["--dry-run"], ["--find-max", "seq", "--card", "T4", "--dry-run"]])
def test_a_config_that_is_no_file_is_one_line_and_never_hangs(capfd, tmp_path, make, words, mode):
    """A FIFO as --config hung every mode (the loader opened it and waited for a writer): now it, a device,
    a folder and a missing file are each one line, exit 2, before anything is opened."""
    path = "/dev/null" if make is None else str(tmp_path / "soup.yaml")
    if make is not None:
        make(path)
    one_error_line(*main(capfd, [*mode, "--config", path]), f"--config {path}", *words)


@pytest.mark.parametrize("given", ["", " "])
def test_an_empty_config_is_said_as_empty_not_as_the_working_directory(capfd, given):
    """`--config ''` said "IsADirectoryError: ... '.'": an empty path is one line saying so."""
    line = one_error_line(*main(capfd, ["--estimate", "--config", given]), "--config: the path is empty")
    assert "IsADirectoryError" not in line and "'.'" not in line
