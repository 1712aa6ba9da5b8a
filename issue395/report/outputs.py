"""Outputs beside the tables: the markdown record, the plot and the map's heatmap, and writes
that never replace what is not ours.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import stat
import sys
import tempfile
from typing import Any, Optional

from ..record import A10G_STACK, QUANTS, RECORD_A10G_PREDICTED, RECORD_RTX3050
from ..model.registry import SHAPES
from ..results.result import Result
from ..results.schema import SCHEMA, TOOL
from ..estimator.releases import PATCH_MARKER
from ..results.saved import RowFile
from ..text import gb, ratio
from ..constraints.cap import Cap
from .tables import (
    PROVENANCE,
    SWEEP_LEGEND,
    attribution_table,
    determinism_table,
    map_summary,
    map_table,
    probe_table,
    resident_gate_table,
    map_verdict,
    margins_table,
    measure_table,
    models_in,
    overestimate_line,
    sdpa_table,
    sweep_cells,
)


def command_words(env: dict[str, Any]) -> str:
    cmd = str(env.get("command"))
    return f"`{cmd}`" + (" (a --gpus child's command: the parent's is not kept in its result)"
                         if " --_child" in cmd else "")


def commands_lines(env: dict[str, Any], parts: Optional[list[tuple[str, dict]]], merged: int) -> list[str]:
    """Every command behind the result: one, or each merged part's (file: command)."""
    if parts:
        return [f"Commands (merged from {len(parts)} results):", ""] + [
            f"- `{os.path.basename(name)}`: {command_words(part)}" for name, part in parts] + [""]
    if merged > 1:  # a merged result whose parts are not at hand: say which command this is
        return [f"Command (the first of {merged} merged results; the others' are not kept in it): "
                f"{command_words(env)}", ""]
    return [f"Command: {command_words(env)}", ""]


TIMING_COLUMNS = (("total_s", "wall s"), ("imports_s", "imports s"), ("arms", "arms"), ("build_s", "builds s"),
                  ("sum_setup_s", "setup s"), ("sum_step_s", "step s"), ("sum_teardown_s", "teardown s"),
                  ("median_arm_overhead_s", "median arm overhead s"))


def timings_rows(t: dict[str, Any], label: str) -> list[tuple[str, dict[str, Any]]]:
    """A run's timings and, below it, each part's or child process's, labelled by place."""
    out = [(label, t)] if any(k in t for k, _ in TIMING_COLUMNS) else []
    for key, word in (("parts", "part"), ("children", "process")):
        for i, sub in enumerate(t.get(key) or [], 1):
            out += timings_rows(sub or {}, f"{label + ', ' if label != 'this run' else ''}{word} {i}")
    return out


def timings_table(t: dict[str, Any]) -> list[str]:
    """--json's timings as a markdown table: seconds, and the checkpoint builds summed."""
    def cell(v: Any) -> str:
        if isinstance(v, dict):
            return f"{sum(v.values()):.1f} ({len(v)})" if v else "-"
        return "-" if v is None else str(v)
    lines = ["| | " + " | ".join(name for _, name in TIMING_COLUMNS) + " |",
             "|---|" + "---:|" * len(TIMING_COLUMNS)]
    lines += [f"| {label} | " + " | ".join(cell(t.get(k)) for k, _ in TIMING_COLUMNS) + " |"
              for label, t in timings_rows(t, "this run")]
    return lines + ["", "builds s: checkpoints built (their count); setup, step and teardown: summed over arms."]


