"""What a measured run asks for (the sweep, the map, --determinism, --measure and --sdpa, under their constraints),
settled once by issue395.run.measure_mode: ``MeasureRequest``, its run one Arm (``arm``: the grid's arms are it at
each point of the grid), and its sub-records (``Outputs``, ``Children``), which the host's machinery takes (the grid, the lanes and children, the scratch and the checkpoint
cache); a child's job file holds one (``measure_from_json`` reads it back). Nothing changes a request once settled."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Optional

from ..tasks import PROTOCOL_TASK
from ..record import RECORD_DETERMINISM
from ..model.arm import Arm
from ..model.registry import SHAPES
from ..constraints.asked import Constraints
from .grid import PROTOCOL_RUN, plan_arms, plan_map


@dataclass(frozen=True)
class Outputs:
    """Where the run's outputs go (None: not asked; "-": stdout)."""

    json: Optional[str] = None
    markdown: Optional[str] = None
    plot: Optional[str] = None

    @classmethod
    def of(cls, args: argparse.Namespace) -> "Outputs":
        return cls(args.json, args.markdown, args.plot)


@dataclass(frozen=True)
class Children:
    """How the run is spread: its GPUs, lanes and shard, and, in a child, that it is one and its repeat."""

    gpus: Optional[tuple] = None
    lanes: Optional[int] = None  # --lanes N (0: bare --lanes, chosen from the host when the run starts)
    shard: Optional[tuple] = None
    child: bool = False  # a child of --gpus, --isolate or --determinism (never the command line)
    repeat_tag: Optional[int] = None  # a child's repeat of --determinism
    ledger: Optional[str] = None  # a --lanes map child's ledger (cardlock.CardLedger): its GPU's bytes between lanes
    card_total: Optional[int] = None  # ... the bytes CUDA hands out of that card
    needs: tuple = ()  # ... and each of its arms' (index, bytes it holds, Soup's number): schedule.Need
    disk_ledger: Optional[str] = None  # a map child's share of the checkpoints' disk (cardlock.DiskLedger)


@dataclass(frozen=True)
class MeasureRequest:
    """The arms measured on the GPU (the sweep's or, with map, the map's; --determinism's repeats) and
    the modes beside them (--measure, --sdpa), each arm under the constraint asked. The run is one Arm
    (``arm``): its adapter, settings, steps, stack and a custom base's checkpoint (--model's, a --config file's
    folder), and for --config the file's whole Arm; the grid's axes (models, quants, seqs, batches, tasks) place it."""

    run_arms: bool = True  # run the grid's arms (the sweep's or, with map, the map's)
    map: bool = False  # --map: models are families, with a quantization axis
    quants: tuple = ("none",)
    measure: bool = False
    sdpa: bool = False
    repeats: Optional[int] = None  # --determinism N
    models: tuple = tuple(SHAPES)
    seqs: Optional[tuple] = None  # None: the record's grid per model
    batches: tuple = (1,)
    tasks: tuple = (PROTOCOL_TASK,)  # Soup's tasks: an axis of the grid (issue395.tasks)
    weights: str = "synthetic"
    dry_run: bool = False
    verbose: bool = False
    snapshot: bool = False
    snapshot_dir: Optional[str] = None
    log_dir: Optional[str] = None
    cache_dir: Optional[str] = None
    shard_dir: Optional[str] = None  # --shard-dir: Soup's layer shards, apart from the checkpoints
    isolate: bool = False
    constraints: Constraints = Constraints()  # --cap, --emulate-card, --min-free
    children: Children = Children()
    outputs: Outputs = Outputs()
    context: Optional[int] = None  # --context, bytes (--emulate-card's card)
    argv: tuple = ()
    #: the run every arm of the grid is (issue395.host.grid.grid_arm): the protocol's at --steps and --model's
    #: checkpoint, or a --config file's Arm (config_arm's) at --steps with its checkpoint settled
    arm: Arm = PROTOCOL_RUN

    @property
    def determinism_grid(self) -> tuple[tuple, Optional[tuple], tuple]:
        """The record's two repeated arms, unless the command line chose others."""
        if self.arm.checkpoint or self.seqs or self.models != tuple(SHAPES) or self.batches != (1,):
            return self.models, self.seqs, self.batches
        return tuple(dict.fromkeys(m for m, _ in RECORD_DETERMINISM)), tuple(s for _, s in RECORD_DETERMINISM), (1,)

    def arms(self) -> list[Arm]:
        """The grid's arms, in grid order (the map's, or the sweep's), each the run's ``arm`` at its point."""
        return (plan_map(self.models, self.quants, self.seqs, self.batches, self.tasks, self.arm) if self.map
                else plan_arms(self.models, self.seqs, self.batches, self.quants[0], self.tasks, self.arm))

    def determinism_arms(self) -> list[Arm]:
        """--determinism's arms (``determinism_grid``), each the run's ``arm`` as the grid's are."""
        return plan_arms(*self.determinism_grid, self.quants[0], self.tasks, self.arm) if self.repeats else []


#: MeasureRequest's sub-records by field, as a child's job file reads them back.
MEASURE_RECORDS = {"outputs": Outputs, "children": Children, "constraints": Constraints}


def measure_from_json(data: dict[str, Any]) -> MeasureRequest:
    """A MeasureRequest as ``dataclasses.asdict`` wrote it (a child's job file): JSON lists back to tuples,
    its sub-records back to theirs."""
    def plain(d: dict) -> dict:
        return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}

    return MeasureRequest(**{k: Arm.from_json(v) if k == "arm" else
                             MEASURE_RECORDS[k](**plain(v)) if k in MEASURE_RECORDS and isinstance(v, dict) else v
                             for k, v in plain(data).items()})
