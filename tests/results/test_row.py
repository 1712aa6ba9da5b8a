"""issue395.results.row: one arm's result and its verdicts. Against the record: pred/real reproduces every
published ratio, no retained bf16 copy fits under a record peak, the non-logits over-estimate
reproduces the record's mean and pstdev. A row's status: ok, UNDER, VOID where the realised length is
not the one asked for (the guard), a failure over everything, FAILED without a peak unless a dry run,
and no ratio unless ok or UNDER; vs_record only on a record arm at batch 1. The one JSON round trip
gives an equal row, re-derives the verdicts from the measured fields and refuses what cannot be
judged. A saved row's names are printed as they stand, so they must be printable; an NF4 row quotes
no A10G figure; UNDER is judged on the lower of Soup's own number and the record's convention. Rows
are built by the harness's own constructor (``make_row`` -> ``arm_row``, with Soup's real
prediction) or read back by ``Row.from_json``, with a peak (the A10G record's, where a test reads the
record) standing in for a CUDA measurement; an attribution is replayed from a hand-built allocator
history."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace

import pytest
from conftest import PUBLISHED, RECORD_ARMS, ROOT, SMOL, main, make_row, one_error_line, record_row, record_rows

from issue395.results.extras import Capped, Emulated, MinFreeFound, Ran, UserConfig
from issue395.model.arm import Arm, Settings, predicted_bytes
from issue395.model.registry import SHAPES
from issue395.measure.cuda import attribute_peak
from issue395.host.measured import MeasureRequest
from issue395.record import RECORD_A10G_PEAK
from issue395.results.row import Row, arm_row, realised_as_requested
from issue395.host.spread import lost_row
from issue395.report.tables import map_verdict, overestimate_summary

SAVED = ROOT / "results" / "cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37" / "map-512-1024.json"


@pytest.mark.parametrize("name", ["\x1b[2J\x1b[31mpwned", "two\nlines", "bell\x07"])
def test_a_model_name_with_escapes_or_a_newline_is_refused(capfd, tmp_path, name):
    data = json.loads(SAVED.read_text())
    data["rows"][0]["model"] = name
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    line = one_error_line(*main(capfd, ["--from-json", path]), "model", "printable")
    assert "\x1b" not in line and "\x07" not in line


def test_an_nf4_row_of_a_record_model_quotes_no_a10g_figure():
    arm = Arm("smol", 2048, 1, 0, "nf4")
    row = arm_row(arm, SMOL, realised_width=2048, realised_rows=(2048,), real_peak=10**9)
    assert row.record_peak is None and row.vs_record is None
    assert make_row(real_peak=10**9).record_peak == RECORD_A10G_PEAK[("smol", 2048)]


def test_under_is_judged_on_the_lower_of_soups_own_and_the_record_convention():
    peak = 1_500_000_000
    row = make_row(real_peak=peak, soup_predicted=peak - 1)  # the convention covers it, Soup's own not
    assert row.predicted > peak and row.status == "UNDER"
    assert row.margin_ratio == pytest.approx((peak - 1) / peak)
    assert "verdict: Soup UNDER-predicts 1 of 1" in map_verdict([row])


def test_an_arm_names_the_checkpoint_where_every_model_row_is_keyed_custom():
    import dataclasses

    row = make_row(real_peak=10**9)
    assert row.arm == ("smol", "none", 2048, 1), "a registry row's arm is its key"
    a = dataclasses.replace(row, model="tiny-a", model_key="custom")
    b = dataclasses.replace(a, model="tiny-b")
    assert a.arm != b.arm and a.arm == dataclasses.replace(a, real_peak=1).arm
    # a --config arm on a checkpoint folder is keyed custom with its streaming modes after it
    c = dataclasses.replace(a, model_key="custom+chunk512")
    assert c.arm == a.arm != dataclasses.replace(b, model_key="custom+chunk512").arm


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

def roundtrip(row: Row) -> Row:
    """A row through JSON text, exactly as --json and the row file hold it."""
    return Row.from_json(json.loads(json.dumps(row.to_json())))


def attribution_of_a_step() -> dict:
    snap = {"device_traces": [[{"action": "alloc", "addr": 1, "size": 2 * 2048 * 49152},
                               {"action": "alloc", "addr": 2, "size": 100}]]}
    return attribute_peak(snap, 1000, 2048 * 49152, None)


ROUND_TRIP_ROWS = {
    "ok": lambda: make_row("smol", 2048, real_peak=1_365_200_000, resident=1234, reserved=1_400_000_000,
                           ran=Ran(base="/ckpt", gpu="0: H200", timings={"setup_s": 1.5, "step_s": 0.2})),
    "under": lambda: make_row("qwen", 6144, index=9, real_peak=20_000_000_000),
    "void": lambda: make_row("smol", 4096, batch=2, index=3, real_peak=2_000_000_000,
                             realised_rows=(4096, 4000)),
    "oom": lambda: make_row("qwen", 6144, failure="OOM", error="CUDA out of memory",
                            oom_request=1_288_490_188, ran=Ran(teardown_error="RuntimeError: x")),
    "dry-run": lambda: make_row("smol", 3072, index=1, dry_run=True),
    "repeat": lambda: make_row("smol", 4096, index=2, repeat=2, real_peak=2_657_800_000),
    "attributed": lambda: make_row("smol", 2048, real_peak=1_365_200_000,
                                   attribution=attribution_of_a_step()),
    "lost": lambda: lost_row(Arm("qwen", 2048, 1, 6), MeasureRequest(), None, -9),
    "config": lambda: make_row("smol", 2048, dry_run=True, config=UserConfig("soup.yaml", 4, 8)),
    "capped": lambda: make_row("smol", 2048, constraint=Capped("soup", 2_000_000_000), failure="OOM"),
    "emulated": lambda: make_row("smol", 2048, constraint=Emulated("T4", 14_000_000_000, 14_000_000_001, 10**9),
                                 real_peak=1_365_200_000),
    "min-free": lambda: make_row("smol", 2048, real_peak=1_365_200_000, constraint=MinFreeFound(
        1_400_000_000, 1_390_000_000, 4 * 2**20, ((1_500_000_000, True), (1_390_000_000, False)), 1_450_000_000)),
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
                                         ("predicted", None), ("config", {"path": "a", "lora_r": -1, "lora_alpha": 16}),
                                         ("config", {"path": "a", "lora_r": 8, "lora_alpha": "16"}),
                                         ("config", {"path": 3, "lora_r": 8, "lora_alpha": 16}),
                                         ("constraint", {"kind": "find-max"}), ("constraint", {"kind": "cap"}),
                                         ("constraint", {"kind": "cap", "at": "soup", "bytes": 0}),
                                         ("ran", {"pid": -1}), ("gate", {"free": 1.5})])
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



def test_a_task_row_carries_its_task_keyed_in_its_arm_and_shown_by_its_label_and_an_sft_row_does_not():
    """SFT writes no 'task' (every saved result re-renders to the same bytes); any other task
    is saved, read back, and pairs rows in compare and merge by its arm key."""
    sft, dpo = make_row("qwen", 2048, 1), arm_row(Arm("qwen", 2048, 1, 1, task="dpo"), SHAPES_QWEN)
    assert "task" not in sft.to_json() and sft.arm == ("qwen", "none", 2048, 1) and sft.label == sft.model
    assert dpo.to_json()["task"] == "dpo" and Row.from_json(dpo.to_json()) == dpo
    assert dpo.arm == ("qwen", "none", 2048, 1, "dpo") and dpo.label == f"{sft.model} dpo"
    assert dpo.record_peak is None  # the record's A10G peaks are SFT's


def test_a_config_arms_optimizer_and_accumulation_are_saved_read_back_and_key_its_arm():
    """Issue 50: a --config arm runs the file's training.optimizer and gradient_accumulation_steps, and its row
    says them (read back alike); the protocol's arm names neither, so its JSON has no such keys (every row saved
    before re-renders to the same bytes). The arm's identity carries them where they differ from the protocol's
    (two optimizers of one file are two arms in compare and merge); Soup's default optimizer at one micro-batch
    is the protocol's own run."""
    plain = make_row("qwen", 2048, 1)
    run = arm_row(Arm("qwen", 2048, 1, 1, settings=Settings("adamw_8bit", 4)), SHAPES_QWEN)
    assert not {"optimizer", "accumulation"} & set(plain.to_json())
    assert (run.to_json()["optimizer"], run.to_json()["accumulation"]) == ("adamw_8bit", 4)
    assert Row.from_json(run.to_json()) == run
    assert run.arm == ("qwen", "none", 2048, 1, "adamw_8bit", 4, 2) and plain.arm == ("qwen", "none", 2048, 1)
    default = arm_row(Arm("qwen", 2048, 1, 1, settings=Settings("adamw_torch", 1)), SHAPES_QWEN)
    assert default.arm == plain.arm and default.to_json()["optimizer"] == "adamw_torch"
    lost = lost_row(Arm("qwen", 2048, 1, 6, task="dpo", settings=Settings("adamw_8bit", 4)), MeasureRequest(),
                    None, -9)
    assert (lost.task, lost.settings.optimizer, lost.settings.accumulation) == ("dpo", "adamw_8bit", 4)  # a lost arm is still its arm


