"""The record's figures: Soup's prediction, the derived columns, row status.

Everything here is computed by Soup's real estimator (soup_cli) from the grid's
shape figures, against the A10G record's published numbers. No GPU is needed:
where a real peak is required, the record's published A10G peak stands in for
a CUDA measurement (said in each test that does so).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import issue395_second_stack_vram as h  # noqa: E402

# PROTOCOL.md's shape table, typed in independently of h.SHAPES.
PROTOCOL_SHAPES = {
    "smol": dict(pool=14160384, extras=56624256, adapter=921600, vocab=49152, hidden=576,
                 intermediate=1536, n_layers=30),
    "qwen": dict(pool=59649536, extras=272271104, adapter=1081344, vocab=151936, hidden=896,
                 intermediate=4864, n_layers=24),
}
RECORD_ARMS = [(k, s) for k, seqs in h.RECORD_GRID.items() for s in seqs]


def record_row(key: str, seq: int) -> dict:
    """A row as run_arm builds it, with the A10G record's published peak standing in
    for the CUDA measurement (no GPU here)."""
    shape = h.SHAPES[key]
    predicted = h.predicted_bytes(shape, seq)
    real = h.RECORD_A10G_PEAK[(key, seq)]
    row = {"model": shape.name, "model_key": key, "seq": seq, "batch": 1, "realised": seq,
           "realised_rows": [seq], "predicted": predicted, "real_peak": real,
           "error_kind": None, "dry_run": False}
    row.update(h.derived_columns(shape, seq, 1, predicted, real))
    row.update(h.record_columns(shape, seq, 1, real))
    row["status"] = h.row_status(row)
    return row


def test_grid_and_shapes_are_the_protocols():
    assert h.RECORD_GRID == {"smol": (2048, 3072, 4096, 4352, 5120, 6144),
                             "qwen": (2048, 4096, 5120, 6144)}
    assert len(RECORD_ARMS) == 10
    for key, figures in PROTOCOL_SHAPES.items():
        shape = h.SHAPES[key]
        assert {f: getattr(shape, f) for f in figures} == figures


@pytest.mark.parametrize("key,seq", RECORD_ARMS)
def test_predicted_bytes_is_soups_estimator_with_protocol_arguments(key, seq):
    from soup_cli.utils.layer_stream import estimate_stream_peak_vram

    s = PROTOCOL_SHAPES[key]
    direct = estimate_stream_peak_vram(
        layer_bytes=s["pool"] // 2, buffers=2, extras_bytes=s["extras"],
        adapter_params=s["adapter"], vocab_size=s["vocab"], hidden_size=s["hidden"],
        intermediate_size=s["intermediate"], n_layers=s["n_layers"], seq_len=seq, batch_size=1)
    pred = h.predicted_bytes(h.SHAPES[key], seq)
    assert pred == int(direct)
    assert round(pred / 1e9, 3) == h.RECORD_A10G_PREDICTED[(key, seq)][0]


def test_smollm2_seq_2048_prediction_is_the_protocols_exact_bytes():
    pred = h.predicted_bytes(h.SHAPES["smol"], 2048)
    version = metadata.version("soup-cli")
    if version != "0.73.3" and pred != 1596396768:
        pytest.skip(f"PROTOCOL's exact figure is for soup-cli 0.73.3; installed {version} "
                    f"gives {pred}")
    assert pred == 1596396768


def test_predicted_bytes_grows_with_batch():
    one = h.predicted_bytes(h.SHAPES["smol"], 4096, 1)
    two = h.predicted_bytes(h.SHAPES["smol"], 4096, 2)
    assert two > one


@pytest.mark.parametrize("key,seq", RECORD_ARMS)
def test_pred_over_record_peak_reproduces_published_ratio(key, seq):
    """The record's published A10G peak stands in for a CUDA measurement.
    Every row matches to 3 decimals exactly (no rounding slack was needed)."""
    row = record_row(key, seq)
    assert round(row["pred_over_real"], 3) == h.RECORD_A10G_PREDICTED[(key, seq)][1]
    assert row["status"] == "ok"


@pytest.mark.parametrize("key,seq", RECORD_ARMS)
def test_retained_copy_would_not_fit_in_any_record_row(key, seq):
    """14 x E exceeds every published A10G peak (the peak stands in for CUDA)."""
    row = record_row(key, seq)
    from soup_cli.utils.layer_stream import LOGITS_BYTES_PER_ELEMENT, LOGITS_LOSS_BYTES_PER_ELEMENT

    elements = seq * h.SHAPES[key].vocab
    assert row["elements"] == elements
    assert row["logits14_bytes"] == LOGITS_BYTES_PER_ELEMENT * elements
    assert row["logits12_bytes"] == LOGITS_LOSS_BYTES_PER_ELEMENT * elements
    assert row["nonlogits_modelled_bytes"] == row["predicted"] - row["logits14_bytes"]
    assert row["logits14_bytes"] > row["real_peak"]
    assert row["retained_copy_would_fit"] is False


def test_nonlogits_overestimate_reproduces_record_mean_and_pstdev():
    """Computed from derived_columns over the ten rows, the record's published peaks
    standing in for CUDA measurements."""
    rows = [record_row(k, s) for k, s in RECORD_ARMS]
    vals = [r["nonlogits_overestimate"] for r in rows]
    for r in rows:
        assert r["nonlogits_overestimate"] == pytest.approx(
            r["nonlogits_modelled_bytes"] / (r["real_peak"] - r["logits12_bytes"]))
    assert round(statistics.fmean(vals), 3) == h.RECORD_A10G_OVERESTIMATE["mean"] == 1.152
    assert round(statistics.pstdev(vals), 4) == h.RECORD_A10G_OVERESTIMATE["pstdev"] == 0.0249


def test_overestimate_summary_matches_record_and_ignores_void_rows():
    """Record peaks stand in for CUDA measurements; a VOID row with a wild ratio must
    not move the summary."""
    rows = [record_row(k, s) for k, s in RECORD_ARMS]
    s = h.overestimate_summary(rows)
    assert s["n"] == 10
    assert round(s["mean"], 3) == 1.152
    assert round(s["pstdev"], 4) == 0.0249

    void = record_row("smol", 2048)
    void["realised"] = 1900
    void["realised_rows"] = [1900]
    void["status"] = h.row_status(void)
    assert void["status"] == "VOID"
    void["nonlogits_overestimate"] = 50.0  # would wreck the mean if counted
    again = h.overestimate_summary(rows + [void])
    assert again == s
    assert h.overestimate_summary([void]) is None


def test_overestimate_summary_counts_under_rows_but_not_failed_ones():
    under = record_row("smol", 4096)
    under["status"] = "UNDER"
    failed = record_row("smol", 6144)
    failed["status"] = "FAILED"
    s = h.overestimate_summary([under, failed])
    assert s["n"] == 1
    assert s["mean"] == under["nonlogits_overestimate"]


def test_derived_columns_without_a_peak_leave_ratios_empty():
    shape = h.SHAPES["qwen"]
    pred = h.predicted_bytes(shape, 2048)
    d = h.derived_columns(shape, 2048, 1, pred, None)
    assert d["pred_over_real"] is None
    assert d["nonlogits_overestimate"] is None
    assert d["retained_copy_would_fit"] is None
    assert d["logits14_bytes"] == 14 * 2048 * shape.vocab


def test_retained_copy_flag_is_true_when_14xE_fits_under_the_peak():
    shape = h.SHAPES["smol"]
    pred = h.predicted_bytes(shape, 2048)
    d = h.derived_columns(shape, 2048, 1, pred, real_peak=pred)
    assert d["retained_copy_would_fit"] is True
    assert d["pred_over_real"] == 1.0


# --- row_status ---------------------------------------------------------------

def base_row(**kw):
    row = {"seq": 4096, "batch": 1, "realised": 4096, "realised_rows": [4096],
           "predicted": 3_000_000_000, "real_peak": 2_600_000_000, "error_kind": None,
           "dry_run": False}
    row.update(kw)
    return row


def test_row_status_ok_when_prediction_covers_peak():
    assert h.row_status(base_row()) == "ok"
    assert h.row_status(base_row(real_peak=3_000_000_000)) == "ok"  # equal is not under


def test_row_status_under_when_prediction_below_peak():
    assert h.row_status(base_row(real_peak=3_000_000_001)) == "UNDER"


def test_row_status_void_when_realised_differs_even_with_a_peak():
    assert h.row_status(base_row(realised=4000, realised_rows=[4000])) == "VOID"
    # A short row that would also look like an under-prediction is still VOID first.
    assert h.row_status(base_row(realised=4000, realised_rows=[4000],
                                 real_peak=9_000_000_000)) == "VOID"


def test_row_status_void_when_the_batch_is_wider_than_seq_though_every_row_is_not():
    """input_ids.shape[-1] is what the step runs at: padding past seq (a collator's
    pad_to_multiple_of, say) voids the row even when every attention mask sums to seq."""
    assert h.row_status(base_row(realised=4096, realised_rows=[4096],
                                 realised_width=4160)) == "VOID"
    assert h.row_status(base_row(realised=4096, realised_rows=[4096],
                                 realised_width=4096)) == "ok"


def test_row_status_void_when_one_row_of_a_batch_is_short():
    lengths = [4096, 4090]
    assert h.realised_length(lengths, 4096) == 4090
    # Even if the table's single realised figure were the batch width, the short row voids it.
    assert h.row_status(base_row(batch=2, realised=4096, realised_rows=lengths)) == "VOID"
    assert h.row_status(base_row(batch=2, realised=4090, realised_rows=lengths)) == "VOID"
    assert h.row_status(base_row(batch=2, realised=4096, realised_rows=[4096, 4096])) == "ok"


def test_row_status_void_when_fewer_rows_than_batch():
    assert h.row_status(base_row(batch=2, realised=4096, realised_rows=[4096])) == "VOID"


@pytest.mark.parametrize("kind", ["OOM", "FAILED"])
def test_row_status_error_kind_wins_over_everything(kind):
    assert h.row_status(base_row(error_kind=kind)) == kind
    assert h.row_status(base_row(error_kind=kind, realised=None, realised_rows=None,
                                 real_peak=None)) == kind


def test_row_status_without_peak_is_failed_unless_dry_run():
    assert h.row_status(base_row(real_peak=None)) == "FAILED"
    assert h.row_status(base_row(real_peak=None, dry_run=True)) == "dry-run"


def test_realised_length_prefers_the_furthest_and_shortest_row():
    assert h.realised_length([2048, 2048], 2048) == 2048
    assert h.realised_length([2048, 2050, 2046], 2048) == 2046  # tie: the shorter
    assert h.realised_length([], 2048) == 0


# --- record_columns -----------------------------------------------------------

def test_vs_record_is_real_over_record_for_a_record_arm():
    rec = h.RECORD_A10G_PEAK[("smol", 2048)]
    cols = h.record_columns(h.SHAPES["smol"], 2048, 1, 1_400_000_000)
    assert cols["record_a10g_peak"] == rec
    assert cols["vs_record"] == 1_400_000_000 / rec


def test_vs_record_is_none_off_the_record():
    shape = h.SHAPES["smol"]
    assert h.record_columns(shape, 2048, 2, 1_400_000_000) == {"record_a10g_peak": None,
                                                               "vs_record": None}
    assert h.record_columns(shape, 2560, 1, 1_400_000_000) == {"record_a10g_peak": None,
                                                               "vs_record": None}
    custom = dataclasses.replace(shape, record=False)
    assert h.record_columns(custom, 2048, 1, 1_400_000_000)["vs_record"] is None
    # A record arm without a measurement keeps the record figure but no ratio.
    cols = h.record_columns(shape, 2048, 1, None)
    assert cols["record_a10g_peak"] == h.RECORD_A10G_PEAK[("smol", 2048)]
    assert cols["vs_record"] is None
