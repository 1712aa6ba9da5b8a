"""issue395.tables: the verdict counts an OOM at Soup's own cap as the under-prediction it is."""

from __future__ import annotations

import json

from conftest import ROOT

from issue395.result import Result
from issue395.tables import verdict_line

ISSUE16 = ROOT / "results" / "cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37"


def test_the_cap_soup_verdict_names_the_ooms_at_soups_number_as_under_predictions():
    saved = Result.from_json(json.loads((ISSUE16 / "cap-soup.json").read_text()))
    line = verdict_line(saved.rows)
    assert line.startswith("verdict: Soup UNDER-predicts 6 of 9 judged row(s)")
    assert "never under" not in line and "phi-2 nf4 seq 2048 batch 1" in line


def test_a_verdict_without_ooms_at_soups_cap_is_unchanged():
    saved = Result.from_json(json.loads((ISSUE16 / "cap-needs-free.json").read_text()))
    assert verdict_line(saved.rows).startswith("verdict: Soup UNDER-predicts 3 of 12 measured row(s); the contract")
