"""issue395.report.outputs: the heatmap names what each grey or red cell is (issue 22, defects 4 and 5), its
scale is centred at exactly 1 (under red, over blue), its text readable on each cell, its axes and
title the map's and the stack's; a dry run's plot and markdown claim no measurement; the record's
markdown has each model's table with the A10G figure, the 14 x E, over-estimate, --measure and --sdpa
sections, and flags an UNDER and a VOID row as the text does; --from-json writes the markdown and a
valid PNG; a merged map's markdown carries its margins, every command and its cost; outputs are
written safely (one failed output skips no other, a symlink, a FIFO, /dev/null, a read-only file).
Committed results and rows built by the harness's own constructor (in conftest's result the A10G
record's peaks stand in for CUDA measurements, and its --measure and --sdpa sections are fake
numbers shaped like those modes' output); CPU only, nothing else faked but where a test says so."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import threading

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from conftest import (MAP_2GPU, ROOT, SWEEP, main, make_result, make_row, one_error_line,  # noqa: E402
                      record_row, table_lines)

from issue395.errors import EXIT_FINDING, EXIT_OK  # noqa: E402
from issue395.report.outputs import heatmap_figure, render_markdown, render_plot, write_output  # noqa: E402
from issue395.record import A10G_STACK, RECORD_A10G_PEAK, RECORD_GRID  # noqa: E402
from issue395.model.registry import SHAPES  # noqa: E402
from issue395.results.result import Result  # noqa: E402
from issue395.results.saved import load_result  # noqa: E402
from issue395.report.tables import overestimate_line, render_text  # noqa: E402

ISSUE16 = ROOT / "results" / "cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37"


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


# -- Outputs: each written that can be, stdout on -, a read-only file kept (defects 7, 12, 14) --

SAVED = ISSUE16 / "map-512-1024.json"


def test_one_failed_output_does_not_skip_the_others(capfd, tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    code, _, err = main(capfd, ["--from-json", SAVED, "--markdown", "/dev/full", "--json", tmp_path / "ok.json",
                                "--plot", tmp_path / "ok.png"])
    assert code != 0 and "--markdown /dev/full could not be written" in err
    assert (tmp_path / "ok.json").is_file() and (tmp_path / "ok.png").is_file()
    code, _, err = main(capfd, ["--from-json", SAVED, "--json", "/dev/full", "--markdown", tmp_path / "ok.md"])
    assert code != 0 and "--json /dev/full" in err and (tmp_path / "ok.md").is_file()


def test_json_dash_is_stdout_and_the_tables_go_to_stderr(capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = main(capfd, ["--from-json", SAVED, "--json", "-"])
    assert json.loads(out)["kind"] == "map" and "verdict" in err
    assert not (tmp_path / "-").exists()
    code, out, err = main(capfd, ["--estimate", "--model", "smol", "--seq", "512", "--json", "-"])
    assert code == 0 and json.loads(out)["kind"] == "estimate" and "corrected" in err


def test_a_read_only_output_is_refused_not_replaced(capfd, tmp_path):
    path = tmp_path / "kept.json"
    path.write_text("mine\n")
    path.chmod(0o444)  # no write bit for anyone: refused even when the tests run as root
    one_error_line(*main(capfd, ["--from-json", SAVED, "--json", path]), "read-only")
    assert path.read_text() == "mine\n"


ENOSPC = (28, "No space left on device")


#: A file this tool wrote: a JSON whose first key is its "tool" (the only kind write_output replaces).
OURS = '{"tool": "issue395_second_stack_vram", "schema": 3, "kind": "estimate"}\n'


def test_write_output_through_a_symlink_writes_the_target_and_keeps_the_link(tmp_path):
    target = tmp_path / "real" / "out.json"
    target.parent.mkdir()
    target.write_text(OURS)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_output(str(link), b"new")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.json"]  # no temp file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real"]


def test_write_output_through_a_dangling_symlink_creates_the_target(tmp_path):
    target = tmp_path / "real" / "out.json"
    target.parent.mkdir()
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_output(str(link), b"new")
    assert link.is_symlink() and target.read_bytes() == b"new"
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.json"]


def test_write_output_to_a_fifo_writes_into_it_and_leaves_it_a_fifo(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    write_output(str(fifo), b"through the pipe\n")
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert got == [b"through the pipe\n"]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["pipe"]


def test_write_output_to_dev_null_leaves_it_a_character_device():
    before = os.lstat("/dev/null")
    write_output("/dev/null", b"discarded")
    after = os.lstat("/dev/null")
    assert stat.S_ISCHR(after.st_mode)
    assert (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


def test_write_output_replaces_a_regular_file_and_leaves_no_temp_file(tmp_path):
    out = tmp_path / "out.json"
    out.write_text(OURS + " " * 64)  # this tool's own JSON, longer than the new content
    write_output(str(out), b"new")
    assert out.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]
    write_output(str(tmp_path / "sub" / "fresh.json"), b"made")  # a new file, folder made
    assert (tmp_path / "sub" / "fresh.json").read_bytes() == b"made"
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["fresh.json"]


def test_write_output_that_fails_leaves_the_old_content_and_no_temp_file(tmp_path, monkeypatch):
    out = tmp_path / "out.json"
    out.write_text(OURS)

    def full_disk(src, dst):
        raise OSError(*ENOSPC)

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        write_output(str(out), b"new")
    assert out.read_text() == OURS
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_merged_map_markdown_has_margins_every_command_and_a_cost_table(tmp_path, capfd):
    md_path = tmp_path / "map.md"
    code, out, err = main(capfd, ["--from-json", MAP_2GPU, ISSUE16 / "map-512-1024.json", "--markdown", md_path])
    assert code in (EXIT_OK, 1), err
    md = md_path.read_text()
    assert "where the margin goes" in md and "missed = live - charged" in md
    assert "`map-2gpu.json`" in md and "`map-512-1024.json`" in md
    assert "--seq 512,1024" in md and "--shard 1/2" in md
    assert "A10G record" not in md  # the map compares with no record
    cost = md.split("## Harness cost", 1)[1]
    assert "{" not in cost and "| part 1 |" in cost and "| part 2 |" in cost


def test_the_map_heatmap_is_a_png():
    rows = [make_row(k, q, index=i, real_peak=10**9) for i, (k, q) in enumerate([("smol", 2048), ("qwen", 4096)])]
    png = render_plot(Result(environment={"gpu": "test"}, kind="map", rows=rows))
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


# -- The heatmap as a reader sees it (the merged map's cells, colours and labels) and a dry run's
# plots and markdown, which claim no measurement --


@pytest.fixture(name="plt")
def closing_pyplot():
    """pyplot, every figure a test drew closed after it."""
    yield plt
    plt.close("all")


def cell_texts(fig):
    return [t for ax in fig.axes for t in ax.texts]


def test_heatmap_scale_is_centred_at_exactly_one_and_under_is_red_over_is_blue(merged_map, plt):
    from matplotlib.colors import TwoSlopeNorm

    from issue395.report.outputs import heatmap_figure, heatmap_norm_and_cmap

    norm, cmap = heatmap_norm_and_cmap()
    assert isinstance(norm, TwoSlopeNorm) and norm.vcenter == 1.0
    under, over = cmap(norm(0.99)), cmap(norm(1.01))
    assert under[0] > under[2] and over[2] > over[0]  # 0.99 reddish, 1.01 bluish: never the same colour
    fig = heatmap_figure(merged_map, plt)
    images = [im for ax in fig.axes for im in ax.get_images()]
    assert images and all(isinstance(im.norm, TwoSlopeNorm) and im.norm.vcenter == 1.0 for im in images)


def test_heatmap_marks_under_names_refused_and_labels_axes_and_stack(merged_map, plt):
    from issue395.report.outputs import heatmap_figure

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

    from issue395.report.outputs import heatmap_figure, heatmap_norm_and_cmap, text_colour

    norm, cmap = heatmap_norm_and_cmap()
    assert text_colour(cmap(norm(0.8))) == "white" and text_colour(cmap(norm(1.0))) == "black"
    assert text_colour(cmap(norm(1.4))) == "white"
    fig = heatmap_figure(merged_map, plt)
    dark = [t for t in cell_texts(fig) if t.get_text().startswith("UNDER\n0.82")]
    assert dark and to_rgba(dark[0].get_color()) == to_rgba("white")


def test_a_dry_run_map_renders_with_a_nothing_measured_note(tmp_path, plt):
    from issue395.report.outputs import heatmap_figure, render_plot
    from issue395.results.result import Result

    rows = [dataclasses.replace(make_row("smol", 64, index=0), dry_run=True)]
    result = Result(environment={"gpu": None, "dry_run": True, "soup_cli": "0.73.3", "torch": "2.13.0+cpu"},
                    kind="map", rows=rows)
    fig = heatmap_figure(result, plt)
    assert "nothing measured" in fig._suptitle.get_text() and "no peak was measured" in fig._suptitle.get_text()
    assert "dry run" in [t.get_text() for t in cell_texts(fig)]
    assert render_plot(result)[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_dry_run_sweep_plot_says_nothing_was_measured(plt, monkeypatch):
    from issue395.report import outputs
    from issue395.results.result import Result

    rows = [dataclasses.replace(make_row("smol", 64), dry_run=True)]
    seen = []
    monkeypatch.setattr(plt, "close", lambda fig=None: seen.append(fig))
    outputs.render_plot(Result(environment={"dry_run": True}, rows=rows))
    texts = [t.get_text() for ax in seen[0].axes for t in ax.texts] + [seen[0].axes[0].get_title()]
    assert any("nothing measured" in t for t in texts)


def test_sweep_markdown_keeps_the_a10g_claim_and_dry_run_says_no_peak(tmp_path):
    from issue395.report.outputs import render_markdown

    sweep = load_result(str(SWEEP))
    assert "Compared against the A10G record" in render_markdown(sweep)
    dry = dataclasses.replace(sweep, rows=[dataclasses.replace(r, dry_run=True, real_peak=None)
                                           for r in sweep.rows], environment=dict(sweep.environment, dry_run=True),
                              measure=None, sdpa=None)
    md = render_markdown(dry)
    assert "measured by this run" not in md and "no peak was measured" in md


# -- The record's ten arms as markdown, an under-prediction and a VOID row in text and markdown, and
# --from-json's markdown and plot (conftest's result: the A10G record's peaks stand in for CUDA) --


def test_render_markdown_has_per_model_tables_with_the_a10g_figure(result):
    md = render_markdown(result)
    assert A10G_STACK in md
    for key, seqs in RECORD_GRID.items():
        name = SHAPES[key].name
        assert (f"## {name}\n\n| seq | realised | batch | predicted GB | real peak GB | pred/real "
                "| corrected GB | corr/real | A10G peak GB | vs A10G | verdict |") in md
        section = md.split(f"## {name}\n")[1].split("\n## ")[0]
        rows = [line for line in section.splitlines()
                if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
        assert [int(r.split("|")[1]) for r in rows] == list(seqs)
        for seq, r in zip(seqs, rows):
            cells = [c.strip() for c in r.strip("|").split("|")]
            assert cells[8] == f"{RECORD_A10G_PEAK[(key, seq)] / 1e9:.4f}"  # the A10G figure
            assert cells[9] == "1.000x"  # the record's peak stands in for this run's
            assert cells[10] == "over-predicts, safe"
    assert md.count("over-predicts, safe") == 10


def test_render_markdown_has_14xE_overestimate_measure_and_sdpa_sections(result):
    md = render_markdown(result)
    assert "## 14 x E against the real peak" in md
    section = md.split("## 14 x E against the real peak")[1].split("\n## ")[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| SmolLM2") or line.startswith("| Qwen")]
    assert len(rows) == 10
    assert [r[5] for r in rows] == ["no"] * 10  # retained copy would fit
    assert [r[7] for r in rows] == ["no"] * 10  # A10G: would fit
    # The record's peaks stand in for this run's: both over-estimates are the same figure.
    assert all(r[9] == r[10] and r[9].endswith("x") for r in rows)
    assert overestimate_line(result.rows) in section
    assert "mean 1.152x" in section
    assert "## --measure" in md and "12.0101" in md
    assert "## --sdpa" in md and "3267.4" in md


UNDER_PEAK = 5_830_000_000  # the RTX 3050 record's SmolLM2 seq 6144 real peak (5.830 GB)


def test_text_and_markdown_flag_an_under_prediction():
    """The RTX 3050 record's seq 6144 peak stands in for a CUDA measurement."""
    under = record_row("smol", 6144, real_peak=UNDER_PEAK)
    assert under.status == "UNDER"
    res = make_result([under])
    md = render_markdown(res)
    assert "UNDER-predicts" in md and "over-predicts, safe" not in md
    line = table_lines(render_text(res), "SmolLM2-135M")[0]
    assert line.split()[-1] == "UNDER"
    assert f"{under.predicted / UNDER_PEAK:.3f}x" in line  # 0.787x, below 1
    assert res.exit_code == EXIT_FINDING


