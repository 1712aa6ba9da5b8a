"""The arms: the record's grid and the margin map's (family, quantization, seq within max positions,
batch, streaming modes after each family), each under every task asked (Soup's tasks, innermost:
one shape's tasks side by side), and shards of them (--shard, --gpus): whole families on
the map, dealt heaviest first, each family's streaming modes with it.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Iterable, Optional

from ..record import MAP_SEQS, PUBLISHED_NF4, RECORD_GRID
from ..tasks import PROTOCOL_TASK
from ..model.arm import Arm
from ..model.registry import FAMILIES, SHAPES, max_positions
from ..model.streaming import Streaming, family_of
from ..measure.shapes import family_shape

#: The protocol's run, which a sweep's or the map's arms take where the command line names no other: the family's
#: own targets at the record's r and alpha, no settings, one step, a registry model's synthetic checkpoint. Its base
#: and shape are no arm's: the grid gives each arm its own (``grid_arm``).
PROTOCOL_RUN = Arm("custom", 0)


def grid_arm(run: Arm, key: str, seq: int, batch: int, index: int, quant: str, task: str) -> Arm:
    """The run ``run`` (a request's template: its adapter, settings, steps, stack and checkpoint) at one point of
    the grid: map key ``key``'s base and streaming modes, at that seq, batch, quantization and task. Only a custom
    base reads the run's checkpoint; a registry model's is its synthetic one (None)."""
    base, streaming = Streaming.parse(key)
    return replace(run, base=base, streaming=streaming, seq=seq, batch=batch, index=index, quant=quant, task=task,
                   checkpoint=run.checkpoint if base == "custom" else None)


def plan_map(families: Iterable[str], quants: Iterable[str], seqs: Optional[Iterable[int]],
             batches: Iterable[int], tasks: Iterable[str] = (PROTOCOL_TASK,), run: Arm = PROTOCOL_RUN) -> list[Arm]:
    """The map's grid, in order: family, quantization, seq (within the family's max
    positions), batch, task; every arm the run ``run`` (``grid_arm``). Llama-3.1-8B is there for its published NF4 arm, batch 1 x seq 512.
    Every batch asked runs under every task: one below a task's smallest batch is planned and
    measured as SKIPPED with its reason (issue395.measure.measurement), never dropped."""
    arms: list[Arm] = []
    for fam in families:
        published = [k for k in PUBLISHED_NF4 if k[0] == fam]
        for quant in quants:
            grid = seqs or (tuple(sorted({k[2] for k in published if k[1] == quant})) if published
                            else MAP_SEQS)
            for seq in (q for q in grid if q <= max_positions(fam)):
                for batch in (batches if seqs or not published else (1,)):
                    for name in tasks:
                        arms.append(grid_arm(run, fam, seq, batch, len(arms), quant, name))
    return arms


def past_positions(families: Iterable[str], seqs: Optional[Iterable[int]]) -> list[str]:
    """The seqs asked for on the map that a family's positions leave out (plan_map does not plan
    them): each named with the reason, never dropped silently."""
    return [f"{fam} at seq {', '.join(map(str, past))}: past its maximum positions ({max_positions(fam)})"
            for fam in families for past in [[s for s in (seqs or ()) if s > max_positions(fam)]] if past]


def plan_arms(models: Iterable[str], seqs: Optional[Iterable[int]], batches: Iterable[int],
              quant: str = "none", tasks: Iterable[str] = (PROTOCOL_TASK,), run: Arm = PROTOCOL_RUN) -> list[Arm]:
    """Grid order: model, then seq, then batch (the record's order), then task, at one
    quantization (the protocol's bf16, or a --config file's), every arm the run ``run`` (``grid_arm``: a --config
    file's Arm, else the protocol's at the steps and checkpoint asked)."""
    arms: list[Arm] = []
    for model in models:
        for seq in (seqs or RECORD_GRID.get(model, ())):
            for batch in batches:
                for name in tasks:
                    arms.append(grid_arm(run, model, seq, batch, len(arms), quant, name))
    return arms


def shard_of(arms: list[Arm], shard: tuple[int, int], whole_models: bool = False) -> list[Arm]:
    """--shard K/N: every arm whose grid index is K-1 modulo N.

    On the map a shard is whole families instead, dealt heaviest first to the lightest
    shard: a family's checkpoint (up to 16 GB) and Soup's shards of it are the map's
    largest cost, and modulo would build every family once per shard."""
    k, n = shard
    if not whole_models:
        return [a for a in arms if a.index % n == k - 1]
    cost: dict[str, float] = {}
    for a in arms:  # a family's streaming modes share its checkpoint: one shard builds it
        cost[family_of(a.model)] = cost.get(family_of(a.model), 0.0) + arm_seconds(a)
    load, owner = [0.0] * n, {}
    for model in sorted(cost, key=lambda m: (-cost[m], m)):
        owner[model] = min(range(n), key=lambda j: (load[j], j))
        load[owner[model]] += cost[model]
    return [a for a in arms if owner[family_of(a.model)] == k - 1]


def arm_seconds(arm: Arm) -> float:
    """A map arm's rough cost, only to deal families evenly: on the H200 map each arm took
    about 3 s of setup and teardown plus 0.7 s per billion parameters."""
    family = family_of(arm.model)  # a streaming mode costs what its family costs
    if family in FAMILIES:
        f = FAMILIES[family]
        # a family with no published count (a reduced-depth MoE): its bf16 bytes, from its shape
        params = f.params if f.params is not None else shape_params(family)
    else:  # the record's two: bf16 bytes of the layers and the extras, over 2
        shape = SHAPES[family]
        params = shape.checkpoint_bytes // 2
    return 3.0 + 0.7e-9 * params


@functools.lru_cache(maxsize=None)  # dealing shards asks once per arm; the meta build is per family
def shape_params(family: str) -> int:
    """A family's parameters from its derived shape (pool and extras are bf16 bytes)."""
    return family_shape(family).checkpoint_bytes // 2
