"""The constraints the command line can choose: what it asked (``Constraints``, the run's record of
them), the constraint each arm runs under, and every constraint in the order its table prints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..results.row import Row
from .cap import Cap
from .constraint import Constraint
from .emulation import EmulateCard
from .minfree import MinFreeBisection

#: Every constraint, in the order the text prints their tables.
CONSTRAINTS: tuple[type[Constraint], ...] = (Cap, EmulateCard, MinFreeBisection)


@dataclass(frozen=True)
class Constraints:
    """What the command line asked to constrain each arm with (at most one is set: issue395.run.clashes)."""

    cap: Optional[str] = None  # --cap: which prediction caps each arm's allocator
    emulate_card: Optional[str] = None  # --emulate-card: the card each arm runs as (a ballast)
    min_free: bool = False  # --min-free: each arm's lowest completing cap, by bisection

    @property
    def fresh(self) -> bool:
        """Each arm needs a fresh process of its own."""
        return self.cap is not None or self.emulate_card is not None or self.min_free

    def for_arm(self, context: Optional[int] = None) -> Optional[Constraint]:
        """The constraint one arm runs under in its process (--min-free's probes are --cap's)."""
        if self.cap:
            return Cap(self.cap)
        if self.emulate_card:
            return EmulateCard(self.emulate_card, context)
        return None


def constraint_tables(rows: list[Row]) -> list[str]:
    """Each constraint's table over the rows that ran under it, in CONSTRAINTS' order."""
    return [c.table(mine) for c in CONSTRAINTS if (mine := [r for r in rows if c.carries(r)])]
