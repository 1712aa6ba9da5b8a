"""--estimate's cards: per card the verdict (needs_free + context <= total), the longest seq that
fits, Soup's own gate on the same card and the longest seq it admits; the table. Stdlib only."""

from __future__ import annotations

from typing import Callable, Optional

from ..constants import CUBLAS_WORKSPACE
from ..errors import UsageError
from ..record import LORA_R
from ..text import gb, table
from .cards import GATE_GROWTH_BYTES, STEP_GROWTH_BYTES, Budget, Card, budget, workspace_env
from .estimate import Estimate, estimate
from .soup_number import arch_of

__all__ = ["card_answers", "estimate_table", "longest_seq", "longest_seq_soup_admits"]

SEQ_STEP = 64
REFUSES = "Soup refuses a run that would fit"
ADMITS_OOM = "Soup admits a run that will OOM"


def _longest(config: dict, fits: Callable[[Estimate], bool], **kwargs) -> Optional[int]:
    """The longest seq (a multiple of 64, up to max positions) whose estimate passes ``fits``;
    None when not even 64 does. Both numbers grow with seq, so a bisection finds it."""
    kwargs.pop("seq", None)
    top = arch_of(config).max_pos // SEQ_STEP
    ok = lambda k: fits(estimate(config, seq=k * SEQ_STEP, **kwargs))  # noqa: E731
    if top < 1 or not ok(1):
        return None
    lo, hi = 1, top
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo * SEQ_STEP


def longest_seq(config: dict, free_bytes: int, **kwargs) -> Optional[int]:
    """The longest seq whose needs-free (this tool's estimator) fits ``free_bytes``."""
    return _longest(config, lambda e: e.needs_free <= free_bytes, **kwargs)


def longest_seq_soup_admits(config: dict, free_bytes: int, **kwargs) -> Optional[int]:
    """The longest seq Soup's gate admits with ``free_bytes`` free: its own number (computed by
    its own estimator code) <= the free VRAM it measures (decide_stream_fit)."""
    kwargs.pop("workspace", None)
    return _longest(config, lambda e: e.soup_predicted <= free_bytes, **kwargs)


def disagreement(fits: bool, soup_admits: bool) -> Optional[str]:
    if fits == soup_admits:
        return None
    return REFUSES if fits else ADMITS_OOM


def card_answers(config: dict, e: Estimate, budgets: list[Budget], targets=None, lora_r: int = LORA_R,
                 env: Optional[str] = None, stream: Optional[dict] = None) -> list[dict]:
    """One arm on each card: the JSON's ``cards`` entries. needs_free is recomputed only where the
    card's cuBLAS workspace is larger than the estimator's (CUBLAS_WORKSPACE_CONFIG)."""
    kw = dict(quant=e.quant, batch=e.batch, steps=e.steps, release=e.release, targets=targets,
              lora_r=lora_r, stream=stream)
    out = []
    for b in budgets:
        ws = b.card.workspace(env)
        mine = e if ws <= CUBLAS_WORKSPACE else estimate(config, seq=e.seq, workspace=ws, **kw)
        fits, admits = b.fits(mine.needs_free), e.soup_predicted <= b.gate_free_bytes
        out.append({"card": b.card.name, "total_bytes": b.card.total_bytes, "context_bytes": b.context_bytes,
                    "free_bytes": b.free_bytes, "step_free_bytes": b.step_free_bytes,
                    "gate_free_bytes": b.gate_free_bytes, "needs_free": mine.needs_free, "fits": fits,
                    "longest_seq": longest_seq(config, b.step_free_bytes, workspace=ws, **kw),
                    "soup_admits": admits,
                    "longest_seq_soup_admits": longest_seq_soup_admits(config, b.gate_free_bytes, **kw),
                    "soup_predicted": e.soup_predicted, "disagreement": disagreement(fits, admits),
                    "context_source": b.context_source, "total_source": b.card.source,
                    "compute_capability": ".".join(map(str, b.card.cc)) if b.card.cc else None,
                    "cublas_workspace_bytes": ws})
    return out


