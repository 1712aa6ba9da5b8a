"""issue395.checks: what --model names, said as what it is (issue 22, defect 16: a FIFO, a
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
    from issue395.checks import parse_ints

    assert parse_ints("--batch", " 5 , 6") == (5, 6)
    assert parse_ints("--batch", "007") == (7,)
    assert parse_ints("--gpus", "0,1", minimum=0) == (0, 1)
    assert parse_ints("--seq", "1048576", minimum=64) == (1048576,)
    assert parse_ints("--batch", "1024") == (1024,)


def test_hub_ids_and_real_paths_still_reach_the_model_loader(tmp_path):
    from issue395.checks import local_or_hub
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
