"""issue395.run.checks: what --model names, said as what it is (issue 22, defect 16: a FIFO, a
device or a dangling symlink said "no such config.json")."""

from __future__ import annotations

import os

import pytest
from conftest import main, one_error_line


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


# Issue 53, item 1: --json (and --markdown, --plot) never replace a file this tool did not write.

FAMILY_YAML = """base: {base}
task: sft
data: {{train: data.jsonl, max_length: 512}}
training:
  batch_size: 1
  quantization: none
  stream_layers: true
  lora: {{r: 8, alpha: 16, target_modules: [q_proj, v_proj]}}
"""


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
    yaml.write_text(FAMILY_YAML.format(base=base))
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