def test_void_row_shows_void_and_no_ratio():
    """A row realised short of its seq, carrying a peak (standing in for CUDA) that would
    give a ratio: the row has no ratio by construction and the renderers print none."""
    # 1% off the record's peak, so no ratio of this row coincides with the record's own
    # figures, which the markdown prints beside each row.
    peak = int(RECORD_A10G_PEAK[("smol", 2048)] * 1.01)
    void = record_row("smol", 2048, real_peak=peak, realised_width=1900, realised_rows=(1900,))
    assert void.status == "VOID"
    assert void.pred_over_real is None and void.nonlogits_overestimate is None
    assert void.vs_record is None and void.retained_copy_would_fit is None
    ratio = f"{void.predicted / peak:.3f}x"
    over = f"{void.nonlogits_modelled / (peak - 12 * void.elements):.3f}x"
    res = make_result([void, record_row("smol", 4096, index=1)])
    md = render_markdown(res)
    head_row = next(line for line in md.splitlines() if line.startswith("| 2048 | 1900 |"))
    assert head_row.count("VOID") == 4  # pred/real, corr/real, vs A10G, verdict
    assert ratio not in md and over not in md
    text = render_text(res)
    line = table_lines(text, "SmolLM2-135M")[0]
    assert line.split()[:2] == ["2048", "1900"]
    assert line.split()[-1] == "VOID"
    assert ratio not in text and over not in text
    assert "VOID - realised [1900] (width 1900) != requested 2048" in text
    assert "over 1 measured rows" in text  # the VOID row is not in the summary
    assert res.exit_code == EXIT_FINDING


