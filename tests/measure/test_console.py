"""issue395.measure.console: Ctrl-C, SIGTERM and SIGHUP, with and without an arm in flight (real signals
to this process); progress, whose first ETA waits for a second arm (the clock FAKED); a library's
import-time warning goes to the arm's log, not the terminal (a stand-in module logs it)."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from conftest import make_row

from issue395.measure.console import Progress, Stop, soup_console


@pytest.fixture
def sighup_restored(monkeypatch):
    """SIGHUP's handler restored after; the streams of a pytest run with -s left alone."""
    from issue395.measure import console

    gone = []
    monkeypatch.setattr(console, "terminal_gone", lambda: gone.append(True))
    saved = signal.getsignal(signal.SIGHUP)
    yield gone
    signal.signal(signal.SIGHUP, saved if saved is not None else signal.SIG_DFL)


def _signal_self(sig) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(2)  # the handler raises KeyboardInterrupt before this returns


def test_a_closed_terminal_sighup_stops_at_once_like_sigterm(sighup_restored):
    Stop.install(quiet=True)
    with pytest.raises(KeyboardInterrupt):
        _signal_self(signal.SIGHUP)
    assert Stop.requested and sighup_restored == [True]


def test_a_closed_terminal_stops_at_once_even_with_an_arm_in_flight(sighup_restored):
    Stop.install(quiet=True)
    with pytest.raises(KeyboardInterrupt), Stop.arm():
        _signal_self(signal.SIGHUP)
    assert Stop.requested and not Stop.in_flight


def test_first_ctrl_c_with_no_arm_in_flight_stops_at_once_and_says_so(capfd):
    Stop.install()
    with pytest.raises(KeyboardInterrupt):
        _signal_self(signal.SIGINT)
    assert Stop.requested
    err = capfd.readouterr().err
    assert "no arm in flight" in err and "stopping now" in err
    assert "after the arm in flight" not in err


def test_first_ctrl_c_with_an_arm_in_flight_waits_for_it_and_a_second_stops_now(capfd):
    Stop.install()
    with Stop.arm():
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 5
        while not Stop.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert Stop.requested  # no KeyboardInterrupt: the arm finishes
        assert "stopping after the arm in flight" in capfd.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            _signal_self(signal.SIGINT)
    assert not Stop.in_flight


def test_a_ctrl_c_between_arms_stops_at_once_once_arms_are_tracked(capfd):
    Stop.install(quiet=True)
    with Stop.arm():
        pass
    with pytest.raises(KeyboardInterrupt):
        _signal_self(signal.SIGINT)


def test_first_eta_waits_for_a_second_arm(capfd, monkeypatch):
    clock = iter([30.0, 40.0])
    monkeypatch.setattr("issue395.measure.console.time.perf_counter", lambda: next(clock))
    p = Progress(5, 0.0)
    row = make_row("smol", 64)
    p.arm(row)
    p.arm(row)
    err = capfd.readouterr().err.splitlines()
    assert "estimating" in err[0] and "~" not in err[0]
    assert err[1].endswith("~30 s left")  # 10 s per arm after the first, 3 left


def test_import_time_library_warnings_land_in_the_arm_log(tmp_path, capfd, monkeypatch):
    mod = tmp_path / "fake_bnb_ops.py"
    mod.write_text("import logging\nlogging.getLogger('bitsandbytes.backends.cpu.ops').warning("
                   "'Failed to load CPU gemm_4bit_forward from kernels-community')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("fake_bnb_ops", None)
    import issue395.measure.console as console

    monkeypatch.setattr(console, "SOUP_MODULES", console.SOUP_MODULES + ("fake_bnb_ops",))
    log = tmp_path / "arm.log"
    with soup_console(log, verbose=False):
        pass
    out, err = capfd.readouterr()
    assert "gemm_4bit_forward" not in out + err
    assert "gemm_4bit_forward" in log.read_text()
    sys.modules.pop("fake_bnb_ops", None)


def test_progress_names_a_task_other_than_sft_and_never_prints_none_for_sft(capfd):
    """The full map of 2026-12-02 printed "Moonlight-16B-A3B (layers 4 of 27) None nf4 seq 512": an SFT
    row's task is None, and the progress line treated None as a task to name."""
    from dataclasses import replace

    p = Progress(3, 0.0)
    sft = make_row("smol", 64)
    p.arm(sft)
    p.arm(replace(sft, task="dpo"))
    p.arm(replace(sft, quant="nf4"))
    err = capfd.readouterr().err.splitlines()
    assert "None" not in err[0] and f"{sft.model} seq 64 batch" in err[0], err[0]
    assert f"{sft.model} dpo seq 64" in err[1], err[1]
    assert f"{sft.model} nf4 seq 64" in err[2] and "None" not in err[2], err[2]


# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


def test_a_map_progress_line_names_a_task_that_is_not_sft(capfd):
    """Issue 36 item 3: a map's progress line names a task that is not SFT."""
    from conftest import SMOL
    from issue395.measure.console import Progress
    from issue395.model.arm import Arm
    from issue395.results.row import arm_row

    row = arm_row(Arm("smol", 512, 2, 0, task="dpo"), SMOL, realised_width=512, realised_rows=(512,) * 4)
    p = Progress(2, time.perf_counter())
    p.arm(row)
    assert " dpo " in capfd.readouterr().err
