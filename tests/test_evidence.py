"""docs/PEAK.md is the evidence the code cites: a comment or docstring states what a term charges
and why, and cites the measurements behind it in one line, ``Evidence: docs/PEAK.md, "<section>".``
Each cite must name a section that is there, and each section of PEAK.md's "By term and constant"
part must be cited by the code (evidence nothing cites is evidence of nothing)."""

from __future__ import annotations

import re

from conftest import ROOT, SCRIPT

CITE = re.compile(r'Evidence: docs/PEAK\.md, "([^"]+)"\.')
BY_TERM = "# By term and constant"


def _cites() -> dict[str, list[str]]:
    """Each section cited, and where (path:line)."""
    found: dict[str, list[str]] = {}
    for path in sorted([*(ROOT / "issue395").rglob("*.py"), SCRIPT]):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for section in CITE.findall(line):
                found.setdefault(section, []).append(f"{path.relative_to(ROOT)}:{n}")
    return found


def _sections() -> tuple[set[str], set[str]]:
    """PEAK.md's "## " sections: all of them, and those of its "By term and constant" part."""
    every, by_term, inside = set(), set(), False
    for line in (ROOT / "docs" / "PEAK.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            inside = line == BY_TERM
        elif line.startswith("## "):
            every.add(line[3:].strip())
            if inside:
                by_term.add(line[3:].strip())
    return every, by_term


def test_every_cite_names_a_section_of_peak_md():
    every, _ = _sections()
    cites = _cites()
    assert cites, "no cite found: the pattern no longer matches the code's cites"
    missing = {s: where for s, where in cites.items() if s not in every}
    assert not missing, f"cited sections not in docs/PEAK.md: {missing}"


def test_every_term_and_constant_section_is_cited():
    _, by_term = _sections()
    assert by_term, f"docs/PEAK.md has no {BY_TERM!r} part"
    orphans = sorted(by_term - set(_cites()))
    assert not orphans, f"sections of docs/PEAK.md no code cites: {orphans}"
