"""issue395.run.parser: a value that starts with '-' is read as the value it is (issue 22, defect 16:
`--card -1GB` said "expected one argument")."""

from __future__ import annotations

import pytest
from conftest import main, one_error_line

from issue395.run.parser import build_parser


@pytest.mark.parametrize("argv, words", [
    (["--estimate", "--model", "llama31-8b", "--seq", "512", "--card", "-1GB"], ["--card '-1GB'", "positive"]),
    (["--estimate", "--model", "llama31-8b", "--seq", "-64"], ["--seq -64 must be at least 64"]),
])
def test_a_value_that_starts_with_a_minus_is_read_and_refused_by_its_own_check(capfd, argv, words):
    one_error_line(*main(capfd, argv), *words)


def test_an_option_where_a_value_should_be_is_still_a_missing_value():
    p = build_parser()
    for argv in (["--seq", "--card", "24GB"], ["--seq"], ["--card", "--json", "x"]):
        with pytest.raises(Exception, match="expected one argument"):
            p.parse_args(argv)
    assert p.parse_args(["--card", "-1GB", "--seq", "64"]).card == "-1GB"


# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


def test_the_rule_is_in_help():
    """Issue 36 item 2: --help states --exit-code's rule: Soup's gate, and exit 3."""
    from issue395.run.parser import build_parser

    flat = " ".join(build_parser().format_help().split())
    assert "--exit-code" in flat and "Soup's gate" in flat[flat.index("--exit-code"):] and " 3 " in flat, flat


@pytest.mark.parametrize("typed, meant", [("--estimat", "--estimate"), ("--sek", "--seq"), ("--famlies", "--families"),
                                          ("--exitcode", "--exit-code"), ("--dryrun", "--dry-run")])
def test_an_unknown_or_abbreviated_flag_is_refused_with_the_flag_meant(capfd, typed, meant):
    """Issue 36 polish: the parser takes no abbreviation: an unknown or abbreviated flag is one line with the
    flag meant."""
    argv = [typed, "512"] if typed in ("--sek",) else ["--estimate", "--model", "smol", "--seq", "512", typed]
    if typed == "--estimat":
        argv = ["--estimat", "--model", "smol", "--seq", "512"]
    if typed == "--famlies":
        argv = ["--map", "--famlies", "smol", "--dry-run"]
    line = one_error_line(*main(capfd, argv), typed, f"did you mean {meant}?")
    assert line.count(typed) >= 1