def budgets_for(cards, context: Optional[int] = None) -> list[Budget]:
    return [budget(c, context) for c in cards]


def seq_words(n: Optional[int]) -> str:
    return "none" if n is None else str(n)


def estimate_table(rows: list[Estimate], cards, config: Optional[dict] = None, *, context: Optional[int] = None,
                   answers: Optional[list[list[dict]]] = None, release_label: Optional[str] = None,
                   **kwargs) -> str:
    """One column per (quant, seq, batch); down it, in order: Soup's own pre-flight (computed by
    Soup), the corrected allocated peak and the free memory it needs (this estimator), each term,
    then per card: total, context, free, needs-free, fits, the longest seq that fits, and Soup's
    two answers (does its gate admit this run; the longest seq it admits), with which way they
    differ where they do."""
    cards = list(cards)
    if cards and not isinstance(cards[0], Card):
        raise UsageError("estimate_table takes Card objects (issue395.cards.parse_cards)")
    if answers is None and cards:
        if config is None:
            raise UsageError("the fit table needs the model's config")
        budgets = budgets_for(cards, context)
        answers = [card_answers(config, e, budgets, env=workspace_env(), **kwargs) for e in rows]
    heads = [f"{e.quant} {e.seq}x{e.batch}" for e in rows]
    width = max([12] + [len(h) for h in heads])
    lines = [["Soup's own pre-flight GB (computed by Soup)"] + [gb(e.soup_predicted) for e in rows],
             ["corrected: allocated peak GB"] + [gb(e.corrected_predicted) for e in rows],
             ["corrected: needs free GB"] + [gb(e.needs_free) for e in rows],
             ["  the peak's phase"] + [e.phase for e in rows]]
    for name in dict.fromkeys(t for e in rows for t in e.terms):
        lines.append([f"  term: {name} GB"] + [gb(e.terms[name]) if name in e.terms else "-" for e in rows])
    notes, sources = [], []
    for i, card in enumerate(cards):
        per = [a[i] for a in answers]
        first = per[0]
        cc = f"compute capability {first['compute_capability']}, " if first["compute_capability"] else ""
        sources.append(f"{card.name}: total {card.source}; {cc}cuBLAS workspace {first['cublas_workspace_bytes']:,} B "
                       "a handle")
        lines += [[f"{card.name}: total GB"] + [gb(first["total_bytes"])] * len(rows),
                  [f"  context GB ({first['context_source']})"] + [gb(a["context_bytes"]) for a in per],
                  ["  free GB (total - context)"] + [gb(a["free_bytes"]) for a in per],
                  ["  the step's free GB (free - runtime growth)"] + [gb(a["step_free_bytes"]) for a in per],
                  ["  needs free GB (this estimator)"] + [gb(a["needs_free"]) for a in per],
                  ["  fits (needs free <= the step's free)"] + ["yes" if a["fits"] else "NO" for a in per],
                  ["  longest seq that fits"] + [seq_words(a["longest_seq"]) for a in per],
                  ["  free GB at Soup's gate (free - modules loaded)"] + [gb(a["gate_free_bytes"]) for a in per],
                  ["  Soup's gate admits it (Soup's number <= that)"] + ["yes" if a["soup_admits"] else "no" for a in per],
                  ["  longest seq Soup's gate admits"] + [seq_words(a["longest_seq_soup_admits"]) for a in per]]
        for e, a in zip(rows, per):
            if a["disagreement"]:
                notes.append(f"{card.name}, {e.quant} {e.seq}x{e.batch}: {a['disagreement']}")
            if a["longest_seq"] != a["longest_seq_soup_admits"]:
                notes.append(f"{card.name}, {e.quant} batch {e.batch}: {seq_direction(a)}")
    if len(rows) > WIDE_ARMS:
        wide = per_arm_table(rows, cards, answers or [[] for _ in rows], heads)
    first_w = max(len(line[0]) for line in lines)
    fmt = lambda cells: "  ".join([f"{cells[0]:<{first_w}}"] + [f"{c:>{width}}" for c in cells[1:]])  # noqa: E731
    head = fmt([f"soup-cli {release_label or rows[0].release}, steps {rows[0].steps}" if rows else ""] + heads)
    legend = ("peak = resident (pool, extras, LoRA weights, cuBLAS workspace, resident rounding) + the larger "
              "phase: the loss (logits, allocator rounding, final norm, and the shared checkpointed inputs, ids, "
              "positions, rotary tables, mask) or the layer recompute (the shared terms, the dequantised layer, "
              "per-token bytes, the autograd workspace) + the allowance; needs free adds the allocator's reserve")
    if cards:
        legend += ("\nfits: needs free + context + runtime growth <= total. context: 'bound' is Soup's own 0.85 GB "
                   "(its dev box, driving a display; --context GB gives yours, as an idle process sees it), "
                   "'measured' this tool's on that card. runtime growth: what CUDA adds outside the allocator "
                   f"by the step's end, {STEP_GROWTH_BYTES / 1e6:.1f} MB, {GATE_GROWTH_BYTES / 1e6:.1f} MB of it "
                   "before Soup's gate reads free memory (measured on the H200: kernel modules loaded lazily, "
                   "library handles)")
    if len(rows) > WIDE_ARMS:
        head = f"soup-cli {release_label or rows[0].release}, steps {rows[0].steps}: one row per arm"
        return "\n".join([head] + wide + [legend] + sources + list(dict.fromkeys(notes))) + "\n"
    return "\n".join([head, "-" * len(head)] + [fmt(line) for line in lines] + [legend] + sources
                     + list(dict.fromkeys(notes))) + "\n"


