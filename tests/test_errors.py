"""issue395.errors: an exception's last line, as a row and a usage error print it, and the exit codes
a shell or CI reads. Nothing is faked."""

from __future__ import annotations

import argparse
import re
import signal

import pytest
from conftest import main, one_error_line, readme_yaml

from issue395.errors import EXIT_FINDING, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError, last_line


def test_the_last_line_of_an_exception_is_its_type_and_its_last_non_blank_line():
    assert last_line(RuntimeError("loading weights\n  shard 3 of 4\nCUDA error: out of memory\n\n")) == \
        "RuntimeError: CUDA error: out of memory"
    assert last_line(UsageError("--seq 0: must be at least 1")) == "UsageError: --seq 0: must be at least 1"
    assert last_line(KeyError("q_proj")) == "KeyError: 'q_proj'"


def test_an_exception_with_no_message_is_its_type_alone():
    assert last_line(KeyboardInterrupt()) == "KeyboardInterrupt:"
    assert last_line(ValueError("   \n  ")) == "ValueError:"


def test_a_last_line_is_at_most_300_characters_cut_at_a_word_with_an_ellipsis():
    line = last_line(ValueError("x" * 1000))
    assert len(line) == 300 and line.startswith("ValueError: xxx") and line.endswith("...")
    line = last_line(ValueError("a word " * 100))
    assert len(line) <= 300 and line.endswith("...") and line[-4].isalpha() and line[:-3].split()[-1] in ("a", "word")


def test_each_exit_code_means_one_thing_and_an_interrupt_is_the_shells_sigint(capsys):
    codes = (EXIT_OK, EXIT_FINDING, EXIT_USAGE, EXIT_INTERRUPTED)
    assert len(set(codes)) == 4 and EXIT_OK == 0
    with pytest.raises(SystemExit) as bad:  # argparse's own exit for bad usage: one code for all bad input
        argparse.ArgumentParser().parse_args(["--no-such-option"])
    assert bad.value.code == EXIT_USAGE
    assert EXIT_INTERRUPTED == 128 + signal.SIGINT  # what a shell reports for a Ctrl-C'd process


# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


def test_a_long_refusal_is_cut_at_a_word_with_an_ellipsis(capfd, tmp_path):
    """Issue 36 polish: errors.cut cuts a long line at a word with an ellipsis, and Soup's long refusal is cut
    so."""
    from issue395.errors import cut

    text = "word " * 100
    short = cut(text.strip(), 52)
    assert short.endswith("...") and len(short) <= 52 and short[:-3].endswith("word"), short
    assert cut("short enough", 52) == "short enough"
    path = readme_yaml(tmp_path)
    path.write_text(path.read_text().replace("batch_size: 1", "batch_size: auto"))
    line = one_error_line(*main(capfd, ["--estimate", "--config", path]), "Soup refuses it")
    if len(line) > 300:
        assert line.endswith("...") and line[-4] != " " and re.search(r"[\w.,'=)]\.\.\.$", line), line
