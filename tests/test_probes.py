"""--min-free on the command line (issue 20). FAKED here, and only this: each probe's fresh capped
child (its outcome is a function of the cap: it completes iff the cap >= the arm's true need,
and the control's peak is given). Real: the settled Run, the bisection, this tool's needs-free,
the row, its JSON and the table."""

from __future__ import annotations

import json

from conftest import main, make_row, one_error_line
from issue395.capped import min_free_table
from issue395.minfree import resolution
from issue395.options import settle
from issue395.parser import build_parser
from issue395.probes import min_free_arms
from issue395.record import Arm
from issue395.row import Row

PEAK, TRUE_MIN = 1_522_010_112, 1_561_000_000


def test_min_free_bisects_over_capped_children_and_the_row_carries_it(tmp_path):
    caps, rows = [], []

    def child(run, arms, scratch, on_row, script):  # FAKE: one fresh capped child's row
        caps.append(run.cap)
        assert run.isolate and not run.min_free and len(arms) == 1
        cap = None if run.cap == "off" else int(run.cap.split(":")[1])
        ok = cap is None or cap >= TRUE_MIN
        on_row(make_row("smol", 2048, cap_at=run.cap, cap=cap, real_peak=PEAK if ok else None,
                        reserved=PEAK + 2**21 if ok else None, failure=None if ok else "OOM"))
        return []

    argv = ["--models", "smol", "--seq", "2048", "--min-free"]
    run = settle(build_parser().parse_args(argv), argv)
    assert run.min_free and run.isolate
    min_free_arms(run, [Arm("smol", 2048)], None, rows.append, "unused", spread_one=child)
    (row,) = rows
    assert caps[0] == "off" and all(c.startswith("bytes:") for c in caps[1:])
    assert row.min_free >= TRUE_MIN > row.min_free_oom and row.min_free - row.min_free_oom <= resolution(PEAK)
    assert row.min_free_resolution == resolution(PEAK) and len(row.min_free_probes) == len(caps) - 1
    assert row.needs_free and row.cap_at is None and row.real_peak == PEAK
    back = Row.from_json(json.loads(json.dumps(row.to_json())))
    assert back == row
    line = next(ln for ln in min_free_table([row]).splitlines() if ln.startswith("SmolLM2"))
    assert f"{row.min_free / 1e9:.4f}" in line and f"{row.needs_free / row.min_free:.3f}x" in line


def test_min_free_refuses_what_would_run_under_its_caps(capfd):
    for extra in (["--dry-run"], ["--cap", "soup"], ["--emulate-card", "T4"]):
        one_error_line(*main(capfd, ["--models", "smol", "--seq", "2048", "--min-free", *extra]), "--")