def render_markdown(result: Result, parts: Optional[list[tuple[str, dict]]] = None) -> str:
    """The run as a record in the #395 record's style, ready to paste. ``parts``: each merged
    result's file and environment, where the caller has them (--from-json A B)."""
    env, rows = result.environment, [r for r in result.rows if r.repeat is None]
    merged = len(result.timings.get("parts") or []) if result.timings else 0
    record = result.kind != "map" and any(r.record_peak is not None for r in rows)
    measured = any(r.measured for r in result.rows)
    how = ("; real peak = `torch.cuda.max_memory_allocated()` around one optimizer step, measured by this run"
           if measured else "; no peak was measured (dry run: everything but the CUDA step, on CPU), so there is "
           "no real peak and no ratio" if env.get("dry_run") else "; no peak was measured by this run")
    md = [f"# Second-stack VRAM record: {env.get('gpu') or 'no GPU'} ({str(env.get('date'))[:10]})", "",
          f"Stack: {env.get('gpu') or 'no GPU'}, driver {env.get('driver') or '-'}, CUDA "
          f"{env.get('cuda') or '-'}, torch {env['torch']}, transformers {env['transformers']}, "
          f"trl {env['trl']}, peft {env['peft']}, Python {env.get('python')}, Soup {env['soup_cli']}, "
          f"{env.get('platform')}. Weights: {env['weights']}. Arms: {env.get('arms')}."
          + "".join(f" {words.capitalize()}: {env[key]}." for key, words in PROVENANCE if env.get(key)), ""]
    md += commands_lines(env, parts, merged)
    md += [(f"Compared against the A10G record: {A10G_STACK}. " if record else "")
           + ("Predicted = Soup's `estimate_stream_peak_vram`" if result.kind != "map" else
              "Predicted = Soup's `estimate_stream_peak_vram` (record-conv) and Soup's own pre-flight")
           + how + ".", ""]
    if result.kind == "map":  # the map's own table: quant, Soup's own, the lower of the two
        md += ["```", map_table(rows, env), "", map_summary(rows)]
        gates, probes = resident_gate_table(rows), probe_table(rows)
        md += (["", gates] if gates else []) + (["", probes] if probes else [])
        if result.margins:
            md += ["", margins_table(result.margins)]
        md += ["", map_verdict(rows, env), "```", ""]
        rows = []
    for model in models_in(rows):
        names = ("seq", "realised", "batch", "predicted GB", "real peak GB", "pred/real", "corrected GB",
                 "corr/real", "A10G peak GB", "vs A10G")
        md += [f"## {model}", "", "| " + " | ".join(names) + " | verdict |", "|" + "---:|" * len(names) + "---|"]
        for r in (x for x in rows if x.label == model):
            c = sweep_cells(r, env)
            verdict = {"ok": "over-predicts, safe", "UNDER": "UNDER-predicts"}.get(r.status, r.status)
            md.append("| " + " | ".join([c[n] for n in names] + [verdict]) + " |")
        md.append("")
    if rows:
        md += ["## 14 x E against the real peak", "", SWEEP_LEGEND + ".", "",
               "| model | seq | batch | 14 x E GB | real peak GB | retained copy would fit | A10G real "
               "peak GB | A10G: would fit | non-logits modelled GB | over-estimate | A10G over-estimate "
               "(from its published peak) |", "|---|---:|---:|---:|---:|---|---:|---|---:|---:|---:|"]
        for r in rows:
            c, rec = sweep_cells(r, env), r.record_peak
            rec_over = r.overestimate_at(rec)
            rec_fit = "-" if rec is None or r.logits14 is None else ("yes" if r.logits14 <= rec else "no")
            md.append(f"| {r.label} | {r.seq} | {r.batch} | {c['14xE GB']} | {c['real peak GB']} | "
                      f"{c['copy fits']} | {c['A10G peak GB']} | {rec_fit} | {gb(r.nonlogits_modelled)} | "
                      f"{c['over-est']} | {ratio(rec_over)} |")
        md += ["", overestimate_line(rows), ""]
        if any(r.attribution for r in rows):
            md += ["## Peak attribution", "", "```", attribution_table(rows, result.control), "```", ""]
    repeats = [r for r in result.rows if r.repeat is not None]
    capped = [r for r in result.rows if Cap.carries(r)]
    for title, text in (("--cap", capped and Cap.table(capped)),
                        ("Determinism", repeats and determinism_table(repeats)),
                        ("--measure", result.measure and measure_table(result.measure)),
                        ("--sdpa", result.sdpa and sdpa_table(result.sdpa))):
        if text:
            md += [f"## {title}", "", "```", text, "```", ""]
    if result.timings:
        md += ["## Harness cost", ""] + timings_table(result.timings) + [""]
    return "\n".join(md)


