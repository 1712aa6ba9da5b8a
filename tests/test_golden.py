"""Every committed output is pinned as readable text under tests/golden/ (see tests/golden.py):
each result's rendered text and markdown, what re-saving its JSON changes, its exit code, stderr
and plot digest, ``--help``, and each bad command line's exit code and one line. A mismatch
shows the lines that moved as a unified diff. A deliberate change re-records the files
(``python tests/golden.py --record``) in the same commit, so the review reads the new numbers."""

from __future__ import annotations

import difflib

import pytest
from golden import GOLDEN, ROOT, golden_names, outputs, recorded, saved_results

#: Lines of diff shown per file, so one broken renderer does not bury the rest.
SHOWN = 60


#: The render is spread over this many slices of the results, so parallel workers (pytest -n) share it.
PARTS = 4


def moved(name: str, was: str | None, now: str | None) -> str:
    lines = list(difflib.unified_diff((was or "").splitlines(True), (now or "").splitlines(True),
                                      f"tests/golden/{name} (recorded)", f"{name} (now)", n=1))
    more = f"... {len(lines) - SHOWN} more diff lines\n" if len(lines) > SHOWN else ""
    return "".join(lines[:SHOWN]) + more


def status_lines(text: str, results: list) -> str:
    """The lines of results.status that are these results' (each line starts with its result's path)."""
    mine = {str(p.relative_to(ROOT)) for p in results}
    return "".join(line for line in text.splitlines(True) if line.split("  ", 1)[0] in mine)


@pytest.mark.slow
@pytest.mark.parametrize("part", range(PARTS), ids=[f"slice-{i + 1}-of-{PARTS}" for i in range(PARTS)])
def test_every_output_renders_as_its_golden_file(part):
    """Every output of this slice of the committed results (its text, markdown, re-saved JSON's diff and its
    line of results.status; --help and the bad command lines in the first) is its golden file, to the byte."""
    now = outputs(ROOT / "issue395_second_stack_vram.py", (part, PARTS))
    was = recorded()
    mine = saved_results()[part::PARTS]
    now["results.status"] = status_lines(now["results.status"], mine)
    was = {k: (status_lines(was[k], mine) if k == "results.status" else was.get(k)) for k in now}
    changed = sorted(k for k in now if was.get(k) != now.get(k))
    assert not changed, (f"{len(changed)} golden file(s) differ; re-record with "
                         "`python tests/golden.py --record` if deliberate\n"
                         + "".join(moved(k, was.get(k), now.get(k)) for k in changed))


def test_the_golden_files_are_exactly_the_ones_the_outputs_make():
    """No golden file is missing and none is left over from a result or an output that is gone, and
    results.status has one line per committed result, in order (the slices above each check their own)."""
    was = recorded()
    assert set(was) == golden_names(), (sorted(golden_names() - set(was))[:10], sorted(set(was) - golden_names())[:10])
    paths = [line.split("  ", 1)[0] for line in was["results.status"].splitlines()]
    assert paths == [str(p.relative_to(ROOT)) for p in saved_results()]


def test_every_committed_result_has_its_golden_text():
    """A result added under results/ without recording its golden files fails here by name."""
    missing = [str(p.relative_to(ROOT)) for p in saved_results()
               if not (GOLDEN / p.relative_to(ROOT).with_suffix(".txt")).is_file()]
    assert not missing, missing


def test_a_changed_number_reads_as_that_line_in_the_diff():
    """The failure message is a diff of lines, not of digests (checked without the slow render)."""
    shown = moved("x.txt", "seq 2048  peak 1.3912\nseq 4096  peak 2.6743\n",
                  "seq 2048  peak 1.3912\nseq 4096  peak 2.6999\n")
    assert "-seq 4096  peak 2.6743\n+seq 4096  peak 2.6999\n" in shown and "2048" in shown
