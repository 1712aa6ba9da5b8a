"""What a constraint on an arm is: a mode that changes how an arm runs (``--cap``, ``--emulate-card``,
``--min-free``) behind one interface, so a new mode is one more ``Constraint``: its hooks around the
arm (before the arm, before Soup's setup, before the measured step, after the arm however it ended), the record it
adds to the row (issue395.results.extras), and the table it prints for the rows that carry it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Optional

from ..model.arm import Arm
from ..model.registry import Shape
from ..results.extras import Record
from ..results.row import Row


@dataclass(frozen=True)
class ArmSetting:
    """What a constraint reads of the arm it constrains."""

    arm: Arm
    shape: Shape
    base: str  # the checkpoint the arm runs
    steps: int = 1
    dry_run: bool = False

    @property
    def estimated(self) -> Arm:
        """The arm as its estimate reads it: the adapter its shape resolved (a family's targets, a --config file's
        targets and r) and the run's steps."""
        return replace(self.arm, adapter=replace(self.arm.adapter, targets=tuple(self.shape.targets) or None,
                                                 lora_r=self.shape.lora_r), steps=self.steps)


class Constraint:
    """One constraint on one arm. The measurement calls its hooks at their moments; the row carries
    ``record()``; the text prints ``table`` over the rows carrying this constraint's ``RECORD``."""

    FLAG: ClassVar[str]  # its option on the command line
    RECORD: ClassVar[type]  # its row record
    #: Its arms are each a series of fresh probes its driver runs (issue395.host.probes), not one arm each.
    PROBES: ClassVar[bool] = False

    @classmethod
    def field(cls) -> str:
        """Its field in ``Constraints`` (issue395.constraints.asked): its option's name."""
        return cls.FLAG.lstrip("-").replace("-", "_")

    @classmethod
    def for_arm(cls, asked, context: Optional[int] = None) -> "Optional[Constraint]":
        """The constraint one arm runs under in its process, asked as ``asked`` (its option's value)."""
        return cls(asked)

    @classmethod
    def how(cls, asked) -> str:
        """How the run's arms ran under it, as the text's header says."""
        raise NotImplementedError

    @classmethod
    def lost(cls, asked) -> Optional[Record]:
        """What a row carries of it when the arm's process died before reporting (no measurement)."""
        return None

    def before_arm(self, setting: ArmSetting) -> None:
        """Before the arm runs at all (a dry run too): what this tool decides of it beforehand."""

    def before_setup(self, setting: ArmSetting) -> None:
        """Before Soup puts anything on the card."""

    def before_step(self, setting: ArmSetting, soup_predicted: Optional[int]) -> None:
        """Soup's own pre-flight known, the measured step not yet run."""

    def release(self) -> Optional[str]:
        """After the arm, however it ended: an error to report beside the row, never raised."""
        return None

    def record(self) -> Optional[Record]:
        """What the row carries of this constraint (None: the arm was never constrained)."""
        return None

    @classmethod
    def carries(cls, row: Row) -> bool:
        return isinstance(row.constraint, cls.RECORD)

    @staticmethod
    def table(rows: list[Row]) -> str:
        raise NotImplementedError


def arm_name(r: Row) -> str:
    return f"{r.label} {r.quant} {r.seq}x{r.batch}"
