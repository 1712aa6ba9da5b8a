"""The map's lanes packed on one card by bytes (issue 38): what each arm holds of the card while it
runs, the room the lanes leave it, the admission rule between lanes, the order families are taken in,
and the threads each lane gets. Pure: no process, file or clock here (cardlock.CardLedger keeps this
state between processes; bench/schedule_sim.py runs it against the committed map's timings).

The rule the card lock had (issue 30) was binary: an arm that did not fit a lane's 1/N of the card held
the whole card, every other lane idle. Here each arm holds its own bytes, and any arms run together
whose bytes sum to no more than the card leaves them (each live lane's CUDA context and the runtime's
growth taken off first). Waiting arms are served in the order they asked. A later arm may start before
an earlier one that cannot start yet while that one has waited less than the ledger's ``patience``;
from then on the earlier one's bytes are kept for it, so nothing behind it starts and the card drains
for it: a large arm is never starved by small ones arriving behind it (the turnstile's writer
preference, in bytes). Patience 0 is first come, first served.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable, Mapping, Optional

from ..estimator.cards import CARDS, CONTEXT_BOUND_BYTES, GATE_GROWTH_BYTES, STEP_GROWTH_BYTES

#: What --lanes gives each lane of the host's cores: cores // lanes (at least one). On the issue's
#: 16-core H200 box, --lanes 4, 6 and 8 give the three layouts issue 38 asks to measure:
#: 4 x 4, 6 x 2 and 8 x 2 threads.
LAYOUTS = (4, 6, 8)


def lane_threads(cores: int, lanes: int) -> int:
    return max(1, cores // max(1, lanes))


@dataclass(frozen=True)
class Need:
    """What one arm asks of the card: ``holds``, the bytes it may take while it runs (this tool's
    needs-free for it), and ``soup``, Soup's own number, which Soup's gate sets against the free memory
    it reads in the arm's setup (None: not known here, e.g. a --model checkpoint)."""

    holds: int
    soup: Optional[int] = None


@dataclass(frozen=True)
class Room:
    """One card shared by ``lanes`` live lane processes: its total as the driver reports it, and the
    CUDA context each process keeps outside the caching allocator (measured on that card, or the card's
    bound). Every live lane, busy or idle, keeps its context and the runtime's growth (the modules CUDA
    loaded and the backward thread's handles stay after its arm's teardown)."""

    total: int
    lanes: int
    context: int = CONTEXT_BOUND_BYTES

    @property
    def per_lane(self) -> int:
        return self.context + STEP_GROWTH_BYTES

    @property
    def arm_bytes(self) -> int:
        """What the lanes leave their arms together: the total less every lane's context and growth."""
        return self.total - self.lanes * self.per_lane

    def gate_free(self, used: int) -> int:
        """The free memory Soup's gate can count on in one lane while the others' arms hold ``used``:
        the other lanes at their whole growth, this one at the growth by the gate."""
        return self.total - self.lanes * self.context - (self.lanes - 1) * STEP_GROWTH_BYTES \
            - GATE_GROWTH_BYTES - used

    def refused_alone(self, need: Need) -> bool:
        """Soup's gate refuses this arm even on an idle card (one lane): it holds no more than its setup."""
        return need.soup is not None and need.soup > Room(self.total, 1, self.context).gate_free(0)

    def fits_beside_lanes(self, need: Need) -> bool:
        """Whether the arm can run at all while the other lanes live (idle): else it runs after the
        lanes, alone, where Soup's gate reads the card as it would on its own."""
        return self.refused_alone(need) or (need.holds <= self.arm_bytes
                                            and (need.soup is None or need.soup <= self.gate_free(0)))

    def admits(self, need: Need, used: int) -> bool:
        """``need`` may start beside arms that hold ``used`` bytes: its bytes fit what is left, and
        Soup's number fits the free memory its gate will read (an arm Soup refuses alone is refused
        beside neighbours too, so it is let through: its row is Soup's refusal either way)."""
        if self.refused_alone(need):
            return True
        return used + need.holds <= self.arm_bytes and (need.soup is None or need.soup <= self.gate_free(used))


