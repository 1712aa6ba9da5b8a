"""issue395.console: Ctrl-C, SIGTERM and SIGHUP, with and without an arm in flight."""

from __future__ import annotations
import os
import signal
import time
import pytest
from issue395.console import Stop


@pytest.fixture
def sighup_restored(monkeypatch):
    """SIGHUP's handler restored after; the streams of a pytest run with -s left alone."""
    from issue395 import console

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
