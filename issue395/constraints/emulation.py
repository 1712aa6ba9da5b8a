"""--emulate-card: one arm run as if on a smaller card. Before Soup's setup a ballast held outside
this process's caching allocator (issue395.constraints.minfree) leaves exactly the named card's free memory
(its total less its context, issue395.estimator.cards), so Soup's own gate measures it and decides; the
row carries the card, that free memory as measured, and this tool's verdict for the same card
(needs free <= that free less the runtime's growth, issue395.estimator.cards). The ballast goes back when the arm ends, however it ends.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..errors import last_line
from ..text import gb, table
from ..model.arm import Arm
from ..model.registry import FAMILIES, SHAPES, config_json
from ..model.streaming import family_of
from ..estimator.cards import Budget, budget, parse_card, workspace_env
from ..estimator.fits import card_answers
from ..results.extras import Emulated
from ..results.row import Row
from .constraint import ArmSetting, Constraint, arm_name
from .minfree import Ballast, hold_ballast, release_ballast


def arm_config(model_key: str, base: Optional[str]) -> Optional[dict]:
    """The config.json the estimator reads for an arm: a family's (or the record's) public one,
    else the checkpoint's own (--model, --config); None where there is none to read."""
    family = family_of(model_key)
    if family in FAMILIES or family in SHAPES:
        return config_json(family)
    path = Path(base or "") / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if base else None
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def tool_needs_free(config: Optional[dict], b: Optional[Budget], arm: Arm) -> Optional[int]:
    """This tool's needs-free for an arm (issue395.model.arm.Arm: its streaming modes, or a resident run, its task
    and adapter) on card ``b`` (its cuBLAS workspace, for a streamed step), or None where the estimator cannot
    model the arm (it is said as '-', never guessed)."""
    if config is None:
        return None
    from ..estimator.resident import estimate_run

    try:
        e = estimate_run(arm, config)
        if b is None or arm.streaming.resident:
            return e.needs_free
        return card_answers(config, e, [b], arm, env=workspace_env())[0]["needs_free"]
    except Exception:  # noqa: BLE001 - an arm the estimator does not model has no verdict
        return None


class EmulateCard(Constraint):
    """--emulate-card CARD: the card an arm runs as (its budget), this tool's verdict for the arm on
    it (before the card decides), and the ballast while the arm holds it."""

    FLAG, RECORD = "--emulate-card", Emulated

    def __init__(self, spec: str, context: Optional[int] = None) -> None:
        self.budget = budget(parse_card(spec), context)
        self.ballast: Optional[Ballast] = None
        self.needs_free: Optional[int] = None
        self.free: Optional[int] = None

    def before_arm(self, s: ArmSetting) -> None:
        """This tool's verdict for the arm on the card (its needs-free), before the card decides."""
        self.needs_free = tool_needs_free(arm_config(s.arm.model, s.base), self.budget, s.estimated)

    def before_setup(self, s: ArmSetting) -> None:
        if not s.dry_run:  # Soup's gate then measures the card's free memory
            self.free = self.hold()

    def record(self) -> Emulated:
        return Emulated(self.budget.card.name, self.budget.free_bytes, self.free, self.needs_free)

    @classmethod
    def for_arm(cls, asked: str, context: Optional[int] = None) -> "EmulateCard":
        return cls(asked, context)

    @classmethod
    def how(cls, asked: str) -> str:
        return f"as {asked} (a ballast outside the allocator, expandable segments), one fresh process per arm"

    @classmethod
    def lost(cls, asked: str) -> Emulated:
        return Emulated(parse_card(asked).name)

    def hold(self) -> int:
        """Take the card's free memory down to the emulated card's; returns mem_get_info's free
        as measured with the ballast held. A card with less free than that cannot emulate it."""
        target = self.budget.free_bytes
        self.ballast = hold_ballast(target)
        if self.ballast.free_after < target:
            free = self.ballast.free_after
            self.release()
            raise RuntimeError(f"--emulate-card {self.budget.card.name}: this GPU has {free / 1e9:.3f} GB "
                               f"free, less than the {target / 1e9:.3f} GB the card leaves")
        return self.ballast.free_after

    def release(self) -> Optional[str]:
        """The ballast back to the driver; an error is reported, never raised over the row."""
        if self.ballast is None:
            return None
        try:
            release_ballast(self.ballast)
        except Exception as exc:  # noqa: BLE001
            return f"the ballast could not be freed: {last_line(exc)}"
        finally:
            self.ballast = None
        return None

    @staticmethod
    def table(rows: list[Row]) -> str:
        """--emulate-card: what the card did with each arm (Soup's own gate on the card's free memory,
        then the step) beside this tool's verdict for the same card."""
        cells, notes = [], []
        for r in rows:
            cells.append([arm_name(r), r.constraint.card, gb(r.constraint.card_free), gb(r.constraint.free),
                          gb(r.gate and r.gate.free), gb(r.soup_predicted), gb(r.constraint.needs_free), tool_words(r.emulated_fits),
                          r.emulated_outcome or r.status, gb(r.real_peak if r.measured else None)])
            if r.emulated_outcome == "admitted and OOM":
                notes.append(f"  {arm_name(r)} on {r.constraint.card}: Soup's gate admitted it and the step OOMed "
                             "(issue #395)" + ("; this tool said it does not fit" if r.emulated_fits is False else ""))
            elif r.emulated_fits is True and r.emulated_outcome == "refused by Soup":
                notes.append(f"  {arm_name(r)} on {r.constraint.card}: Soup refused a run this tool says fits")
            elif r.emulated_fits is False and r.emulated_outcome == "admitted and completed":
                notes.append(f"  {arm_name(r)} on {r.constraint.card}: completed where this tool said it does not fit "
                             "(this tool's margin)")
        return "\n".join(["--emulate-card: each arm in a fresh process, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, "
                          "a ballast outside the allocator leaving the card's free memory (card free: total - context, "
                          "computed; free: measured with the ballast held; Soup's gate: the free memory Soup's gate read, "
                          "after the kernel modules its setup loaded; Soup's own: computed by Soup; needs free: "
                          "this tool's estimator; this tool: fits when needs free <= card free less the runtime's "
                          "growth (issue395.cards); outcome and allocated: measured here)"] + table(
            [("arm", -34), ("card", -18), ("card free GB", 12), ("free GB", 8), ("Soup's gate GB", 14),
             ("Soup's own GB", 13),
             ("needs free GB", 13), ("this tool", -12), ("outcome", -22), ("allocated GB", 12)], cells) + notes)


def tool_words(fits: Optional[bool]) -> str:
    return "-" if fits is None else "fits" if fits else "does not fit"
