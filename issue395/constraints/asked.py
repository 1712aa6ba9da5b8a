"""The constraints the command line can choose: what it asked (``Constraints``, the run's record of
them), the constraint each arm runs under, and every constraint in the order its table prints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..results.extras import Record
from ..results.row import Row
from .cap import Cap
from .constraint import Constraint
from .emulation import EmulateCard
from .minfree import MinFreeBisection

#: Every constraint, in the order the text prints their tables.
CONSTRAINTS: tuple[type[Constraint], ...] = (Cap, EmulateCard, MinFreeBisection)


@dataclass(frozen=True)
class Constraints:
    """What the command line asked to constrain each arm with (at most one is set: issue395.run.clashes),
    a field per constraint named for its option (``Constraint.field``). What a run does with it, it asks
    the constraint: whether each arm needs a fresh process, how the arms ran, what a lost row carries."""

    cap: Optional[str] = None  # --cap: which prediction caps each arm's allocator
    emulate_card: Optional[str] = None  # --emulate-card: the card each arm runs as (a ballast)
    min_free: bool = False  # --min-free: each arm's lowest completing cap, by bisection

    @classmethod
    def of(cls, args: Any) -> "Constraints":
        """What the command line asked, each constraint's value read off its option."""
        return cls(**{c.field(): getattr(args, c.field()) for c in CONSTRAINTS})

    @property
    def asked(self) -> Optional[tuple[type[Constraint], Any]]:
        """The constraint asked and its option's value (None: the arms run unconstrained)."""
        return next(((c, v) for c in CONSTRAINTS if (v := getattr(self, c.field())) not in (None, False)), None)

    @property
    def fresh(self) -> bool:
        """Each arm needs a fresh process of its own, its allocator's expandable segments set before
        CUDA starts, as `soup train` sets them (every constraint does)."""
        return self.asked is not None

    @property
    def probes(self) -> bool:
        """Each arm is a series of fresh probes (issue395.host.probes drives them), not one arm."""
        return self.asked is not None and self.asked[0].PROBES

    @property
    def how(self) -> Optional[str]:
        """How the arms ran under it, as the text's header says (None: unconstrained)."""
        return None if self.asked is None else self.asked[0].how(self.asked[1])

    def lost(self) -> Optional[Record]:
        """What a row carries of it when the arm's process died before reporting."""
        return None if self.asked is None else self.asked[0].lost(self.asked[1])

    def for_arm(self, context: Optional[int] = None) -> Optional[Constraint]:
        """The constraint one arm runs under in its process (--min-free's probes are --cap's)."""
        return None if self.asked is None else self.asked[0].for_arm(self.asked[1], context)


def constraint_tables(rows: list[Row]) -> list[str]:
    """Each constraint's table over the rows that ran under it, in CONSTRAINTS' order."""
    return [c.table(mine) for c in CONSTRAINTS if (mine := [r for r in rows if c.carries(r)])]