def test_from_json_writes_markdown_and_a_valid_png_plot(saved, result, tmp_path, capfd):
    from PIL import Image

    md, png = tmp_path / "record.md", tmp_path / "plot.png"
    code, out, err = main(capfd, ["--from-json", saved, "--markdown", md, "--plot", png])
    assert code == EXIT_OK, err
    assert md.read_text() == render_markdown(result)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as img:
        img.verify()
    with Image.open(png) as img:
        width, height = img.size
    assert width >= 600 and height >= 400
    assert render_plot(result)[:8] == b"\x89PNG\r\n\x1a\n"


# Issue 53, items 1 and 2: an output never replaces a file this tool did not write (USAGE.md, "Files it writes").

def test_write_output_refuses_a_file_this_tool_did_not_write_even_when_it_appears_mid_run(tmp_path):
    """A file put at an output's path after the command line was settled (a config.json, a script) is not
    replaced at the write either: NotOurs, an OSError the outputs' one error line reports, the file intact."""
    from issue395.report.outputs import NotOurs

    out = tmp_path / "config.json"
    out.write_text('{"model_type": "llama"}\n')
    with pytest.raises(NotOurs, match="not this tool's own output"):
        write_output(str(out), b"{}")
    assert out.read_text() == '{"model_type": "llama"}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_every_output_this_tool_writes_carries_its_mark_and_a_foreign_one_does_not(tmp_path, result):
    """The rule's other half: a JSON result, --markdown's record and --plot's PNG (the sweep's and the map's
    heatmap) as this tool renders them are recognised as its own, so a second run replaces them; a PNG
    matplotlib wrote for someone else, a markdown file and a JSON without the tool's key are not."""
    from issue395.report.outputs import not_ours

    ours = {"r.json": json.dumps(result.to_json(), indent=2, default=str).encode(),
            "r.md": render_markdown(result).encode(), "r.png": render_plot(result)}
    fig, ax = plt.subplots()
    ax.plot([1, 2])
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    foreign = {"f.png": buf.getvalue(), "f.md": b"# My notes\n", "f.json": b'{"model_type": "llama"}\n',
               "f.yaml": b"base: x\n"}
    for name, data in {**ours, **foreign}.items():
        (tmp_path / name).write_bytes(data)
    assert [n for n in ours if not_ours(str(tmp_path / n))] == []
    assert [n for n in foreign if not not_ours(str(tmp_path / n))] == []
    (tmp_path / "empty").write_bytes(b"")  # nothing to lose (a mktemp'd name)
    assert not not_ours(str(tmp_path / "empty")) and not not_ours(str(tmp_path / "absent.json"))
