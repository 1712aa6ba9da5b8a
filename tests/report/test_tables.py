"""issue395.report.tables: the sweep table has each model's section, its realised column, pred/real per row
and the legend above the over-estimate summary; a row that carried bytes from earlier arms says so;
compare lists only the arms measured in both; the over-estimate summary counts ok and UNDER rows only;
the determinism spread takes only measured peaks. The verdict counts an OOM at Soup's own cap as the under-prediction it is; a
sweep row under by Soup's own number says so; compare matches the same quantization only; a --model
row claims no A10G record; the margins' notes name the term that misses, in grid order, under a
legend; compare's header names both stacks; --measure prints four decimals and --sdpa's columns align;
an interrupted dry run says its rows were set up, not measured. Committed results and rows built by
the harness's own constructor with a peak (the A10G record's, in conftest's result) standing in for a
CUDA measurement; nothing else faked."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import MAP_512, ROOT, SMOL, SWEEP, make_result, make_row, record_row, record_rows, table_lines

from issue395.results.extras import UserConfig
from issue395.model.arm import Arm, predicted_bytes
from issue395.record import RECORD_GRID
from issue395.model.registry import SHAPES
from issue395.results.result import Result
from issue395.results.row import Row, arm_row
from issue395.results.saved import load_result
from issue395.report.tables import (SWEEP_LEGEND, compare_table, determinism_spread, margins_table, measure_table,
                             models_in, overestimate_summary, render_text, sdpa_table, sweep_table, verdict_line)

ISSUE16 = ROOT / "results" / "cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37"


def test_the_cap_soup_verdict_names_the_ooms_at_soups_number_as_under_predictions():
    saved = Result.from_json(json.loads((ISSUE16 / "cap-soup.json").read_text()))
    line = verdict_line(saved.rows)
    assert line.startswith("verdict: Soup UNDER-predicts 6 of 9 judged row(s)")
    assert "never under" not in line and "phi-2 nf4 seq 2048 batch 1" in line


def test_a_verdict_without_ooms_at_soups_cap_is_unchanged():
    saved = Result.from_json(json.loads((ISSUE16 / "cap-needs-free.json").read_text()))
    assert verdict_line(saved.rows).startswith("verdict: Soup UNDER-predicts 3 of 12 measured row(s); the contract")


def test_a_sweep_row_under_by_soups_own_number_says_so_beside_its_ratio():
    peak = 1_500_000_000
    row = make_row(real_peak=peak, soup_predicted=peak - 1)
    text = sweep_table([row])
    assert "UNDER by Soup's own pre-flight" in text and row.status == "UNDER"


def test_compare_matches_the_same_quantization_only():
    bf16 = make_row(real_peak=10**9)
    nf4 = arm_row(Arm("smol", 2048, 1, 0, "nf4"), SMOL, realised_width=2048, realised_rows=(2048,),
                    real_peak=9 * 10**8)
    a = Result(environment={"arms": "a", "date": "d"}, rows=[bf16, nf4])
    text = compare_table(a, a)
    assert "2 of 2 shared arm(s) equal to the byte" in text
    lines = [line.split() for line in text.splitlines() if line.split()[:1] == ["SmolLM2-135M"]]
    assert [cells[1] for cells in lines] == ["none", "nf4"], "two arms of one seq, told apart"
    assert "quant" not in compare_table(*[Result(environment={}, rows=[bf16])] * 2)


def test_custom_model_rows_claim_no_a10g_record():
    row = dataclasses.replace(make_row("smol", 64), model="my-model", model_key="custom")
    text = sweep_table([row])
    assert "A10G: the record" not in text.splitlines()[0] and "no A10G record" in text.splitlines()[0]
    assert "A10G: the record" in sweep_table([make_row("smol", 2048)]).splitlines()[0]
    own = make_row("smol", 2048, config=UserConfig("soup.yaml", 4, 8))  # the user's config on smol
    assert "no A10G record" in sweep_table([own]).splitlines()[0]


def test_compare_pairs_rows_by_their_arm_not_by_the_name_they_display():
    """A saved row whose label reads differently (an older tool's wording) is still the same arm;
    a --model checkpoint that happens to share a family's name is not that family's arm. Paired
    by display name, both would come out wrong."""
    import dataclasses

    row = make_row(real_peak=10**9)
    relabelled = dataclasses.replace(row, model="SmolLM2-135M (older label)", real_peak=10**9 + 512)
    text = compare_table(Result(environment={}, rows=[row]), Result(environment={}, rows=[relabelled]))
    assert "0 of 1 shared arm(s) equal to the byte" in text and "512" in text.splitlines()[-2]
    lookalike = dataclasses.replace(row, model_key="custom")  # a local folder named SmolLM2-135M
    assert "0 of 0 shared" in compare_table(Result(environment={}, rows=[row]),
                                            Result(environment={}, rows=[lookalike]))


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
    from issue395.results.result import Result

    rows = [dataclasses.replace(make_row("smol", 64), dry_run=True)]
    env = load_result(str(SWEEP)).environment
    text = render_text(Result(environment=dict(env, dry_run=True), rows=rows, interrupted=True))
    assert "1 row(s) set up" in text and "row(s) measured" not in text


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


def test_a_row_that_carried_bytes_from_earlier_arms_says_so_under_the_tables():
    clean = make_row("smol", 2048, index=0, real_peak=10**9, carried=0)
    carried = make_row("qwen", 2048, index=1, real_peak=4 * 10**9, carried=1024)
    out = render_text(make_result([clean, carried]))
    assert "carried: 1 row(s) began with bytes earlier arms left allocated (up to 1,024)" in out
    assert "carried" not in render_text(make_result([clean]))
    assert Row.from_json(carried.to_json()).carried == 1024
    with pytest.raises(ValueError, match="carried"):
        Row.from_json(dict(carried.to_json(), carried=-1))


def test_overestimate_summary_counts_ok_and_under_rows_only():
    """A VOID row measured with a wild peak, a FAILED and an OOM row carrying a peak, and a
    dry run: none of them has an over-estimate, so none moves the summary."""
    rows = record_rows()
    s = overestimate_summary(rows)
    void = make_row("smol", 2048, index=10, real_peak=50_000_000,
                    realised_width=1900, realised_rows=(1900,))
    failed = make_row("smol", 3072, index=11, real_peak=60_000_000, failure="FAILED", error="x")
    oom = make_row("qwen", 6144, index=12, real_peak=60_000_000, failure="OOM", error="x")
    dry = make_row("smol", 4096, index=13, dry_run=True)
    assert [r.status for r in (void, failed, oom, dry)] == ["VOID", "FAILED", "OOM", "dry-run"]
    assert overestimate_summary(rows + [void, failed, oom, dry]) == s
    assert overestimate_summary([void, failed, oom, dry]) is None

    under_peak = predicted_bytes(SMOL, 4096) + 1
    under = make_row("smol", 4096, real_peak=under_peak)
    assert under.status == "UNDER"
    assert overestimate_summary([under, failed]) == {
        "n": 1, "mean": under.nonlogits_overestimate, "pstdev": 0.0}


def test_determinism_spread_takes_only_measured_peaks():
    a = make_row("smol", 4096, index=2, repeat=1, real_peak=2_657_800_000)
    b = make_row("smol", 4096, index=2, repeat=2, real_peak=2_649_300_000)
    void = make_row("smol", 6144, index=5, repeat=1, real_peak=3_943_000_000,
                    realised_rows=(6000,))
    ok = make_row("smol", 6144, index=5, repeat=2, real_peak=3_943_900_000)
    first, second = determinism_spread([ok, b, void, a])
    assert first["row"] is a and first["peaks"] == [a.real_peak, b.real_peak]
    assert first["spread_pct"] == pytest.approx((2_657_800_000 - 2_649_300_000) / 2_649_300_000 * 100)
    assert round(first["spread_pct"], 2) == 0.32  # the record's spread for this arm
    assert second["peaks"] == [None, ok.real_peak]
    assert second["statuses"] == ["VOID", "ok"]
    assert second["spread_pct"] is None


def test_a_task_arm_is_its_own_line_of_the_map_and_its_summary_and_its_own_section_of_the_sweep():
    from issue395.report.tables import map_summary, map_table, sweep_table

    shape = SHAPES["qwen"]
    rows = [arm_row(Arm("qwen", 2048, 1, 0), shape, realised_width=2048, realised_rows=(2048,), dry_run=True),
            arm_row(Arm("qwen", 2048, 1, 1, task="dpo"), shape, realised_width=2048, realised_rows=(2048, 2048),
                    dry_run=True)]
    lines = map_table(rows).splitlines()
    assert [line.split()[:2] for line in lines if line.startswith(shape.name)] == [
        [shape.name, "none"], [shape.name, "dpo"]]
    assert sum(1 for line in map_summary(rows).splitlines() if line.startswith(f"{shape.name} dpo")) == 1
    assert f"{shape.name} dpo  (predicted" in sweep_table(rows)
    assert "lower/real is Soup's own number alone" in map_table(rows)
    assert "lower/real is Soup's own number alone" not in map_table(rows[:1])


# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


def test_a_dry_run_table_says_soups_number_there_is_the_cpu_budgets():
    """Issue 29 item 13: a dry run's sweep table says Soup's number there is the CPU budget's (float32,
    --estimate), and a measured table does not."""
    from dataclasses import replace as swap

    from issue395.report.tables import sweep_table
    from issue395.results.result import Result
    from conftest import ROOT

    saved = Result.from_json(json.loads((ROOT / "results/margin-map-in-4-parts-h200-soup0.73.3-3238e1a-to-b3a7891/"
                                         "full-cold.json").read_text()))
    measured = sweep_table(saved.rows[:2])
    assert "float32" not in measured
    dry = sweep_table([swap(r, dry_run=True, real_peak=None) for r in saved.rows[:2]])
    (line,) = [ln for ln in dry.splitlines() if "float32" in ln]
    assert "--estimate" in line and "CPU" in line


def test_the_probe_table_flags_soups_probe_verdict_against_the_real_step_and_a_map_without_probes_has_none():
    """Issue 51 item 5: each probed row's probe peak beside its real peak, their ratio and Soup's verdict; an
    admit whose real step is past the free memory Soup read, and a refusal of one inside it, are flagged; a row the
    probe did not run on says why; a map without probed rows prints no such table, and its rows' JSON has no
    soup_probe key (what rows saved before it hold), while a probed row's reads back equal."""
    from issue395.report.tables import probe_table
    from issue395.results.extras import SoupProbe

    gb = 10**9
    admits = make_row("smol", 1024, 1, index=0, real_peak=3 * gb, soup_predicted=gb,
                      soup_probe=SoupProbe("soup", peak=2 * gb, rows=1, seq=1024, available=int(2.5 * gb), admits=True,
                                           ceiling=4.0))
    from issue395.tasks import task

    refuses = make_row("smol", 1024, 1, index=1, task="dpo", real_peak=gb, soup_predicted=gb,
                       realised_rows=(1024,) * task("dpo").guard_rows(1),
                       soup_probe=SoupProbe("called", peak=3 * gb, rows=2, seq=1024, available=2 * gb, admits=False))
    idle = make_row("smol", 1024, 1, index=2, task="kto", dry_run=True, soup_probe=SoupProbe("called", outcome="not run"))
    text = probe_table([admits, refuses, idle])
    lines = text.splitlines()
    assert "admits, real peak past free" in lines[3] and "0.667x" in lines[3] and "Soup's setup" in lines[3]
    assert "refuses, real peak fits" in lines[4] and "3.000x" in lines[4] and "this tool" in lines[4]
    assert "not run" in lines[5] and "within 4x" in text
    assert probe_table([make_row("smol", 1024, 1)]) == ""
    assert "soup_probe" not in make_row("smol", 1024, 1).to_json()
    assert Row.from_json(json.loads(json.dumps(refuses.to_json()))) == refuses