def render_plot(result: Result) -> bytes:
    """pred/real against seq: this run, the A10G and RTX 3050 records, and the 1.0 line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    env = result.environment
    here = env.get("gpu") or "this run"
    if result.kind == "map":
        return render_heatmap(result, plt)
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    colours = {SHAPES["smol"].name: "tab:blue", SHAPES["qwen"].name: "tab:orange"}
    series: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for r in result.rows:
        if r.pred_over_real is not None and r.repeat is None:
            series.setdefault((r.label, r.batch), []).append((r.seq, r.pred_over_real))
    for (model, batch), pts in series.items():
        pts.sort()
        ax.plot(*zip(*pts), marker="o", linewidth=2, color=colours.get(model) if batch == 1 else None,
                label=f"{model}, {here} (this run)" + (f", batch {batch}" if batch != 1 else ""))
    for key in ("smol", "qwen"):
        pts = sorted((seq, v[1]) for (k, seq), v in RECORD_A10G_PREDICTED.items() if k == key)
        ax.plot(*zip(*pts), marker="s", linestyle="--", alpha=0.7, color=colours[SHAPES[key].name],
                label=f"{SHAPES[key].name}, A10G record")
    pts = sorted((seq, p / r) for (_, seq), (p, r) in RECORD_RTX3050.items())
    ax.plot(*zip(*pts), marker="^", linestyle=":", color="crimson", label="SmolLM2-135M, RTX 3050 record")
    if not series:
        none = not any(r.measured for r in result.rows)
        ax.text(0.3, 0.3, ("nothing measured by this run" + (" (dry run: no peak was measured)" if env.get("dry_run")
                                                               else "") if none else "no sweep row in this run")
                + ":\nthe records only",
                transform=ax.transAxes, ha="center", va="center", fontsize=11,
                bbox=dict(boxstyle="round", facecolor="lightyellow", edgecolor="grey"))
        here = f"{here}, nothing measured" if none else here
    ax.axhline(1.0, color="black", linewidth=1)
    ax.text(ax.get_xlim()[0], 0.99, " below 1.0: the prediction under-predicts (the #395 failure)",
            va="top", fontsize=8)
    ax.set(xlabel="sequence length (tokens)", ylabel="predicted / real peak VRAM",
           title=f"Soup stream pre-flight: predicted / real peak ({here}, {str(env.get('date'))[:10]})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata=PNG_MARK)
    plt.close(fig)
    return buf.getvalue()


#: The heatmap's scale: red below 1.0 (Soup under-predicts: the #395 failure), blue above, with
#: a step at exactly 1.0 so a 0.99 cell never shares a colour with a 1.01 one.
HEATMAP_LOW, HEATMAP_HIGH = 0.8, 1.4
NOT_MEASURED_GREY = "#c8c8c8"


def heatmap_norm_and_cmap(low: float = HEATMAP_LOW, high: float = HEATMAP_HIGH) -> tuple[Any, Any]:
    """A diverging scale centred at exactly 1.0: reds (darker further under) below, blues
    (darker further over) above, a light-red to light-blue step at 1.0 itself."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap, TwoSlopeNorm

    reds, blues = plt.get_cmap("Reds"), plt.get_cmap("Blues")
    n = 128
    colours = [reds(0.95 - 0.6 * i / (n - 1)) for i in range(n)] + [blues(0.25 + 0.7 * i / (n - 1)) for i in range(n)]
    return TwoSlopeNorm(vmin=min(low, 0.99), vcenter=1.0, vmax=max(high, 1.01)), ListedColormap(colours, "under_over")


