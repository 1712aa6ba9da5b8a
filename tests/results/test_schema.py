"""issue395.results.schema: a saved result is read back only where its blocks have the types the renderers
and the merge read, each arm once; schema 1 (the first H200 results) reads as this version's rows,
and --from-json re-renders the committed schema-1 result with the figures its printed output holds."""

from __future__ import annotations

import json
import math

import pytest
from conftest import ROOT, main, make_row, one_error_line, table_lines

from issue395.errors import EXIT_OK
from issue395.results.result import Result
from issue395.results.row import Row
from issue395.results.schema import SCHEMA, TOOL, check_blocks, check_unique, determinism_rows, schema1_row, schema2_row

SCHEMA1 = ROOT / "results" / "record-h200x2-soup0.73.3-e7c26f7" / "h200-2026-11-30-full-cold.json"
TASKS_CAPPED = ROOT / "results" / "task-map-h200-soup0.77.0-f8e1b91-and-85975aa" / "cap-soup-tasks.json"
DETERMINISM = ROOT / "results" / "isolated-determinism-h200x2-soup0.73.3-5670dee" / "h200-2026-11-30-determinism.json"
MARGIN = dict(model="m", model_key="smol", quant="none", seq=2048, batch=1, ratio=1.2, complete=True,
              note=None, real_peak=10**9, soup_predicted=2 * 10**9,
              terms=[dict(term="logits", charged=1.0, measured=2.0, missed=1.0, per=None)])


def test_a_schema1_row_reads_as_this_versions_row():
    old = json.loads(SCHEMA1.read_text())["rows"][0]
    row = Row.from_json(schema2_row(schema1_row(old)))
    assert row.vocab == old["elements"] // (old["seq"] * old["batch"]) == 49152
    assert row.loss_bytes_per_element == old["logits12_bytes"] / old["elements"] == 12
    assert (row.logits14, row.resident, row.reserved) == (
        old["logits14_bytes"], old["resident_before_step"], old["max_reserved"])
    assert row.realised_width == old["realised"] and row.repeat is None  # schema 1's sweep rows said 0


def test_a_schema2_task_row_keeps_its_task_as_the_arms_own_and_its_flat_fields_move_into_records():
    """The committed DPO rows capped at Soup's number (schema 2, flat): the task stays the arm's own
    field (and key, absent for SFT), the cap and the teardown move into their records, and re-saving
    writes the task key as schema 2 did."""
    old = next(r for r in json.loads(TASKS_CAPPED.read_text())["rows"] if r.get("task") == "dpo")
    row = Row.from_json(schema2_row(dict(old, teardown_error="RuntimeError: x")))
    assert (row.task, row.arm[-1], row.label) == ("dpo", "dpo", f"{old['model']} dpo")
    assert (row.constraint.at, row.constraint.bytes) == ("soup", old["cap"])
    assert (row.ran.teardown_error, row.ran.pid, row.gate.terms) == ("RuntimeError: x", old["pid"], old["soup_terms"])
    assert row.to_json()["task"] == "dpo" and "teardown_error" not in row.to_json()
    assert "task" not in make_row("smol", 2048).to_json(), "an SFT row grew a task key"


def test_a_schema1_row_with_a_negative_element_count_is_refused():
    old = dict(json.loads(SCHEMA1.read_text())["rows"][0], elements=-1)
    with pytest.raises(ValueError, match="'elements' is -1, not a number >= 0"):
        schema1_row(old)


def test_a_schema1_determinism_block_is_read_as_every_arms_repeat_rows():
    data = json.loads(DETERMINISM.read_text())
    rows = determinism_rows(data)
    assert len(rows) == sum(len(arm["rows"]) for arm in data["determinism"]["arms"]) > 0
    with pytest.raises(ValueError, match="'determinism' arms must be objects"):
        determinism_rows({"determinism": {"arms": [{"rows": "not a list"}]}})


@pytest.mark.parametrize("margin, words", [
    ({k: v for k, v in MARGIN.items() if k != "ratio"}, "margin 0 has no 'ratio'"),
    (dict(MARGIN, quant="fp8"), "margin 0: its 'quant' is 'fp8', not one of"),
    (dict(MARGIN, terms=[dict(MARGIN["terms"][0], charged=math.nan)]),
     "margin 0: its terms[0]: its 'charged' is nan, not a finite number"),
])
def test_a_margin_the_renderers_cannot_read_is_refused_naming_its_field(margin, words):
    check_blocks({"environment": {}, "margins": [MARGIN]})  # the well-formed one passes
    with pytest.raises(ValueError) as err:
        check_blocks({"environment": {}, "margins": [margin]})
    assert words in str(err.value)


def test_an_environment_value_that_is_not_a_scalar_is_refused():
    with pytest.raises(ValueError, match="environment's 'torch' is dict, not a string"):
        check_blocks({"environment": {"torch": {"version": "2"}}})


def test_one_arm_saved_twice_is_refused_where_a_map_keys_on_the_arm_and_a_sweep_on_its_index():
    rows = [make_row(index=0, seq=2048), make_row(index=0, seq=4096)]
    check_unique(rows, "map")  # two arms of a map: its index is not what names them
    with pytest.raises(ValueError, match="the same arm appears twice"):
        check_unique(rows, "sweep")
    check_unique(rows[:1] + [make_row(index=0, repeat=1)], "sweep")  # a repeat is its own row


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


def test_every_json_this_version_writes_carries_the_one_tool_and_schema_it_reads(capfd, tmp_path):
    """A run's result and an --estimate result state the same tool and version, those read back."""
    env = {k: "x" for k in ("torch", "transformers", "trl", "peft", "soup_cli", "weights")}
    written = Result(environment=env, rows=[make_row()]).to_json()
    assert (written["tool"], written["schema"]) == (TOOL, SCHEMA)
    assert Result.from_json(json.loads(json.dumps(written))).rows
    est = tmp_path / "est.json"
    assert main(capfd, ["--estimate", "--model", "smol", "--seq", "512", "--json", est])[0] == 0
    assert (json.loads(est.read_text())["tool"], json.loads(est.read_text())["schema"]) == (TOOL, SCHEMA)


# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


def test_a_schema1_row_with_an_impossible_seq_blames_seq_not_vocab(capfd, tmp_path):
    """Issue 29 item 12: a schema-1 row with an impossible seq is one line blaming 'seq', not vocab."""
    from conftest import ROOT

    saved = json.loads((ROOT / "results/record-h200x2-soup0.73.3-e7c26f7/h200-2026-11-30-full-cold.json").read_text())
    saved["rows"][0]["seq"] = 10**30
    (tmp_path / "bad.json").write_text(json.dumps(saved))
    line = one_error_line(*main(capfd, ["--from-json", tmp_path / "bad.json"]), "'seq'")
    assert "vocab" not in line, line
