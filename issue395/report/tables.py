"""Fixed-width text tables: plain rows of cells printed through one helper.
"""

from __future__ import annotations

import statistics
from typing import Any, Optional

from ..constants import GB
from ..record import (
    PUBLISHED_NF4,
    QUANTS,
    RECORD_A10G_OVERESTIMATE,
    RECORD_DETERMINISM,
    RECORD_MEASURE,
    RECORD_SDPA_MB,
    SDPA_BACKENDS,
    SDPA_HEAD_DIM,
    SDPA_HEADS,
    SDPA_SEQS,
)
from ..text import gb, ratio, table
from ..model.registry import SHAPES
from ..estimator.anatomy import margin_anatomy
from ..results.corrected import corrected, corrected_ratio
from ..results.result import Result, map_order
from ..results.row import Row
from ..results.stack import stack_check
from ..constraints.asked import constraint_tables
from ..measure.margin import margin_note


def determinism_spread(rows: list[Row]) -> list[dict[str, Any]]:
    """Each repeated arm's peaks, one per fresh process, and their spread in percent."""
    out = []
    for index in sorted({r.index for r in rows}):
        mine = sorted((r for r in rows if r.index == index), key=lambda r: r.repeat or 0)
        peaks = [r.real_peak if r.measured else None for r in mine]
        nums = [p for p in peaks if p]
        out.append({"row": mine[0], "peaks": peaks, "pids": [r.ran.pid for r in mine],
                    "statuses": [r.status for r in mine],
                    "spread_pct": (max(nums) - min(nums)) / min(nums) * 100 if len(nums) >= 2 else None})
    return out


def models_in(rows: list[Row]) -> list[str]:
    return list(dict.fromkeys(r.label for r in rows))


SWEEP_COLUMNS = [("seq", 6), ("realised", 8), ("batch", 5), ("predicted GB", 12), ("real peak GB", 13),
                 ("pred/real", 9), ("corrected GB", 12), ("corr/real", 9), ("A10G peak GB", 12), ("vs A10G", 8), ("14xE GB", 8),
                 ("non-logits GB", 13), ("over-est", 8), ("copy fits", 9), ("status", 7)]


SWEEP_LEGEND = ("corrected: this tool's estimator (issue395.estimate), from the model's public config "
                "alone; 14xE: Soup's logits charge (E = seq x vocab x batch); non-logits: predicted - 14xE; "
                "over-est: non-logits / (real peak - 12xE); copy fits: would a retained bf16 logits "
                "copy fit under the real peak (14xE <= real peak)")


#: Soup's pre-flight in a CPU dry run reads the model's weights as they load there, float32, so its
#: number is not the one its gate computes on CUDA (issue 29: 3.16 GB against --estimate's 2.47).
DRY_RUN_SOUP = ("dry run: Soup's own number in this CPU setup budgets float32 weights (its CPU load); on CUDA "
                "its gate computes another: --estimate (--config FILE) gives that one")


def peak_cell(r: Row) -> str:
    """The real peak, or why there is none: a row with no measurement never shows a figure."""
    return gb(r.real_peak) if r.measured else r.status if r.failure else "n/a (dry run)" if r.dry_run else "-"


def sweep_cells(r: Row, env: Optional[dict] = None) -> dict[str, str]:
    """A sweep row's cells by column name (the text table and the markdown pick by name)."""
    void = "VOID" if r.status == "VOID" else None
    flag = r.retained_copy_would_fit
    return dict(zip((name for name, _ in SWEEP_COLUMNS), [
        str(r.seq), "-" if r.realised is None else str(r.realised), str(r.batch), gb(r.predicted),
        peak_cell(r), void or ratio(r.pred_over_real), gb(corrected(r, env)), void or ratio(corrected_ratio(r, env)),
        gb(r.record_peak), void or ratio(r.vs_record), gb(r.logits14, 3), gb(r.nonlogits_modelled, 3),
        void or ratio(r.nonlogits_overestimate), "-" if flag is None else ("yes" if flag else "no"), r.status],
        strict=True))