def text_colour(rgba: Any) -> str:
    """Black on light cells, white on dark ones, by the cell's relative luminance."""
    def lin(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = (lin(c) for c in rgba[:3])
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.2 else "white"


def stack_title(env: dict[str, Any]) -> str:
    return (f"{env.get('gpu') or 'no GPU'} | soup-cli {env.get('soup_cli') or '?'} | torch {env.get('torch') or '?'}"
            f" | {str(env.get('date') or '')[:10]} | arms {env.get('arms')}")


def ratio_words(v: float, under: bool) -> str:
    """3 decimals; an UNDER gets as many more as it takes never to read 1.000."""
    for places in range(3, 7):
        text = f"{v:.{places}f}"
        if not under or float(text) < 1:
            return text
    return text


def heatmap_cells(rows: list[Any], quant: str) -> tuple[list[str], list[tuple[int, int]], dict]:
    """One panel's families (rows), seq x batch columns, and the row in each cell: every panel
    has the map's families and columns, so the panels line up (a cell a quantization's grid
    lacks stays blank)."""
    families = models_in(rows)
    columns = sorted({(r.seq, r.batch) for r in rows})
    return families, columns, {(r.label, r.seq, r.batch): r for r in rows if r.quant == quant}


def heatmap_figure(result: Result, plt: Any) -> Any:
    """The map as a heatmap of lower/real (the lower of Soup's two predictions over the real
    peak): family x (seq x batch), one panel per quantization. Red: under 1.0, an UNDER (also
    hatched, boxed and named); blue: over; grey with its status: in the grid, not measured
    (REFUSED, SKIPPED, OOM, FAILED, VOID, dry run); blank: not in the grid."""
    env = result.environment
    rows = [r for r in result.rows if r.repeat is None]
    quants = [q for q in QUANTS if any(r.quant == q for r in rows)]
    measured = [r.margin_ratio for r in rows if r.measured and r.margin_ratio is not None]
    norm, cmap = heatmap_norm_and_cmap(min(measured + [HEATMAP_LOW]), max(measured + [HEATMAP_HIGH]))
    shapes = [heatmap_cells(rows, q) for q in quants]
    ncols = max([len(c) for _, c, _ in shapes] + [1])
    heights = [max(len(f), 1) for f, _, _ in shapes] or [1]
    label_w = max([len(f) for fs, _, _ in shapes for f in fs] + [8]) * 0.075
    fig, axes = plt.subplots(len(heights), 1, squeeze=False, dpi=110, layout="constrained",
                             figsize=(max(7.5, label_w + 0.72 * ncols + 2.2), 2.1 + sum(0.42 * h + 0.9 for h in heights)),
                             gridspec_kw={"height_ratios": [h + 1.6 for h in heights]})
    dry = bool(env.get("dry_run"))
    title = "Soup's pre-flight margin map: the lower of Soup's two predictions / real peak (below 1.0: UNDER-predicts)"
    if not measured:
        title = ("Soup's pre-flight margin map: nothing measured"
                 + (" (dry run: set up on CPU, no peak was measured)" if dry else " (no arm has a real peak)"))
    fig.suptitle(title + "\n" + stack_title(env), fontsize=10)
    if not quants:
        axes[0][0].set_axis_off()
        axes[0][0].text(0.5, 0.5, "no rows in this result", ha="center", va="center", transform=axes[0][0].transAxes)
    for ax, quant, (families, columns, cell) in zip((a[0] for a in axes), quants, shapes):
        grid = [[cell[(f, q, b)].margin_ratio if (f, q, b) in cell and cell[(f, q, b)].measured else float("nan")
                 for q, b in columns] for f in families]
        ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto")
        ax.set_facecolor("white")
        for i, fam in enumerate(families):
            for j, (seq, batch) in enumerate(columns):
                r = cell.get((fam, seq, batch))
                if r is None:
                    continue  # not in the grid: left blank
                heatmap_cell(ax, r, i, j, cmap, norm)
        heatmap_axes(ax, quant, families, columns)
    if measured:
        from matplotlib.cm import ScalarMappable

        bar = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=[a[0] for a in axes], shrink=0.8,
                           label="pred / real (red, below 1.0: UNDER-predicts)")
        bar.ax.axhline(1.0, color="black", linewidth=1.5)
        bar.ax.tick_params(labelsize=7)
    fig.text(0.01, 0.0, "hatched and boxed: UNDER (Soup predicts less than the real peak); grey with its status: "
             "in the grid, not measured; blank: not in the grid" + ("" if measured else
             "; nothing measured: no ratio to colour"), fontsize=7, ha="left", va="top")
    return fig