@pytest.mark.parametrize("field, value", [("optimizer", ""), ("optimizer", 8), ("optimizer", "adam\nw"),
                                          ("accumulation", 0), ("accumulation", 2.0), ("accumulation", True)])
def test_a_saved_optimizer_or_accumulation_that_cannot_be_a_run_is_refused(field, value):
    data = dict(arm_row(Arm("qwen", 2048, 1, settings=Settings("adamw_8bit", 4)), SHAPES_QWEN).to_json(),
                **{field: value})
    with pytest.raises(ValueError, match=f"row field '{field}'"):
        Row.from_json(data)


def test_a_paired_tasks_record_convention_is_soups_estimator_at_its_two_rows_per_example():
    dpo = arm_row(Arm("qwen", 2048, 1, task="dpo"), SHAPES_QWEN)
    assert dpo.predicted == predicted_bytes(SHAPES_QWEN, 2048, 2) and dpo.elements == 2 * make_row("qwen", 2048).elements


@pytest.mark.parametrize("value", ["sft", "ppo", 3, ["dpo"]])
def test_a_saved_task_that_is_not_one_of_the_four_beside_sft_is_refused(value):
    data = dict(arm_row(Arm("qwen", 2048, 1, task="dpo"), SHAPES_QWEN).to_json(), task=value)
    with pytest.raises(ValueError, match="row field 'task'"):
        Row.from_json(data)


