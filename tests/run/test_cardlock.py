"""issue395.run.cardlock: the card lock of --lanes on the map (issue 30), and the ledger that packs the
lanes' arms by bytes (issue 38: each holds its own bytes; arms run together while they fit the card;
first asked, first served; a killed lane's bytes come back). Real processes on the real lock files: an arm that holds the card alone keeps every other lane's arm off it until it releases;
lane arms share it; a whole-card arm waiting for the card is not starved by lane arms that keep
arriving (the turnstile). Each process logs when it asked, got and let go (CLOCK_MONOTONIC, one
clock for every process of the host)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import ROOT

HOLDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from issue395.run.cardlock import CardLock

    name, whole, hold_s = sys.argv[1], sys.argv[2] == "whole", float(sys.argv[3])
    with open({log!r}, "a") as log:
        log.write(f"{{name}} ask {{time.monotonic()}}\\n"); log.flush()
        with CardLock({lock!r}).held(whole):
            log.write(f"{{name}} got {{time.monotonic()}}\\n"); log.flush()
            time.sleep(hold_s)
            log.write(f"{{name}} free {{time.monotonic()}}\\n"); log.flush()
""")


def holders(tmp_path: Path):
    script, log = tmp_path / "holder.py", tmp_path / "card.log"
    script.write_text(HOLDER.format(root=str(ROOT), log=str(log), lock=str(tmp_path / "card.lock")))

    def start(name: str, side: str, hold_s: float) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), name, side, str(hold_s)])

    def seen(name: str, word: str) -> bool:
        return log.exists() and f"{name} {word} " in log.read_text()

    def wait_for(name: str, word: str, timeout: float = 20.0) -> None:
        end = time.monotonic() + timeout
        while not seen(name, word):
            assert time.monotonic() < end, f"{name} never logged {word!r}"
            time.sleep(0.02)

    def times() -> dict[tuple[str, str], float]:
        return {(n, w): float(t) for n, w, t in (ln.split() for ln in log.read_text().splitlines())}

    return start, wait_for, times


def finish(*procs: subprocess.Popen) -> None:
    for p in procs:
        assert p.wait(timeout=30) == 0


def test_a_lane_arm_waits_while_another_process_holds_the_card_alone_and_gets_it_on_release(tmp_path):
    start, wait_for, times = holders(tmp_path)
    whole = start("whole", "whole", 1.0)
    wait_for("whole", "got")
    lane = start("lane", "shared", 0.0)
    wait_for("lane", "ask")
    time.sleep(0.3)
    t = times()
    assert ("lane", "got") not in t, "a lane arm got the card while a whole-card arm held it"
    finish(whole, lane)
    t = times()
    assert t[("lane", "got")] >= t[("whole", "free")]


def test_lane_arms_share_the_card_at_once(tmp_path):
    start, wait_for, times = holders(tmp_path)
    a = start("a", "shared", 1.0)
    wait_for("a", "got")
    b = start("b", "shared", 0.0)
    finish(a, b)
    t = times()
    assert t[("b", "got")] < t[("a", "free")], "two lane arms did not hold the card at once"


def test_a_whole_card_arm_waiting_for_the_card_is_served_before_a_lane_arm_that_asked_after_it(tmp_path):
    """Lane arm A holds the card; whole-card arm W asks (it must wait for A); lane arm C asks after W.
    Without the turnstile C would join A at once and W could wait on lanes indefinitely."""
    start, wait_for, times = holders(tmp_path)
    a = start("a", "shared", 1.0)
    wait_for("a", "got")
    w = start("w", "whole", 0.3)
    wait_for("w", "ask")
    time.sleep(0.2)  # W is blocked on the card, holding the turnstile
    c = start("c", "shared", 0.0)
    finish(a, w, c)
    t = times()
    assert t[("w", "got")] >= t[("a", "free")]
    assert t[("c", "ask")] < t[("a", "free")], "the test did not ask for C while A held the card"
    assert t[("c", "got")] >= t[("w", "free")], "a lane arm that asked later got the card before the whole-card arm"


