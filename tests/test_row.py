"""issue395.row: a saved row's names are printed as they stand, so they must be printable."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, main, one_error_line
from conftest import SMOL, make_row
from issue395.arm import Arm
from issue395.record import RECORD_A10G_PEAK
from issue395.row import arm_row

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


def test_an_arm_names_the_checkpoint_where_every_model_row_is_keyed_custom():
    import dataclasses

    row = make_row(real_peak=10**9)
    assert row.arm == ("smol", "none", 2048, 1), "a registry row's arm is its key"
    a = dataclasses.replace(row, model="tiny-a", model_key="custom")
    b = dataclasses.replace(a, model="tiny-b")
    assert a.arm != b.arm and a.arm == dataclasses.replace(a, real_peak=1).arm
