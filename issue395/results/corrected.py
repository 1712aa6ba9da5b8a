"""This tool's corrected estimate for a saved row's arm: from its family's public config, under the
streaming modes its map key names, and the Soup release the row ran, never from the row's own
measurement. A row whose arm the estimator does not model has none, and says so by being None: a
--model run (no public config here), or an arm the estimator refuses (per_expert on a family Soup
refuses it for, a seq past the model's max positions). The figures the text renders are the ones a
saved row carries (``with_corrected``: its ``Corrected`` record, put in the row as the result is written).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Optional

from ..errors import UsageError
from ..model.arm import Adapter, Arm, Settings
from ..model.registry import known
from ..estimator.resident import estimate_run
from ..estimator.estimate import Estimate, needs_free
from ..tasks import PROTOCOL_TASK
from .extras import Corrected
from .row import Row


@functools.lru_cache(maxsize=4096)
def _corrected(key: str, quant: str, seq: int, batch: int, targets: tuple, lora_r: int, release: Optional[str],
               steps: int, task: str = PROTOCOL_TASK, transformers: Optional[str] = None,
               run: tuple = ()) -> Optional[Estimate]:
    try:  # streamed or resident (every layer on the card: the resident construction, where it is modelled)
        arm = Arm.at(key, seq, batch, quant=quant, task=task, settings=Settings(**dict(run)),
                     adapter=Adapter(targets or None, lora_r), steps=steps)
        return estimate_run(arm, release=release, soup=False, transformers=transformers)
    except UsageError:
        return None


def _estimated(r: Row, env: Optional[dict]) -> Optional[Estimate]:
    env = env or {}
    return _corrected(r.model_key, r.quant, r.seq, r.batch, tuple(r.targets), r.rank, env.get("soup_cli"),
                      int(env.get("steps") or 1), getattr(r, "task", None) or PROTOCOL_TASK, env.get("transformers"),
                      tuple(r.run.items()))


def corrected(r: Row, env: Optional[dict] = None) -> Optional[int]:
    """This tool's corrected allocated peak for a row's arm (its LoRA targets and r), from its family's
    public config and the Soup release (and transformers) the row ran, at the row's task, optimizer and
    accumulation (None where the estimator does not model the arm)."""
    if not known(r.model_key):  # no public config here: the figure the arm's own config gave as it ran
        return r.corrected_custom
    e = _estimated(r, env)
    return None if e is None else e.corrected_predicted


def corrected_ratio(r: Row, env: Optional[dict] = None) -> Optional[float]:
    c = corrected(r, env)
    return c / r.real_peak if c and r.measured else None


def corrected_record(r: Row, env: Optional[dict] = None) -> Optional[Corrected]:
    """The row's corrected estimate (``corrected``) and its needs-free, as a row's record (None where the
    estimator does not model the arm)."""
    if not known(r.model_key):
        c = r.corrected_custom
        return None if c is None else Corrected(allocated=c, needs_free=needs_free(c))
    e = _estimated(r, env)
    return None if e is None else Corrected(allocated=e.corrected_predicted, needs_free=e.needs_free)


def with_corrected(r: Row, env: Optional[dict] = None) -> Row:
    """The row carrying the corrected figures the text renders for it under the run's environment."""
    return replace(r, corrected=corrected_record(r, env))
