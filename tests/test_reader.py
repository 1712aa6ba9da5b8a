"""What a reader sees of saved results: the map's heatmap, markdown, attribution notes and messages.
Tests still to move to test_outputs and test_tables (issue 21): each reads results through
load_result, merge or Result (the console's messages moved to test_console, the sweep table's
A10G claim to test_tables, the merged map's markdown to test_outputs). CPU only: saved results
from results/ and rows built through the harness's own constructor."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import ROOT, make_row

from issue395.merge import merge
from issue395.saved import load_result
from issue395.tables import compare_table, margins_table, measure_table, render_text, sdpa_table

MAP_2GPU = ROOT / "results/margin-map-h200x2-soup0.73.3-f3ad9d2/map-2gpu.json"
MAP_512 = ROOT / "results/cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37/map-512-1024.json"
SWEEP = ROOT / "results/margin-map-in-4-parts-h200-soup0.73.3-3238e1a-to-b3a7891/full-cold.json"


@pytest.fixture(scope="module")
def merged_map():
    return merge([load_result(str(MAP_2GPU)), load_result(str(MAP_512))], "merged from 2 result(s)")


@pytest.fixture
def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    yield plt
    plt.close("all")


def cell_texts(fig):
    return [t for ax in fig.axes for t in ax.texts]


# 1. the heatmap


def test_heatmap_scale_is_centred_at_exactly_one_and_under_is_red_over_is_blue(merged_map, plt):
    from matplotlib.colors import TwoSlopeNorm

    from issue395.outputs import heatmap_figure, heatmap_norm_and_cmap

    norm, cmap = heatmap_norm_and_cmap()
    assert isinstance(norm, TwoSlopeNorm) and norm.vcenter == 1.0
    under, over = cmap(norm(0.99)), cmap(norm(1.01))
    assert under[0] > under[2] and over[2] > over[0]  # 0.99 reddish, 1.01 bluish: never the same colour
    fig = heatmap_figure(merged_map, plt)
    images = [im for ax in fig.axes for im in ax.get_images()]
    assert images and all(isinstance(im.norm, TwoSlopeNorm) and im.norm.vcenter == 1.0 for im in images)


def test_heatmap_marks_under_names_refused_and_labels_axes_and_stack(merged_map, plt):
    from issue395.outputs import heatmap_figure

    fig = heatmap_figure(merged_map, plt)
    texts = [t.get_text() for t in cell_texts(fig)]
    unders = [r for r in merged_map.rows if r.status == "UNDER"]
    assert sum(t.startswith("UNDER") for t in texts) == len(unders)
    assert not any(t.endswith("1.000") for t in texts if t.startswith("UNDER"))  # phi-2 1024x1: 0.99996
    assert "REFUSED" in texts
    hatched = [p for ax in fig.axes for p in ax.patches if p.get_hatch()]
    assert len(hatched) == len(unders)
    grey = [p for ax in fig.axes for p in ax.patches if p.get_fill() and not p.get_hatch()]
    assert len(grey) == sum(1 for r in merged_map.rows if not r.measured)
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert all(ax.get_xlabel() == "seq x batch" and ax.get_ylabel() == "family" for ax in panels)
    title = fig._suptitle.get_text()
    assert "NVIDIA H200" in title and "soup-cli 0.73.3" in title and "torch 2.11.0+cu130" in title


def test_heatmap_text_colour_follows_the_cells_luminance(merged_map, plt):
    from matplotlib.colors import to_rgba

    from issue395.outputs import heatmap_figure, heatmap_norm_and_cmap, text_colour

    norm, cmap = heatmap_norm_and_cmap()
    assert text_colour(cmap(norm(0.8))) == "white" and text_colour(cmap(norm(1.0))) == "black"
    assert text_colour(cmap(norm(1.4))) == "white"
    fig = heatmap_figure(merged_map, plt)
    dark = [t for t in cell_texts(fig) if t.get_text().startswith("UNDER\n0.82")]
    assert dark and to_rgba(dark[0].get_color()) == to_rgba("white")


def test_a_dry_run_map_renders_with_a_nothing_measured_note(tmp_path, plt):
    from issue395.outputs import heatmap_figure, render_plot
    from issue395.result import Result

    rows = [dataclasses.replace(make_row("smol", 64, index=0), dry_run=True)]
    result = Result(environment={"gpu": None, "dry_run": True, "soup_cli": "0.73.3", "torch": "2.13.0+cpu"},
                    kind="map", rows=rows)
    fig = heatmap_figure(result, plt)
    assert "nothing measured" in fig._suptitle.get_text() and "no peak was measured" in fig._suptitle.get_text()
    assert "dry run" in [t.get_text() for t in cell_texts(fig)]
    assert render_plot(result)[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_dry_run_sweep_plot_says_nothing_was_measured(plt, monkeypatch):
    from issue395 import outputs
    from issue395.result import Result

    rows = [dataclasses.replace(make_row("smol", 64), dry_run=True)]
    seen = []
    monkeypatch.setattr(plt, "close", lambda fig=None: seen.append(fig))
    outputs.render_plot(Result(environment={"dry_run": True}, rows=rows))
    texts = [t.get_text() for ax in seen[0].axes for t in ax.texts] + [seen[0].axes[0].get_title()]
    assert any("nothing measured" in t for t in texts)


# 2. markdown


def test_sweep_markdown_keeps_the_a10g_claim_and_dry_run_says_no_peak(tmp_path):
    from issue395.outputs import render_markdown

    sweep = load_result(str(SWEEP))
    assert "Compared against the A10G record" in render_markdown(sweep)
    dry = dataclasses.replace(sweep, rows=[dataclasses.replace(r, dry_run=True, real_peak=None)
                                           for r in sweep.rows], environment=dict(sweep.environment, dry_run=True),
                              measure=None, sdpa=None)
    md = render_markdown(dry)
    assert "measured by this run" not in md and "no peak was measured" in md


# 3. attribution notes


def test_gemma2_note_names_the_logits_term_whose_slack_is_gone(merged_map):
    text = margins_table(merged_map.margins)
    note = next(x for x in text.splitlines() if x.startswith("  gemma-2-2b none seq"))
    assert "logits term's slack is gone" in note and "the weights term misses" not in note
    phi = next(x for x in text.splitlines() if x.startswith("  phi-2 nf4 seq 2048 batch 1"))
    assert "activations term misses" in phi


def test_attribution_rows_follow_the_grid_and_missed_has_a_legend(merged_map):
    text = margins_table(merged_map.margins)
    arms = list(dict.fromkeys(" ".join(x.split()[:3]) for x in text.splitlines()
                              if not x.startswith(" ") and len(x.split()) > 3 and x.split()[1] in ("none", "nf4")))
    grid = list(dict.fromkeys(f"{r.model} {r.quant} {r.seq}x{r.batch}" for r in merged_map.rows))
    assert arms == sorted(arms, key=grid.index)
    assert any(line.startswith("missed = live - charged") for line in text.splitlines())


# 4. messages


def test_compare_header_names_both_stacks():
    a, b = load_result(str(SWEEP)), load_result(str(MAP_512))
    head = compare_table(a, b, ("a.json", "b.json")).splitlines()[:3]
    assert "A: a.json, NVIDIA H200, soup-cli 0.73.3, torch 2.11.0+cu130" in head[1]
    assert head[2].startswith("  B: b.json, NVIDIA H200, soup-cli")


def test_measure_prints_four_decimals_and_sdpa_rows_align():
    sweep = load_result(str(SWEEP))
    text = measure_table(sweep.measure)
    assert "12.01010951979781" not in text and "12.0101" in text
    lines = sdpa_table(sweep.sdpa).splitlines()[3:7]
    bars = {tuple(i for i, c in enumerate(line) if c == "|") for line in lines}
    assert len(bars) == 1, lines  # every backend's "|" in the same columns, "default" too


def test_an_interrupted_dry_run_says_set_up_not_measured():
    from issue395.result import Result

    rows = [dataclasses.replace(make_row("smol", 64), dry_run=True)]
    env = load_result(str(SWEEP)).environment
    text = render_text(Result(environment=dict(env, dry_run=True), rows=rows, interrupted=True))
    assert "1 row(s) set up" in text and "row(s) measured" not in text
