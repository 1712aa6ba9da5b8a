"""Fixed-width lines through one helper, and the tables of arms run under a constraint: --cap (the
allocator capped at a prediction), --emulate-card (a smaller card's free memory) and --min-free
(the lowest cap the step completes under)."""

from __future__ import annotations

from typing import Optional

from ..constants import GB, MiB
from ..results.row import Row


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




def cap_table(rows: list[Row]) -> str:
    """--cap: each arm re-run in a fresh process with its allocator capped at a prediction."""
    cells = []
    for r in rows:
        if r.measured:
            outcome = "completed" + (" (control: no cap)" if r.cap_at == "off" else "")
        elif r.status == "OOM":
            outcome = "OOM" + (": admitted by Soup, OOM at its own number" if r.cap_at == "soup" else "")
        else:
            outcome = r.status
        cells.append([f"{r.label} {r.quant} {r.seq}x{r.batch}", r.cap_at or "-", gb(r.cap), gb(r.soup_predicted),
                      gb(r.real_peak if r.measured else None), gb(r.reserved if r.measured else None), outcome])
    return "\n".join(["--cap: each arm in a fresh process, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, "
                      "allocator capped at the prediction named (cap: computed by Soup or this tool's estimator; "
                      "peaks: measured here)"] + table(
        [("arm", -34), ("cap at", -10), ("cap GB", 8), ("Soup's own GB", 13), ("allocated GB", 12),
         ("reserved GB", 11), ("outcome", -50)], cells))


def arm_name(r: Row) -> str:
    return f"{r.label} {r.quant} {r.seq}x{r.batch}"


def tool_words(fits: Optional[bool]) -> str:
    return "-" if fits is None else "fits" if fits else "does not fit"


def emulate_table(rows: list[Row]) -> str:
    """--emulate-card: what the card did with each arm (Soup's own gate on the card's free memory,
    then the step) beside this tool's verdict for the same card."""
    cells, notes = [], []
    for r in rows:
        cells.append([arm_name(r), r.emulated_card or "-", gb(r.emulated_card_free), gb(r.emulated_free),
                      gb(r.soup_gate_free), gb(r.soup_predicted), gb(r.needs_free), tool_words(r.emulated_fits),
                      r.emulated_outcome or r.status, gb(r.real_peak if r.measured else None)])
        if r.emulated_outcome == "admitted and OOM":
            notes.append(f"  {arm_name(r)} on {r.emulated_card}: Soup's gate admitted it and the step OOMed "
                         "(issue #395)" + ("; this tool said it does not fit" if r.emulated_fits is False else ""))
        elif r.emulated_fits is True and r.emulated_outcome == "refused by Soup":
            notes.append(f"  {arm_name(r)} on {r.emulated_card}: Soup refused a run this tool says fits")
        elif r.emulated_fits is False and r.emulated_outcome == "admitted and completed":
            notes.append(f"  {arm_name(r)} on {r.emulated_card}: completed where this tool said it does not fit "
                         "(this tool's margin)")
    return "\n".join(["--emulate-card: each arm in a fresh process, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, "
                      "a ballast outside the allocator leaving the card's free memory (card free: total - context, "
                      "computed; free: measured with the ballast held; Soup's gate: the free memory Soup's gate read, "
                      "after the kernel modules its setup loaded; Soup's own: computed by Soup; needs free: "
                      "this tool's estimator; this tool: fits when needs free <= card free less the runtime's "
                      "growth (issue395.cards); outcome and allocated: measured here)"] + table(
        [("arm", -34), ("card", -18), ("card free GB", 12), ("free GB", 8), ("Soup's gate GB", 14),
         ("Soup's own GB", 13),
         ("needs free GB", 13), ("this tool", -12), ("outcome", -22), ("allocated GB", 12)], cells) + notes)


def min_free_table(rows: list[Row]) -> str:
    """--min-free: the lowest cap each arm's step completes under, found by bisection over fresh
    capped processes, beside this tool's needs-free and their ratio."""
    cells = []
    for r in rows:
        over = r.needs_free / r.min_free if r.needs_free and r.min_free else None
        cells.append([arm_name(r), gb(r.soup_predicted), gb(r.needs_free), gb(r.min_free), gb(r.min_free_oom),
                      f"{(r.min_free_resolution or 0) / MiB:.1f}", ratio(over), str(len(r.min_free_probes or ()))])
    return "\n".join(["--min-free: the lowest allocator cap the step completes under (measured: a bisection over "
                      "fresh processes, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, to the resolution shown); "
                      "needs free: this tool's estimator; Soup's own: computed by Soup"] + table(
        [("arm", -34), ("Soup's own GB", 13), ("needs free GB", 13), ("min free GB", 11), ("OOM at GB", 9),
         ("res. MiB", 8), ("needs/min", 9), ("probes", 6)], cells))
