"""--emulate-card: one arm run as if on a smaller card. Before Soup's setup a ballast held outside
this process's caching allocator (issue395.constraints.minfree) leaves exactly the named card's free memory
(its total less its context, issue395.estimator.cards), so Soup's own gate measures it and decides; the
row carries the card, that free memory as measured, and this tool's verdict for the same card
(needs free <= that free less the runtime's growth, issue395.estimator.cards). The ballast goes back when the arm ends, however it ends.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from ..errors import last_line
from ..model.registry import FAMILIES, SHAPES, config_json, family_of
from ..estimator.cards import Budget, budget, parse_card, workspace_env
from ..estimator.fits import card_answers
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


def tool_needs_free(config: Optional[dict], b: Optional[Budget], *, quant: str, seq: int, batch: int,
                    targets: tuple, lora_r: int = 8, steps: int = 1, stream: tuple = ()) -> Optional[int]:
    """This tool's needs-free for the arm (on card ``b``: its cuBLAS workspace), or None where the
    estimator cannot model the arm (it is said as '-', never guessed)."""
    if config is None:
        return None
    from ..estimator.estimate import estimate

    try:
        e = estimate(config, quant=quant, seq=seq, batch=batch, targets=tuple(targets) or None,
                     lora_r=lora_r, steps=steps, stream=dict(stream))
        if b is None:
            return e.needs_free
        return card_answers(config, e, [b], targets=tuple(targets) or None, lora_r=lora_r,
                            env=workspace_env(), stream=dict(stream))[0]["needs_free"]
    except Exception:  # noqa: BLE001 - an arm the estimator does not model has no verdict
        return None


class Emulation:
    """The card an arm runs as: its budget, and the ballast while the arm holds it."""

    def __init__(self, spec: str, context: Optional[int] = None) -> None:
        self.budget = budget(parse_card(spec), context)
        self.ballast: Optional[Ballast] = None

    def row_fields(self, needs_free: Optional[int]) -> dict[str, Any]:
        return {"emulated_card": self.budget.card.name, "emulated_card_free": self.budget.free_bytes,
                "needs_free": needs_free}

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
