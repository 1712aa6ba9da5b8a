"""--estimate's cards: per card the verdict (needs_free + context <= total), the longest seq that
fits, Soup's own gate on the same card and the longest seq it admits; the table. Stdlib only."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from ..constants import CUBLAS_WORKSPACE
from ..errors import EXIT_FINDING, EXIT_OK, EXIT_SOUP_REFUSES, InvalidRun, UsageError
from ..text import gb, table
from ..tasks import PROTOCOL_TASK, task
from .cards import CARDS, CLI_GATE_GROWTH_BYTES, DRIVER_KEPT, STEP_GROWTH_BYTES, Budget, Card, budget, workspace_env
from .estimate import EXPANDABLE_RESERVE_BYTES, EXPANDABLE_RESERVE_PAGES, Estimate
from .arch import arch_from_config, layer_bytes
from .resident import estimate_run
from .soup_number import arch_of, soup_namespace
from .terms import Phase, phases_of, words

__all__ = ["card_answers", "estimate_table", "largest", "longest", "longest_resident", "longest_seq",
           "longest_seq_soup_admits", "longest_soup_admits"]

SEQ_STEP = 64
#: Soup's measured gate refuses by arithmetic a run its number puts past this many times the free
#: memory, without measuring (soup_cli/trainer/stream_setup.py, _PROBE_DEFERRAL_CEILING, both releases).
PROBE_DEFERRAL_CEILING = 4.0


@dataclass(frozen=True)
class Gate:
    """Soup's gate as the user's soup.yaml sets it. ``override``: training.stream_vram_override, the
    bytes Soup takes as free instead of the driver's reading (resolve_available_vram_bytes: it
    replaces the figure, in either direction). ``probe``: training.stream_vram_probe, the measured
    path: Soup admits when one measured step's max_memory_allocated fits the free memory
    (decide_measured_fit), unless its own number is past PROBE_DEFERRAL_CEILING x the free memory."""

    override: Optional[int] = None
    probe: bool = False

    def available(self, gate_free: int) -> int:
        return gate_free if self.override is None else self.override

    def admits(self, soup_predicted: int, one_step_allocated: int, available: int) -> bool:
        if not self.probe:
            return soup_predicted <= available  # decide_stream_fit
        return soup_predicted <= available * PROBE_DEFERRAL_CEILING and one_step_allocated <= available

    @staticmethod
    def probed(e: Any) -> int:
        """What the probe measures of a one-step estimate (Gate.measured's): its forward and backward, no optimizer
        step (measure_step_peak_bytes runs none)."""
        return e.forward_backward or e.corrected_predicted

    @property
    def rule(self) -> str:
        return "measured probe (decide_measured_fit)" if self.probe else "Soup's number (decide_stream_fit)"

    def measured(self, arm: Any) -> Any:
        """The arm (issue395.model.arm.Arm) whose corrected allocated peak the gate reads: with the probe, the one
        step it measures, before any optimizer state (the estimator's default optimizer); else the run itself."""
        if not self.probe:
            return arm
        return replace(arm, steps=1, settings=replace(arm.settings, optimizer=None))


REFUSES = "Soup refuses a run that would fit"
ADMITS_OOM = "Soup admits a run that will OOM"


#: --find-max's batch axis has no max positions to stop at: the largest batch this tool answers.
BATCH_TOP = 1024


def axis_range(config: dict, axis: str, task_name: Optional[str] = None) -> tuple[int, int, int]:
    """(smallest, step, largest) of the values an answer along ``axis`` takes: seq, multiples of 64
    up to max positions; batch, every whole batch from the task's smallest up to BATCH_TOP."""
    if axis == "seq":
        # the model's own limit: whether the installed Soup streams it is the estimate's question (its release)
        return SEQ_STEP, SEQ_STEP, arch_from_config(config).max_pos // SEQ_STEP * SEQ_STEP
    if axis == "batch":
        return task(task_name or PROTOCOL_TASK).min_batch, 1, BATCH_TOP
    raise UsageError(f"no answer along {axis!r}: seq or batch")


def largest(ok: Callable[[int], bool], low: int, step: int, top: int) -> Optional[int]:
    """The largest multiple of ``step`` in [low, top] that passes ``ok``, where ``ok`` holds below every value it
    holds at (a number that grows with seq and with batch, against a fixed budget): a bisection; None when not even
    ``low`` passes."""
    lo, hi = low // step, top // step
    if hi < lo or not ok(lo * step):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid * step) else (lo, mid - 1)
    return lo * step


def _longest(config: dict, arm: Any, fits: Callable[[Estimate], bool], axis: str = "seq", **extra) -> Optional[int]:
    """The largest value along ``axis`` (axis_range) whose estimate of ``arm`` (issue395.model.arm.Arm, at each
    value; ``extra``: what is not the run, as estimate_run takes it) passes ``fits``; None when not even the smallest
    does. Both numbers grow with seq and with batch, so a bisection finds it."""
    low, step, top = axis_range(config, axis, arm.task)
    return largest(lambda v: fits(estimate_run(replace(arm, **{axis: v}), config, **extra)), low, step, top)


def longest_resident(axis: str, config: dict, free_bytes: int, arm, **extra) -> tuple[Optional[int], Optional[str]]:
    """The longest seq (or largest batch) whose resident needs-free (estimator.resident, the resident Arm
    ``arm`` at each value: issue395.model.arm.Arm) fits ``free_bytes``, and why there is none where the estimator
    does not model the run: (None, its line) where it refuses the smallest value (MoE, a hybrid, latent attention,
    phi), or where the run fits up to the last value it models (past a sliding window without checkpointing) and
    beyond that it cannot say. (None, None): not even the smallest fits. ``extra``: the card's (its dispatch)."""
    low, step, top = axis_range(config, axis, arm.task)

    def at(value: int) -> tuple[Optional[Estimate], Optional[str]]:
        try:
            return estimate_run(replace(arm, **{axis: value}), config, **extra), None
        except InvalidRun:  # no stack starts it at any value: bad input, not a run beyond the estimator
            raise
        except UsageError as exc:
            return None, str(exc)

    why = at(low)[1]
    if why is not None:
        return None, why
    # refused only past a value (a sliding window, without checkpointing): the modelled values are a prefix
    modelled = largest(lambda v: at(v)[0] is not None, low, step, top)
    found = largest(lambda v: at(v)[0].needs_free <= free_bytes, low, step, modelled)
    if found is not None and found == modelled < top:
        return None, f"it fits up to {axis} {found} and is not modelled past it: {at(found + step)[1]}"
    return found, None


def longest(axis: str, config: dict, free_bytes: int, arm: Any, **extra) -> Optional[int]:
    """The longest seq (or largest batch) whose needs-free (this tool's estimator, of the streamed Arm ``arm`` at each
    value) fits ``free_bytes``; ``extra``: what is not the run (a card's workspace, the release)."""
    return _longest(config, arm, lambda e: e.needs_free <= free_bytes, axis, **extra)


def longest_soup_admits(axis: str, config: dict, free_bytes: int, arm: Any, gate: Gate = Gate(),
                        **extra) -> Optional[int]:
    """The longest seq (or largest batch) of ``arm`` Soup's gate admits with ``free_bytes`` free: its own number
    (computed by its own estimator code) <= the free VRAM it measures (decide_stream_fit), or, with
    the probe, the measured path's rule on one step (Gate.admits, Gate.measured)."""
    extra.pop("workspace", None)
    return _longest(config, gate.measured(arm), lambda e: gate.admits(e.soup_predicted, gate.probed(e), free_bytes),
                    axis, **extra)


def longest_seq(config: dict, free_bytes: int, arm: Any, **extra) -> Optional[int]:
    return longest("seq", config, free_bytes, arm, **extra)


def longest_seq_soup_admits(config: dict, free_bytes: int, arm: Any, gate: Gate = Gate(), **extra) -> Optional[int]:
    return longest_soup_admits("seq", config, free_bytes, arm, gate, **extra)


def host_store(config: dict, quant: str) -> tuple[int, int, float]:
    """The streamed store Soup keeps in host RAM (its RAM tier, choose_tier), not a card's memory:
    (the store's bytes, the free RAM Soup's RAM tier asks for it, Soup's RAM_TIER_HEADROOM). The store
    is every layer as Soup's shard counts one (the widest kind for MoE and hybrid layers: a bound)
    plus the vocab matrices in bf16; Soup's tier wants it under RAM_TIER_HEADROOM of the free RAM."""
    a = arch_of(config)
    store = a.L * layer_bytes(a, quant) + 2 * a.V * a.h * (1 if a.tied else 2)
    headroom = float(soup_namespace()["RAM_TIER_HEADROOM"])
    return store, int(store / headroom) + 1, headroom


def host_ram_line(a: dict, quant: str) -> str:
    """The host RAM the streamed store needs, said beside the verdict (the machine's, never a card's)."""
    return (f"host RAM (the machine's, not a card's): Soup's streamed store, about {a['host_store_bytes'] / 1e9:.1f} GB "
            f"{'bf16' if quant == 'none' else quant} (computed by this tool from Soup's shard sizes), needs {a['host_ram_free_bytes'] / 1e9:.1f} GB of "
            f"free RAM for Soup's RAM tier (the store / its RAM_TIER_HEADROOM {a['ram_tier_headroom']:g}), else an "
            "NVMe disk")


def disagreement(fits: bool, soup_admits: bool) -> Optional[str]:
    if fits == soup_admits:
        return None
    return REFUSES if fits else ADMITS_OOM


def card_answers(config: dict, e: Estimate, budgets: list[Budget], arm, env: Optional[str] = None,
                 gate: Gate = Gate()) -> list[dict]:
    """One arm (issue395.model.arm.Arm) on each card: the JSON's ``cards`` entries. needs_free is recomputed only where the
    card's cuBLAS workspace is larger than the estimator's (CUBLAS_WORKSPACE_CONFIG) or, under NF4, where the card's
    SM count and compute capability are known (gemm_4bit's kernel is its choice). Soup's gate
    is the file's (``gate``): the free memory it reads, or its override; its number, or the probe."""
    extra = {"release": e.release}  # ``e`` is the arm's estimate: its release is the answers' too
    one_step = e if not gate.probe or e.steps == 1 else estimate_run(gate.measured(arm), config, **extra)
    out = []
    store, ram, headroom = host_store(config, e.quant)
    top = axis_range(config, "seq")[2]
    for b in budgets:
        kernels = b.card.kernels(env)  # its cuBLAS workspace, and where NF4's gemm_4bit fuses on it
        own = kernels["workspace"] > CUBLAS_WORKSPACE or e.quant == "nf4" and kernels["dispatch"] is not None
        mine = estimate_run(arm, config, **kernels, **extra) if own else e
        available = gate.available(b.gate_free_bytes)
        fits = b.fits(mine.needs_free)
        admits = gate.admits(e.soup_predicted, gate.probed(one_step), available)
        out.append({"card": b.card.name, "total_bytes": b.card.total_bytes, "context_bytes": b.context_bytes,
                    "free_bytes": b.free_bytes, "step_free_bytes": b.step_free_bytes,
                    "growth_bytes": b.growth, "growth_source": b.growth_from,
                    "gate_free_bytes": available, "needs_free": mine.needs_free, "fits": fits,
                    # the card's own estimate's: its needs_free less its split peak (the walk may differ per card)
                    "reserve_bytes": mine.needs_free - mine.split_allocated,
                    "longest_seq": longest_seq(config, b.step_free_bytes, arm, **kernels, **extra),
                    "soup_admits": admits,
                    "longest_seq_soup_admits": longest_seq_soup_admits(config, available, arm, gate, **extra),
                    "gate_rule": gate.rule,
                    "gate_free_source": ("training.stream_vram_override" if gate.override is not None
                                         else "the card's free memory less the modules loaded"),
                    "soup_predicted": e.soup_predicted, "disagreement": disagreement(fits, admits),
                    "context_source": b.context_source, "total_source": b.card.source,
                    "compute_capability": ".".join(map(str, b.card.cc)) if b.card.cc else None,
                    "cublas_workspace_bytes": kernels["workspace"], "max_positions_seq": top,
                    "host_store_bytes": store, "host_ram_free_bytes": ram, "ram_tier_headroom": headroom})
    return out


def runs_exit_code(answers: list[list[dict]]) -> int:
    """--exit-code: will `soup train` run it to the end on every card? 0 where this tool's fit and
    Soup's admission (its gate as the file sets it) both hold on every card; 1 where it does not fit
    on some card; EXIT_SOUP_REFUSES where it fits on every card but Soup's gate refuses it on some."""
    every = [a for per in answers for a in per]
    if not all(a["fits"] for a in every):
        return EXIT_FINDING
    return EXIT_OK if all(a["soup_admits"] for a in every) else EXIT_SOUP_REFUSES


def budgets_for(cards, context: Optional[int] = None) -> list[Budget]:
    return [budget(c, context) for c in cards]


def seq_words(n: Optional[int]) -> str:
    return "none" if n is None else str(n)


def estimate_table(rows: list[Estimate], cards, config: Optional[dict] = None, *, context: Optional[int] = None,
                   answers: Optional[list[list[dict]]] = None, release_label: Optional[str] = None,
                   verbose: bool = True, arms: Optional[list] = None) -> str:
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
        from ..model.arm import Arm  # each row's own arm, else the plain one its figures name

        arms = arms or [Arm("custom", e.seq, e.batch, quant=e.quant, task=e.task, steps=e.steps) for e in rows]
        answers = [card_answers(config, e, budgets, arm, env=workspace_env()) for e, arm in zip(rows, arms)]
    # the task is named wherever one is not the protocol's SFT, so an SFT-only table reads as before
    tasked = any(e.task != PROTOCOL_TASK for e in rows)
    heads = [f"{e.task} {e.quant} {e.seq}x{e.batch}" if tasked else f"{e.quant} {e.seq}x{e.batch}" for e in rows]
    width = max([12] + [len(h) for h in heads])
    lines = [["Soup's own pre-flight GB (computed by Soup)"] + [gb(e.soup_predicted) for e in rows]]
    if any("formula" in e.soup_terms for e in rows):  # a soup_cli patched by --soup-patch: its gate beside the stock one
        lines = [["Soup's own pre-flight GB (patched: its gate's number)"] + [gb(e.soup_predicted) for e in rows],
                 ["  Soup's formula GB (stock, computed by Soup)"]
                 + [gb(e.soup_terms.get("formula")) for e in rows]]
    lines += [["corrected: allocated peak GB"] + [gb(e.corrected_predicted) for e in rows],
             ["corrected: needs free GB"] + [gb(e.needs_free) for e in rows],
             ["  the peak's phase"] + [e.phase for e in rows]]
    for name in dict.fromkeys(t for e in rows for t in e.terms):
        lines.append([f"  term: {name} GB ({', '.join(phases_of(name))})"]
                     + [gb(e.terms[name]) if name in e.terms else "-" for e in rows])
    notes, sources = [], []
    for i, card in enumerate(cards):
        card_lines(card, rows, [a[i] for a in answers], lines, notes, sources)
    if len(rows) > WIDE_ARMS:
        wide = per_arm_table(rows, cards, answers or [[] for _ in rows], heads)
    first_w = max(len(line[0]) for line in lines)
    fmt = lambda cells: "  ".join([f"{cells[0]:<{first_w}}"] + [f"{c:>{width}}" for c in cells[1:]])  # noqa: E731
    head = fmt([f"soup-cli {release_label or rows[0].release}, steps {rows[0].steps}" if rows else ""] + heads)
    legend = LEGEND
    if cards:
        legend += ("\nfits: needs free + context + runtime growth <= total. context: 'bound' is Soup's own 0.85 GB "
                   "(its dev box, driving a display; --context GB gives yours, as an idle process sees it), "
                   "'measured' this tool's on that card" + driver_kept_words() + ". runtime growth: what CUDA adds outside the allocator "
                   f"by the step's end, {STEP_GROWTH_BYTES / 1e6:.1f} MB (kernel modules loaded lazily, library "
                   f"handles), {CLI_GATE_GROWTH_BYTES / 1e6:.1f} MB of it before Soup's gate reads free memory in "
                   "`soup train` (both measured on the H200). the allocator's reserve: what the caching allocator holds above the allocated "
                   f"peak under expandable segments that a card cannot do without: the partial 20 MiB pages live "
                   f"blocks touch, charged {EXPANDABLE_RESERVE_PAGES} pages, {EXPANDABLE_RESERVE_BYTES / 1e6:.1f} MB "
                   "(the whole pages above the most measured, at the allocator's replayed peak and in torch's OOM "
                   "messages inside Soup's process: docs/PEAK.md, results/fit4-anatomy-findmax-render.txt)"
                   + (replayed_words() if any(e.reserve != EXPANDABLE_RESERVE_BYTES for e in rows) else ""))
    if not verbose:  # the legends and the cards' sources: --verbose (the verdict lines come first)
        legend, sources = "--verbose: what each line means (the peak's terms, the fit rule, the context) and each card's source", []
    if len(rows) > WIDE_ARMS:
        head = f"soup-cli {release_label or rows[0].release}, steps {rows[0].steps}: one row per arm"
        return "\n".join([head] + wide + [legend] + sources + list(dict.fromkeys(notes))) + "\n"
    return "\n".join([head, "-" * len(head)] + [fmt(line) for line in lines] + [legend] + sources
                     + list(dict.fromkeys(notes))) + "\n"


def card_lines(card: Card, rows: list[Estimate], per: list[dict], lines: list, notes: list, sources: list) -> None:
    """One card's block of the fit table (its total, context, free, needs-free, fits, the longest seq, Soup's two
    answers), its source line and the notes where this tool and Soup's gate differ, appended in place."""
    first = per[0]
    cc = f"compute capability {first['compute_capability']}, " if first["compute_capability"] else ""
    sources.append(f"{card.name}: total {card.source}; {cc}cuBLAS workspace {first['cublas_workspace_bytes']:,} B "
                   "a handle")
    lines += [[f"{card.name}: total GB"] + [gb(first["total_bytes"])] * len(rows),
              [f"  context GB ({first['context_source']})"] + [gb(a["context_bytes"]) for a in per],
              ["  free GB (total - context)"] + [free_gb(a["free_bytes"]) for a in per],
              [f"  runtime growth GB (by the step's end; {first['growth_source']})"]
              + [gb(a["growth_bytes"]) for a in per],
              ["  the step's free GB (free - runtime growth)"] + [free_gb(a["step_free_bytes"]) for a in per],
              ["  needs free GB (this estimator)"] + [gb(a["needs_free"]) for a in per],
              ["    of it, the allocator's reserve GB (needs free - split peak)"]
              + [gb(a["reserve_bytes"]) for a in per],
              ["  fits (needs free <= the step's free)"] + ["yes" if a["fits"] else "NO" for a in per],
              ["  longest seq that fits"] + [seq_words(a["longest_seq"]) for a in per],
              [f"  free GB at Soup's gate ({gate_free_words(first)})"] + [free_gb(a["gate_free_bytes"]) for a in per],
              [f"  Soup's gate admits it ({gate_rule_words(first)})"] + ["yes" if a["soup_admits"] else "no" for a in per],
              ["  longest seq Soup's gate admits"] + [seq_words(a["longest_seq_soup_admits"]) for a in per]]
    for e, a in zip(rows, per):
        if reserve_words(e):
            notes.append(f"{e.quant} {e.seq}x{e.batch}: {reserve_words(e)}")
        if a["disagreement"]:
            notes.append(f"{card.name}, {e.quant} {e.seq}x{e.batch}: {a['disagreement']}")
        if a["fits"] is not None and a["longest_seq"] != a["longest_seq_soup_admits"]:
            notes.append(f"{card.name}, {e.quant} batch {e.batch}: {seq_direction(a)}")


def reserve_words(e: Estimate) -> str:
    """An estimate's allocator reserve in words where it is replayed, not the bound ("" for the bound)."""
    if e.reserve == EXPANDABLE_RESERVE_BYTES:
        return ""
    return (f"the allocator's reserve replayed by estimator/gc_sequence.py, {e.reserve / 1e6:.1f} MB computed, in "
            f"place of the {EXPANDABLE_RESERVE_BYTES / 1e6:.1f} MB bound")


def replayed_words() -> str:
    """The legend's words where an arm's reserve is replayed rather than the bound."""
    return ("; replayed where marked: a checkpointed resident run estimator/gc_sequence.py replays on expandable "
            "segments (its load and two steps, both pools, request by request): the most pages its live blocks "
            "touch less their allocated peak, never under the reserve measured on that arm, in place of the bound")


#: The fit table's legend, its terms read from the term table (issue395.estimator.terms).
LEGEND = (f"peak = resident ({words((Phase.RESIDENT,))}) + the larger phase: the loss "
          f"({words((Phase.LOSS,), (Phase.LAYER,))}, and the shared {words((Phase.LOSS, Phase.LAYER))}) or the "
          f"layer recompute (the shared terms, {words((Phase.LAYER,), (Phase.LOSS,))}) + the allowance; needs "
          "free adds the allocator's reserve")

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


def free_gb(n: int) -> str:
    """A free-memory cell: a card with no room says so, never a negative figure."""
    return gb(n) if n > 0 else "none"


def no_room(a: dict) -> Optional[str]:
    """A card whose total the context and the runtime's growth take whole: one clear line's words."""
    if a["step_free_bytes"] > 0:
        return None
    return (f"no room for a step: its {a['total_bytes'] / 1e9:.2f} GB total is under the context "
            f"({a['context_bytes'] / 1e9:.2f} GB, {a['context_source']}) and the runtime's growth "
            f"({a['growth_bytes'] / 1e9:.2f} GB, {a['growth_source']}); nothing fits on it")


def driver_kept_words() -> str:
    """The legend's words for DRIVER_KEPT, naming each card it applies to and its figure."""
    kept = [c for c in CARDS.values() if c.hidden_bytes]
    return (f"; '{DRIVER_KEPT}' that bound plus what the driver keeps below nvidia-smi's total ("
            + ", ".join(f"{c.name}: {c.hidden_bytes / 1e9:.2f} GB, {c.context_bound / 1e9:.2f} GB in all" for c in kept)
            + ")") if kept else ""


def positions_words(a: dict, key: str) -> str:
    """A longest seq that is the model's max positions (its multiple of 64), said so: memory is not the limit."""
    return ((" (the model's max positions: memory is not the limit)" if key == "longest_seq" else " (max positions)")
            if a[key] is not None and a[key] == a.get("max_positions_seq") else "")


def gate_free_words(a: dict) -> str:
    return ("training.stream_vram_override" if a.get("gate_free_source") == "training.stream_vram_override"
            else "free - modules loaded")


def gate_rule_words(a: dict) -> str:
    return ("one measured step <= that" if "probe" in a.get("gate_rule", "") else "Soup's number <= that")


def steps_words(steps: int, source: Optional[str] = None) -> str:
    """Which answer it is: the protocol's one step, or the run's steady state (from step 2 on the
    optimizer's states are live and every later step repeats the peak)."""
    if steps == 1:
        return "the first step alone (the protocol's one step: its optimizer step makes the states)"
    return (f"the run's steady state (the peak over {steps} steps: from step 2 on the optimizer's states are live)"
            + ("; --steps 1 gives the protocol's one step" if source == "--config's run" else ""))


def verdict_lines(rows: list[Estimate], cards, answers: list[list[dict]]) -> list[str]:
    """What a person reads first: per card (and arm, where there are several) fits or not, the
    longest seq that fits, Soup's gate, the longest seq it admits. No card: needs-free alone."""
    lines = []
    said_ram: set = set()
    for e, per in zip(rows, answers):
        arm = f"{arm_tag(e)}: "  # every line its arm's task, quantization and shape, SFT's as DPO's
        if not cards:
            lines.append(f"{arm}needs {e.needs_free / 1e9:.2f} GB free (this estimator); Soup's own number "
                         f"{e.soup_predicted / 1e9:.2f} GB; give --card to fit it on a card")
        for card, a in zip(cards, per):
            room = no_room(a)
            if room:
                lines.append(f"{card.name}: {arm}{room}")
                continue
            fit = (f"{'fits' if a['fits'] else 'does NOT fit'} (needs {a['needs_free'] / 1e9:.2f} GB, "
                   f"{a['step_free_bytes'] / 1e9:.2f} GB free)")
            gate = "admits" if a["soup_admits"] else "refuses"
            lines.append(f"{card.name}: {arm}{fit}, longest seq that fits {seq_words(a['longest_seq'])}"
                         f"{positions_words(a, 'longest_seq')}; Soup {gate} it, longest seq it admits "
                         f"{seq_words(a['longest_seq_soup_admits'])}{positions_words(a, 'longest_seq_soup_admits')}"
                         + (f" -- {a['disagreement']}" if a["disagreement"] else ""))
        if per and e.quant not in said_ram:  # once a quantization: the store does not move with seq or batch
            said_ram.add(e.quant)
            lines.append(host_ram_line(per[0], e.quant))
    return lines


def arm_tag(e: Estimate) -> str:
    """An estimate's arm as the verdict lines name it: task, quantization, seq x batch (``sft nf4 2048x1``)."""
    return f"{e.task} {e.quant} {e.seq}x{e.batch}"


def first_line(rows: list[Estimate], cards, answers: list[list[dict]]) -> str:
    """The verdict in one line, --estimate's first (issue 53 item 13): per card, whether every arm asked fits
    (this tool's estimate) and Soup's gate admits it, grouped, with what --exit-code answers; without a card,
    the most any arm needs free beside Soup's own number."""
    several = len(rows) > 1
    if not cards:
        e = max(rows, key=lambda r: r.needs_free)
        return (f"verdict: needs {e.needs_free / 1e9:.2f} GB free by this tool's estimate"
                + (f" (the most of {len(rows)} arms, at {arm_tag(e)})" if several else "")
                + f"; Soup's own number {e.soup_predicted / 1e9:.2f} GB; give --card to fit it on a card")
    admitted, refused, parts = [], [], []
    for i, card in enumerate(cards):
        per = [(e, a[i]) for e, a in zip(rows, answers)]
        misfit = next(((e, a) for e, a in per if not a["fits"]), None)
        if misfit is not None:
            e, a = misfit
            parts.append(f"does NOT fit on {card.name}" + (f" at {arm_tag(e)}" if several else "")
                         + f" (needs {a['needs_free'] / 1e9:.2f} GB, {max(a['step_free_bytes'], 0) / 1e9:.2f} GB free)"
                         + (", yet Soup's gate admits it: a run that will OOM" if a["soup_admits"] else ""))
        elif all(a["soup_admits"] for _, a in per):
            admitted.append(card.name)
        else:
            refused.append(card.name)
    if admitted:
        parts.append(f"fits on {', '.join(admitted)}, and Soup's gate admits it there")
    if refused:
        parts.append(f"fits on {', '.join(refused)}, but Soup's gate refuses it there: soup train would not start it")
    code = runs_exit_code(answers)
    said = {EXIT_OK: "soup train runs it to the end on every card", EXIT_FINDING: "it does not fit on every card",
            EXIT_SOUP_REFUSES: "Soup's gate refuses it on some card"}[code]
    return (f"verdict ({'every arm asked, ' if several else ''}this tool's estimate and Soup's own gate): "
            + "; ".join(parts) + f"; --exit-code {code}: {said}")


def card_list() -> str:
    """--card list: every named card, its total as the driver reports it, its compute capability
    and where the total comes from."""
    from .cards import CARDS

    rows = [(c.name, f"{c.total_bytes / 1e9:.2f} GB", ".".join(map(str, c.cc)) if c.cc else "-", c.source)
            for c in CARDS.values()]
    head = ("card", "total", "cc", "source")
    w = [max(len(r[i]) for r in rows + [head]) for i in range(3)]
    fmt = lambda r: f"{r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}  {r[3]}"  # noqa: E731
    return "\n".join([fmt(head)] + [fmt(r) for r in rows]
                     + ["or a size: 24GB (24e9 bytes) or 24GiB (24 x 2^30); --context GB gives the context yours leaves"]) + "\n"


def seq_direction(a: dict) -> str:
    """Which way Soup's longest seq differs from the longest that fits (this estimator)."""
    fit, soup = a["longest_seq"], a["longest_seq_soup_admits"]
    if soup is not None and fit is None:
        return f"Soup admits seq up to {soup}, but no seq fits: every one will OOM (Soup admits a run that will OOM)"
    if soup is not None and soup > fit:
        return (f"Soup admits seq up to {soup}, a run that will OOM past {fit} "
                "(Soup admits a run that will OOM)")
    refused = "every seq" if soup is None else f"seq past {soup}"
    return f"Soup refuses {refused}, runs that would fit up to {fit} (Soup refuses a run that would fit)"
