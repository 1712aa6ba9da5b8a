"""issue395.host.cardlock: the ledger that packs the map's lanes' arms by bytes on one card (issue 38: each
holds its own bytes; arms run together while they fit the card; first asked, first served; a killed
lane's bytes come back; an arm asking for the whole card waits for the others to drain). Real processes
on the real lock files; each process logs when it asked, got and let go (CLOCK_MONOTONIC, one clock for
every process of the host)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import ROOT

def holders(tmp_path: Path, script: Path, log: Path):
    """Start a holder process, wait for a word in the log, read every process's times from it."""

    def seen(name: str, word: str) -> bool:
        return log.exists() and f"{name} {word} " in log.read_text()

    def wait_for(name: str, word: str, timeout: float = 20.0) -> None:
        end = time.monotonic() + timeout
        while not seen(name, word):
            assert time.monotonic() < end, f"{name} never logged {word!r}"
            time.sleep(0.02)

    def times() -> dict[tuple[str, str], float]:
        return {(n, w): float(t) for n, w, t in (ln.split() for ln in log.read_text().splitlines())}

    return wait_for, times


def finish(*procs: subprocess.Popen) -> None:
    for p in procs:
        assert p.wait(timeout=30) == 0


LEDGER_HOLDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from issue395.host.cardlock import CardLedger
    from issue395.host.schedule import Need

    name, hold_s = sys.argv[1], float(sys.argv[3])
    need = None if sys.argv[2] == "all" else Need(int(float(sys.argv[2]) * 1e9))
    ledger = CardLedger({ledger!r}, total=10 * 10**9, context=0)
    ledger.join()
    with open({log!r}, "a") as log:
        log.write(f"{{name}} ask {{time.monotonic()}}\\n"); log.flush()
        with ledger.held(need):
            log.write(f"{{name}} got {{time.monotonic()}}\\n"); log.flush()
            time.sleep(hold_s)
            log.write(f"{{name}} free {{time.monotonic()}}\\n"); log.flush()
    ledger.leave()
""")


def ledger_holders(tmp_path: Path):
    """As holders, but each process holds its own bytes (GB) of a 10 GB card with no context (the
    runtime's growth, 0.26 GB a live lane, still comes off)."""
    script, log = tmp_path / "ledger_holder.py", tmp_path / "card.log"
    script.write_text(LEDGER_HOLDER.format(root=str(ROOT), log=str(log), ledger=str(tmp_path / "card.json")))
    wait_for, times = holders(tmp_path, script, log)

    def start(name: str, gb, hold_s: float) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), name, str(gb), str(hold_s)])

    return start, wait_for, times


@pytest.mark.slow
def test_an_arm_too_large_for_a_lanes_share_runs_beside_another_when_their_bytes_fit_the_card(tmp_path):
    start, wait_for, times = ledger_holders(tmp_path)
    big = start("big", 6, 3.0)  # past a half of the card: the binary lock would have held it alone
    wait_for("big", "got")
    small = start("small", 3, 0.0)
    finish(big, small)
    t = times()
    assert t[("small", "got")] < t[("big", "free")], "two arms whose bytes fit the card did not run at once"


def a_waiter_then_a_small_arm(tmp_path, waiter, hold: float) -> dict:
    """a holds 6 of the card's bytes for 3 s; w asks for ``waiter`` (bytes, or "all") and holds them
    ``hold`` s; c asks for 1 after w has asked. The times each asked, got and freed its bytes."""
    start, wait_for, times = ledger_holders(tmp_path)
    a = start("a", 6, 3.0)
    wait_for("a", "got")
    w = start("w", waiter, hold)
    wait_for("w", "ask")
    time.sleep(0.3)
    c = start("c", 1, 0.0)
    finish(a, w, c)
    return times()


@pytest.mark.slow
def test_an_arm_that_does_not_fit_waits_and_a_small_one_asking_after_it_does_not_pass_it(tmp_path):
    t = a_waiter_then_a_small_arm(tmp_path, 5, 0.2)  # 6 + 5 > the card: w waits for a; 6 + 1 would fit c, but w asked first
    assert t[("w", "got")] >= t[("a", "free")], "an arm ran beside others past the card"
    assert t[("c", "ask")] < t[("a", "free")], "the test did not ask for c while a held its bytes"
    assert t[("c", "got")] >= t[("a", "free")], "a later small arm went past the arm waiting before it"


@pytest.mark.slow
def test_an_arm_asking_for_the_whole_card_waits_for_the_others_and_holds_it_alone(tmp_path):
    t = a_waiter_then_a_small_arm(tmp_path, "all", 0.5)  # an arm measured again alone after an OOM beside neighbours
    assert t[("w", "got")] >= t[("a", "free")], "the whole-card arm ran beside another"
    assert t[("c", "got")] >= t[("w", "free")], "an arm ran beside the whole-card one"


