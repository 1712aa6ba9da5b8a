"""Shards of one run merged into one result, in grid order (a map's by its own family order):
never two stacks or protocols, never one arm twice.
"""

from __future__ import annotations

from typing import Any, Optional

from ..errors import UsageError
from .result import Result, map_order, row_order
from .stack import STACK_KEYS


def merge(results: list[Result], arms_label: Optional[str] = None) -> Result:
    """Shards of one run into one result, in grid order. Two stacks or protocols never merge:
    a table mixing them would compare what cannot be compared."""
    first = results[0].environment
    if len({r.kind for r in results}) > 1:
        raise UsageError("cannot merge a map with a sweep")
    for other in results[1:]:
        for key in STACK_KEYS:
            if other.environment.get(key) != first.get(key):
                raise UsageError(f"cannot merge results of different stacks or protocols: {key} is "
                                 f"{first.get(key)!r} in one and {other.environment.get(key)!r} in another")
    rows = [r for res in results for r in res.rows]
    if results[0].kind == "map":  # maps of different families merge too: by the map's own order
        rows.sort(key=lambda r: map_order(r.model_key, r.quant, r.seq, r.batch, r.task))
        seen = [r.arm for r in rows]
    else:
        rows.sort(key=row_order)
        seen = [(r.index, r.repeat) for r in rows]
    if len(set(seen)) != len(seen):
        raise UsageError("cannot merge: the same arm appears in two results (overlapping shards?)")
    one = lambda name: next((getattr(r, name) for r in results if getattr(r, name)), None)  # noqa: E731
    controls = [r.control for r in results if r.control]
    env = dict(first, arms=arms_label or first.get("arms"))
    return Result(environment=env, rows=rows, measure=one("measure"), sdpa=one("sdpa"),
                  control=next((c for c in controls if not c.get("passed")), one("control")),
                  interrupted=any(r.interrupted for r in results), error=one("error"),
                  timings={"parts": [r.timings for r in results]}, kind=results[0].kind,
                  margins=thinnest([m for r in results for m in r.margins]) if results[0].kind == "map"
                  else [m for r in results for m in r.margins])


def thinnest(margins: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of margins attributed in several shards: each family's thinnest, and every UNDER."""
    keep = {}
    for m in margins:
        key = ((m["model_key"], m.get("task")) if m["ratio"] >= 1
               else (m["model_key"], m["quant"], m["seq"], m["batch"], m.get("task")))
        if key not in keep or m["ratio"] < keep[key]["ratio"]:
            keep[key] = m
    return list(keep.values())
