"""issue395.run.parser: a value that starts with '-' is read as the value it is (issue 22, defect 16:
`--card -1GB` said "expected one argument"); an option that takes a value, given twice, is one line (issue 53,
item 3: argparse kept the last without a word). Nothing is faked."""

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
# Issue 53 item 3: an option that takes a value, given twice, is refused in one line; argparse kept the last.

@pytest.mark.parametrize("argv, words", [
    (["--estimate", "--model", "qwen", "--seq", "512", "--card", "24GB", "--card", "80GB", "--exit-code"],
     ["--card is given twice (24GB, then 80GB)", "--card 24GB,80GB"]),
    (["--estimate", "--model", "qwen", "--seq=512", "--seq", "1024"], ["--seq is given twice", "--seq 512,1024"]),
    (["--estimate", "--model", "qwen", "--model", "smol", "--seq", "512"], ["--model is given twice", "give it once"]),
    (["--estimate", "--model", "qwen", "--seq", "512", "--task", "sft", "--task=dpo"], ["--task is given twice"]),
    (["--dry-run", "--emulate-card", "T4", "--emulate-card", "L4"], ["--emulate-card is given twice (T4, then L4)"]),
    (["--estimate", "--config", "a.yaml", "--config", "b.yaml"], ["--config is given twice (a.yaml, then b.yaml)"]),
    (["--from-json", "a.json", "b.json", "--from-json", "c.json"],
     ["--from-json is given twice", "--from-json a.json b.json c.json"]),
])
def test_a_single_valued_option_given_twice_is_one_line_never_the_last_kept(capfd, argv, words):
    """`--card 24GB --card 80GB --exit-code` checked only 80GB and exited 0 (the comma form exits 1): a repeated
    option that takes a value is exit 2 and one line naming both values and the spelling that keeps both."""
    one_error_line(*main(capfd, argv), *words)


def test_a_repeated_flag_that_takes_no_value_is_harmless(capfd):
    """--verbose twice asks for the same thing twice: it is not refused."""
    code, out, err = main(capfd, ["--estimate", "--model", "qwen", "--seq", "512", "--verbose", "--verbose"])
    assert code == 0, err


def test_usage_names_the_command_the_user_typed(tmp_path):
    """Issue 53 item 11: `issue395 --help` (the console command pip installs) printed `usage:
    issue395_second_stack_vram.py`; usage now names the command typed. Run as a console script would be: a
    file named issue395 calling the entry script's main."""
    import subprocess
    import sys

    from conftest import ROOT

    command = tmp_path / "issue395"
    command.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nimport issue395_second_stack_vram as h\n"
                       "sys.exit(h.main())\n")
    done = subprocess.run([sys.executable, str(command), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: issue395 [-h]"), done.stderr
    script = subprocess.run([sys.executable, str(ROOT / "issue395_second_stack_vram.py"), "--help"],
                            capture_output=True, text=True, timeout=120)
    assert script.stdout.startswith("usage: issue395_second_stack_vram.py [-h]")
