"""issue395.tables: the verdict counts an OOM at Soup's own cap as the under-prediction it is; a
sweep row under by Soup's own number says so; compare matches the same quantization only; a --model
row claims no A10G record. Committed results and rows built by the harness's own constructor with a
peak standing in for a CUDA measurement; nothing else faked."""

from __future__ import annotations

import dataclasses
import json

from conftest import ROOT

from issue395.result import Result
from issue395.tables import verdict_line
from conftest import SMOL, make_row
from issue395.arm import Arm
from issue395.row import arm_row
from issue395.tables import compare_table, sweep_table

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
