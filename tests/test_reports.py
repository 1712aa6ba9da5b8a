"""Reports: the text tables, the markdown record, the plot, --from-json and exit codes.

There is no GPU here, so the results are built from the harness's own pieces
(predicted_bytes, derived_columns, record_columns, row_status, environment)
with the A10G record's published peaks standing in for CUDA measurements of
`real_peak`. The --measure and --sdpa sections carry fake numbers shaped like
measure_mode / sdpa_mode output (those modes need CUDA).
"""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import issue395_second_stack_vram as h  # noqa: E402

UNDER_PEAK = 5_830_000_000  # the RTX 3050 record's SmolLM2 seq 6144 real peak (5.830 GB)


def make_row(key, seq, real, *, batch=1, realised=None, index=0, realised_rows=None,
             error_kind=None):
    """A row as run_arm builds it; `real` stands in for the CUDA max_memory_allocated()."""
    shape = h.SHAPES[key]
    realised = seq if realised is None else realised
    predicted = h.predicted_bytes(shape, seq, batch)
    row = {"model": shape.name, "model_key": key, "seq": seq, "batch": batch,
           "weights": "synthetic", "base": "/synthetic", "index": index, "dry_run": False,
           "realised": realised, "realised_rows": realised_rows or [realised] * batch,
           "predicted": predicted, "real_peak": real, "resident_before_step": None,
           "max_reserved": None, "error_kind": error_kind, "error": None,
           "oom_request_bytes": None, "teardown_error": None, "gpu": None, "pid": 1,
           "timings": {"build_s": 0.0, "setup_s": 1.0, "step_s": 0.5, "teardown_s": 0.1},
           "log": None, "repeat": 0}
    row.update(h.derived_columns(shape, seq, batch, predicted, real))
    row.update(h.record_columns(shape, seq, batch, real))
    row["status"] = h.row_status(row)
    return row


def record_rows():
    """The ten record arms, the A10G record's published peaks standing in for CUDA."""
    rows = []
    for key, seqs in h.RECORD_GRID.items():
        for seq in seqs:
            rows.append(make_row(key, seq, h.RECORD_A10G_PEAK[(key, seq)], index=len(rows)))
    return rows


FAKE_MEASURE = {  # fake numbers, shaped like measure_mode() output
    "constants": {"LOGITS_BYTES_PER_ELEMENT": 14, "LOGITS_LOSS_BYTES_PER_ELEMENT": 12},
    "repeats": [12.0, 12.0, 12.0], "spread": 0.0,
    "by_vocab": {8192: 12.0, 32768: 12.0, 49152: 12.0, 151936: 12.01010951979781},
}
FAKE_SDPA = {  # fake numbers, shaped like sdpa_mode() output
    "seqs": list(h.SDPA_SEQS),
    "extra_mb": {"flash": [2.4, 3.7, 4.9, 6.1, 7.3],
                 "mem_efficient": [2.4, 3.5, 4.7, 5.9, 7.1],
                 "math": [383.9, 831.5, 1463.8, 2279.7, 3267.4],
                 "default": ["n/a (RuntimeError)", 3.7, 4.9, 6.1, 7.3]},
}


def make_result(rows=None):
    return {"tool": "issue395_second_stack_vram", "schema": 1,
            "environment": h.environment("synthetic", "in one process", ["x"]),
            "options": asdict(h.Options()), "rows": record_rows() if rows is None else rows,
            "determinism": None, "measure": copy.deepcopy(FAKE_MEASURE),
            "sdpa": copy.deepcopy(FAKE_SDPA), "control": None, "interrupted": False,
            "error": None, "timings": {"total_s": 1.0}}


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


# --- text ------------------------------------------------------------------------

def test_render_text_has_each_model_section_and_seq_realised_columns(result):
    text = h.render_text(result)
    for key in h.RECORD_GRID:
        assert h.SHAPES[key].name + "  (predicted" in text
    head = next(line for line in text.splitlines() if "realised" in line and "seq" in line)
    assert head.split()[:2] == ["seq", "realised"]
    for key, seqs in h.RECORD_GRID.items():
        lines = table_lines(text, h.SHAPES[key].name)
        assert [int(line.split()[0]) for line in lines] == list(seqs)
        assert [int(line.split()[1]) for line in lines] == list(seqs)
        assert all(line.split()[-1] == "ok" for line in lines)
    assert "mean 1.152x, population stdev 0.0249" in text
    assert "(record, 10 rows: mean 1.152x, pstdev 0.0249)" in text
    assert "--measure" in text and "--sdpa" in text
    assert "n/a (RuntimeError) | -" in text  # a raising backend is data


