"""A run's result: its rows in grid order and its mode results, the exit code they add up to, and
one JSON round trip (what a saved result must hold is `schema`'s).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

from ..constants import is_whole
from ..errors import EXIT_FINDING, EXIT_INTERRUPTED, EXIT_OK
from ..record import QUANTS
from ..tasks import PROTOCOL_TASK, TASKS
from ..model.registry import ALL_FAMILIES
from .corrected import with_corrected
from .row import FINDINGS, Row
from .schema import READS, SCHEMA, TOOL, check_blocks, check_unique, determinism_rows, schema1_row, schema2_row


@dataclass
class Result:
    environment: dict
    rows: list = field(default_factory=list)  # Row, in grid order
    measure: Optional[dict] = None
    sdpa: Optional[dict] = None
    control: Optional[dict] = None
    interrupted: bool = False
    error: Optional[str] = None
    timings: dict = field(default_factory=dict)
    kind: str = "sweep"  # or "map"
    margins: list = field(default_factory=list)  # the map: where the thinnest margins go

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return EXIT_INTERRUPTED
        if any(r.status in FINDINGS for r in self.rows):
            return EXIT_FINDING
        if self.error or (self.control is not None and not self.control.get("passed")):
            return EXIT_FINDING
        return EXIT_OK

    def to_json(self) -> dict[str, Any]:
        """The saved result; each row with the corrected figures the text renders for it (computed here,
        under this result's environment, whatever the row was read with)."""
        return {"tool": TOOL, "schema": SCHEMA,
                **{f.name: getattr(self, f.name) for f in fields(self)},
                "rows": [with_corrected(r, self.environment).to_json() for r in self.rows],
                "exit_code": self.exit_code}

    @classmethod
    def from_json(cls, data: Any) -> "Result":
        if not isinstance(data, dict) or not isinstance(data.get("environment"), dict) \
                or not isinstance(data.get("rows"), list):
            raise ValueError("not a result this tool wrote")
        if data.get("tool") != TOOL:
            raise ValueError(f"its tool is {data.get('tool')!r:.60}, not {TOOL}")
        if data.get("kind") not in (None, "sweep", "map"):
            raise ValueError(f"its kind is {data.get('kind')!r:.60}, not sweep or map")
        if not data["rows"] and data.get("margins"):
            raise ValueError("it holds margins but no rows: nothing measured to set them against")
        if not is_whole(data.get("schema"), 1) or data["schema"] not in READS:
            raise ValueError(f"schema {data.get('schema')!r} is not one this version reads "
                             f"({', '.join(map(str, READS[:-1]))} or {SCHEMA})")
        check_blocks(data)
        raw = data["rows"] if data["schema"] != 1 else [schema1_row(r) for r in data["rows"]]
        if data["schema"] == 1:
            raw += [schema1_row(dict(r, repeat=r.get("repeat", 0) + 1)) for r in determinism_rows(data)]
        if data["schema"] < SCHEMA:
            raw = [schema2_row(r) for r in raw]
        rows = [Row.from_json(r) for r in raw]
        check_unique(rows, data.get("kind") or "sweep")
        env = data["environment"]
        if data["schema"] == 1:
            env = dict(env, arms=env.get("isolation"), dry_run=any(r.dry_run for r in rows))
        missing = [k for k in ("torch", "transformers", "trl", "peft", "soup_cli", "weights") if k not in env]
        if missing:
            raise ValueError(f"its environment has no {missing[0]!r}")
        return cls(environment=env, rows=sorted(rows, key=row_order),
                   measure=data.get("measure"), sdpa=data.get("sdpa"), control=data.get("control"),
                   interrupted=bool(data.get("interrupted")), error=data.get("error"),
                   timings=data.get("timings") or {}, kind=data.get("kind") or "sweep",
                   margins=data.get("margins") or [])


def map_order(model_key: Optional[str], quant: str, seq: int, batch: int, task: Optional[str] = None) -> tuple:
    """An arm's place in the map's grid: its family by the map's own order, quantization, seq, batch,
    task (a family or quantization the map does not list goes last)."""
    return (ALL_FAMILIES.index(model_key) if model_key in ALL_FAMILIES else len(ALL_FAMILIES),
            QUANTS.index(quant) if quant in QUANTS else len(QUANTS), seq, batch,
            list(TASKS).index(task or PROTOCOL_TASK))


def row_order(row: Row) -> tuple[int, int, int]:
    """Grid order: the arms by index, then the --determinism repeats, each arm's in turn."""
    return (row.repeat is not None, row.index, row.repeat or 0)