def sweep_table(rows: list[Row], env: Optional[dict] = None) -> str:
    """One section per model; seq and realised lead, as in the record."""
    out = []
    for model in models_in(rows):
        # the record's models at the protocol's adapter only (a --config arm on one is the user's)
        record = any(r.model_key in SHAPES and r.config is None for r in rows if r.label == model)
        out.append(f"{model}  (predicted: Soup's estimator; real peak: measured here; corrected: this tool's "
                   "estimator" + ("; A10G: the record)" if record else "; no A10G record for this model)"))
        out += table(SWEEP_COLUMNS, [list(sweep_cells(r, env).values()) for r in rows if r.label == model]) + [""]
    out += [SWEEP_LEGEND, overestimate_line(rows), corrected_line(rows, env)]
    if any(r.dry_run for r in rows):
        out.append(DRY_RUN_SOUP)
    notes = [f"  {r.label} seq {r.seq} batch {r.batch}: {r.status} - {r.error or ''}"
             + (f" (asked for {r.oom_request / GB:.2f} GB)" if r.oom_request else "")
             for r in rows if r.failure]
    notes += [f"  {r.label} seq {r.seq} batch {r.batch}: UNDER by Soup's own pre-flight in this setup "
              f"({gb(r.soup_predicted)} GB, {ratio(r.margin_ratio)} of the real peak); pred/real above "
              f"is the grid-convention estimate ({ratio(r.pred_over_real)})"
              for r in rows if r.status == "UNDER" and r.pred_over_real >= 1]
    notes += [f"  {r.label} seq {r.seq}: teardown error (measurement kept): {r.ran.teardown_error}"
              for r in rows if r.ran.teardown_error]
    notes += [f"  {r.label} seq {r.seq} batch {r.batch}: VOID - realised {list(r.realised_rows)} "
              f"(width {r.realised_width}) != requested {r.seq}; no ratio is printed for it"
              for r in rows if r.status == "VOID"]
    return "\n".join(out + (["notes:"] + notes if notes else []))


def overestimate_summary(rows: list[Row]) -> Optional[dict[str, Any]]:
    vals = [r.nonlogits_overestimate for r in rows if r.nonlogits_overestimate is not None]
    return {"n": len(vals), "mean": statistics.fmean(vals),
            "pstdev": statistics.pstdev(vals)} if vals else None


def overestimate_line(rows: list[Row]) -> str:
    s, rec = overestimate_summary(rows), RECORD_A10G_OVERESTIMATE
    if s is None:
        return (f"non-logits over-estimate: no measured rows (record: mean {rec['mean']:.3f}x, "
                f"pstdev {rec['pstdev']:.4f})")
    return (f"non-logits over-estimate over {s['n']} measured rows: mean {s['mean']:.3f}x, population "
            f"stdev {s['pstdev']:.4f} (record, 10 rows: mean {rec['mean']:.3f}x, pstdev {rec['pstdev']:.4f})")


def attribution_table(rows: list[Row], control: Optional[dict[str, Any]]) -> str:
    out = ["peak attribution (allocator history around the one step; measured here)"]
    if control is not None:
        out.append(f"positive control: {'PASSED' if control.get('passed') else 'FAILED'} - holding one "
                   f"extra bf16 logits copy across backward showed {control.get('extra_bf16_blocks')} "
                   "more bf16 logits-shaped block(s) at the peak (exactly 1 expected)")
    cells = []
    for r in rows:
        a = r.attribution
        if not a:
            continue
        share = (a["logits_bf16"]["bytes"] + a["logits_fp32"]["bytes"]) / (a["replayed_peak"] or 1)
        other = ", ".join(f"{k}: {v['count']}/{v['bytes'] / GB:.3f}" for k, v in a["other_groups"].items())
        caveat = ("history incomplete" if not a.get("complete") else "no positive control ran"
                  if control is None else "control failed" if not control.get("passed") else None)
        cells.append([r.label, str(r.seq), str(r.batch), str(a["logits_bf16"]["count"]),
                      gb(a["logits_bf16"]["bytes"], 3), str(a["logits_fp32"]["count"]),
                      gb(a["logits_fp32"]["bytes"], 3), f"{share:.1%}", gb(a["resident_at_peak"], 3),
                      (f"{caveat}: not a finding; " if caveat else "") + other])
    cols = [("model", 13), ("seq", 5), ("batch", 5), ("bf16 logits", 11), ("bf16 GB", 8),
            ("fp32 logits", 11), ("fp32 GB", 8), ("logits share", 12), ("resident GB", 11),
            ("other (count, GB)", -40)]
    return "\n".join(out + table(cols, cells))