def card_total(driver_total: int) -> int:
    """What CUDA can hand out of a card the driver reports at ``driver_total`` bytes: a named card's
    hidden bytes (the H200's 616 MiB below nvidia-smi's total) come off where its total is that card's."""
    card = next((c for c in CARDS.values() if c.total_bytes == driver_total), None)
    return driver_total - (card.hidden_bytes if card else 0)


def held(need: Need, room: Room) -> int:
    """The bytes an admitted arm counts for against the others: an arm Soup refuses stops in its
    setup, before it allocates more than its weights' first layer, so it counts for nothing."""
    return 0 if room.refused_alone(need) else need.holds


@dataclass
class Ledger:
    """The card's arms: those running (key: the bytes they hold) and those waiting, in the order
    they asked, each with when it asked (any clock: seconds). Keys are any hashable (a lane
    process's pid, a simulated lane)."""

    room: Room
    patience: float = 0.0
    running: dict = field(default_factory=dict)
    waiting: list = field(default_factory=list)  # (key, Need, asked), first asked first

    @property
    def used(self) -> int:
        return sum(self.running.values())

    def ask(self, key: Hashable, need: Need, now: float = 0.0) -> None:
        if key in self.running or any(w[0] == key for w in self.waiting):
            raise ValueError(f"{key!r} asked twice")
        self.waiting.append((key, need, now))

    def admit(self, now: float = 0.0) -> list:
        """Start every waiting arm that may start now, first asked first; each one that starts holds
        its bytes at once. One that cannot start and has waited its patience out keeps its bytes
        against those behind it: they start only where they fit beside it as well."""
        started, kept = [], 0
        for entry in list(self.waiting):
            key, need, asked = entry
            if self.room.admits(need, self.used + kept):
                self.running[key] = held(need, self.room)
                self.waiting.remove(entry)
                started.append(key)
            elif now - asked >= self.patience:
                kept += held(need, self.room)
        return started

    def done(self, key: Hashable) -> None:
        self.running.pop(key, None)
        self.waiting = [w for w in self.waiting if w[0] != key]

    def to_json(self) -> dict:
        return {"patience": self.patience, "running": [[k, v] for k, v in self.running.items()],
                "waiting": [[k, n.holds, n.soup, t] for k, n, t in self.waiting]}

    @classmethod
    def from_json(cls, room: Room, data: Mapping) -> "Ledger":
        return cls(room, float(data.get("patience", 0.0)), {k: int(v) for k, v in data.get("running", ())},
                   [(k, Need(int(h), None if s is None else int(s)), float(t))
                    for k, h, s, t in data.get("waiting", ())])


def claim_order(cost: Mapping[str, float]) -> list[str]:
    """The order lanes take families in: the costliest first (longest processing time first, so the
    run's end is not one large family alone), ties by name. Its first families are the largest
    checkpoints, whose builds then overlap the other lanes' steps rather than the run's tail."""
    return sorted(cost, key=lambda f: (-cost[f], f))


def deal(cost: Mapping[str, float], lanes: int) -> list[list[str]]:
    """Families dealt to ``lanes`` lanes ahead of the run: each, costliest first, to the lane with the
    least so far (what a lane holds is fixed once dealt; claim_order is the same order taken live)."""
    load, dealt = [0.0] * lanes, [[] for _ in range(lanes)]
    for f in claim_order(cost):
        k = min(range(lanes), key=lambda j: (load[j], j))
        dealt[k].append(f)
        load[k] += cost[f]
    return dealt


def may_build(on_disk: int, size: int, disk: Optional[int]) -> bool:
    """Whether a checkpoint of ``size`` bytes may be built now beside the ``on_disk`` bytes the lanes'
    checkpoints already hold, on a disk that holds ``disk`` for them (None: not bounded). One that
    would not fit waits for a family's release; with nothing on the disk it is built whatever it costs
    (it is the only way on). The committed 4-lane map held 66.4 GB at once on a 68.7 GB disk."""
    return disk is None or on_disk == 0 or on_disk + size <= disk


def needs_table(needs: Iterable[tuple[int, Need]]) -> dict[int, Need]:
    """Arm index to its Need, refusing an index named twice (one arm, one row)."""
    out: dict[int, Need] = {}
    for index, need in needs:
        if index in out:
            raise ValueError(f"arm {index} named twice")
        out[index] = need
    return out