def _shared_free(path: Path) -> bool:
    """Whether another lane could share the card now (a non-blocking shared flock on its own fd)."""
    import fcntl
    import os
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_whole_card_arms_back_to_back_keep_the_card_alone_between_them_and_give_it_back_after(tmp_path):
    from issue395.run.cardlock import CardHold, CardLock

    path = tmp_path / "card.lock"
    hold = CardHold(CardLock(str(path)))
    seen = []
    with hold.arm(True, next_whole_card=True):
        seen.append(_shared_free(path))
    seen.append(_shared_free(path))  # between the two: no other lane's arm may slip in
    with hold.arm(True, next_whole_card=False):
        seen.append(_shared_free(path))
    seen.append(_shared_free(path))
    assert seen == [False, False, False, True]


def test_a_lane_arm_after_whole_card_arms_shares_the_card_and_a_failed_arm_lets_it_go(tmp_path):
    import pytest

    from issue395.run.cardlock import CardHold, CardLock

    path = tmp_path / "card.lock"
    hold = CardHold(CardLock(str(path)))
    with hold.arm(True, next_whole_card=True):
        pass
    with hold.arm(False, next_whole_card=False):  # the run of whole-card arms ended: shared now
        assert _shared_free(path)
    with pytest.raises(KeyboardInterrupt):
        with hold.arm(True, next_whole_card=True):
            raise KeyboardInterrupt  # a Ctrl-C in the arm: the card is not kept for an arm that will not run
    assert _shared_free(path)
    with hold.arm(True, next_whole_card=True):
        pass
    hold.release()  # the sweep's end after a stop between two whole-card arms
    assert _shared_free(path)


def test_a_lane_runs_each_familys_whole_card_arms_after_its_other_arms_families_in_turn():
    from issue395.model.arm import Arm
    from issue395.model.registry import family_of
    from issue395.run.cardlock import lane_order

    arms = [Arm("qwen", 512, 1, 0), Arm("qwen", 512, 4, 1), Arm("qwen", 1024, 1, 2), Arm("qwen", 1024, 4, 3),
            Arm("moonlight", 512, 1, 4), Arm("moonlight+per_expert", 512, 4, 5), Arm("moonlight", 1024, 1, 6)]
    order = [a.index for a in lane_order(arms, {1, 4}, family_of)]
    assert order == [0, 2, 3, 1, 5, 6, 4]


LEDGER_HOLDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from issue395.run.cardlock import CardLedger
    from issue395.run.schedule import Need

    name, holds, hold_s = sys.argv[1], int(float(sys.argv[2]) * 1e9), float(sys.argv[3])
    ledger = CardLedger({ledger!r}, total=10 * 10**9, context=0)
    ledger.join()
    with open({log!r}, "a") as log:
        log.write(f"{{name}} ask {{time.monotonic()}}\\n"); log.flush()
        with ledger.held(Need(holds)):
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
    _, wait_for, times = holders(tmp_path)

    def start(name: str, gb: float, hold_s: float) -> subprocess.Popen:
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


@pytest.mark.slow
def test_an_arm_that_does_not_fit_waits_and_a_small_one_asking_after_it_does_not_pass_it(tmp_path):
    start, wait_for, times = ledger_holders(tmp_path)
    a = start("a", 6, 3.0)
    wait_for("a", "got")
    w = start("w", 5, 0.2)  # 6 + 5 > the card: it waits for a
    wait_for("w", "ask")
    time.sleep(0.3)
    c = start("c", 1, 0.0)  # 6 + 1 would fit, but w asked first
    finish(a, w, c)
    t = times()
    assert t[("w", "got")] >= t[("a", "free")], "an arm ran beside others past the card"
    assert t[("c", "ask")] < t[("a", "free")], "the test did not ask for c while a held its bytes"
    assert t[("c", "got")] >= t[("a", "free")], "a later small arm went past the arm waiting before it"


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
    from issue395.run.cardlock import CardLedger
    from issue395.run.schedule import Need

    ledger = CardLedger(str(tmp_path / "card.json"), total=10 * 10**9, context=0)
    ledger.join()
    with ledger.held(Need(4 * 10**9)):
        seen = ledger.snapshot()
    assert seen["running"] == [[ledger.key, 4 * 10**9]] and seen["lanes"] == [ledger.key]
    ledger.leave()
    assert ledger.snapshot() == {"lanes": [], "patience": 0.0, "running": [], "waiting": []}
