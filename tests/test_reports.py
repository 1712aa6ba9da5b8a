"""Reports: the text tables, the markdown record, the plot, --from-json (one result, the
committed schema-1 results, damaged files) and the exit codes.

There is no GPU here, so results are built from rows made by the harness's own
constructor (``make_row``: Soup's real prediction and the record's figures), with the
A10G record's published peaks standing in for CUDA measurements of ``real_peak``. The
--measure and --sdpa sections carry fake numbers shaped like measure_mode / sdpa_mode
output (those modes need CUDA). Nothing here runs a Soup setup: it is all in process. Tests still
to move to test_tables, test_outputs, test_result and test_saved (issue 21): each builds or reads a
Result.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import ROOT, main, make_row, one_error_line

from issue395.errors import EXIT_FINDING, EXIT_INTERRUPTED, EXIT_OK
from issue395.outputs import render_markdown, render_plot
from issue395.record import A10G_STACK, RECORD_A10G_PEAK, RECORD_GRID, SDPA_SEQS
from issue395.registry import SHAPES
from issue395.result import Result
from issue395.stack import environment
from issue395.row import Row
from issue395.tables import SWEEP_LEGEND, compare_table, models_in, overestimate_line, render_text

UNDER_PEAK = 5_830_000_000  # the RTX 3050 record's SmolLM2 seq 6144 real peak (5.830 GB)
SCHEMA1 = ROOT / "results" / "record-h200x2-soup0.73.3-e7c26f7" / "h200-2026-11-30-full-cold"

FAKE_MEASURE = {  # fake numbers, shaped like measure_mode() output
    "constants": {"LOGITS_BYTES_PER_ELEMENT": 14, "LOGITS_LOSS_BYTES_PER_ELEMENT": 12},
    "repeats": [12.0, 12.0, 12.0], "spread": 0.0,
    "by_vocab": {8192: 12.0, 32768: 12.0, 49152: 12.0, 151936: 12.01010951979781},
}
FAKE_SDPA = {  # fake numbers, shaped like sdpa_mode() output
    "seqs": list(SDPA_SEQS),
    "extra_mb": {"flash": [2.4, 3.7, 4.9, 6.1, 7.3],
                 "mem_efficient": [2.4, 3.5, 4.7, 5.9, 7.1],
                 "math": [383.9, 831.5, 1463.8, 2279.7, 3267.4],
                 "default": ["n/a (RuntimeError)", 3.7, 4.9, 6.1, 7.3]},
}


def record_row(key, seq, index=0, **measured):
    """One record arm, the A10G record's published peak standing in for CUDA."""
    measured.setdefault("real_peak", RECORD_A10G_PEAK[(key, seq)])
    measured.setdefault("resident", 100_000_000)
    measured.setdefault("reserved", measured["real_peak"])
    return make_row(key, seq, index=index, **measured)


def record_rows():
    rows = []
    for key, seqs in RECORD_GRID.items():
        for seq in seqs:
            rows.append(record_row(key, seq, index=len(rows)))
    return rows


_ENV = None


def make_result(rows=None, **kw):
    global _ENV
    if _ENV is None:
        _ENV = environment("synthetic", False, "in one process", ["issue395_second_stack_vram.py"])
    kw.setdefault("measure", copy.deepcopy(FAKE_MEASURE))
    kw.setdefault("sdpa", copy.deepcopy(FAKE_SDPA))
    kw.setdefault("timings", {"total_s": 1.0})
    return Result(environment=dict(_ENV), rows=record_rows() if rows is None else rows, **kw)


@pytest.fixture(scope="module")
def result():
    return make_result()