def measure_table(m: dict[str, Any]) -> str:
    rec = RECORD_MEASURE
    fmt = lambda v: v if isinstance(v, str) else ("-" if v is None else f"{float(v):.4f}")  # noqa: E731
    c = m["constants"]
    cells = [[f"default, run {i}", fmt(v), fmt(rec["repeat"])] for i, v in enumerate(m["repeats"], 1)]
    cells.append(["spread (max - min)", fmt(m["spread"]), fmt(rec["spread"])])
    cells += [[f"vocab {v}", fmt(x), fmt(rec["vocab"].get(int(v)))] for v, x in m["by_vocab"].items()]
    return "\n".join([
        "--measure: bytes per logit element (Soup's constants; Soup's probe measured here; the A10G record)",
        f"  LOGITS_BYTES_PER_ELEMENT      (Soup, shipped) {c['LOGITS_BYTES_PER_ELEMENT']}",
        f"  LOGITS_LOSS_BYTES_PER_ELEMENT (Soup, shipped) {c['LOGITS_LOSS_BYTES_PER_ELEMENT']}",
    ] + table([("probe", -22), ("measured", 20), ("A10G record", 20)], cells, indent="  "))


def sdpa_table(s: dict[str, Any]) -> str:
    seqs = [int(x) for x in s["seqs"]]
    cells = []
    for backend in SDPA_BACKENDS:
        rec = RECORD_SDPA_MB.get(backend)
        row = [backend]
        for q, v in zip(seqs, s["extra_mb"][backend]):
            mine = v if isinstance(v, str) else f"{v:.1f}"
            theirs = f"{rec[SDPA_SEQS.index(q)]:.1f}" if rec and q in SDPA_SEQS else "-"
            row.append(f"{mine:>8} | {theirs:>8}")
        cells.append(row)
    return "\n".join(
        ["--sdpa: extra allocation over the baseline, MB (measured here | A10G record); "
         f"bf16 query (1, {SDPA_HEADS}, seq, {SDPA_HEAD_DIM}), causal self-attention"]
        + table([("backend", -14)] + [(f"seq {q}", 20) for q in seqs], cells, indent="  ")
        + ["  record: default 2.4 to 7.3 MB, never the math path; math is the positive control "
           "(the seq^2 cost is real)"])


def determinism_table(rows: list[Row]) -> str:
    out = ["--determinism: the same arm in fresh processes (measured here | A10G record)"]
    for entry in determinism_spread(rows):
        r = entry["row"]
        peaks = ", ".join("-" if p is None else f"{p / GB:.4f}" for p in entry["peaks"])
        rec = RECORD_DETERMINISM.get((r.model_key, r.seq)) if r.batch == 1 else None
        findings = [f"repeat {i} {st}" for i, st in enumerate(entry["statuses"], 1)
                    if st not in ("ok", "dry-run")]
        out.append(f"  {r.label} seq {r.seq} batch {r.batch}: peaks {peaks} GB (pids "
                   f"{','.join(str(p) for p in entry['pids'])}); spread "
                   + ("-" if entry["spread_pct"] is None else f"{entry['spread_pct']:.2f}%")
                   + " | record " + (f"{rec[0]:.4f}, {rec[1]:.4f} GB, spread {rec[2]:.2f}%" if rec else "-")
                   + (f"; {', '.join(findings)}" if findings else ""))
    return "\n".join(out)


