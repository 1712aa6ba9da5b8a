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
