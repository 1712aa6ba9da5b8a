"""issue395.report.capped: the one fixed-width helper, and the tables of arms run under a constraint (--cap,
--emulate-card; --min-free's is in test_probes beside the driver that fills it): what each outcome is
called and when a note says that Soup or this tool was wrong. Rows are built by the harness's own
constructor with the peaks, OOMs and refusals a GPU run would have recorded standing in (FAKED: no
arm runs here); the tables are the real ones."""

from __future__ import annotations

from conftest import make_row

from issue395.report.capped import cap_table, emulate_table, gb, ratio, table

GB = 10**9


def test_a_cell_wider_than_its_column_widens_it_so_every_line_stays_aligned():
    lines = table([("arm", -4), ("GB", 6), ("note", -5)],
                  [["a", "1.0", "x"], ["a-long-family-name", "12.5", "a note longer than its column"]])
    head, rule, short, long = lines
    assert head.index("GB") + 2 == short.index("1.0") + 3 == long.index("12.5") + 4  # right-aligned, one edge
    assert short.index("x") == long.index("a note") == head.index("note")  # left-aligned, one edge
    assert rule == "-" * len(head) and len(long) > len(head)  # the last column's overflow widens nothing
    assert table([("a", 3)], [["1"]], indent="  ")[0] == "    a" and table([("a", 3)], [["1"]], indent="  ")[1] == "  ---"


def test_numbers_are_gigabytes_and_ratios_or_a_dash():
    assert (gb(1_234_567_890), gb(1_234_567_890, 2), gb(None)) == ("1.2346", "1.23", "-")
    assert (ratio(1.0456), ratio(None)) == ("1.046x", "-")


def cap_row(cap_at, **seen):
    return make_row("smol", 2048, cap_at=cap_at, cap=2 * GB if cap_at != "off" else None, **seen)


def test_each_cap_outcome_is_named_and_an_oom_at_soups_own_cap_says_soup_admitted_it():
    rows = [cap_row("off", real_peak=GB, reserved=GB), cap_row("soup", real_peak=GB, reserved=GB),
            cap_row("soup", failure="OOM", real_peak=None), cap_row("corrected", failure="OOM", real_peak=None),
            cap_row("corrected", failure="FAILED", error="RuntimeError: x", real_peak=None)]
    outcomes = [line.rstrip().split("  ")[-1].strip() for line in cap_table(rows).splitlines()[3:]]
    assert outcomes == ["completed (control: no cap)", "completed", "OOM: admitted by Soup, OOM at its own number",
                        "OOM", "FAILED"]


def card_row(needs_free, card_free=5 * GB, **seen):
    seen.setdefault("real_peak", GB)
    return make_row("smol", 2048, emulated_card="T4", emulated_card_free=card_free, emulated_free=card_free,
                    needs_free=needs_free, **seen)


def test_an_emulated_card_notes_where_soups_gate_or_this_tools_verdict_was_wrong():
    rows = {"oom, tool warned": card_row(6 * GB, failure="OOM", real_peak=None),
            "oom, tool said fits": card_row(4 * GB, failure="OOM", real_peak=None),
            "refused, tool says fits": card_row(4 * GB, failure="REFUSED", real_peak=None, error="too big"),
            "completed, tool said no": card_row(6 * GB),
            "completed, tool said fits": card_row(4 * GB)}
    notes = {name: [line for line in emulate_table([row]).splitlines() if line.startswith("  SmolLM2")]
             for name, row in rows.items()}
    assert notes["oom, tool warned"] == ["  SmolLM2-135M none 2048x1 on T4: Soup's gate admitted it and the step OOMed "
                                         "(issue #395); this tool said it does not fit"]
    assert notes["oom, tool said fits"] == ["  SmolLM2-135M none 2048x1 on T4: Soup's gate admitted it and the step OOMed "
                                            "(issue #395)"]
    assert notes["refused, tool says fits"] == ["  SmolLM2-135M none 2048x1 on T4: Soup refused a run this tool says fits"]
    assert "this tool's margin" in notes["completed, tool said no"][0]
    assert notes["completed, tool said fits"] == []