MAP_COLUMNS = [("family", -22), ("quant", 5), ("seq", 6), ("batch", 5), ("realised", 8),
               ("LoRA targets", -15), ("record-conv GB", 14), ("Soup's own GB", 13), ("own - conv MB", 13),
               ("real peak GB", 13), ("lower/real", 10), ("corrected GB", 12), ("corr/real", 9), ("status", 8)]


MAP_LEGEND = ("record-conv: Soup's estimator fed the grid's figures (the record's convention); Soup's own: "
              "the number Soup's pre-flight computed in this very setup (the one its gate uses; on a "
              "CPU dry run it budgets float32 weights); lower/real: the lower of the two over the real "
              "peak; UNDER: either is below it; corrected: this tool's estimator (issue395.estimate) from "
              "the family's public config alone, and corr/real its ratio")


def map_table(rows: list[Row], env: Optional[dict] = None) -> str:
    """The margin map, one row per arm, with the same guard and statuses as the sweep."""
    cells = []
    for r in rows:
        # a resident row: Soup's resident gate is its own number, and the grid's streamed convention is no figure of its run
        conv, own = (None, r.soup_resident.peak) if r.soup_resident else (r.predicted, r.soup_predicted)
        diff = f"{(own - conv) / 1e6:+.1f}" if own and conv else "-"
        cells.append([r.label, r.quant, str(r.seq), str(r.batch), "-" if r.realised is None else str(r.realised),
                      ",".join(r.targets) or "-", gb(conv), gb(own), diff, peak_cell(r),
                      "VOID" if r.status == "VOID" else ratio(r.margin_ratio), gb(corrected(r, env)),
                      "VOID" if r.status == "VOID" else ratio(corrected_ratio(r, env)), r.status])
    notes = [f"  {r.label} {r.quant} seq {r.seq} batch {r.batch}: {r.status} - {r.error}"
             for r in rows if r.failure and r.error]
    legend = ([MAP_LEGEND] + ([TASK_LEGEND] if any(r.task for r in rows) else [])
              + ([RESIDENT_LEGEND] if any(r.soup_resident for r in rows) else []))
    return "\n".join(["margin map (record-conv and Soup's own: computed by Soup; real peak: measured here)"]
                     + table(MAP_COLUMNS, cells) + legend + (["notes:"] + notes if notes else []))


TASK_LEGEND = ("a task after the family (dpo, orpo, simpo, kto): Soup's own task; record-conv is Soup's estimator "
               "at the rows its setup counts for it (2 x batch for dpo, orpo, simpo), and lower/real is Soup's own "
               "number alone over the real peak")


RESIDENT_LEGEND = ("[resident]: training.stream_layers off, every layer on the card ([resident+gc]: with "
                   "training.gradient_checkpointing); Soup's own is its resident gate's number (commands/train.py's input, "
                   "hardware_fit.estimate_peak_vram_gb: computed by Soup), lower/real that number over the real peak, and "
                   "record-conv (a streamed run's convention) does not apply; corrected: this tool's resident estimate "
                   "(issue395.estimator.resident) where it models the run (LoRA and QLoRA on dense "
                   "families; past a sliding window only with checkpointing), else blank")


