"""issue395.run.runner: what the command line meets outside its own checks. A stdout that cannot be written
(issue 53 item 5: `> /dev/full` was a traceback) is one line on stderr and exit 2, in a fresh process as a
terminal runs it. Nothing is faked."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import SCRIPT

from issue395.errors import EXIT_USAGE


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["--estimate", "--model", "qwen", "--seq", "512", "--card", "T4", "--verbose"],
                                  ["--estimate", "--model", "qwen", "--seq", "512"], ["--card", "list"], ["--help"]])
def test_a_stdout_that_cannot_be_written_is_one_line_and_exit_2_never_a_traceback(argv):
    """Long text (past the buffer: the print itself fails) and short text (the flush at exit fails) alike."""
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, str(SCRIPT), *argv], stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == EXIT_USAGE, done.stderr
    assert lines == [lines[0]] and lines[0].startswith("error: stdout cannot be written (no space left on device)")
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
