"""issue395.constraints: each constraint's table (--cap, --emulate-card; --min-free's is in test_probes
beside the driver that fills it), printed in CONSTRAINTS' order over the rows carrying its record: what
each outcome is called and when a note says that Soup or this tool was wrong. Rows are built by the
harness's own constructor with the peaks, OOMs and refusals a GPU run would have recorded standing in
(FAKED: no arm runs here); the tables are the real ones."""

from __future__ import annotations

from conftest import make_row

from issue395.constraints.cap import Cap
from issue395.constraints.emulation import EmulateCard
from issue395.constraints.asked import CONSTRAINTS, Constraints, constraint_tables
from issue395.results.extras import Capped, Emulated, MinFreeFound

GB = 10**9


def cap_row(cap_at, **seen):
    return make_row("smol", 2048, constraint=Capped(cap_at, 2 * GB if cap_at != "off" else None), **seen)


def test_each_cap_outcome_is_named_and_an_oom_at_soups_own_cap_says_soup_admitted_it():
    rows = [cap_row("off", real_peak=GB, reserved=GB), cap_row("soup", real_peak=GB, reserved=GB),
            cap_row("soup", failure="OOM", real_peak=None), cap_row("corrected", failure="OOM", real_peak=None),
            cap_row("corrected", failure="FAILED", error="RuntimeError: x", real_peak=None)]
    outcomes = [line.rstrip().split("  ")[-1].strip() for line in Cap.table(rows).splitlines()[3:]]
    assert outcomes == ["completed (control: no cap)", "completed", "OOM: admitted by Soup, OOM at its own number",
                        "OOM", "FAILED"]


def card_row(needs_free, card_free=5 * GB, **seen):
    seen.setdefault("real_peak", GB)
    return make_row("smol", 2048, constraint=Emulated("T4", card_free, card_free, needs_free), **seen)


def test_an_emulated_card_notes_where_soups_gate_or_this_tools_verdict_was_wrong():
    rows = {"oom, tool warned": card_row(6 * GB, failure="OOM", real_peak=None),
            "oom, tool said fits": card_row(4 * GB, failure="OOM", real_peak=None),
            "refused, tool says fits": card_row(4 * GB, failure="REFUSED", real_peak=None, error="too big"),
            "completed, tool said no": card_row(6 * GB),
            "completed, tool said fits": card_row(4 * GB)}
    notes = {name: [line for line in EmulateCard.table([row]).splitlines() if line.startswith("  SmolLM2")]
             for name, row in rows.items()}
    assert notes["oom, tool warned"] == ["  SmolLM2-135M none 2048x1 on T4: Soup's gate admitted it and the step OOMed "
                                         "(issue #395); this tool said it does not fit"]
    assert notes["oom, tool said fits"] == ["  SmolLM2-135M none 2048x1 on T4: Soup's gate admitted it and the step OOMed "
                                            "(issue #395)"]
    assert notes["refused, tool says fits"] == ["  SmolLM2-135M none 2048x1 on T4: Soup refused a run this tool says fits"]
    assert "this tool's margin" in notes["completed, tool said no"][0]
    assert notes["completed, tool said fits"] == []


def test_each_row_prints_in_its_own_constraints_table_and_in_constraints_order():
    rows = [make_row("smol", 2048, constraint=MinFreeFound(GB, GB // 2, 4 * 2**20, ((GB, True),), GB)),
            make_row("smol", 2048, constraint=Emulated("T4", 5 * GB, 5 * GB, GB), real_peak=GB),
            make_row("smol", 2048, constraint=Capped("soup", 2 * GB), real_peak=GB),
            make_row("smol", 4096)]
    tables = constraint_tables(rows)
    assert [t.split(":")[0] for t in tables] == ["--cap", "--emulate-card", "--min-free"]
    assert [c.FLAG for c in CONSTRAINTS] == ["--cap", "--emulate-card", "--min-free"]
    assert all(sum("SmolLM2" in line for line in t.splitlines()) == 1 for t in tables)  # one row each
    assert constraint_tables([rows[-1]]) == []  # an unconstrained row prints in none


def test_the_run_asks_one_constraint_of_each_arm_and_min_free_none_in_process():
    assert isinstance(Constraints(cap="soup").for_arm(), Cap)
    assert isinstance(Constraints(emulate_card="T4").for_arm(), EmulateCard)
    assert Constraints(min_free=True).for_arm() is None and Constraints().for_arm() is None
    assert Constraints(min_free=True).fresh and not Constraints().fresh


def test_each_constraint_answers_for_itself_how_its_arms_ran_and_what_a_lost_row_carries():
    """The runner and the lanes ask Constraints; each constraint answers: a fresh process each, the header's
    words, the record of an arm whose process died, whether its arms are probes its driver runs."""
    cap, card, bisect, none = (Constraints(cap="soup"), Constraints(emulate_card="T4"), Constraints(min_free=True),
                               Constraints())
    assert [c.fresh for c in (cap, card, bisect, none)] == [True, True, True, False]
    assert [c.probes for c in (cap, card, bisect, none)] == [False, False, True, False]
    assert cap.how == "capped at soup (expandable segments), one fresh process per arm" and none.how is None
    assert card.how.startswith("as T4 (a ballast outside the allocator") and bisect.how.startswith("--min-free: ")
    assert (cap.lost(), card.lost(), bisect.lost(), none.lost()) == (Capped("soup"), Emulated("T4"), None, None)
    assert [c.field() for c in CONSTRAINTS] == ["cap", "emulate_card", "min_free"]