def resident_gate_table(rows: list[Row], cards: Optional[list] = None) -> str:
    """Soup's resident gate beside each resident row's real peak: its number and its number with the 10%
    margin (computed by Soup), its verdict on this card (Soup's own decide_hardware_fit, where it ran on
    CUDA), and, on the named cards, the smallest one it admits the run on where the measured peak alone is
    past that card's total memory (a run its gate admits that cannot fit), or the largest it refuses where
    the measured peak fits inside the card (a run it refuses that fits, before the CUDA context)."""
    from ..estimator.cards import CARDS

    named = sorted(cards or CARDS.values(), key=lambda c: c.total_bytes)
    cells = []
    for r in [r for r in rows if r.soup_resident]:
        g = r.soup_resident
        with_margin = g.peak * 1.1 if g.peak else None  # Soup's VRAM_SAFETY_MARGIN, as decide_hardware_fit adds it
        wrong = "-"
        if with_margin and r.measured:
            admitted = [c for c in named if with_margin <= c.total_bytes - c.hidden_bytes]
            dies = [c for c in admitted if r.real_peak > c.total_bytes - c.hidden_bytes]
            refused = [c for c in named if with_margin > c.total_bytes - c.hidden_bytes
                       and r.real_peak <= c.total_bytes - c.hidden_bytes]
            wrong = (f"admits on {dies[0].name}, peak past its total" if dies else
                     f"refuses on {refused[-1].name}, peak inside it" if refused else "right on every named card")
        verdict = "-" if g.admits is None else "admits" if g.admits else "REFUSES"
        cells.append([r.label, r.quant, str(r.seq), str(r.batch), gb(g.peak), gb(with_margin and round(with_margin)),
                      peak_cell(r), ratio(r.margin_ratio), verdict, wrong])
    if not cells:
        return ""
    return "\n".join(["Soup's resident gate (its number and margin: computed by Soup; real peak: measured here)"] + table(
        [("family", -26), ("quant", 5), ("seq", 6), ("batch", 5), ("Soup GB", 8), ("+10% GB", 8),
         ("real peak GB", 13), ("Soup/real", 9), ("this card", 9), ("on the named cards", -40)], cells)
        + ["this card: Soup's decide_hardware_fit against the total memory it read here (- without CUDA, or where "
           "its CLI builds no input and skips its gate); named cards: issue395/estimator/cards.py, their totals as "
           "CUDA reports them, against the measured peak alone (the CUDA context comes on top)"])


def probe_table(rows: list[Row]) -> str:
    """Soup's stream_vram_probe per task (issue 51 item 5, Soup's #840): the peak Soup's probe function measured
    beside the real step's, their ratio, and Soup's verdict on the probe (decide_measured_fit against the free memory
    its gate read), flagged where it admits a run whose real step is past that free memory or refuses one inside it."""
    cells, ceilings = [], sorted({r.soup_probe.ceiling for r in rows if r.soup_probe and r.soup_probe.ceiling})
    for r in [r for r in rows if r.soup_probe]:
        p = r.soup_probe
        wrong = "-"
        if p.admits is not None and r.measured:
            wrong = ("admits, real peak past free" if p.admits and r.real_peak > p.available else
                     "refuses, real peak fits" if not p.admits and r.real_peak <= p.available else "right")
        cells.append([r.label, r.quant, str(r.seq), str(r.batch), str(p.rows or "-"),
                      "Soup's setup" if p.path == p.SOUP else "this tool", gb(p.peak) if p.peak else p.outcome or "-",
                      peak_cell(r), ratio(p.peak / r.real_peak if p.peak and r.measured else None), gb(p.available),
                      "-" if p.admits is None else "admits" if p.admits else "REFUSES", wrong])
    if not cells:
        return ""
    deferral = (f"; Soup defers its formula's refusal to the probe within {' or '.join(f'{c:g}' for c in ceilings)}x "
                "that free memory (stream_setup._PROBE_DEFERRAL_CEILING, read from Soup)") if ceilings else ""
    return "\n".join(["Soup's stream_vram_probe per task: probe number vs real step peak, ratio, would it admit "
                      "(probe: computed by Soup's measure_step_peak_bytes on this card; verdict: Soup's "
                      "decide_measured_fit; real peak: measured here)"] + table(
        [("family", -26), ("quant", 5), ("seq", 6), ("batch", 5), ("rows", 4), ("probed by", -12), ("probe GB", 8),
         ("real peak GB", 13), ("probe/real", 10), ("free GB", 8), ("verdict", 7), ("its verdict on the real peak", -28)],
        cells) + ["probed by: Soup's setup: training.stream_vram_probe set, Soup's setup ran its probe and decided the "
                  "run on it; this tool: Soup's probe function, called by this tool: Soup refuses the key for this task "
                  "(its schema; Soup's #840 asks for it), right after Soup's setup, at the rows Soup's setup counts for "
                  "the task, and Soup's decide_measured_fit on it (it gated nothing); rows: the probe's, each seq long; "
                  "free: what Soup's gate read (- without CUDA)" + deferral])


