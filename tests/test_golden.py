"""Every committed output is pinned as readable text under tests/golden/ (see tests/golden.py):
each result's rendered text and markdown, what re-saving its JSON changes, its exit code, stderr
and plot digest, ``--help``, and each bad command line's exit code and one line. A mismatch
shows the lines that moved as a unified diff. A deliberate change re-records the files
(``python tests/golden.py --record``) in the same commit, so the review reads the new numbers."""

from __future__ import annotations

import difflib

import pytest
from golden import GOLDEN, ROOT, outputs, recorded, saved_results

#: Lines of diff shown per file, so one broken renderer does not bury the rest.
SHOWN = 60


@pytest.fixture(scope="module")
def now() -> dict[str, str]:
    return outputs(ROOT / "issue395_second_stack_vram.py")


def moved(name: str, was: str | None, now: str | None) -> str:
    lines = list(difflib.unified_diff((was or "").splitlines(True), (now or "").splitlines(True),
                                      f"tests/golden/{name} (recorded)", f"{name} (now)", n=1))
    more = f"... {len(lines) - SHOWN} more diff lines\n" if len(lines) > SHOWN else ""
    return "".join(lines[:SHOWN]) + more


@pytest.mark.slow
def test_every_output_renders_as_its_golden_file(now):
    was = recorded()
    changed = sorted(k for k in was.keys() | now.keys() if was.get(k) != now.get(k))
    assert not changed, (f"{len(changed)} golden file(s) differ; re-record with "
                         "`python tests/golden.py --record` if deliberate\n"
                         + "".join(moved(k, was.get(k), now.get(k)) for k in changed))


@pytest.mark.slow
def test_every_committed_result_has_its_golden_text(now):
    """A result added under results/ without recording its golden files fails here by name."""
    missing = [str(p.relative_to(ROOT)) for p in saved_results()
               if not (GOLDEN / p.relative_to(ROOT).with_suffix(".txt")).is_file()]
    assert not missing, missing


def test_a_changed_number_reads_as_that_line_in_the_diff():
    """The failure message is a diff of lines, not of digests (checked without the slow render)."""
    shown = moved("x.txt", "seq 2048  peak 1.3912\nseq 4096  peak 2.6743\n",
                  "seq 2048  peak 1.3912\nseq 4096  peak 2.6999\n")
    assert "-seq 4096  peak 2.6743\n+seq 4096  peak 2.6999\n" in shown and "2048" in shown