def test_a_task_row_is_judged_on_soups_own_number_and_its_guard_counts_the_tasks_rows():
    """DPO's guard reads 2 x batch rows; Soup's own number alone judges it (the record's
    convention is an SFT grid's), so a peak between the two is UNDER only by Soup's own."""
    arm = Arm("qwen", 2048, 1, task="dpo")
    ok = arm_row(arm, SHAPES_QWEN, realised_width=2048, realised_rows=(2048, 2048), real_peak=10 ** 9,
                 resident=1, soup_predicted=2 * 10 ** 9)
    assert ok.status == "ok" and ok.margin_ratio == 2.0
    assert replace(ok, realised_rows=(2048,)).status == "VOID"
    assert replace(ok, soup_predicted=10 ** 9 - 1).status == "UNDER"
    assert realised_as_requested(64, 2, 64, [64] * 4, "kto") and not realised_as_requested(64, 2, 64, [64] * 2, "kto")
SHAPES_QWEN = SHAPES["qwen"]


def test_a_full_fine_tunings_row_saves_no_targets_and_reads_back():
    """Issue 50 item 2 (house5c): a full fine-tuning's row (a --config arm at lora.r 0) trains no LoRA target, so it
    saves targets null (not the shape's resolution of "auto") and reads back as a full fine-tuning's Arm; a LoRA
    row at the same file keeps its targets; a lost full row saves none either."""
    from issue395.host.measured import MeasureRequest
    from issue395.host.spread import lost_row
    from issue395.model.arm import Adapter

    full = Adapter(("auto",), 0, 16, "soup.yaml")
    arm = Arm("qwen", 2048, 1, 1, adapter=full)
    row = arm_row(arm, SHAPES_QWEN, config=UserConfig("soup.yaml", 0, 16))
    assert row.to_json()["targets"] is None and "targets" in row.to_json()
    back = Row.from_json(json.loads(json.dumps(row.to_json())))
    assert back == row and back.run_arm().full and back.run_arm().adapter.targets is None
    lora = arm_row(Arm("qwen", 2048, 1, 1), SHAPES_QWEN, config=UserConfig("soup.yaml", 8, 16))
    assert lora.to_json()["targets"] == list(SHAPES_QWEN.targets)
    lost = lost_row(arm, MeasureRequest(), None, -9)  # the lost arm's own adapter
    assert lost.to_json()["targets"] is None and lost.rank == 0


def test_a_config_rows_lora_dropout_is_saved_where_it_is_not_soups_default_and_its_arm_reads_it_back():
    """Issue 50 item 1: a --config row's LoRA dropout is its UserConfig's: absent from the JSON at Soup's default
    (so every row saved before re-renders alike), saved otherwise; it reads back to an equal row whose Arm's adapter
    has it, so its corrected figure is the dropout's (at 0: no masks, less); a lost row of such an arm carries it;
    a value no run has (past 1) is refused on reading."""
    from issue395.host.measured import MeasureRequest
    from issue395.host.spread import lost_row
    from issue395.model.arm import Adapter
    from issue395.results.corrected import corrected

    arm = Arm.at("qwen+resident", 2048, 1, 1)  # resident without checkpointing: every layer's masks held at the loss
    rows = {p: arm_row(arm, SHAPES_QWEN, real_peak=10**9, realised_width=2048, realised_rows=(2048,),
                       config=UserConfig("soup.yaml", 8, 16, p)) for p in (0.05, 0.0)}
    assert "lora_dropout" not in rows[0.05].to_json()["config"] and rows[0.0].to_json()["config"]["lora_dropout"] == 0
    back = {p: roundtrip(r) for p, r in rows.items()}
    assert back == rows and back[0.0].to_json() == rows[0.0].to_json()
    assert back[0.0].run_arm().adapter.dropout == 0.0 and back[0.05].run_arm().adapter.dropout == 0.05
    assert corrected(back[0.0]) < corrected(back[0.05])
    lost = lost_row(replace(arm, adapter=Adapter(("q_proj",), 8, 16, "soup.yaml", 0.0)), MeasureRequest(), None, -9)
    assert roundtrip(lost).config == UserConfig("soup.yaml", 8, 16, 0.0)
    data = rows[0.0].to_json()
    data["config"]["lora_dropout"] = 1.5
    with pytest.raises(ValueError, match="lora_dropout"):
        Row.from_json(data)