def map_summary(rows: list[Row]) -> str:
    """Per family and quantization: rows, the thinnest and widest margin and where, UNDERs."""
    cells = []
    for fam in models_in(rows):
        for quant in QUANTS:
            mine = [r for r in rows if r.label == fam and r.quant == quant]
            if not mine:
                continue
            measured = [r for r in mine if r.measured]
            lo = min(measured, key=lambda r: r.margin_ratio, default=None)
            hi = max(measured, key=lambda r: r.margin_ratio, default=None)
            where = lambda r: f"{ratio(r.margin_ratio)} @ {r.seq}x{r.batch}" if r else "-"  # noqa: E731
            others = {st: sum(1 for r in mine if r.status == st) for st in ("REFUSED", "SKIPPED", "OOM",
                                                                            "FAILED", "VOID", "dry-run")}
            cells.append([fam, quant, ",".join(mine[0].targets), f"{len(measured)}/{len(mine)}", where(lo),
                          where(hi), str(sum(1 for r in mine if r.status == "UNDER")),
                          ", ".join(f"{n} {st}" for st, n in others.items() if n) or "-"])
    return "\n".join(["summary per family and quantization (lower/real @ seq x batch)"] + table(
        [("family", -22), ("quant", 5), ("LoRA targets", -15), ("measured", 8), ("min lower/real", 18),
         ("max lower/real", 18), ("UNDER", 5), ("not measured", -30)], cells))


def map_verdict(rows: list[Row], env: Optional[dict] = None) -> str:
    published = [f"published figure: {name} {quant} batch {b} x seq {q}: {gb(peak)} GB allocated (Soup v0.73.1, "
                 f"issue #349); here {gb(r.real_peak)} GB ({r.real_peak / peak:.3f}x), Soup's own prediction "
                 f"{gb(r.soup_predicted)} GB ({ratio(r.margin_ratio)} of the peak here)"
                 for (name, quant, q, b), peak in PUBLISHED_NF4.items() for r in rows
                 if r.arm == (name, quant, q, b) and r.measured]
    return "\n".join(published + [verdict_line(rows), corrected_line(rows, env)])


def verdict_line(rows: list[Row]) -> str:
    under = [r for r in rows if r.status == "UNDER"]
    measured = [r for r in rows if r.measured]
    capped = [r for r in rows if r.oom_at_soup_cap]
    if capped:
        return (f"verdict: Soup UNDER-predicts {len(under) + len(capped)} of {len(measured) + len(capped)} judged "
                f"row(s): {len(capped)} raised OOM capped at Soup's own number (the run Soup admits dies: "
                + "; ".join(f"{r.label} {r.quant} seq {r.seq} batch {r.batch}" for r in capped) + ")"
                + ("" if not under else "; measured under: " + "; ".join(
                    f"{r.label} {r.quant} seq {r.seq} batch {r.batch} ({ratio(r.margin_ratio)})" for r in under)))
    if under:
        return (f"verdict: Soup UNDER-predicts {len(under)} of {len(measured)} measured row(s); the contract "
                "fails at " + "; ".join(f"{r.label} {r.quant} seq {r.seq} batch {r.batch} "
                                        f"({ratio(r.margin_ratio)})" for r in under))
    if not measured:
        return f"verdict: nothing measured ({len(rows)} row(s), none with a real peak): no verdict"
    thin = min(measured, key=lambda r: r.margin_ratio)
    return (f"verdict: Soup never under-predicts on the {len(measured)} measured row(s); the thinnest "
            f"margin is {ratio(thin.margin_ratio)} ({thin.label} {thin.quant} seq {thin.seq} batch {thin.batch})")


