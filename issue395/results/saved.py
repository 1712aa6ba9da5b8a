"""A run's rows saved as they finish (`RowFile`) and a saved result read back (`load_result`),
each file named for what it is when it is not a result.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

from ..errors import UsageError, last_line
from .corrected import with_corrected
from .result import Result
from .row import Row
from .schema import SCHEMA, TOOL


class RowFile:
    """Rows appended as JSON lines as they finish, beside --json, so nothing measured is
    lost to a crash; removed once the final JSON holds them. Given the run's environment, the
    first line is a header (`HEADER`) holding it, so a run stopped before its JSON can still be
    rendered from its rows (`load_result`)."""

    SUFFIX = ".rows.jsonl"  # after the --json path's own name: o.json's rows are o.json.rows.jsonl
    HEADER = "row_file"  # the key only the header line holds: its format's version
    ROWS_FROM = ("the row file: the run stopped before it wrote its JSON, so these are the rows it saved as "
                 "each finished")

    def __init__(self, json_path: Optional[str], environment: Optional[dict] = None, kind: str = "sweep"):
        self.path = self.path_for(json_path) if json_path and json_path != "-" else None  # -: stdout
        self.ok = True
        self.environment = environment
        if self.path:
            self.refuse_unfinished(json_path)  # never deleted: the rows of a run that did not finish
            self.path.unlink(missing_ok=True)  # empty: it holds no row
            if environment is not None:
                self.write({self.HEADER: 1, "tool": TOOL, "schema": SCHEMA, "kind": kind,
                            "environment": environment})

    @staticmethod
    def path_for(json_path: str) -> Path:
        return Path(os.path.realpath(json_path) + RowFile.SUFFIX)

    @classmethod
    def unfinished(cls, json_path: Optional[str]) -> Optional[Path]:
        """The row file beside ``json_path`` where it holds anything: its run never wrote its --json
        (finish removes it once the JSON holds the rows), or it is still running. None otherwise."""
        if not json_path or json_path == "-":
            return None
        path = cls.path_for(json_path)
        try:
            return path if path.stat().st_size > 0 else None
        except OSError:
            return None

    @classmethod
    def refuse_unfinished(cls, json_path: Optional[str], flag: str = "--json") -> None:
        """One line, before any work, for a --json whose row file holds an unfinished run's rows:
        the next run would have replaced them."""
        path = cls.unfinished(json_path)
        if path is not None:
            raise UsageError(f"{flag} {json_path}: its row file {path} holds the rows of a run that did not finish "
                             f"(it never wrote that --json, or it is still running); render them with --from-json "
                             f"{path}, or move it away, then run again")

    @classmethod
    def is_header(cls, line: object) -> bool:
        return isinstance(line, dict) and cls.HEADER in line

    @staticmethod
    def whole_lines(data: bytes) -> tuple[list[bytes], int]:
        """The complete lines of a row file's bytes (a writer may be mid-line: the last may be
        half-written) and how many bytes they span."""
        done = data.rfind(b"\n") + 1
        return data[:done].splitlines(), done

    def add(self, row: Row) -> None:
        """A finished row, with the corrected figures the run's text renders for it."""
        self.write(with_corrected(row, self.environment).to_json())

    def write(self, line: dict) -> None:
        if self.path and self.ok:
            try:
                with open(self.path, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(line, default=str) + "\n")
            except OSError as exc:  # the tables and the final JSON still hold the row; the run goes on
                self.ok = False
                print(f"warning: cannot save rows to {self.path} ({exc.strerror or exc}); the rows saved so far "
                      "stay in it, and every row is in the tables", file=sys.stderr)

    def finish(self) -> None:
        """The final JSON holds every row: its row file goes (where the folder lets it)."""
        if self.path:
            try:
                self.path.unlink(missing_ok=True)
            except OSError as exc:
                print(f"warning: {self.path} could not be removed ({exc.strerror or exc}); the --json beside it "
                      "holds all its rows", file=sys.stderr)


def row_file_result(path: str, flag: str) -> dict[str, Any]:
    """A row file as the result its run did not write: interrupted, its rows, the header's
    environment saying where the rows came from. Whole lines only: the last may be half-written."""
    data = Path(path).read_bytes()
    whole, done = RowFile.whole_lines(data)
    lines = [line for line in whole if line.strip()]
    try:
        header = json.loads(lines[0]) if lines else None
    except ValueError:
        header = None
    if not RowFile.is_header(header):  # a file from before the header, or not a row file at all
        raise UsageError(f"{flag} {path}: this is a run's row file (its measured rows, one JSON line each, kept "
                         "when the run could not write its --json); it holds no environment to judge them by, "
                         "so --from-json cannot render it: read the lines as they are (a committed one under "
                         "results/ is rendered by the bench/ script its folder's commands.txt or README names)")
    if header[RowFile.HEADER] != 1:
        raise ValueError(f"its row file version is {header[RowFile.HEADER]!r:.60}, not 1")
    rows_from = RowFile.ROWS_FROM + ("; its last line, half-written, is left out" if data[done:].strip() else "")
    return {"tool": header.get("tool"), "schema": header.get("schema"), "kind": header.get("kind"),
            "environment": dict(header["environment"], rows_from=rows_from),
            "rows": [json.loads(line) for line in lines[1:]], "interrupted": True}


#: The tool's own JSONs that hold no measured arm, by kind: what each is, in one line's words.
NOT_MEASURED = {
    "estimate": "an --estimate result (a config's estimate, nothing measured)",
    "find-max": ("a --find-max result (its probes of the real `soup train`, each judged from Soup's console: no "
                 "measured arm; its 'measured' block holds the probes, in order)"),
}


def load_result(path: str, flag: str = "--from-json") -> Result:
    try:
        if path.endswith(RowFile.SUFFIX):
            return Result.from_json(row_file_result(path, flag))
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        kind = data.get("kind") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind in NOT_MEASURED and "environment" not in data:  # a hand-edited kind may be any JSON
            raise UsageError(f"{flag} {path}: this is {NOT_MEASURED[kind]}; --from-json re-renders measured results")
        return Result.from_json(data)
    except (OSError, ValueError, TypeError, KeyError, RecursionError, MemoryError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else last_line(exc)
        raise UsageError(f"{flag} {path}: not a result this tool can read ({reason})") from None
