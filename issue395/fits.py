"""--estimate's cards, longest sequence and table, on top of issue395.estimate. Stdlib only."""

from __future__ import annotations

import re

from .errors import UsageError
from .estimate import Estimate, arch_of, estimate

SEQ_STEP = 64
_CARD = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GB|GiB)\s*$", re.IGNORECASE)


def parse_cards(text: str) -> list[tuple[str, int]]:
    """'24GB,40GB,80GiB' -> [(label, bytes)]: GB = 1e9 bytes, GiB = 2**30."""
    if not isinstance(text, str) or not text.strip():
        raise UsageError("--card needs sizes like 24GB,40GB,80GiB")
    out = []
    for part in text.split(","):
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


def _gb(n: int) -> str:
    return f"{n / 1e9:10.3f}"


def estimate_table(rows: list[Estimate], cards, config: dict | None = None, **kwargs) -> str:
    """Fixed-width text: per (seq, batch), Soup's own pre-flight (computed by Soup), the corrected
    allocated peak and needs_free (this estimator), each term, and per card whether it fits; with
    ``config`` given, also the longest seq that fits each card at that batch (this estimator)."""
    cards = list(cards)
    out = []
    for e in rows:
        out.append(f"seq {e.seq} x batch {e.batch}, quant {e.quant}, steps {e.steps}, "
                   f"soup-cli {e.release}  (GB = 1e9 bytes)")
        out.append(f"  {'Soup pre-flight (computed by Soup)':<46}{_gb(e.soup_predicted)}")
        out.append(f"  {'corrected allocated peak (this estimator)':<46}{_gb(e.corrected_predicted)}"
                   f"  phase: {e.phase}")
        out.append(f"  {'needs free (this estimator, + allocator)':<46}{_gb(e.needs_free)}")
        for name, value in e.terms.items():
            out.append(f"    term {name:<40}{_gb(value)}")
        for label, size in cards:
            verdict = "fits" if e.needs_free <= size else "does NOT fit"
            soup = "admits" if e.soup_predicted <= size else "refuses"
            line = f"  card {label:<8} {verdict:<13} (Soup's own gate {soup})"
            if config is not None:
                best = longest_seq(config, size, quant=e.quant, batch=e.batch, steps=e.steps,
                                   release=e.release, **kwargs)
                line += f"; longest seq that fits (this estimator): {best if best else 'none'}"
            out.append(line)
    return "\n".join(out) + "\n"
