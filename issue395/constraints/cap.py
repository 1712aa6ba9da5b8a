"""--cap: what an arm's caching allocator is capped at, so a prediction is tested the way a card
tests it. Capped at Soup's own pre-flight, an arm Soup under-predicts should die with OOM (the run
Soup's gate admits dies: issue #395's failure); capped at the corrected needs-free, it should
complete; 'off' is the control, the same fresh process and allocator with no cap."""

from __future__ import annotations

from typing import Optional

from ..text import gb, table
from ..model.arm import Arm
from ..estimator.resident import estimate_run
from ..results.extras import Capped
from ..results.row import Row
from .constraint import ArmSetting, Constraint, arm_name
from .emulation import arm_config


def cap_bytes(cap: str, arm: Arm, release: Optional[str] = None, config: Optional[dict] = None) -> Optional[int]:
    """The cap in bytes for one arm (issue395.model.arm.Arm: its family, or the record's models, from its public
    config, or ``config``, a --model arm's checkpoint's), at its adapter, under its task (a preference task's step is
    not SFT's) and streaming modes or resident run: Soup's own number is Soup's estimator fed what its setup
    computes (exact on every map arm)."""
    if cap == "off":
        return None
    if cap.startswith("bytes:"):  # --min-free's probes: a number, not a prediction
        return int(cap.partition(":")[2])
    # Soup's number only where it is the cap: it needs the release's own code, the physics does not
    e = estimate_run(arm, config, release=release, soup=cap == "soup")
    return {"soup": e.soup_predicted, "corrected": e.corrected_predicted, "needs-free": e.needs_free}[cap]


def apply_cap(limit: Optional[int]) -> Optional[float]:
    """Cap this process's caching allocator at ``limit`` bytes of the card (before Soup's setup
    moves anything there); returns the fraction set."""
    if limit is None:
        return None
    import torch

    fraction = min(1.0, limit / torch.cuda.get_device_properties(0).total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return fraction


class Cap(Constraint):
    """--cap AT: the arm's allocator capped at a prediction (AT: soup, corrected, needs-free; off: the
    control), in a fresh process. Soup's own number is known only once its setup computed it, so it
    caps before the step; the others cap before Soup's setup."""

    FLAG, RECORD = "--cap", Capped

    def __init__(self, at: str) -> None:
        self.at, self.bytes, self.capped = at, None, False

    def before_setup(self, s: ArmSetting) -> None:
        if self.at != "soup" and not s.dry_run:
            self.bytes = cap_bytes(self.at, s.estimated, config=arm_config(s.arm.model, s.base))
            self.capped = True
            apply_cap(self.bytes)

    def before_step(self, s: ArmSetting, soup_predicted: Optional[int]) -> None:
        # Soup's own number exactly as this setup computed it, for every family and streaming mode
        # it streams; set before the measured step, which is where the peak lives. Soup's gate
        # reads the device's free memory, which a per-process fraction does not change.
        if self.at == "soup" and not s.dry_run and soup_predicted:
            self.bytes, self.capped = soup_predicted, True
            apply_cap(self.bytes)

    def record(self) -> Optional[Capped]:
        return Capped(self.at, self.bytes) if self.capped else None

    @classmethod
    def how(cls, asked: str) -> str:
        return f"capped at {asked} (expandable segments), one fresh process per arm"

    @classmethod
    def lost(cls, asked: str) -> Capped:
        return Capped(asked)

    @staticmethod
    def table(rows: list[Row]) -> str:
        """--cap: each arm re-run in a fresh process with its allocator capped at a prediction."""
        cells = []
        for r in rows:
            if r.measured:
                outcome = "completed" + (" (control: no cap)" if r.constraint.at == "off" else "")
            elif r.status == "OOM":
                outcome = "OOM" + (": admitted by Soup, OOM at its own number" if r.constraint.at == "soup" else "")
            else:
                outcome = r.status
            soup = r.soup_resident.peak if r.soup_resident is not None else r.soup_predicted  # a resident run's: its gate's
            cells.append([arm_name(r), r.constraint.at, gb(r.constraint.bytes), gb(soup),
                          gb(r.real_peak if r.measured else None), gb(r.reserved if r.measured else None), outcome])
        return "\n".join(["--cap: each arm in a fresh process, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, "
                          "allocator capped at the prediction named (cap: computed by Soup or this tool's estimator; "
                          "peaks: measured here)"] + table(
            [("arm", -34), ("cap at", -10), ("cap GB", 8), ("Soup's own GB", 13), ("allocated GB", 12),
             ("reserved GB", 11), ("outcome", -50)], cells))
