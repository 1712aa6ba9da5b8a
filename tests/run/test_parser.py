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