def heatmap_cell(ax: Any, r: Any, i: int, j: int, cmap: Any, norm: Any) -> None:
    """One cell of the map: a measured arm's ratio in its colour (an UNDER hatched, boxed and named), an OOM
    at Soup's cap as the under-prediction it is, any other arm grey with its status."""
    from matplotlib.patches import Rectangle

    if r.measured:
        colour = cmap(norm(r.margin_ratio))
        under = r.status == "UNDER"
        if under:
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///",
                                   edgecolor="black", linewidth=2.2))
        ax.text(j, i, ("UNDER\n" if under else "") + ratio_words(r.margin_ratio, under), ha="center",
                va="center", fontsize=7, color=text_colour(colour),
                fontweight="bold" if under else "normal",
                bbox=dict(boxstyle="square,pad=0.1", facecolor=colour, edgecolor="none")
                if under else None)
    elif r.oom_at_soup_cap:  # no peak read, but above Soup's number: the under-prediction
        colour = cmap(norm(HEATMAP_LOW))
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=colour, hatch="///",
                               edgecolor="black", linewidth=2.2))
        ax.text(j, i, "UNDER\nOOM at\nSoup's cap", ha="center", va="center", fontsize=6,
                fontweight="bold", color=text_colour(colour),
                bbox=dict(boxstyle="square,pad=0.1", facecolor=colour, edgecolor="none"))
    else:
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=NOT_MEASURED_GREY,
                               edgecolor="white", linewidth=0.5))
        word = "dry run" if r.status == "dry-run" else r.status  # a FAILED dry run says so
        ax.text(j, i, word, ha="center", va="center", fontsize=6, color="black")


def heatmap_axes(ax: Any, quant: str, families: list[str], columns: list[tuple[int, int]]) -> None:
    """One panel's axes: seq x batch across, the families down, the quantization its title, white lines
    between the cells."""
    ax.set_xticks(range(len(columns)), [f"{q}\nx{b}" for q, b in columns])
    ax.set_yticks(range(len(families)), families)
    ax.set_xlim(-0.5, len(columns) - 0.5)
    ax.set_ylim(len(families) - 0.5, -0.5)
    ax.set_xlabel("seq x batch", fontsize=8)
    ax.set_ylabel("family", fontsize=8)
    ax.set_title(f"quantization: {quant}", fontsize=9)
    ax.tick_params(labelsize=7)
    ax.set_xticks([x - 0.5 for x in range(1, len(columns))], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, len(families))], minor=True)
    ax.grid(which="minor", color="white", linewidth=0.8)
    ax.tick_params(which="minor", length=0)


def render_heatmap(result: Result, plt: Any) -> bytes:
    """The map's heatmap (``heatmap_figure``) as PNG bytes."""
    fig = heatmap_figure(result, plt)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight", metadata=PNG_MARK)
    plt.close(fig)
    return buf.getvalue()


#: The PNG text chunk every plot this tool writes carries (its mark: ``OWN_MARKS``).
PNG_MARK = {"Software": f"{TOOL} (matplotlib)"}

