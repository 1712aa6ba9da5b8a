"""One GPU shared by --lanes processes: the ledger that packs the lanes' arms by their bytes (issue 38:
CardLedger, schedule.Ledger kept between processes), and before it a card lock: an arm that needs the whole card holds it
alone, every other arm shares it (issue 30).

The map deals whole families to lanes and keeps no shared checkpoint cache (its families' checkpoints
do not fit the box's disk together), so a family's whole-card arms run in that family's own lane,
where its checkpoint already is, while the other lanes wait between arms. flock(2) on two files: the
card (shared by lane arms, exclusive for a whole-card arm) and a turnstile before it, which a
whole-card arm holds while it waits for and holds the card, so lane arms that keep arriving cannot
starve it (writer preference). Locks belong to the open file, so a process that dies releases
them, and every acquire opens its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from typing import Iterator, Optional

from ..estimator.cards import CONTEXT_BOUND_BYTES
from .schedule import Ledger, Need, Room


class CardLock:
    """The lock of one GPU's lanes, at ``path`` (its turnstile beside it)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.turnstile = f"{path}.turnstile"

    @contextlib.contextmanager
    def held(self, whole_card: bool) -> Iterator[None]:
        """The card for one arm: alone (``whole_card``) or beside the other lanes' arms."""
        gate = _acquire(self.turnstile, fcntl.LOCK_EX)
        try:
            card = _acquire(self.path, fcntl.LOCK_EX if whole_card else fcntl.LOCK_SH)
        except BaseException:
            os.close(gate)
            raise
        if not whole_card:
            os.close(gate)  # through the turnstile: the next lane arm may come in beside this one
        try:
            yield
        finally:
            os.close(card)
            if whole_card:
                os.close(gate)


def _acquire(path: str, how: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, how)  # blocks; a signal's KeyboardInterrupt leaves here, the fd closed
    except BaseException:
        os.close(fd)
        raise
    return fd


class CardHold:
    """A lane's hold on its card over its arms in turn: each lane arm shares the card for itself, and
    a run of whole-card arms back to back keeps the card alone from the first to the last. Each
    exclusive acquire first drains every other lane's arm in flight, so one hold per run, not one
    per arm (the 0.77.0 map at 4 lanes: 37 whole-card arms, each a drain; results/INDEX.md)."""

    def __init__(self, lock: "CardLock | None") -> None:
        self.lock = lock
        self._alone: contextlib.ExitStack | None = None

    @contextlib.contextmanager
    def arm(self, whole_card: bool, next_whole_card: bool) -> Iterator[None]:
        """The card for one arm; ``next_whole_card``: the arm this lane runs next needs the card alone too,
        so the hold is kept for it (never across anything else this lane does)."""
        if self.lock is None:
            yield
            return
        if not whole_card:
            self.release()
            with self.lock.held(False):
                yield
            return
        if self._alone is None:
            stack = contextlib.ExitStack()
            stack.enter_context(self.lock.held(True))
            self._alone = stack
        try:
            yield
        except BaseException:
            self.release()
            raise
        if not next_whole_card:
            self.release()

    def release(self) -> None:
        if self._alone is not None:
            self._alone.close()
            self._alone = None


def lane_order(arms: list, whole_card: "set[int] | frozenset[int]", family_of) -> list:
    """A lane's arms in the order it runs them: family by family as dealt, each family's whole-card arms
    after its others, so they run back to back under one hold (rows are put back in grid order)."""
    rank = {f: i for i, f in enumerate(dict.fromkeys(family_of(a.model) for a in arms))}
    return sorted(arms, key=lambda a: (rank[family_of(a.model)], a.index in whole_card))


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
        fd = _acquire(f"{self.path}.lock", fcntl.LOCK_EX)
        try:
            try:
                with open(self.path, encoding="utf-8") as fh:
                    state = json.load(fh)
            except (OSError, ValueError):
                state = {}
            lanes = [k for k in state.get("lanes", ()) if _alive(k)]
            ledger = Ledger.from_json(self.room(len(lanes)), state.get("ledger", {"patience": self.patience}))
            for key in [k for k in ledger.running if not _alive(k)] + [w[0] for w in ledger.waiting if not _alive(w[0])]:
                ledger.done(key)
            state = {"lanes": lanes, "ledger": ledger}
            yield state
            state["ledger"].room = self.room(len(state["lanes"]))
            state["ledger"].admit(time.monotonic())  # a lane that left may let a waiting arm in
            tmp = f"{self.path}.{self.key}.tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump({"lanes": state["lanes"], "ledger": state["ledger"].to_json()}, fh)
            os.replace(tmp, self.path)
        finally:
            os.close(fd)

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
    def held(self, need: Need) -> Iterator[None]:
        """The card for one arm: it waits until its bytes are admitted beside what runs, holds them for
        the arm, and gives them back after (an exception or a stop while it waits withdraws it)."""
        with self._state() as state:
            state["ledger"].ask(self.key, need, time.monotonic())
        try:
            while True:
                with self._state() as state:
                    state["ledger"].admit(time.monotonic())
                    if self.key in state["ledger"].running:
                        break
                time.sleep(self.poll_s)
            yield
        finally:
            with self._state() as state:
                state["ledger"].done(self.key)

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