def corrected_line(rows: list[Row], env: Optional[dict] = None) -> str:
    """The corrected estimate's own verdict, counted apart from Soup's: an UNDER here is a bug in
    this tool's estimator, not a finding about Soup."""
    judged = [(r, corrected_ratio(r, env)) for r in rows]
    judged = [(r, v) for r, v in judged if v is not None]
    if not judged:
        return "corrected estimate: no measured row it covers"
    under = [(r, v) for r, v in judged if v < 1]
    if under:
        return (f"corrected estimate: UNDER on {len(under)} of {len(judged)} measured row(s): a BUG in this "
                "tool's estimator (issue395.estimate), not a finding about Soup: " + "; ".join(
                    f"{r.label} {r.quant} seq {r.seq} batch {r.batch} ({ratio(v)})" for r, v in under))
    lo = min(judged, key=lambda x: x[1])
    return (f"corrected estimate: never under on the {len(judged)} measured row(s) it covers; the thinnest is "
            f"{ratio(lo[1])} ({lo[0].label} {lo[0].quant} seq {lo[0].seq} batch {lo[0].batch}), the median "
            f"{ratio(statistics.median(v for _, v in judged))}")


MARGINS_LEGEND = ("missed = live - charged: + Soup charges less than is live at the peak (a shortfall "
                  "that eats the margin); - it charges more (slack); own/real: Soup's own pre-flight over the real peak")


def margins_table(margins: list[dict[str, Any]]) -> str:
    """Each attributed arm, in the grid's order: estimator term against the blocks live at the
    peak it charges, and why each thin margin is thin."""
    margins = sorted(margins, key=lambda m: map_order(m.get("model_key"), m["quant"], m["seq"], m["batch"],
                                                     m.get("task")))
    out = ["where the margin goes (allocator history of the tightest arm per family and every UNDER; "
           "charged: Soup's terms; live at the peak: measured here)"]
    cells = []
    for m in margins:
        for t in m["terms"]:
            per = f"{t['missed'] / t['per'][0]:+.2f} B {t['per'][1]}" if t["per"] else "-"
            cells.append([f"{m['model']} {m['quant']} {m['seq']}x{m['batch']}", ratio(m["ratio"]), t["term"],
                          gb(t["charged"]), gb(t["measured"]), f"{t['missed'] / 1e6:+.1f}", per,
                          "" if m["complete"] else "history incomplete: not a finding"])
    out += table([("arm", -34), ("own/real", 9), ("term", -11), ("charged GB", 10), ("live GB", 9),
                  ("missed MB", 10), ("missed per unit", -28), ("", -10)], cells)
    out.append(MARGINS_LEGEND)
    notes = [margin_note(m, margins) for m in margins if m["complete"]]
    out += [f"  {n}" for n in notes if n]
    return "\n".join(out)


def stack_words(env: dict[str, Any]) -> str:
    """A result's stack in one short phrase: GPU, soup-cli, torch, transformers."""
    return (f"{env.get('gpu') or 'no GPU'}, soup-cli {env.get('soup_cli') or '?'}, torch {env.get('torch') or '?'}, "
            f"transformers {env.get('transformers') or '?'}" + (", dry run" if env.get("dry_run") else ""))


def arm_pairs(a: Result, b: Result) -> list[tuple[Row, Row]]:
    """The measured rows of the same arm and repeat in both results (Row.arm: the arm's identity)."""
    index = {(r.arm, r.repeat): r for r in b.rows if r.measured}
    return [(r, index[(r.arm, r.repeat)]) for r in a.rows if r.measured and (r.arm, r.repeat) in index]


def compare_table(a: Result, b: Result, names: Optional[tuple[str, str]] = None) -> str:
    """The same arms' measured peaks in two saved results (e.g. before and after a change);
    ``names`` (the files) head each side's stack when the caller has them."""
    pairs = arm_pairs(a, b)
    quant = any(r.quant != "none" for r, _ in pairs)  # a sweep's compare keeps its columns
    cells = [[r.label] + ([r.quant] if quant else []) + [
        str(r.seq), str(r.batch), gb(r.real_peak), gb(o.real_peak), str(o.real_peak - r.real_peak),
        f"{(o.real_peak - r.real_peak) / r.real_peak:.3%}"] for r, o in pairs]
    same = sum(1 for r, o in pairs if o.real_peak == r.real_peak)
    width = max([13] + [len(r.label) for r, _ in pairs])
    names = names or ("A", "B")
    return "\n".join(
        [f"compare: A = {a.environment.get('arms')} ({a.environment.get('date')}), "
         f"B = {b.environment.get('arms')} ({b.environment.get('date')}); measured peaks",
         f"  A: {names[0] + ', ' if names[0] != 'A' else ''}{stack_words(a.environment)}",
         f"  B: {names[1] + ', ' if names[1] != 'B' else ''}{stack_words(b.environment)}"]
        + table([("model", width)] + ([("quant", 5)] if quant else []) + [
            ("seq", 5), ("batch", 5), ("A GB", 9), ("B GB", 9), ("B - A bytes", 12), ("diff", 8)],
            cells, indent="  ")
        + [f"  {same} of {len(cells)} shared arm(s) equal to the byte"])


