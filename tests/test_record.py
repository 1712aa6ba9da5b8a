"""issue395.record: what the record holds (its grid and the map's, the protocol's constants,
every published figure), and the Row that carries those figures: the derived columns, a row's
status, and the one JSON round trip.

Every row is built by the harness's own constructor (``make_row`` -> ``arm_row``, with Soup's
real prediction) or read back by ``Row.from_json``. No GPU is needed: where a real peak is
required, the A10G record's published peak stands in for a CUDA measurement (each test that
does so says so).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace

import pytest
from conftest import SMOL, make_row

from issue395.cuda import attribute_peak
from issue395.options import Run
from issue395.grid import plan_arms
from issue395.arm import Arm, predicted_bytes
from issue395.constants import GB
from issue395.record import (
    DATA_ROWS,
    GRID_ADAPTER_FACTOR,
    LORA_ALPHA,
    LORA_R,
    LORA_TARGETS,
    MAP_BATCHES,
    MAP_SEQS,
    OVERSHOOT,
    QUANTS,
    RECORD_A10G_OVERESTIMATE,
    RECORD_A10G_PEAK,
    RECORD_A10G_PREDICTED,
    RECORD_DETERMINISM,
    RECORD_GRID,
    RECORD_RTX3050,
    SOUP_QUANT,
)
from issue395.row import Row, arm_row, realised_as_requested
from issue395.schema import SCHEMA
from issue395.spread import lost_row
from issue395.tables import determinism_spread, overestimate_summary

# The A10G record's published figures (docs/PROTOCOL.md), typed in here independently of
# the harness's own copies.
PUBLISHED = {  # (model, seq): (predicted GB, real peak GB, pred/real)
    ("smol", 2048): (1.596, 1.3652, 1.169), ("smol", 3072): (2.345, 2.0167, 1.163),
    ("smol", 4096): (3.094, 2.6578, 1.164), ("smol", 4352): (3.281, 2.8184, 1.164),
    ("smol", 5120): (3.842, 3.3030, 1.163), ("smol", 6144): (4.591, 3.9430, 1.164),
    ("qwen", 2048): (4.854, 4.1770, 1.162), ("qwen", 4096): (9.346, 8.0123, 1.166),
    ("qwen", 5120): (11.592, 9.9294, 1.167), ("qwen", 6144): (13.837, 11.8481, 1.168),
}
RECORD_ARMS = list(PUBLISHED)


def record_row(key: str, seq: int, index: int = 0) -> Row:
    """The row an arm builds, the A10G record's published peak standing in for the CUDA
    measurement (no GPU here)."""
    return make_row(key, seq, index=index, real_peak=RECORD_A10G_PEAK[(key, seq)])


def record_rows() -> list[Row]:
    return [record_row(k, s, i) for i, (k, s) in enumerate(RECORD_ARMS)]


def roundtrip(row: Row) -> Row:
    """A row through JSON text, exactly as --json and the row file hold it."""
    return Row.from_json(json.loads(json.dumps(row.to_json())))


# --- the record as data ------------------------------------------------------------

def test_the_grid_and_published_figures_are_the_protocols():
    assert RECORD_GRID == {"smol": (2048, 3072, 4096, 4352, 5120, 6144),
                             "qwen": (2048, 4096, 5120, 6144)}
    assert [(k, s) for k, seqs in RECORD_GRID.items() for s in seqs] == RECORD_ARMS
    assert RECORD_A10G_PREDICTED == {k: (p, r) for k, (p, _, r) in PUBLISHED.items()}
    assert {k: round(v / 1e9, 4) for k, v in RECORD_A10G_PEAK.items()} == \
        {k: real for k, (_, real, _) in PUBLISHED.items()}
    assert RECORD_A10G_OVERESTIMATE == {"mean": 1.152, "pstdev": 0.0249}


def test_each_published_ratio_is_its_predicted_over_its_real_peak():
    for arm, (predicted_gb, ratio) in RECORD_A10G_PREDICTED.items():
        assert round(predicted_gb * GB / RECORD_A10G_PEAK[arm], 3) == ratio, arm


def test_the_other_published_runs_lie_on_the_grid_and_repeat_the_a10g_peaks():
    assert all(seq in RECORD_GRID[model] for model, seq in RECORD_RTX3050)
    for arm, (first, second, spread_pct) in RECORD_DETERMINISM.items():
        assert first == RECORD_A10G_PEAK[arm] / GB  # the first run is the grid's peak
        assert round((max(first, second) / min(first, second) - 1) * 100, 2) == spread_pct


def test_the_protocols_constants():
    assert (LORA_R, LORA_ALPHA, LORA_TARGETS) == (8, 16, ("q_proj", "v_proj"))
    assert (DATA_ROWS, OVERSHOOT, GB, SCHEMA) == (4, 3, 1e9, 2)
    assert SOUP_QUANT == {"none": "none", "nf4": "4bit"}


def test_the_grids_adapter_count_is_twice_loras_a_and_b_on_q_and_v():
    """PROTOCOL: SmolLM2's 921,600 = 2 x 460,800, r 8 on q_proj (576 -> 576) and v_proj
    (576 -> 3 kv heads x 64) in each of its 30 layers."""
    per_layer = LORA_R * ((576 + 576) + (576 + 3 * 64))
    assert GRID_ADAPTER_FACTOR * 30 * per_layer == SMOL.grid_adapter == 921_600


def test_the_map_grid_reaches_below_the_records_and_every_quantization_has_a_soup_spelling():
    assert MAP_SEQS == tuple(sorted(MAP_SEQS)) and MAP_SEQS[:2] == (512, 1024)
    assert MAP_SEQS[1] < min(min(seqs) for seqs in RECORD_GRID.values())  # where NF4's misses live
    assert MAP_BATCHES == (1, 4)
    assert set(QUANTS) == set(SOUP_QUANT)


def test_plan_arms_is_the_record_grid_in_order():
    arms = plan_arms(["smol", "qwen"], None, [1])
    assert [(a.model, a.seq, a.batch) for a in arms] == [(k, s, 1) for k, s in RECORD_ARMS]
    assert [a.index for a in arms] == list(range(10))


def test_plan_arms_orders_model_then_seq_then_batch():
    arms = plan_arms(["qwen", "smol"], [4096, 2048], [2, 1])
    assert [(a.model, a.seq, a.batch) for a in arms] == [
        ("qwen", 4096, 2), ("qwen", 4096, 1), ("qwen", 2048, 2), ("qwen", 2048, 1),
        ("smol", 4096, 2), ("smol", 4096, 1), ("smol", 2048, 2), ("smol", 2048, 1)]
    assert [a.index for a in arms] == list(range(8))


# --- the derived columns against the record (record peaks stand in for CUDA) -----

@pytest.mark.parametrize("key,seq", RECORD_ARMS)
def test_pred_over_record_peak_reproduces_published_ratio(key, seq):
    """Every row matches the published ratio to 3 decimals exactly (no slack needed)."""
    row = record_row(key, seq)
    assert row.status == "ok"
    assert round(row.pred_over_real, 3) == PUBLISHED[(key, seq)][2]
    assert row.pred_over_real == row.predicted / RECORD_A10G_PEAK[(key, seq)]
    assert row.record_peak == RECORD_A10G_PEAK[(key, seq)]
    assert row.vs_record == 1.0  # the record's own peak, against the record


@pytest.mark.parametrize("key,seq", RECORD_ARMS)
def test_retained_copy_would_not_fit_in_any_record_row(key, seq):
    row = record_row(key, seq)
    assert row.logits14 > row.real_peak
    assert row.retained_copy_would_fit is False


def test_nonlogits_overestimate_reproduces_record_mean_and_pstdev():
    """Over the ten rows built with the record's peaks (standing in for CUDA)."""
    rows = record_rows()
    for r in rows:
        assert r.nonlogits_overestimate == pytest.approx(
            (r.predicted - 14 * r.elements) / (r.real_peak - 12 * r.elements))
    vals = [r.nonlogits_overestimate for r in rows]
    assert round(statistics.fmean(vals), 3) == 1.152
    assert round(statistics.pstdev(vals), 4) == 0.0249
    s = overestimate_summary(rows)
    assert s["n"] == 10
    assert s["mean"] == pytest.approx(statistics.fmean(vals))
    assert s["pstdev"] == pytest.approx(statistics.pstdev(vals))


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


