"""issue395.row: one arm's result and its verdicts. A saved row's names are printed as they stand, so
they must be printable; an NF4 row quotes no A10G figure; UNDER is judged on the lower of Soup's own
number and the record's convention. Rows are built by the harness's own constructor with a peak
standing in for a CUDA measurement."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, main, one_error_line
from conftest import SMOL, make_row
from issue395.arm import Arm
from issue395.record import RECORD_A10G_PEAK
from issue395.row import arm_row
from issue395.tables import map_verdict

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
