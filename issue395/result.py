"""A run's result: rows and mode results, one JSON round trip, one way to merge shards, the stack
every output carries, and rows saved as they finish.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field, fields
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

from .cuda import measure_context
from .errors import EXIT_FINDING, EXIT_INTERRUPTED, EXIT_OK, UsageError, last_line
from .margin import thinnest
from .record import QUANTS, SCHEMA
from .row import Row, _whole
from .registry import ALL_FAMILIES

#: What must agree for two results to merge into one table: the same stack and protocol.
STACK_KEYS = ("gpu", "driver", "cuda", "torch", "transformers", "trl", "peft", "soup_cli", "python",
              "weights", "dry_run")


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
        if any(r.status in ("VOID", "OOM", "FAILED", "UNDER") for r in self.rows):
            return EXIT_FINDING
        if self.error or (self.control is not None and not self.control.get("passed")):
            return EXIT_FINDING
        return EXIT_OK

    def to_json(self) -> dict[str, Any]:
        return {"tool": "issue395_second_stack_vram", "schema": SCHEMA,
                **{f.name: getattr(self, f.name) for f in fields(self)},
                "rows": [r.to_json() for r in self.rows], "exit_code": self.exit_code}

    @classmethod
    def from_json(cls, data: Any) -> "Result":
        if not isinstance(data, dict) or not isinstance(data.get("environment"), dict) \
                or not isinstance(data.get("rows"), list):
            raise ValueError("not a result this tool wrote")
        if data.get("tool") != "issue395_second_stack_vram":
            raise ValueError(f"its tool is {data.get('tool')!r:.60}, not issue395_second_stack_vram")
        if data.get("kind") not in (None, "sweep", "map"):
            raise ValueError(f"its kind is {data.get('kind')!r:.60}, not sweep or map")
        if not data["rows"] and data.get("margins"):
            raise ValueError("it holds margins but no rows: nothing measured to set them against")
        if not _whole(data.get("schema"), 1) or data["schema"] not in (1, SCHEMA):
            raise ValueError(f"schema {data.get('schema')!r} is not one this version reads "
                             f"(1 or {SCHEMA})")
        check_blocks(data)
        raw = [r if data["schema"] == SCHEMA else schema1_row(r) for r in data["rows"]]
        if data["schema"] == 1:
            raw += [schema1_row(dict(r, repeat=r.get("repeat", 0) + 1)) for r in determinism_rows(data)]
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


#: A margin's fields, as the renderers and the merge read them: (name, check, what it must be).
_NUMBER = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
MARGIN_FIELDS = (
    ("model", lambda v: isinstance(v, str), "a string"),
    ("model_key", lambda v: isinstance(v, str), "a string"),
    ("quant", lambda v: v in QUANTS, f"one of {', '.join(QUANTS)}"),
    ("seq", lambda v: _whole(v, 1), "a whole number >= 1"),
    ("batch", lambda v: _whole(v, 1), "a whole number >= 1"),
    ("ratio", lambda v: _NUMBER(v) and v > 0, "a finite number > 0"),
    ("complete", lambda v: isinstance(v, bool), "true or false"),
    ("terms", lambda v: isinstance(v, list), "a list"),
    ("note", lambda v: v is None or isinstance(v, str), "a string or null"),
    ("real_peak", lambda v: _whole(v, 1), "a whole number >= 1"),
    ("soup_predicted", lambda v: _whole(v, 1), "a whole number >= 1"),
)
TERM_FIELDS = (
    ("term", lambda v: isinstance(v, str), "a string"),
    ("charged", _NUMBER, "a finite number"),
    ("measured", _NUMBER, "a finite number"),
    ("missed", _NUMBER, "a finite number"),
    ("per", lambda v: v is None or (isinstance(v, list) and len(v) == 2 and _NUMBER(v[0]) and v[0] > 0
                                    and isinstance(v[1], str)), "null or [a number > 0, a unit]"),
)

def check_blocks(data: dict[str, Any]) -> None:
    """The saved result's own blocks have the types the renderers and the merge read."""
    for key, value in data["environment"].items():
        if value is not None and not isinstance(value, (str, int, float)):
            raise ValueError(f"its environment's {key!r} is {type(value).__name__}, not a string")
    if data.get("kind") not in (None, "sweep", "map"):
        raise ValueError(f"its 'kind' is {data['kind']!r}, not 'sweep' or 'map'")
    for key in ("measure", "sdpa", "control", "timings"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise ValueError(f"its {key!r} is {type(data[key]).__name__}, not an object")
    if data.get("interrupted") is not None and not isinstance(data["interrupted"], bool):
        raise ValueError(f"its 'interrupted' is {data['interrupted']!r}, not true or false")
    if data.get("error") is not None and not isinstance(data["error"], str):
        raise ValueError(f"its 'error' is {type(data['error']).__name__}, not a string")
    margins = data.get("margins")
    if margins is not None and not isinstance(margins, list):
        raise ValueError(f"its 'margins' is {type(margins).__name__}, not a list")
    for i, m in enumerate(margins or []):
        if not isinstance(m, dict):
            raise ValueError(f"margin {i} is {type(m).__name__}, not an object")
        check_fields(m, MARGIN_FIELDS, f"margin {i}")
        for j, t in enumerate(m["terms"]):
            if not isinstance(t, dict):
                raise ValueError(f"margin {i}: its terms[{j}] is {type(t).__name__}, not an object")
            check_fields(t, TERM_FIELDS, f"margin {i}: its terms[{j}]")


def check_fields(block: dict[str, Any], spec: tuple, where: str) -> None:
    for name, ok, what in spec:
        if name not in block:
            raise ValueError(f"{where} has no {name!r}")
        if not ok(block[name]):
            raise ValueError(f"{where}: its {name!r} is {block[name]!r:.60}, not {what}")


def determinism_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """A schema-1 result's --determinism rows: {"arms": [{"rows": [row, ...]}, ...]}."""
    block = data.get("determinism")
    if not block:
        return []
    if not isinstance(block, dict) or not isinstance(block.get("arms", []), list):
        raise ValueError("its 'determinism' is not an object holding a list of arms")
    rows = []
    for arm in block.get("arms", []):
        if not isinstance(arm, dict) or not isinstance(arm.get("rows", []), list) \
                or not all(isinstance(r, dict) for r in arm.get("rows", [])):
            raise ValueError("its 'determinism' arms must be objects holding a list of rows")
        for r in arm.get("rows", []):
            if not _whole(r.get("repeat", 0), 0):
                raise ValueError(f"a 'determinism' row's 'repeat' is {r['repeat']!r:.60}, not a whole number")
            rows.append(r)
    return rows


def check_unique(rows: list[Row], kind: str) -> None:
    """One arm, one row: a row saved twice would count twice in every summary."""
    seen = set()
    for r in rows:
        key = (*r.arm, r.repeat) if kind == "map" else (r.index, r.repeat)
        if key in seen:
            again = f" repeat {r.repeat}" if r.repeat is not None else ""
            raise ValueError(f"the same arm appears twice in it ({r.model} {r.quant} seq {r.seq} "
                             f"batch {r.batch}{again})")
        seen.add(key)


def row_order(row: Row) -> tuple[int, int, int]:
    return (row.repeat is not None, row.index, row.repeat or 0)


def schema1_row(old: dict[str, Any]) -> dict[str, Any]:
    """A row as schema 1 (the first H200 results) stored it, in this version's fields."""
    if not isinstance(old, dict):
        return old
    for key in ("elements", "logits12_bytes"):
        if old.get(key) is not None and not (_NUMBER(old[key]) and old[key] >= 0):
            raise ValueError(f"row field {key!r} is {old[key]!r:.60}, not a number >= 0")
    elements = old.get("elements") or 0
    per = old["seq"] * old["batch"] if _whole(old.get("seq"), 1) and _whole(old.get("batch"), 1) else 0
    repeat = old.get("repeat") if old.get("repeat") else None
    return {"model": old.get("model"), "model_key": old.get("model_key"), "seq": old.get("seq"),
            "batch": old.get("batch"), "index": old.get("index"), "predicted": old.get("predicted"),
            "logits14": old.get("logits14_bytes"), "vocab": elements // per if per else None,
            "loss_bytes_per_element": (old["logits12_bytes"] / elements) if elements else None,
            "repeat": repeat, "dry_run": bool(old.get("dry_run")),
            "realised_width": old.get("realised_width", old.get("realised")),
            "realised_rows": old.get("realised_rows") or [], "real_peak": old.get("real_peak"),
            "resident": old.get("resident_before_step"), "reserved": old.get("max_reserved"),
            "failure": old.get("error_kind"), "error": old.get("error"),
            "oom_request": old.get("oom_request_bytes"), "teardown_error": old.get("teardown_error"),
            "record_peak": old.get("record_a10g_peak"), "attribution": old.get("attribution"),
            "base": old.get("base"), "gpu": old.get("gpu"), "pid": old.get("pid"),
            "log": old.get("log"), "timings": old.get("timings") or {}}


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
        order = {f: i for i, f in enumerate(ALL_FAMILIES)}
        rows.sort(key=lambda r: (order.get(r.model_key, len(order)), QUANTS.index(r.quant), r.seq, r.batch))
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


def environment(weights: str, dry_run: bool, arms: str, argv: list[str],
                with_torch: bool = True) -> dict[str, Any]:
    """The stack every output carries. Without torch (a fan-out parent whose children all
    died before reporting theirs) torch's version is read from its package, and no GPU."""
    torch = __import__("torch") if with_torch else None
    cuda = torch is not None and torch.cuda.is_available()
    driver = None
    if cuda:
        with contextlib.suppress(Exception):
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=10).stdout.split()[0]
    return {"gpu": torch.cuda.get_device_name(0) if cuda else None, "driver": driver,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cuda": torch.version.cuda if torch else None,
            "torch": torch.__version__ if torch else package_version("torch"), **{k.replace("-", "_"): package_version(k) for k in
                                            ("transformers", "trl", "peft", "soup-cli")},
            "python": platform.python_version(), "platform": platform.platform(), "weights": weights,
            "dry_run": dry_run, "arms": arms, "command": " ".join(argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **linear_attention_kernels(), **((measure_context() or {}) if cuda else {})}


def linear_attention_kernels() -> dict[str, str]:
    """Which path a gated delta-net (Qwen3.5's linear attention) runs: the fused kernels of
    flash-linear-attention and causal-conv1d where installed, else transformers' torch fallback.
    The two save different tensors for backward, so the peak depends on it; recorded only where a
    package is there, so a stack without them reads as it always did."""
    found = {k: package_version(k) for k in ("flash-linear-attention", "causal-conv1d")}
    found = {k: v for k, v in found.items() if v != "not installed"}
    return {"linear_attention_kernels": ", ".join(f"{k} {v}" for k, v in found.items())} if found else {}


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


class RowFile:
    """Rows appended as JSON lines as they finish, beside --json, so nothing measured is
    lost to a crash; removed once the final JSON holds them."""

    def __init__(self, json_path: Optional[str]):
        self.path = self.path_for(json_path) if json_path and json_path != "-" else None  # -: stdout
        self.ok = True
        if self.path:
            self.path.unlink(missing_ok=True)

    @staticmethod
    def path_for(json_path: str) -> Path:
        return Path(os.path.realpath(json_path) + ".rows.jsonl")

    def add(self, row: Row) -> None:
        if self.path and self.ok:
            try:
                with open(self.path, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(row.to_json(), default=str) + "\n")
            except OSError as exc:  # the tables and the final JSON still hold the row
                self.ok = False
                print(f"warning: cannot save rows to {self.path} ({exc.strerror}); "
                      "they are in the tables", file=sys.stderr)
                self.path.unlink(missing_ok=True)

    def finish(self) -> None:
        if self.path:
            self.path.unlink(missing_ok=True)


def load_result(path: str, flag: str = "--from-json") -> Result:
    if path.endswith(".rows.jsonl"):
        raise UsageError(f"{flag} {path}: this is a run's row file (its measured rows, one JSON line each, kept "
                         "when the run could not write its --json); it holds no environment to judge them by, "
                         "so --from-json cannot render it: read the lines as they are")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if isinstance(data, dict) and data.get("kind") == "estimate" and "environment" not in data:
            raise UsageError(f"{flag} {path}: this is an --estimate result (a config's estimate, nothing "
                             "measured); --from-json re-renders measured results")
        return Result.from_json(data)
    except (OSError, ValueError, TypeError, KeyError, RecursionError, MemoryError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else last_line(exc)
        raise UsageError(f"{flag} {path}: not a result this tool can read ({reason})") from None