#: Past this many arms a column per arm runs off a terminal: one row per arm instead.
WIDE_ARMS = 6


def per_arm_table(rows: list[Estimate], cards, answers: list[list[dict]], heads: list[str]) -> list[str]:
    """The wide grid one row per arm, lines kept under ~160 characters: Soup's own number, the
    corrected peak and needs-free, the phase, and per card 'fits, longest seq / Soup's gate
    admits, its longest seq'. The terms of each arm are in --json."""
    names = ["arm", "Soup GB", "corrected GB", "needs free GB", "phase"] + [c.name for c in cards]
    body = [[h, gb(e.soup_predicted), gb(e.corrected_predicted), gb(e.needs_free), e.phase]
            + [f"{'yes' if a['fits'] else 'NO'} {seq_words(a['longest_seq'])} / "
               f"{'yes' if a['soup_admits'] else 'no'} {seq_words(a['longest_seq_soup_admits'])}" for a in per]
            for h, e, per in zip(heads, rows, answers)]
    last = max(len(r[-1]) for r in [names] + body)  # the helper widens every column but the last
    columns = [(names[0], -1)] + [(n, 1) for n in names[1:-1]] + [(names[-1], last)]
    return table(columns, body) + [
        "per card: fits (needs free <= the step's free), the longest seq that fits / Soup's gate admits it, the longest "
        "seq it admits", "each arm's terms: --json (or at most 6 arms, a column each)"]


def seq_direction(a: dict) -> str:
    """Which way Soup's longest seq differs from the longest that fits (this estimator)."""
    fit, soup = a["longest_seq"], a["longest_seq_soup_admits"]
    if soup is not None and (fit is None or soup > fit):
        return (f"Soup admits seq up to {soup}, a run that will OOM past {seq_words(fit)} "
                "(Soup admits a run that will OOM)")
    return f"Soup refuses seq past {seq_words(soup)}, runs that would fit up to {fit} (Soup refuses a run that would fit)"