@pytest.mark.slow
def test_a_killed_lanes_bytes_come_back_to_the_card(tmp_path):
    start, wait_for, times = ledger_holders(tmp_path)
    dead = start("dead", 9, 60.0)
    wait_for("dead", "got")
    dead.kill()
    dead.wait(timeout=10)
    after = start("after", 9, 0.0)  # the whole room: only once the killed lane's bytes are dropped
    finish(after)
    assert ("after", "free") in times()


def test_the_ledger_is_empty_after_its_lanes_leave(tmp_path):
    from issue395.host.cardlock import CardLedger
    from issue395.host.schedule import Need

    ledger = CardLedger(str(tmp_path / "card.json"), total=10 * 10**9, context=0)
    ledger.join()
    with ledger.held(Need(4 * 10**9)) as beside:
        seen = ledger.snapshot()
    assert beside == 0, "no other lane held bytes"
    assert seen["running"] == [[ledger.key, 4 * 10**9]] and seen["lanes"] == [ledger.key]
    ledger.leave()
    assert ledger.snapshot() == {"lanes": [], "patience": 0.0, "running": [], "waiting": []}


DISK_HOLDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from issue395.host.cardlock import DiskLedger

    name, gb, hold_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    ledger = DiskLedger({ledger!r}, poll_s=0.05)
    with open({log!r}, "a") as log:
        log.write(f"{{name}} ask {{time.monotonic()}}\\n"); log.flush()
        ledger.hold(name, int(gb * 1e9))
        log.write(f"{{name}} got {{time.monotonic()}}\\n"); log.flush()
        time.sleep(hold_s)
        log.write(f"{{name}} free {{time.monotonic()}}\\n"); log.flush()  # before the release: no tolerance
        ledger.release(name)
""")


def disk_holders(tmp_path: Path, budget_gb: float):
    """Processes holding checkpoints' bytes (GB) of a disk ledger whose budget is ``budget_gb``."""
    from issue395.host.cardlock import DiskLedger

    script, log, path = tmp_path / "disk_holder.py", tmp_path / "disk.log", tmp_path / "disk.json"
    DiskLedger.create(str(path), str(tmp_path), budget=int(budget_gb * 1e9))
    script.write_text(DISK_HOLDER.format(root=str(ROOT), log=str(log), ledger=str(path)))
    wait_for, times = holders(tmp_path, script, log)

    def start(name: str, gb: float, hold_s: float) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), name, str(gb), str(hold_s)])

    return start, wait_for, times, DiskLedger(str(path))


@pytest.mark.slow
def test_a_checkpoint_that_does_not_fit_the_disk_beside_another_lanes_waits_for_its_release(tmp_path):
    """Issue 38's map lost three lanes to "No space left on device": a build that does not fit beside
    what another lane holds starts only after that lane frees its family; one that fits starts at once."""
    start, wait_for, times, _ = disk_holders(tmp_path, budget_gb=40)
    a = start("a", 30, 8.0)
    wait_for("a", "got")
    small = start("small", 10, 0.0)  # 30 + 10 fits 40
    finish(small)
    big = start("big", 20, 0.0)  # 30 + 20 does not
    finish(a, big)
    t = times()
    assert t[("small", "got")] < t[("a", "free")], "a build that fit waited"
    assert t[("big", "got")] >= t[("a", "free")], "a build that did not fit started beside the other"


def test_a_build_ahead_defers_to_a_lane_waiting_for_its_next_family(tmp_path):
    """A lane that frees its family and at once builds its next one ahead would take the bytes back
    from a lane waiting for them, every time; a build ahead yields to a waiter instead."""
    from issue395.host.cardlock import DiskLedger

    ledger = DiskLedger.create(str(tmp_path / "disk.json"), str(tmp_path), budget=40 * 10**9)
    with ledger._state() as state:  # another live lane (this test's parent process) waits
        state["waiting"] = [f"{os.getppid()}:other"]
    assert not ledger.try_hold("ahead", 10 * 10**9), "a build ahead passed a waiting lane"
    assert ledger.try_hold("now", 10 * 10**9, ahead=False), "a build needed now waited for a waiter"


@pytest.mark.slow
def test_a_killed_lanes_checkpoint_bytes_come_back_and_an_oversized_build_runs_on_an_empty_disk(tmp_path):
    start, wait_for, times, ledger = disk_holders(tmp_path, budget_gb=40)
    dead = start("dead", 35, 60.0)
    wait_for("dead", "got")
    dead.kill()
    dead.wait(timeout=10)
    huge = start("huge", 90, 0.0)  # past the whole budget: with nothing held it is the only way on
    try:
        finish(huge)
    finally:
        huge.kill()
    assert ("huge", "free") in times()
    assert ledger.snapshot()["held"] == {}
