"""A run's rows saved as they finish (`RowFile`) and a saved result read back (`load_result`),
each file named for what it is when it is not a result.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

from ..errors import UsageError, last_line
from .result import Result
from .row import Row


class RowFile:
    """Rows appended as JSON lines as they finish, beside --json, so nothing measured is
    lost to a crash; removed once the final JSON holds them."""

    SUFFIX = ".rows.jsonl"  # after the --json path's own name: o.json's rows are o.json.rows.jsonl

    def __init__(self, json_path: Optional[str]):
        self.path = self.path_for(json_path) if json_path and json_path != "-" else None  # -: stdout
        self.ok = True
        if self.path:
            self.path.unlink(missing_ok=True)

    @staticmethod
    def path_for(json_path: str) -> Path:
        return Path(os.path.realpath(json_path) + RowFile.SUFFIX)

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
    if path.endswith(RowFile.SUFFIX):
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
