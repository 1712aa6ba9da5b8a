"""One GPU shared by --lanes processes on the map: the ledger that packs the lanes' arms by their bytes
(issue 38). The map deals whole families to lanes and keeps no shared checkpoint cache (its families'
checkpoints do not fit the box's disk together), so every arm runs in its family's lane, where its
checkpoint already is. Each arm holds this tool's needs-free for it while it runs; arms of all lanes run
together while their bytes fit the card beside every live lane's CUDA context and growth, first asked
first served (host/schedule.py, the rule; here, that rule kept between processes). It replaces issue 30's
binary card lock, under which an arm past a lane's 1/N of the card held the whole card and drained every
other lane. flock(2) on the ledger's lock file: a lock belongs to the open file, so a process that dies
releases it, and a dead lane's bytes are dropped by the next reader. The same for the disk the lanes build
their checkpoints on (DiskLedger: each build's bytes from before it starts to its family's release).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from typing import Iterator, Optional

from ..estimator.cards import CONTEXT_BOUND_BYTES
from .schedule import Ledger, Need, Room, may_build


def _acquire(path: str, how: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, how)  # blocks; a signal's KeyboardInterrupt leaves here, the fd closed
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _locked_json(path: str, writer: str, missing_ok: bool = False) -> Iterator[dict]:
    """The JSON object at ``path`` under an exclusive flock of ``path``.lock, written back whole (through
    a temporary file of ``writer``'s, replaced at once) when the block ends without an exception.
    ``missing_ok``: a file not there yet, or not readable, reads as empty."""
    fd = _acquire(f"{path}.lock", fcntl.LOCK_EX)
    try:
        try:
            with open(path, encoding="utf-8") as fh:
                state = json.load(fh)
        except (OSError, ValueError):
            if not missing_ok:
                raise
            state = {}
        yield state
        tmp = f"{path}.{writer}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(state, fh)
        os.replace(tmp, path)
    finally:
        os.close(fd)


class CardLedger:
    """One GPU's lanes packed by bytes (issue 38): schedule.Ledger kept in a JSON file at ``path``,
    read and written under an exclusive flock of ``path``.lock, so each lane process asks, starts and
    gives back its arm's bytes against every other lane's. The room is the card's ``total`` (what CUDA
    can hand out) less ``context`` and the runtime's growth for each live lane: lanes join when they
    start and leave when they end; a lane process that died (SIGKILL runs no clean-up) is dropped with
    its bytes the next time anyone reads the ledger, as the driver frees its memory."""

    def __init__(self, path: str, total: int, context: int = CONTEXT_BOUND_BYTES, patience: float = 0.0,
                 poll_s: float = 0.05) -> None:
        self.path, self.total, self.context, self.patience, self.poll_s = path, total, context, patience, poll_s
        self.key = str(os.getpid())

    @contextlib.contextmanager
    def _state(self) -> Iterator[dict]:
        with _locked_json(self.path, self.key, missing_ok=True) as saved:
            lanes = [k for k in saved.get("lanes", ()) if _alive(k)]
            ledger = Ledger.from_json(self.room(len(lanes)), saved.get("ledger", {"patience": self.patience}))
            for key in [k for k in ledger.running if not _alive(k)] + [w[0] for w in ledger.waiting if not _alive(w[0])]:
                ledger.done(key)
            state = {"lanes": lanes, "ledger": ledger}
            yield state
            state["ledger"].room = self.room(len(state["lanes"]))
            state["ledger"].admit(time.monotonic())  # a lane that left may let a waiting arm in
            saved.clear()
            saved.update(lanes=state["lanes"], ledger=state["ledger"].to_json())

    def room(self, lanes: int) -> Room:
        return Room(self.total, max(1, lanes), self.context)

    def join(self) -> None:
        with self._state() as state:
            if self.key not in state["lanes"]:
                state["lanes"].append(self.key)

    def leave(self) -> None:
        with self._state() as state:
            state["lanes"] = [k for k in state["lanes"] if k != self.key]
            state["ledger"].done(self.key)

    @contextlib.contextmanager
    def held(self, need: Optional[Need]) -> Iterator[int]:
        """The card for one arm: it waits until its bytes are admitted beside what runs, holds them for
        the arm, and gives them back after (an exception or a stop while it waits withdraws it). It
        yields the bytes the other lanes' arms held when it was admitted. ``need`` None: the whole room
        the live lanes leave (asked again at each look, as lanes join and leave), so it runs alone."""
        with self._state() as state:
            state["ledger"].ask(self.key, need or self._alone(state), time.monotonic())
        try:
            while True:
                with self._state() as state:
                    if need is None:
                        state["ledger"].waiting = [(k, self._alone(state) if k == self.key else n, t)
                                                   for k, n, t in state["ledger"].waiting]
                    state["ledger"].admit(time.monotonic())
                    if self.key in state["ledger"].running:
                        beside = state["ledger"].used - state["ledger"].running[self.key]
                        break
                time.sleep(self.poll_s)
            yield beside
        finally:
            with self._state() as state:
                state["ledger"].done(self.key)

    def _alone(self, state: dict) -> Need:
        return Need(self.room(len(state["lanes"])).arm_bytes)

    def snapshot(self) -> dict:
        """The ledger as the lanes see it now (for a test, or a progress line)."""
        with self._state() as state:
            return {"lanes": list(state["lanes"]), **state["ledger"].to_json()}


def _alive(key: str) -> bool:
    try:
        os.kill(int(str(key).split(":")[0]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


def ledger_for(path: Optional[str], total: Optional[int], context: int = CONTEXT_BOUND_BYTES) -> Optional[CardLedger]:
    return CardLedger(path, total, context) if path and total else None


#: What the lanes write to the checkpoints' disk beside the checkpoints (rows, logs, each arm's work
#: folder, Soup's audit log: kilobytes to a few MB an arm), kept out of the checkpoints' budget.
DISK_HEADROOM_BYTES = 2**30


class DiskLedger:
    """The disk the map's synthetic checkpoints share, between lanes (issue 38: on a box whose root disk
    had 43 GB free, four lanes each building one family ahead ran out: "No space left on device", three
    lanes lost). A build holds its bytes from before its first byte is written until its family's release;
    one that does not fit beside what the live lanes hold (schedule.may_build) is not started ahead, and
    a lane that needs it now waits, unless nothing is held (the only way on). The budget is the disk's
    free bytes when the run started, less DISK_HEADROOM_BYTES, written once by the parent. The same
    flock'd JSON as CardLedger; a dead lane's bytes are dropped by the next reader."""

    def __init__(self, path: str, poll_s: float = 0.5) -> None:
        self.path, self.poll_s, self.pid = path, poll_s, str(os.getpid())

    @classmethod
    def create(cls, path: str, folder: str, budget: Optional[int] = None) -> "DiskLedger":
        """A new ledger at ``path`` for the checkpoints that will be built under ``folder``'s disk
        (``budget``: the bytes they may hold at once; default the disk's free bytes less the headroom)."""
        import shutil

        if budget is None:
            budget = max(0, shutil.disk_usage(folder).free - DISK_HEADROOM_BYTES)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"budget": budget, "held": {}, "waiting": []}, fh)
        return cls(path)

    @contextlib.contextmanager
    def _state(self) -> Iterator[dict]:
        with _locked_json(self.path, self.pid) as state:
            state["held"] = {k: int(v) for k, v in state.get("held", {}).items() if _alive(k)}
            state["waiting"] = [k for k in state.get("waiting", ()) if _alive(k)]
            yield state

    def try_hold(self, name: str, size: int, ahead: bool = True) -> bool:
        """Hold ``size`` bytes for ``name``'s checkpoint if they fit now (True: held). A build ahead
        defers to a lane that is waiting for its next family (it would otherwise take back the bytes
        it just released, every time, and the waiting lane would wait for its last family)."""
        with self._state() as state:
            key = f"{self.pid}:{name}"
            if key in state["held"]:
                return True
            if ahead and any(not w.startswith(f"{self.pid}:") for w in state["waiting"]):
                return False
            if not may_build(sum(state["held"].values()), size, state.get("budget")):
                return False
            state["held"][key] = size
            state["waiting"] = [w for w in state["waiting"] if w != key]
            return True

    def hold(self, name: str, size: int) -> float:
        """Hold them, waiting (as a waiter every build ahead defers to) for other lanes' releases;
        the seconds it waited."""
        started, key = time.monotonic(), f"{self.pid}:{name}"
        if self.try_hold(name, size, ahead=False):
            return 0.0
        try:
            with self._state() as state:
                state["waiting"] = [w for w in state["waiting"] if w != key] + [key]
            while not self.try_hold(name, size, ahead=False):
                time.sleep(self.poll_s)
        finally:
            with self._state() as state:
                state["waiting"] = [w for w in state["waiting"] if w != key]
        return time.monotonic() - started

    def release(self, name: str) -> None:
        with self._state() as state:
            state["held"].pop(f"{self.pid}:{name}", None)

    @property
    def budget(self) -> int:
        with self._state() as state:
            return int(state.get("budget") or 0)

    def snapshot(self) -> dict:
        with self._state() as state:
            return dict(state)
