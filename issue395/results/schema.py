"""What a saved result must hold to be read back: the version this one writes (``SCHEMA``), the
types of its own blocks (environment, modes, margins and their terms), one row per arm, and
schema 1's rows (the first H200 results) and schema 2's flat rows in this version's records. Each check raises ValueError naming what it found.
A row's record added within a schema (``corrected``, issue 52; ``task`` and ``corrected_custom`` before it) is
optional: a row saved before it reads with none, and its re-save writes it. A mode's record (``soup_resident``,
``soup_probe``: issue 51) is absent where the arm did not ask for the mode, so a row saved before it reads and re-saves
to the same bytes.
"""

from __future__ import annotations

import math
from typing import Any

from ..constants import is_whole
from ..record import QUANTS
from .extras import CONSTRAINT_RECORDS, Gate, Ran, UserConfig
from .row import ROW_FIELDS, Row

SCHEMA = 3  # the JSON this version writes; it also reads schemas 1 and 2
READS = (1, 2, SCHEMA)
TOOL = "issue395_second_stack_vram"  # the name every JSON it writes carries, and a result must

#: A margin's fields, as the renderers and the merge read them: (name, check, what it must be).
_NUMBER = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
MARGIN_FIELDS = (
    ("model", lambda v: isinstance(v, str), "a string"),
    ("model_key", lambda v: isinstance(v, str), "a string"),
    ("quant", lambda v: v in QUANTS, f"one of {', '.join(QUANTS)}"),
    ("seq", lambda v: is_whole(v, 1), "a whole number >= 1"),
    ("batch", lambda v: is_whole(v, 1), "a whole number >= 1"),
    ("ratio", lambda v: _NUMBER(v) and v > 0, "a finite number > 0"),
    ("complete", lambda v: isinstance(v, bool), "true or false"),
    ("terms", lambda v: isinstance(v, list), "a list"),
    ("note", lambda v: v is None or isinstance(v, str), "a string or null"),
    ("real_peak", lambda v: is_whole(v, 1), "a whole number >= 1"),
    ("soup_predicted", lambda v: is_whole(v, 1), "a whole number >= 1"),
)
#: The blocks live at a margin's peak, [size, count] pairs (anatomy.live_blocks); absent before they were kept.
_LIVE_BLOCKS = lambda v: isinstance(v, list) and all(  # noqa: E731
    isinstance(p, list) and len(p) == 2 and is_whole(p[0], 0) and is_whole(p[1], 1) for p in v)
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
        if "task" in m and not ROW_FIELDS["task"][0](m["task"]):  # absent for SFT, as a row's
            raise ValueError(f"margin {i}: its 'task' is {m['task']!r:.60}, not {ROW_FIELDS['task'][1]}")
        if "live_blocks" in m and not _LIVE_BLOCKS(m["live_blocks"]):
            raise ValueError(f"margin {i}: its 'live_blocks' is {m['live_blocks']!r:.60}, not a list of "
                             "[a size >= 0, a count >= 1]")
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
            if not is_whole(r.get("repeat", 0), 0):
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


def schema1_row(old: dict[str, Any]) -> dict[str, Any]:
    """A row as schema 1 (the first H200 results) stored it, in this version's fields."""
    if not isinstance(old, dict):
        return old
    for key in ("elements", "logits12_bytes"):
        if old.get(key) is not None and not (_NUMBER(old[key]) and old[key] >= 0):
            raise ValueError(f"row field {key!r} is {old[key]!r:.60}, not a number >= 0")
    elements = old.get("elements") or 0
    per = old["seq"] * old["batch"] if is_whole(old.get("seq"), 1) and is_whole(old.get("batch"), 1) else 0
    if per and elements and elements < per:  # vocab = elements // (seq x batch) would read 0, and be blamed
        raise ValueError(f"row field 'seq' x 'batch' ({old['seq']} x {old['batch']}) is more than its "
                         f"'elements' ({elements}): not a row's shape")
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


#: Schema 2's flat row fields, by the record (issue395.results.extras) each moved into, as (old, new).
RAN_FIELDS = (("base", "base"), ("gpu", "gpu"), ("pid", "pid"), ("log", "log"), ("timings", "timings"),
              ("teardown_error", "teardown_error"))
GATE_FIELDS = (("soup_terms", "terms"), ("soup_gate_free", "free"))
CONFIG_FIELDS = (("soup_config", "path"), ("lora_r", "lora_r"), ("lora_alpha", "lora_alpha"))
CONSTRAINT_FIELDS = {  # a row ran under at most one; which is the one whose first field is set
    "cap": (("cap_at", "at"), ("cap", "bytes")),
    "emulate-card": (("emulated_card", "card"), ("emulated_card_free", "card_free"), ("emulated_free", "free"),
                     ("needs_free", "needs_free")),
    "min-free": (("min_free_probes", "probes"), ("min_free", "completes"), ("min_free_oom", "oom"),
                 ("min_free_resolution", "resolution"), ("needs_free", "needs_free")),
}


def schema2_row(old: dict[str, Any]) -> dict[str, Any]:
    """A row as schema 2 stored it (every field flat; a mode's written only when set), in this
    version's records: where it ran, Soup's gate, the user's config, the constraint it ran under."""
    if not isinstance(old, dict):
        return old
    row = dict(old)

    def moved(pairs: tuple, record: type) -> dict[str, Any]:
        for k, new in pairs:  # named as the file names it, not as this version would
            ok, what = record.CHECKS.get(new, (lambda v: True, ""))
            if k in row and row[k] is not None and not ok(row[k]):
                raise ValueError(f"row field {k!r} is {row[k]!r:.60}, not {what}")
        return {new: row.pop(k) for k, new in pairs if k in row}

    row["ran"] = moved(RAN_FIELDS, Ran)
    gate = moved(GATE_FIELDS, Gate)
    row["gate"] = gate if any(v is not None for v in gate.values()) else None
    config = moved(CONFIG_FIELDS, UserConfig)
    row["config"] = config if config.get("path") is not None else None
    kinds = [kind for kind, pairs in CONSTRAINT_FIELDS.items() if row.get(pairs[0][0]) is not None]
    if len(kinds) > 1:
        raise ValueError(f"a row ran under one constraint at most, not {' and '.join(kinds)}")
    constraint = ({"kind": kinds[0], **moved(CONSTRAINT_FIELDS[kinds[0]], CONSTRAINT_RECORDS[kinds[0]])}
                  if kinds else None)
    flat = {k for pairs in CONSTRAINT_FIELDS.values() for k, _ in pairs}
    stray = sorted(k for k in flat if row.pop(k, None) is not None and constraint is None)
    if stray:
        raise ValueError(f"row field {stray[0]!r} is set, but no constraint the row ran under")
    row["constraint"] = constraint
    return row
