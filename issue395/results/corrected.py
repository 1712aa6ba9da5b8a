"""This tool's corrected estimate for a saved row's arm: from its family's public config, under the
streaming modes its map key names, the Soup release the row ran and, where it decides the physics (NF4's
gemm_4bit kernel), the card it ran on; never from the row's own measurement. A row whose arm the estimator
does not model has none, and says so by being None: a
--model run (no public config here), or an arm the estimator refuses (per_expert on a family Soup
refuses it for, a seq past the model's max positions). The figures the text renders are the ones a
saved row carries (``with_corrected``: its ``Corrected`` record, put in the row as the result is written).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Optional

from ..errors import UsageError
from ..model.arm import Arm
from ..model.registry import known
from ..estimator.resident import estimate_run
from ..estimator.cards import saved_dispatch
from ..estimator.estimate import Estimate, needs_free
from ..estimator.gemm4bit import Dispatch
from .extras import Corrected
from .row import Row


@functools.lru_cache(maxsize=4096)
def _corrected(arm: Arm, release: Optional[str], transformers: Optional[str] = None,
               dispatch: Optional[Dispatch] = None) -> Optional[Estimate]:
    try:  # streamed or resident (every layer on the card: the resident construction, where it is modelled)
        return estimate_run(arm, release=release, soup=False, transformers=transformers, dispatch=dispatch)
    except UsageError:
        return None


def _estimated(r: Row, env: Optional[dict]) -> Optional[Estimate]:
    env = env or {}
    try:
        arm = r.run_arm(int(env.get("steps") or 1))
    except UsageError:  # a key no streaming record has
        return None
    # the card the row ran on decides where NF4's gemm_4bit fused (estimator/gemm4bit.py)
    dispatch = saved_dispatch(env) if arm.quant == "nf4" else None
    return _corrected(replace(arm, index=0), env.get("soup_cli"), env.get("transformers"), dispatch)


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
