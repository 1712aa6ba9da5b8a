"""issue395.outputs: the heatmap names what each grey or red cell is (issue 22, defects 4 and 5)."""

from __future__ import annotations

import dataclasses
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from conftest import ROOT  # noqa: E402

from issue395.outputs import heatmap_figure  # noqa: E402
from issue395.result import Result  # noqa: E402

ISSUE16 = ROOT / "results" / "h200x2-2026-11-30-issue16"


def cell_words(result: Result) -> list[str]:
    fig = heatmap_figure(result, plt)
    words = [t.get_text() for ax in fig.axes for t in ax.texts]
    plt.close(fig)
    return words


def test_a_failed_arm_of_a_dry_run_says_failed_not_dry_run():
    saved = Result.from_json(json.loads((ISSUE16 / "map-512-1024.json").read_text()))
    rows = [dataclasses.replace(r, dry_run=True, real_peak=None, failure="FAILED" if i == 0 else None)
            for i, r in enumerate(saved.rows)]
    words = cell_words(dataclasses.replace(saved, rows=rows, environment=dict(saved.environment, dry_run=True)))
    assert words.count("FAILED") == 1 and words.count("dry run") == len(rows) - 1


def test_an_oom_at_soups_own_cap_is_drawn_as_the_under_prediction():
    saved = Result.from_json(json.loads((ISSUE16 / "cap-soup.json").read_text()))
    capped = [r for r in saved.rows if r.oom_at_soup_cap]
    assert len(capped) == 6
    words = cell_words(saved)
    assert sum(w.startswith("UNDER") and "Soup's cap" in w for w in words) == 6
    assert "OOM" not in words