def test_retained_copy_flag_is_true_when_14xE_fits_under_the_peak():
    pred = predicted_bytes(SMOL, 2048)
    row = make_row("smol", 2048, real_peak=pred)
    assert row.retained_copy_would_fit is True
    assert row.pred_over_real == 1.0
    assert row.status == "ok"  # equal is not under


# --- status --------------------------------------------------------------------------

SEQ = 4096
PRED = predicted_bytes(SMOL, SEQ)


def test_status_ok_when_the_prediction_covers_the_peak():
    assert make_row("smol", SEQ, real_peak=PRED - 1).status == "ok"
    assert make_row("smol", SEQ, real_peak=PRED).status == "ok"


def test_status_under_when_the_prediction_is_below_the_peak():
    row = make_row("smol", SEQ, real_peak=PRED + 1)
    assert row.status == "UNDER"
    assert row.measured is True
    assert row.pred_over_real == PRED / (PRED + 1) < 1


def test_status_void_when_realised_differs_even_with_a_peak():
    assert make_row("smol", SEQ, real_peak=PRED // 2, realised_width=4000,
                    realised_rows=(4000,)).status == "VOID"
    # A short row whose peak would read as an under-prediction is VOID first.
    assert make_row("smol", SEQ, real_peak=PRED * 2, realised_width=4000,
                    realised_rows=(4000,)).status == "VOID"


