"""--estimate's cards, longest sequence and table, on top of issue395.estimate. Stdlib only."""

from __future__ import annotations

import re

from .checks import comma_list
from .errors import UsageError
from .estimate import Estimate, arch_of, estimate

SEQ_STEP = 64
_CARD = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GB|GiB)\s*$", re.IGNORECASE)


def parse_cards(text: str) -> list[tuple[str, int]]:
    """'24GB,40GB,80GiB' -> [(label, bytes)]: GB = 1e9 bytes, GiB = 2**30."""
    if not isinstance(text, str) or not text.strip():
        raise UsageError("--card needs sizes like 24GB,40GB,80GiB")
    out = []
    for part in comma_list(text):
        m = _CARD.match(part)
        if not m or float(m.group(1)) <= 0:
            raise UsageError(f"--card {part.strip()!r} is not a size like 24GB or 80GiB")
        unit = 1e9 if m.group(2).lower() == "gb" else 2**30
        out.append((f"{m.group(1)}{'GB' if unit == 1e9 else 'GiB'}", int(float(m.group(1)) * unit)))
    return out


def longest_seq(config: dict, card_bytes: int, **kwargs) -> int | None:
    """The longest seq (a multiple of 64, up to max positions) whose needs_free fits the card;
    None when not even 64 fits. needs_free grows with seq, so a bisection finds it."""
    kwargs.pop("seq", None)
    top = arch_of(config).max_pos // SEQ_STEP
    fits = lambda k: estimate(config, seq=k * SEQ_STEP, **kwargs).needs_free <= card_bytes  # noqa: E731
    if top < 1 or not fits(1):
        return None
    lo, hi = 1, top
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo * SEQ_STEP


def estimate_table(rows: list[Estimate], cards, config: dict | None = None, **kwargs) -> str:
    """One column per (quant, seq, batch); down it, in order: Soup's own pre-flight (computed by
    Soup), the corrected allocated peak and the free memory it needs (this estimator), each term,
    and per card whether it fits and, with ``config``, the longest seq that fits (this estimator)."""
    cards = list(cards)
    heads = [f"{e.quant} {e.seq}x{e.batch}" for e in rows]
    width = max([12] + [len(h) for h in heads])
    gb = lambda n: f"{n / 1e9:.4f}"  # noqa: E731
    lines = [["Soup's own pre-flight GB (computed by Soup)"] + [gb(e.soup_predicted) for e in rows],
             ["corrected: allocated peak GB"] + [gb(e.corrected_predicted) for e in rows],
             ["corrected: needs free GB"] + [gb(e.needs_free) for e in rows],
             ["  the peak's phase"] + [e.phase for e in rows]]
    for name in dict.fromkeys(t for e in rows for t in e.terms):
        lines.append([f"  term: {name} GB"] + [gb(e.terms[name]) if name in e.terms else "-" for e in rows])
    for label, size in cards:
        lines.append([f"fits {label} (needs free <= card)"] + [
            ("yes" if e.needs_free <= size else "NO") + ("" if e.soup_predicted <= size else " (Soup refuses)")
            for e in rows])
        if config is not None:
            lines.append([f"  longest seq that fits {label}"] + [
                str(longest_seq(config, size, quant=e.quant, batch=e.batch, steps=e.steps, release=e.release,
                                **kwargs) or "none") for e in rows])
    first = max(len(line[0]) for line in lines)
    fmt = lambda cells: "  ".join([f"{cells[0]:<{first}}"] + [f"{c:>{width}}" for c in cells[1:]])  # noqa: E731
    head = fmt([f"soup-cli {rows[0].release}, steps {rows[0].steps}" if rows else ""] + heads)
    legend = ("peak = resident (pool, extras, LoRA weights, cuBLAS workspace, resident rounding) + the larger "
              "phase: the loss (logits, allocator rounding, final norm, and the shared checkpointed inputs, ids, "
              "positions, rotary tables, mask) or the layer recompute (the shared terms, the dequantised layer, "
              "per-token bytes, the autograd workspace) + the allowance; needs free adds the allocator's reserve")
    return "\n".join([head, "-" * len(head)] + [fmt(line) for line in lines] + [legend]) + "\n"