#: Where a stack or its rows came from, when not from the run's own JSON (a row file's header): key, words.
PROVENANCE = (("stack_of", "stack of"), ("rows_from", "rows from"))


def header_line(env: dict[str, Any]) -> str:
    return (f"stack: torch {env['torch']} (CUDA {env.get('cuda') or 'none'}) | GPU {env.get('gpu') or 'none'}"
            + (f" (driver {env['driver']})" if env.get("driver") else "")
            + f" | transformers {env['transformers']} | trl {env['trl']} | peft {env['peft']}"
            + (f" | bitsandbytes {env['bitsandbytes']}" if env.get("bitsandbytes") else "")
            + f" | soup-cli {env['soup_cli']} | weights {env['weights']} | arms {env.get('arms')}"
            + (f" | {env['steps']} optimizer steps per arm" if env.get("steps", 1) != 1 else "")
            + (f" | linear attention: {env['linear_attention_kernels']}" if env.get("linear_attention_kernels")
               else "")
            + "".join(f" | {words} {env[key]}" for key, words in PROVENANCE if env.get(key)))


def stack_check_line(result: Result) -> str:
    """Whether the physics behind the result's corrected figures was verified on its stack."""
    return "stack check: " + stack_check(result.environment, nf4=any(r.quant == "nf4" for r in result.rows)).words()


def render_text(result: Result) -> str:
    """The header and every table the result holds, as the console shows them."""
    sweep_rows = [r for r in result.rows if r.repeat is None]
    repeats = [r for r in result.rows if r.repeat is not None]
    parts = [header_line(result.environment), stack_check_line(result)]
    if result.kind == "map":
        parts += ["", map_table(sweep_rows, result.environment), "", map_summary(sweep_rows)]
        gates, probes = resident_gate_table(sweep_rows), probe_table(sweep_rows)
        parts += (["", gates] if gates else []) + (["", probes] if probes else [])
        if result.margins:
            parts += ["", margins_table(result.margins)]
            anatomy = margin_anatomy(result.margins, result.environment.get("soup_cli"), result.environment.get("transformers"))
            parts += ["", anatomy] if anatomy else []
        parts += ["", map_verdict(sweep_rows, result.environment)]
        parts += [f"not on this map: {line}" for line in
                  filter(None, str(result.environment.get("not_on_map") or "").split(" | "))]
        sweep_rows = []
    if sweep_rows:
        parts += ["", sweep_table(sweep_rows, result.environment)]
        if any(r.attribution for r in sweep_rows):
            parts += ["", attribution_table(sweep_rows, result.control)]
    if repeats:
        parts += ["", determinism_table(repeats)]
    if result.measure:
        parts += ["", measure_table(result.measure)]
    if result.sdpa:
        parts += ["", sdpa_table(result.sdpa)]
    for text in constraint_tables(result.rows):
        parts += ["", text]
    carried = [r for r in result.rows if r.carried]
    if carried:
        parts += ["", f"carried: {len(carried)} row(s) began with bytes earlier arms left allocated "
                      f"(up to {max(r.carried for r in carried):,}); their peaks include them"]
    if result.interrupted:
        done = "set up (dry run: nothing measured)" if result.environment.get("dry_run") else "measured"
        parts += ["", f"interrupted: {len(result.rows)} row(s) {done} before the stop"]
    return "\n".join(parts) + "\n"