def test_status_void_when_the_batch_is_wider_than_seq_though_every_row_is_not():
    """input_ids.shape[-1] is what the step runs at: padding past seq voids the row even
    when every attention mask sums to seq."""
    row = make_row("smol", SEQ, real_peak=PRED // 2, realised_width=SEQ + 64, realised_rows=(SEQ,))
    assert row.status == "VOID"
    assert row.realised == SEQ + 64
    assert realised_as_requested(SEQ, 1, SEQ + 64, [SEQ]) is False


def test_status_void_when_one_row_of_a_batch_is_short():
    row = make_row("smol", SEQ, batch=2, real_peak=PRED // 2, realised_rows=(SEQ, SEQ - 6))
    assert row.realised_width == SEQ  # the batch is seq wide: only the short row shows it
    assert row.status == "VOID"
    assert row.realised == SEQ - 6
    assert make_row("smol", SEQ, batch=2, real_peak=PRED // 2).status == "ok"


def test_status_void_when_fewer_rows_than_batch():
    assert make_row("smol", SEQ, batch=2, real_peak=PRED // 2, realised_rows=(SEQ,)).status == "VOID"
    assert realised_as_requested(SEQ, 2, SEQ, [SEQ]) is False
    assert realised_as_requested(SEQ, 2, SEQ, [SEQ, SEQ]) is True


def test_status_void_when_nothing_was_realised():
    assert make_row("smol", SEQ, real_peak=PRED // 2, realised_width=None,
                    realised_rows=()).status == "VOID"


@pytest.mark.parametrize("kind", ["OOM", "FAILED"])
def test_failure_wins_over_every_other_status(kind):
    assert make_row("smol", SEQ, real_peak=PRED // 2, failure=kind).status == kind
    assert make_row("smol", SEQ, real_peak=PRED * 2, failure=kind).status == kind
    assert make_row("smol", SEQ, failure=kind, realised_width=None, realised_rows=()).status == kind
    assert make_row("smol", SEQ, failure=kind, dry_run=True).status == kind


def test_status_without_a_peak_is_failed_unless_dry_run():
    assert make_row("smol", SEQ).status == "FAILED"
    assert make_row("smol", SEQ, dry_run=True).status == "dry-run"
    # The guard holds in a dry run too.
    assert make_row("smol", SEQ, dry_run=True, realised_width=100, realised_rows=(100,)).status == "VOID"


@pytest.mark.parametrize("measured", [
    dict(real_peak=PRED // 2, realised_width=4000, realised_rows=(4000,)),  # VOID
    dict(real_peak=PRED // 2, realised_width=SEQ + 64),  # VOID: wider than seq
    dict(real_peak=PRED // 2, failure="FAILED", error="boom"),
    dict(real_peak=PRED // 2, failure="OOM", error="CUDA out of memory"),
    dict(dry_run=True),
    dict(),  # no peak, not a dry run: FAILED
], ids=["void-short", "void-wide", "failed", "oom", "dry-run", "no-peak"])
def test_a_row_not_ok_or_under_has_no_ratio_even_with_a_real_peak(measured):
    row = make_row("smol", SEQ, **measured)
    assert row.status not in ("ok", "UNDER")
    assert row.measured is False
    assert (row.pred_over_real, row.nonlogits_overestimate, row.retained_copy_would_fit,
            row.vs_record) == (None, None, None, None)
    # Soup's figures for the arm are still there: they do not depend on a measurement.
    assert row.predicted == PRED and row.logits14 == 14 * SEQ * SMOL.vocab
    assert row.record_peak == RECORD_A10G_PEAK[("smol", SEQ)]


def test_realised_prefers_the_furthest_and_shortest_length():
    assert make_row("smol", 2048, batch=2).realised == 2048
    assert make_row("smol", 2048, batch=3, realised_rows=(2048, 2050, 2046)).realised == 2046  # tie
    assert make_row("smol", 2048, batch=2, realised_rows=(2048, 2047), realised_width=2100).realised == 2100
    assert make_row("smol", 2048, batch=2, realised_rows=(2000, 2048), realised_width=2050).realised == 2000
    assert make_row("smol", 2048, realised_rows=(), realised_width=1900).realised == 1900
    assert make_row("smol", 2048, realised_rows=(), realised_width=None).realised is None


# --- vs_record ----------------------------------------------------------------------

def test_vs_record_is_real_over_record_on_a_record_arm_at_batch_1():
    rec = RECORD_A10G_PEAK[("qwen", 5120)]
    row = make_row("qwen", 5120, real_peak=10_000_000_000)
    assert row.record_peak == rec
    assert row.vs_record == 10_000_000_000 / rec


def test_vs_record_only_on_record_arms_and_batch_1():
    assert make_row("smol", 2048, batch=2, real_peak=1_400_000_000).record_peak is None
    assert make_row("smol", 2048, batch=2, real_peak=1_400_000_000).vs_record is None
    assert make_row("smol", 2560, real_peak=1_400_000_000).vs_record is None  # off the grid
    custom = replace(SMOL, key="custom", record=False)
    row = arm_row(Arm("custom", 2048), custom, realised_width=2048, realised_rows=(2048,),
                    real_peak=1_400_000_000)
    assert row.status == "ok"
    assert (row.record_peak, row.vs_record) == (None, None)
    # A record arm without a measurement keeps the record's figure but has no ratio.
    row = make_row("smol", 2048, dry_run=True)
    assert (row.record_peak, row.vs_record) == (RECORD_A10G_PEAK[("smol", 2048)], None)


# --- the one JSON round trip -----------------------------------------------------------

def attribution_of_a_step() -> dict:
    snap = {"device_traces": [[{"action": "alloc", "addr": 1, "size": 2 * 2048 * 49152},
                               {"action": "alloc", "addr": 2, "size": 100}]]}
    return attribute_peak(snap, 1000, 2048 * 49152, None)


ROUND_TRIP_ROWS = {
    "ok": lambda: make_row("smol", 2048, real_peak=1_365_200_000, resident=1234, reserved=1_400_000_000,
                           base="/ckpt", gpu="0: H200", timings={"setup_s": 1.5, "step_s": 0.2}),
    "under": lambda: make_row("qwen", 6144, index=9, real_peak=20_000_000_000),
    "void": lambda: make_row("smol", 4096, batch=2, index=3, real_peak=2_000_000_000,
                             realised_rows=(4096, 4000)),
    "oom": lambda: make_row("qwen", 6144, failure="OOM", error="CUDA out of memory",
                            oom_request=1_288_490_188, teardown_error="RuntimeError: x"),
    "dry-run": lambda: make_row("smol", 3072, index=1, dry_run=True),
    "repeat": lambda: make_row("smol", 4096, index=2, repeat=2, real_peak=2_657_800_000),
    "attributed": lambda: make_row("smol", 2048, real_peak=1_365_200_000,
                                   attribution=attribution_of_a_step()),
    "lost": lambda: lost_row(Arm("qwen", 2048, 1, 6), Run(), None, -9),
}


@pytest.mark.parametrize("name", list(ROUND_TRIP_ROWS))
def test_row_json_round_trip_gives_an_equal_row(name):
    row = ROUND_TRIP_ROWS[name]()
    back = roundtrip(row)
    assert back == row
    assert back.to_json() == row.to_json()
    assert back.status == row.status


def test_row_json_carries_the_derived_verdicts_for_readers():
    row = record_row("smol", 2048)
    d = row.to_json()["derived"]
    assert d["status"] == "ok"
    assert d["realised"] == 2048
    assert d["pred_over_real"] == row.pred_over_real
    assert d["retained_copy_would_fit"] is False


def test_from_json_re_derives_status_from_the_measured_fields():
    saved = record_row("smol", 2048).to_json()
    under = Row.from_json(dict(saved, real_peak=saved["predicted"] + 1))
    assert under.status == "UNDER"
    void = Row.from_json(dict(saved, realised_width=1000))
    assert void.status == "VOID"
    assert void.pred_over_real is None and void.nonlogits_overestimate is None


def test_from_json_never_reads_the_derived_block_back():
    row = make_row("smol", 2048, real_peak=1_365_200_000, realised_rows=(1900,))
    saved = json.loads(json.dumps(row.to_json()))
    assert saved["derived"]["status"] == "VOID"
    saved["derived"].update(status="ok", pred_over_real=1.169, realised=2048, vs_record=1.0)
    back = Row.from_json(saved)
    assert back == row
    assert back.status == "VOID" and back.pred_over_real is None
    assert back.to_json()["derived"] == row.to_json()["derived"]
    del saved["derived"]
    assert Row.from_json(saved) == row


@pytest.mark.parametrize("peak", [0, -5, float("nan"), float("inf"), True, 1.5, "1365200000"])
def test_from_json_refuses_a_real_peak_that_is_not_a_measurement(peak):
    saved = record_row("smol", 2048).to_json()
    with pytest.raises(ValueError, match="real_peak"):
        Row.from_json(dict(saved, real_peak=peak))


def test_from_json_refuses_nan_read_from_json_text():
    text = json.dumps(record_row("smol", 2048).to_json()).replace('"real_peak": 1365200000',
                                                                  '"real_peak": NaN')
    assert "NaN" in text
    with pytest.raises(ValueError, match="real_peak"):
        Row.from_json(json.loads(text))


def test_from_json_refuses_an_unknown_field():
    saved = record_row("smol", 2048).to_json()
    with pytest.raises(ValueError, match="peak_gb"):
        Row.from_json(dict(saved, peak_gb=1.3652))


@pytest.mark.parametrize("kind", ["CRASH", "oom", ""])
def test_from_json_refuses_a_failure_kind_it_does_not_know(kind):
    saved = make_row("smol", 2048, failure="OOM", error="x").to_json()
    assert Row.from_json(saved).status == "OOM"
    with pytest.raises(ValueError, match="failure"):
        Row.from_json(dict(saved, failure=kind))


@pytest.mark.parametrize("field,value", [("seq", 0), ("batch", True), ("vocab", 49152.0),
                                         ("realised_rows", [2048, -1]), ("realised_rows", "2048"),
                                         ("loss_bytes_per_element", float("nan")),
                                         ("predicted", None)])
def test_from_json_refuses_other_fields_that_cannot_be_judged(field, value):
    saved = record_row("smol", 2048).to_json()
    with pytest.raises(ValueError):
        Row.from_json(dict(saved, **{field: value}))


@pytest.mark.parametrize("field", ["logits14", "loss_bytes_per_element"])
def test_from_json_refuses_a_measured_row_without_soups_logits_figures(field):
    """A measured row's verdicts need Soup's 14 x E and its 12 bytes: without them the row
    cannot be judged, so it must be refused here, not crash the tables later."""
    saved = record_row("smol", 2048).to_json()
    with pytest.raises(ValueError):
        Row.from_json(dict(saved, **{field: None}))


def test_from_json_refuses_a_row_without_its_grid_index():
    """Rows are ordered and merged by index; a row without one cannot be placed."""
    saved = record_row("smol", 2048).to_json()
    with pytest.raises(ValueError, match="index"):
        Row.from_json(dict(saved, index=None))


# --- determinism: peaks per fresh process ----------------------------------------------

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