def test_render_text_shows_pred_over_real_per_row(result):
    text = h.render_text(result)
    lines = table_lines(text, "SmolLM2-135M")
    # seq 2048: predicted 1.5964 GB, real 1.3652 GB, pred/real 1.169x, 14xE never fits
    first = lines[0].split()
    assert first[3:6] == ["1.5964", "1.3652", "1.169x"]
    assert all(line.split()[-2] == "no" for line in lines)


# --- markdown --------------------------------------------------------------------

def test_render_markdown_headline_tables_per_model(result):
    md = h.render_markdown(result)
    for key, seqs in h.RECORD_GRID.items():
        name = h.SHAPES[key].name
        assert f"## {name}\n\n| seq | realised | batch | predicted GB | real peak GB |" in md
        section = md.split(f"## {name}\n")[1].split("\n## ")[0]
        rows = [line for line in section.splitlines() if line.startswith("| ") and
                line.split("|")[1].strip().isdigit()]
        assert [int(r.split("|")[1]) for r in rows] == list(seqs)
        assert all(r.rstrip().endswith("| over-predicts, safe |") for r in rows)
    assert md.count("over-predicts, safe") == 10


def test_render_markdown_has_14xE_overestimate_measure_and_sdpa(result):
    md = h.render_markdown(result)
    assert "## 14 x E against the real peak" in md
    table = md.split("## 14 x E against the real peak")[1].split("\n## ")[0]
    flags = [line.rstrip(" |").rsplit("|", 1)[-1].strip() for line in table.splitlines()
             if line.startswith("| SmolLM2") or line.startswith("| Qwen")]
    assert flags == ["no"] * 10
    assert "## Non-logits over-estimate" in md
    assert "mean 1.152x" in md
    assert "## --measure" in md and "12.01010951979781" in md
    assert "## --sdpa" in md and "3267.4" in md
    assert h.A10G_STACK in md


def test_markdown_and_text_flag_an_under_prediction():
    """The RTX 3050 record's seq 6144 peak stands in for a CUDA measurement."""
    under = make_row("smol", 6144, UNDER_PEAK)
    assert under["status"] == "UNDER"
    res = make_result([under])
    md = h.render_markdown(res)
    assert "UNDER-predicts" in md
    assert "over-predicts, safe" not in md
    line = table_lines(h.render_text(res), "SmolLM2-135M")[0]
    assert line.split()[-1] == "UNDER"
    assert f"{under['predicted'] / UNDER_PEAK:.3f}x" in line  # 0.787x, below 1
    assert h.exit_code(res) == 1


def test_void_row_shows_void_and_no_ratio():
    """A row realised short of its seq, with a peak (standing in for CUDA) that would
    give a ratio: the renderers must not print it, even though the row carries one."""
    # 1% off the record's peak, so no ratio of this row coincides with the record's own
    # figures, which the markdown prints beside each row.
    void = make_row("smol", 2048, int(h.RECORD_A10G_PEAK[("smol", 2048)] * 1.01), realised=1900)
    assert void["status"] == "VOID"
    ratio = f"{void['pred_over_real']:.3f}x"
    over = f"{void['nonlogits_overestimate']:.3f}x"
    res = make_result([void, make_row("smol", 4096, h.RECORD_A10G_PEAK[("smol", 4096)],
                                      index=1)])
    md = h.render_markdown(res)
    head_row = next(line for line in md.splitlines() if line.startswith("| 2048 | 1900 |"))
    assert head_row.count("VOID") == 3  # pred/real, vs A10G, verdict
    assert ratio not in md and over not in md
    text = h.render_text(res)
    line = table_lines(text, "SmolLM2-135M")[0]
    assert line.split()[:2] == ["2048", "1900"]
    assert line.split()[-1] == "VOID"
    assert ratio not in text and over not in text
    assert "VOID - realised [1900] != requested 2048" in text
    assert "over 1 measured rows" in text  # the VOID row is not in the summary


# --- JSON round trip and --from-json ------------------------------------------------

