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