#: What marks a file as one this tool wrote, read off its first ``MARK_BYTES``: a JSON whose first key is
#: "tool": TOOL (a saved result, --estimate's and --find-max's), --markdown's record (its heading), a PNG
#: whose Software chunk names the tool (--plot), a --soup-patch diff (it adds the marked module to soup_cli).
OWN_MARKS = (
    re.compile(rb'\A\s*\{\s*"tool"\s*:\s*"' + re.escape(TOOL.encode()) + rb'"'),
    re.compile(rb"\A# Second-stack VRAM record: "),
    re.compile(rb"\A\x89PNG\r\n\x1a\n.*?tEXtSoftware\x00" + re.escape(TOOL.encode()), re.S),
    re.compile(rb"\A--- .*?\n\+\+\+ b/soup_cli/.*?" + re.escape(PATCH_MARKER.encode()), re.S),
)
MARK_BYTES = 1 << 16
#: The words for a file an output would replace and this tool did not write (USAGE.md, "Files it writes").
NOT_OURS = "exists and is not this tool's own output, so it is never replaced"


class NotOurs(OSError):
    """An output's path holds a file this tool did not write: it is not replaced."""


def not_ours(path: str) -> bool:
    """Whether writing an output at ``path`` would replace a file this tool did not write: a non-empty
    regular file (a symlink's target) that carries none of ``OWN_MARKS``. Nothing there, an empty file, a
    device or a FIFO (written to directly, never replaced) are not."""
    target = os.path.realpath(path)
    try:
        st = os.stat(target)
    except OSError:  # nothing there (or no folder to hold it: said by the output's own checks)
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        return False
    try:
        with open(target, "rb") as fh:
            head = fh.read(MARK_BYTES)
    except OSError:
        return True  # there and unreadable: not known to be ours
    return not any(mark.search(head) for mark in OWN_MARKS)


def write_output(path: str, data: bytes) -> None:
    """Write an output without ever replacing what is not ours: a symlink is written
    through to its target, a device or FIFO is written to directly, a regular file this tool did
    not write (``not_ours``) is refused (``NotOurs``), and one it did (or a new one) is replaced
    atomically through a temp file that never outlives a failure."""
    if path == "-":  # the process's real stdout (the tables went to stderr)
        sys.__stdout__.buffer.write(data)
        sys.__stdout__.flush()
        return
    target = os.path.realpath(path)
    if not_ours(target):  # checked when settled too: a file put there while the run ran
        raise NotOurs(0, NOT_OURS, path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        with open(target, "wb") as fh:
            fh.write(data)
        return
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(target)}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)  # mkstemp makes 0600; an output gets the mode any new file would
        os.chmod(tmp, stat.S_IMODE(mode) if mode is not None else 0o666 & ~umask)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json(path: str, kind: str, data: dict) -> bool:
    """A mode's own --json (--estimate's, --find-max's): the envelope every saved result opens with (the
    tool, the schema, the kind), then ``data``. One line on stderr where it cannot be written (False)."""
    envelope = {"tool": TOOL, "schema": SCHEMA, "kind": kind, **data}
    try:
        write_output(path, (json.dumps(envelope, indent=2) + "\n").encode("utf-8"))
    except OSError as exc:
        print(f"error: --json {path} could not be written ({exc.strerror or exc})", file=sys.stderr)
        return False
    return True


def write_outputs(result: Result, outputs: Any, rows_file: RowFile,
                  parts: Optional[list[tuple[str, dict]]] = None) -> Optional[str]:
    """--json, --markdown and --plot (``outputs``: their paths; ``parts``: each merged saved result's
    file and stack, for the markdown's commands). Every output that can be written is; returns one
    line naming each that could not and the one place the rows are kept, or None."""
    failed = []
    for flag, path, render in (
            ("--json", outputs.json, lambda: json.dumps(result.to_json(), indent=2, default=str) + "\n"),
            ("--markdown", outputs.markdown, lambda: render_markdown(result, parts)),
            ("--plot", outputs.plot, lambda: render_plot(result))):
        if not path:
            continue
        try:
            data = render()
            write_output(path, data.encode("utf-8") if isinstance(data, str) else data)
        except OSError as exc:
            failed.append(f"{flag} {path} could not be written ({exc.strerror or exc})")
    if failed:
        keep = (f"the rows are kept in {rows_file.path}" if rows_file.path and rows_file.ok
                and rows_file.path.exists() else "the rows are in the tables printed above")
        return "; ".join(failed) + f"; {keep}"
    rows_file.finish()
    return None