@pytest.fixture(scope="module")
def saved(result, tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "result.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    return path


def test_from_json_prints_the_same_tables(saved, result, capsys):
    code = h.main(["--from-json", str(saved)])
    out = capsys.readouterr()
    assert out.out == h.render_text(result)
    assert out.err == ""
    assert code == 0


def test_from_json_writes_markdown_and_plot(saved, result, tmp_path, capsys):
    from PIL import Image

    md, png = tmp_path / "record.md", tmp_path / "plot.png"
    assert h.main(["--from-json", str(saved), "--markdown", str(md), "--plot", str(png)]) == 0
    capsys.readouterr()
    assert md.read_text() == h.render_markdown(result)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as img:
        width, height = img.size
    assert width >= 600 and height >= 400


@pytest.mark.parametrize("content", [None, "not json {", '["a", "list"]', '{"rows": []}'])
def test_from_json_of_a_bad_file_exits_2_with_one_line(tmp_path, capsys, content):
    path = tmp_path / "result.json"
    if content is not None:
        path.write_text(content)
    code = h.main(["--from-json", str(path)])
    out = capsys.readouterr()
    assert code == 2
    assert out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --from-json")
    assert "Traceback" not in out.err


@pytest.mark.parametrize("content", ['{"environment": {}, "rows": []}',
                                     '{"environment": "x", "rows": [{"model": "m"}]}'])
def test_from_json_of_a_hollow_result_exits_2_with_one_line(tmp_path, capsys, content):
    path = tmp_path / "result.json"
    path.write_text(content)
    try:
        code = h.main(["--from-json", str(path)])
    except Exception as exc:  # noqa: BLE001 - the bug: an uncaught traceback
        pytest.fail(f"traceback instead of exit 2: {type(exc).__name__}: {exc}")
    out = capsys.readouterr()
    assert code == 2
    assert len(out.err.strip().splitlines()) == 1


def test_from_json_compare_lists_peak_differences(saved, tmp_path, capsys):
    other = json.loads(saved.read_text())
    other["environment"]["isolation"] = "isolated, one fresh process per arm"
    other["rows"][0]["real_peak"] += 1_000_000
    other_path = tmp_path / "other.json"
    other_path.write_text(json.dumps(other))
    assert h.main(["--from-json", str(saved), "--compare", str(other_path)]) == 0
    out = capsys.readouterr().out
    assert "compare: A = in one process" in out
    assert "B = isolated, one fresh process per arm" in out
    line = next(x for x in out.splitlines() if x.split()[:2] == ["SmolLM2-135M", "2048"])
    assert line.split()[5] == "1000000"


# --- exit codes ------------------------------------------------------------------

def test_exit_code_zero_when_every_row_is_ok(result):
    assert h.exit_code(result) == 0


@pytest.mark.parametrize("status", ["VOID", "OOM", "FAILED", "UNDER"])
def test_exit_code_one_for_any_finding(result, status):
    res = copy.deepcopy(result)
    res["rows"][3]["status"] = status
    assert h.exit_code(res) == 1


def test_exit_code_one_for_a_finding_in_a_determinism_repeat(result):
    res = copy.deepcopy(result)
    res["determinism"] = {"repeats": 2, "arms": [{"rows": [{"status": "ok"},
                                                           {"status": "OOM"}]}]}
    assert h.exit_code(res) == 1


def test_exit_code_one_for_a_failed_control(result):
    res = copy.deepcopy(result)
    res["control"] = {"passed": False}
    assert h.exit_code(res) == 1
    res["control"] = {"passed": True}
    assert h.exit_code(res) == 0


def test_exit_code_130_when_interrupted_even_with_findings(result):
    res = copy.deepcopy(result)
    res["interrupted"] = True
    assert h.exit_code(res) == 130
    res["rows"][0]["status"] = "VOID"
    assert h.exit_code(res) == 130


# --- compare_table ---------------------------------------------------------------

def test_compare_table_lists_the_peak_difference_of_the_same_arm():
    a = make_result([make_row("smol", 4096, 2_657_800_000, index=0),
                     make_row("qwen", 2048, 4_177_000_000, index=1)])
    b = copy.deepcopy(a)
    b["environment"]["isolation"] = "isolated, one fresh process per arm"
    b["rows"][0]["real_peak"] = 2_649_300_000  # the record's determinism repeat
    b["rows"] = b["rows"][:1]  # qwen missing from B: not listed
    table = h.compare_table(a, b)
    lines = [line for line in table.splitlines() if "SmolLM2" in line or "Qwen" in line]
    assert len(lines) == 1
    cells = lines[0].split()
    assert cells[:5] == ["SmolLM2-135M", "4096", "1", "2.6578", "2.6493"]
    assert cells[5] == "-8500000"
    assert cells[6] == f"{-8_500_000 / 2_657_800_000:.3%}"
