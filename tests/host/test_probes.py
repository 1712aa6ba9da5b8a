"""issue395.host.probes (--min-free, issue 20): each arm's control, then a bisection over caps, each probe
a fresh capped child. FAKED here, and only this: each probe's fresh capped child (its outcome is a
function of the cap: it completes iff the cap >= the arm's true need, and the control's peak is
given). Real: the settled MeasureRequest, the bisection, this tool's needs-free, the row, its JSON and the
table."""

from __future__ import annotations

import json

from conftest import make_row
from issue395.constraints.minfree import MinFreeBisection
from issue395.results.extras import Capped, UserConfig
from issue395.measure.console import Stop
from issue395.constraints.minfree import resolution
from issue395.run.options import settle
from issue395.run.parser import build_parser
from issue395.host.probes import min_free_arms
from issue395.model.arm import Arm
from issue395.results.merge import merge
from issue395.results.result import Result
from issue395.results.row import Row

ENV = {"gpu": "fake", "arms": "isolated"}

PEAK, TRUE_MIN = 1_522_010_112, 1_561_000_000


def test_min_free_bisects_over_capped_children_and_the_row_carries_it(tmp_path):
    caps, rows = [], []

    def child(run, arms, scratch, on_row, script):  # FAKE: one fresh capped child's row
        caps.append(run.constraints.cap)
        assert run.isolate and not run.constraints.min_free and len(arms) == 1
        cap = None if run.constraints.cap == "off" else int(run.constraints.cap.split(":")[1])
        ok = cap is None or cap >= TRUE_MIN
        row = make_row("smol", 2048, constraint=Capped(run.constraints.cap, cap), real_peak=PEAK if ok else None,
                       reserved=PEAK + 2**21 if ok else None, failure=None if ok else "OOM")
        on_row(row)
        return [Result(environment=ENV, rows=[row], kind="map")]  # as a real child's result holds its row

    argv = ["--models", "smol", "--seq", "2048", "--min-free"]
    run = settle(build_parser().parse_args(argv), argv)
    assert run.constraints.min_free and run.isolate
    children = min_free_arms(run, [Arm("smol", 2048)], None, rows.append, "unused", spread_one=child)
    (row,) = rows
    assert merge(children).rows == [], "the runner merges the probes for their stack: no overlapping arms"
    assert caps[0] == "off" and all(c.startswith("bytes:") for c in caps[1:])
    found = row.constraint
    assert found.completes >= TRUE_MIN > found.oom and found.completes - found.oom <= resolution(PEAK)
    assert found.resolution == resolution(PEAK) and len(found.probes) == len(caps) - 1
    assert found.needs_free and MinFreeBisection.carries(row) and row.real_peak == PEAK
    back = Row.from_json(json.loads(json.dumps(row.to_json())))
    assert back == row
    line = next(ln for ln in MinFreeBisection.table([row]).splitlines() if ln.startswith("SmolLM2"))
    assert f"{found.completes / 1e9:.4f}" in line and f"{found.needs_free / found.completes:.3f}x" in line


def fake_children(outcomes, caps):
    """FAKE: a fresh capped child per probe, its row measured or OOM as ``outcomes(cap)`` says."""
    def child(run, arms, scratch, on_row, script):
        caps.append(run.constraints.cap)
        ok = outcomes(run.constraints.cap)
        row = make_row(arms[0].model, arms[0].seq, constraint=Capped(run.constraints.cap), real_peak=PEAK if ok else None,
                       reserved=PEAK if ok else None, failure=None if ok else "OOM")
        on_row(row)
        return [Result(environment=ENV, rows=[row], kind="map")]
    return child


def test_a_control_that_does_not_complete_is_the_row_as_it_is_with_no_probe():
    caps, rows = [], []
    run = settle(build_parser().parse_args(["--min-free"]), ["--min-free"])
    min_free_arms(run, [Arm("smol", 2048)], None, rows.append, "unused",
                  spread_one=fake_children(lambda cap: False, caps))
    (row,) = rows
    assert caps == ["off"] and row.status == "OOM" and row.constraint is None


def test_a_stop_between_arms_probes_no_further_arm():
    caps, rows = [], []
    run = settle(build_parser().parse_args(["--min-free"]), ["--min-free"])

    def stop_after_first_arm(cap):
        Stop.requested = cap != "off"  # the first arm's bisection is under way when Ctrl-C comes
        return True

    min_free_arms(run, [Arm("smol", 2048), Arm("smol", 4096, index=1)], None, rows.append, "unused",
                  spread_one=fake_children(stop_after_first_arm, caps))
    assert [r.seq for r in rows] == [2048] and "off" not in caps[1:]  # the second arm's control never ran


def test_needs_free_is_estimated_for_the_adapter_the_control_ran_with():
    """A --config arm's control row carries its file's targets and r (q_proj at r 4 here): the
    needs-free beside its min-free is the estimator's for that adapter, not the protocol's."""
    from dataclasses import replace as with_fields

    from issue395.estimator.estimate import estimate_key

    rows = []

    def child(run, arms, scratch, on_row, script):  # FAKE: a fresh capped child's row
        ok = run.constraints.cap == "off" or int(run.constraints.cap.split(":")[1]) >= TRUE_MIN
        row = with_fields(make_row("smol", 2048, real_peak=PEAK if ok else None, reserved=PEAK if ok else None,
                                   failure=None if ok else "OOM", config=UserConfig("soup.yaml", 4, 8)),
                          targets=("q_proj",))
        on_row(row)
        return [Result(environment=ENV, rows=[row], kind="sweep")]

    run = settle(build_parser().parse_args(["--min-free"]), ["--min-free"])
    min_free_arms(run, [Arm("smol", 2048)], None, rows.append, "unused", spread_one=child)
    (row,) = rows
    own = estimate_key("smol", seq=2048, targets=("q_proj",), lora_r=4).needs_free
    assert row.constraint.needs_free == own != estimate_key("smol", seq=2048).needs_free
    assert (row.config, row.targets) == (UserConfig("soup.yaml", 4, 8), ("q_proj",))


def rowless_after(n, caps):
    """FAKE: fake_children's measured children for the first ``n`` probes, then children that write no
    row (a stop reached the child before it wrote one, as the session's time limit did on the GPU box)."""
    measured = fake_children(lambda cap: True, caps)

    def child(run, *rest):
        if len(caps) >= n:
            caps.append(run.constraints.cap)
            return []
        return measured(run, *rest)
    return child


def test_a_probe_stopped_before_its_row_keeps_the_measured_control_and_stops_the_run():
    caps, rows = [], []
    run = settle(build_parser().parse_args(["--min-free"]), ["--min-free"])
    try:
        min_free_arms(run, [Arm("smol", 2048), Arm("smol", 4096, index=1)], None, rows.append, "unused",
                      spread_one=rowless_after(2, caps))
        assert Stop.requested, "the run reads as interrupted"
    finally:
        Stop.requested = False
    (row,) = rows
    assert row.seq == 2048 and row.real_peak == PEAK and row.constraint is None, "no min-free claimed"
    assert len(caps) == 3, "the second arm never ran"


def test_a_control_stopped_before_its_row_leaves_no_row():
    caps, rows = [], []
    run = settle(build_parser().parse_args(["--min-free"]), ["--min-free"])
    try:
        min_free_arms(run, [Arm("smol", 2048)], None, rows.append, "unused", spread_one=rowless_after(0, caps))
        assert Stop.requested
    finally:
        Stop.requested = False
    assert rows == [] and caps == ["off"]