def table_lines(text, model):
    """The data lines of one model's section of the sweep table."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(model + "  ("))
    out = []
    for line in lines[start + 3:]:
        if not line.strip():
            break
        out.append(line)
    return out


def save(result, path: Path) -> Path:
    path.write_text(json.dumps(result.to_json(), indent=2, default=str))
    return path


# --- text ------------------------------------------------------------------------

def test_render_text_has_each_model_section_seq_realised_columns_and_the_legend(result):
    text = render_text(result)
    lines = text.splitlines()
    for key in RECORD_GRID:
        assert SHAPES[key].name + "  (predicted" in text
    head = next(line for line in lines if "realised" in line and "seq" in line)
    assert head.split()[:2] == ["seq", "realised"]
    assert "copy fits" in head and "14xE<=peak" not in head
    last = None
    for key, seqs in RECORD_GRID.items():
        rows = table_lines(text, SHAPES[key].name)
        assert [int(line.split()[0]) for line in rows] == list(seqs)
        assert [int(line.split()[1]) for line in rows] == list(seqs)
        assert all(line.split()[-1] == "ok" for line in rows)
        last = lines.index(rows[-1])
    # The legend sits under the last table, before the over-estimate summary.
    assert lines[last + 1] == "" and lines[last + 2] == SWEEP_LEGEND
    assert "14xE" in SWEEP_LEGEND and "copy fits" in SWEEP_LEGEND
    assert lines[last + 3].startswith("non-logits over-estimate over 10 measured rows")
    assert "mean 1.152x, population stdev 0.0249" in text
    assert "(record, 10 rows: mean 1.152x, pstdev 0.0249)" in text
    assert "--measure" in text and "12.0101" in text
    assert "--sdpa" in text and "n/a (RuntimeError) |        -" in text  # a raising backend is data


def test_render_text_shows_pred_over_real_per_row(result):
    text = render_text(result)
    lines = table_lines(text, "SmolLM2-135M")
    # seq 2048: predicted 1.5964 GB, real 1.3652 GB, pred/real 1.169x (the record's figure)
    assert lines[0].split()[3:6] == ["1.5964", "1.3652", "1.169x"]
    for model in models_in(result.rows):
        rows = [r for r in result.rows if r.model == model]
        for row, line in zip(rows, table_lines(text, model), strict=True):
            assert line.split()[5] == f"{row.predicted / row.real_peak:.3f}x"
            assert line.split()[-2] == "no"  # a retained bf16 copy never fits under the peak


# --- markdown --------------------------------------------------------------------

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


# --- JSON round trip and --from-json ------------------------------------------------

@pytest.fixture(scope="module")
def saved(result, tmp_path_factory):
    return save(result, tmp_path_factory.mktemp("saved") / "result.json")


def test_from_json_prints_the_same_tables_after_a_round_trip(saved, result, capfd):
    back = Result.from_json(json.loads(saved.read_text()))
    assert back.rows == result.rows  # every stored field, re-read exactly
    code, out, err = main(capfd, ["--from-json", saved])
    assert out == render_text(result)
    assert err == ""
    assert code == EXIT_OK


def _numbers(lines):
    return [line.split() for line in lines]


def test_from_json_of_the_committed_schema1_result_prints_its_sweep_tables(capfd):
    """The first H200 result (schema 1) still loads, and its re-rendered sweep tables hold
    the figures its printed output holds. Only a column name changed ('14xE<=peak' became
    'copy fits'; its cells are still yes/no)."""
    printed = [line for line in SCHEMA1.with_suffix(".txt").read_text().splitlines()
               if not line.startswith("[arm ")]
    code, out, err = main(capfd, ["--from-json", SCHEMA1.with_suffix(".json")])
    assert code == EXIT_OK, err
    assert err == ""
    new = out.splitlines()
    assert new[0] == printed[0]  # the stack header
    for name in ("SmolLM2-135M", "Qwen2.5-0.5B"):
        old_rows, new_rows = table_lines("\n".join(printed), name), table_lines(out, name)
        assert len(old_rows) == len(new_rows) == {"SmolLM2-135M": 6, "Qwen2.5-0.5B": 4}[name]
        # this version adds the corrected estimate and its ratio after pred/real
        assert [row[:6] + row[8:] for row in _numbers(new_rows)] == _numbers(old_rows)
    old_head = next(line for line in printed if "realised" in line).split()
    new_head = next(line for line in new if "realised" in line).split()
    assert "14xE<=peak" in old_head and "copy" in new_head and "fits" in new_head
    summary = next(line for line in printed if line.startswith("non-logits over-estimate"))
    assert summary in new
    # The --measure and --sdpa tables hold the same figures (this version prints 4 decimals for the
    # probe and pads the sdpa cells, so the text is not the same line for line).
    def figures(lines):
        return [round(float(w), 4) for line in lines for w in line.replace("|", " ").split()
                if w.replace(".", "", 1).isdigit()]

    assert figures(new[new.index(next(x for x in new if x.startswith("--measure"))):]) == \
        figures(printed[printed.index(next(x for x in printed if x.startswith("--measure"))):])


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


_ENV_FIELDS = '"torch": "2", "transformers": "5", "trl": "0", "peft": "0", "soup_cli": "0", "weights": "x"'
BAD_FILES = [
    ("missing", None),
    ("not-json", "not json {"),
    ("a-list", '["a", "list"]'),
    ("no-schema", '{"environment": {}, "rows": []}'),
    ("hollow-schema2", '{"schema": 2, "environment": {}, "rows": []}'),
    ("hollow-schema1", '{"schema": 1, "environment": {}, "rows": []}'),
    ("environment-not-object", '{"schema": 2, "environment": "x", "rows": [{"model": "m"}]}'),
    ("hollow-row", '{"schema": 2, "environment": {%s}, "rows": [{"model": "m"}]}' % _ENV_FIELDS),
    ("rows-not-a-list", '{"schema": 2, "environment": {%s}, "rows": {"0": {}}}' % _ENV_FIELDS),
    ("schema-999", '{"schema": 999, "environment": {%s}, "rows": []}' % _ENV_FIELDS),
    ("nested-deeply", "[" * 100_000),
    ("fifo", "FIFO"),
    ("dev-zero", "/dev/zero"),
]


@pytest.mark.parametrize("content", [c for _, c in BAD_FILES], ids=[i for i, _ in BAD_FILES])
def test_from_json_of_a_bad_file_exits_2_with_one_line(tmp_path, capfd, content):
    path = tmp_path / "result.json"
    if content == "FIFO":
        os.mkfifo(path)  # reading it would hang: refused before it is opened
    elif content == "/dev/zero":
        path = Path("/dev/zero")  # never ends: refused before it is read
    elif content is not None:
        path.write_text(content)
    try:
        code, out, err = main(capfd, ["--from-json", path])
    except Exception as exc:  # noqa: BLE001 - the bug: an uncaught traceback
        pytest.fail(f"traceback instead of exit 2: {type(exc).__name__}: {exc}")
    one_error_line(code, out, err, "--from-json", str(path))


@pytest.mark.parametrize("value", [0, float("nan"), -5], ids=["zero", "nan", "negative"])
def test_from_json_of_a_row_edited_to_an_impossible_peak_exits_2(saved, tmp_path, capfd, value):
    data = json.loads(saved.read_text())
    data["rows"][0]["real_peak"] = value
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))  # NaN is written as the bare token NaN
    code, out, err = main(capfd, ["--from-json", path])
    one_error_line(code, out, err, "--from-json", "real_peak")


def test_from_json_rejudges_an_edited_row_under_and_void(saved, tmp_path, capfd):
    """The saved verdicts ("derived") are never read back: a row edited above its prediction
    re-renders UNDER, one edited to a realised width of 1000 re-renders VOID; exit 1."""
    data = json.loads(saved.read_text())
    assert data["rows"][0]["derived"]["status"] == "ok"
    under = copy.deepcopy(data)
    under["rows"][0]["real_peak"] = under["rows"][0]["predicted"] + 1
    void = copy.deepcopy(data)
    void["rows"][1]["realised_width"] = 1000
    (tmp_path / "under.json").write_text(json.dumps(under))
    (tmp_path / "void.json").write_text(json.dumps(void))

    code, out, err = main(capfd, ["--from-json", tmp_path / "under.json"])
    assert code == EXIT_FINDING, err
    line = table_lines(out, "SmolLM2-135M")[0]
    assert line.split()[0] == "2048" and line.split()[-1] == "UNDER"
    assert line.split()[5] == "1.000x"  # predicted / (predicted + 1), rounded

    code, out, err = main(capfd, ["--from-json", tmp_path / "void.json"])
    assert code == EXIT_FINDING, err
    line = table_lines(out, "SmolLM2-135M")[1]
    assert line.split()[:2] == ["3072", "1000"] and line.split()[-1] == "VOID"
    assert line.split()[5] == "VOID"
    assert "VOID - realised [3072] (width 1000) != requested 3072" in out


def test_from_json_compare_lists_the_byte_difference_of_the_same_arm(saved, tmp_path, capfd):
    other = json.loads(saved.read_text())
    other["environment"]["arms"] = "isolated, one fresh process per arm"
    other["rows"][0]["real_peak"] += 1_000_000
    other_path = tmp_path / "other.json"
    other_path.write_text(json.dumps(other))
    code, out, err = main(capfd, ["--from-json", saved, "--compare", other_path])
    assert code == EXIT_OK, err
    assert "compare: A = in one process" in out
    assert "B = isolated, one fresh process per arm" in out
    line = next(x for x in out.splitlines() if x.split()[:2] == ["SmolLM2-135M", "2048"])
    assert line.split()[5] == "1000000"
    assert "9 of 10 shared arm(s) equal to the byte" in out


def test_compare_table_lists_only_arms_measured_in_both():
    a = make_result([record_row("smol", 4096, index=0), record_row("qwen", 2048, index=1)])
    b = make_result([record_row("smol", 4096, index=0, real_peak=2_649_300_000)])  # qwen absent
    b.environment["arms"] = "isolated, one fresh process per arm"
    table = compare_table(a, b)
    lines = [line for line in table.splitlines() if "SmolLM2" in line or "Qwen" in line]
    assert len(lines) == 1
    cells = lines[0].split()
    assert cells[:5] == ["SmolLM2-135M", "4096", "1", "2.6578", "2.6493"]
    assert cells[5] == "-8500000"
    assert cells[6] == f"{-8_500_000 / 2_657_800_000:.3%}"
    assert "0 of 1 shared arm(s) equal to the byte" in table


def test_compare_with_a_missing_file_names_that_file(saved, tmp_path, capfd):
    """The error must be about the missing --compare file, not some other flaw."""
    missing = tmp_path / "missing.json"
    code, out, err = main(capfd, ["--from-json", saved, "--compare", missing])
    line = one_error_line(code, out, err, "--compare", "missing.json")
    assert str(saved) not in line


# --- exit codes ------------------------------------------------------------------

def finding(row, status):
    """The same row, turned into one finding the way an arm would produce it."""
    return {"VOID": lambda: replace(row, realised_width=row.seq - 1, realised_rows=(row.seq - 1,)),
            "OOM": lambda: replace(row, real_peak=None, failure="OOM", oom_request=2**30),
            "FAILED": lambda: replace(row, real_peak=None, failure="FAILED", error="RuntimeError: x"),
            "UNDER": lambda: replace(row, real_peak=row.predicted + 1)}[status]()


def test_exit_code_zero_when_every_row_is_ok(result):
    assert result.exit_code == EXIT_OK
    dry = make_result([make_row("smol", 64, dry_run=True)], measure=None, sdpa=None)
    assert dry.rows[0].status == "dry-run" and dry.exit_code == EXIT_OK


@pytest.mark.parametrize("status", ["VOID", "OOM", "FAILED", "UNDER"])
def test_exit_code_one_for_any_finding(result, status):
    rows = list(result.rows)
    rows[3] = finding(rows[3], status)
    assert rows[3].status == status
    res = make_result(rows)
    assert res.exit_code == EXIT_FINDING
    assert Result.from_json(json.loads(json.dumps(res.to_json()))).exit_code == EXIT_FINDING


def test_exit_code_one_for_a_finding_in_a_determinism_repeat(result):
    base = record_row("smol", 4096, index=0)
    repeats = [replace(base, repeat=1, pid=101), finding(replace(base, repeat=2, pid=102), "OOM")]
    res = make_result([base] + repeats)
    assert res.exit_code == EXIT_FINDING
    assert "repeat 2 OOM" in render_text(res)
    assert make_result([base, repeats[0]]).exit_code == EXIT_OK


def test_exit_code_one_for_a_failed_control_or_a_harness_error(result):
    assert make_result(control={"passed": False}).exit_code == EXIT_FINDING
    assert make_result(control={"passed": True}).exit_code == EXIT_OK
    assert make_result(error="RuntimeError: boom").exit_code == EXIT_FINDING


def test_exit_code_130_when_interrupted_even_with_findings(result):
    assert make_result(interrupted=True).exit_code == EXIT_INTERRUPTED
    rows = list(result.rows)
    rows[0] = finding(rows[0], "VOID")
    res = make_result(rows, interrupted=True, control={"passed": False})
    assert res.exit_code == EXIT_INTERRUPTED


def test_a_row_that_carried_bytes_from_earlier_arms_says_so_under_the_tables():
    clean = make_row("smol", 2048, index=0, real_peak=10**9, carried=0)
    carried = make_row("qwen", 2048, index=1, real_peak=4 * 10**9, carried=1024)
    out = render_text(make_result([clean, carried]))
    assert "carried: 1 row(s) began with bytes earlier arms left allocated (up to 1,024)" in out
    assert "carried" not in render_text(make_result([clean]))
    assert Row.from_json(carried.to_json()).carried == 1024
    with pytest.raises(ValueError, match="carried"):
        Row.from_json(dict(carried.to_json(), carried=-1))
