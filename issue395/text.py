"""Fixed-width text through one helper: a table's lines, and a number's cell in GB or as a ratio
(the units are constants')."""

from __future__ import annotations

from typing import Optional

from .constants import GB


def table(columns: list[tuple[str, int]], rows: list[list[str]], indent: str = "") -> list[str]:
    """Fixed-width lines; a negative width left-aligns that column. A cell wider than its column
    (a long family name with its depth and mode) widens the column, so every line stays aligned."""
    columns = [(name, w if i == len(columns) - 1 else  # the last column's overflow misaligns nothing
                (1 if w > 0 else -1) * max([abs(w), len(name)] + [len(r[i]) for r in rows]))
               for i, (name, w) in enumerate(columns)]

    def line(cells: list[str]) -> str:
        return indent + "  ".join(f"{c:<{-w}}" if w < 0 else f"{c:>{w}}"
                                  for c, (_, w) in zip(cells, columns, strict=True))
    head = line([name for name, _ in columns])
    return [head, indent + "-" * (len(head) - len(indent))] + [line(r) for r in rows]


def gb(v: Optional[float], places: int = 4) -> str:
    return "-" if v is None else f"{v / GB:.{places}f}"


def ratio(v: Optional[float], places: int = 3) -> str:
    return "-" if v is None else f"{v:.{places}f}x"
