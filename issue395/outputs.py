"""Outputs beside the tables: the markdown record, the plot and the map's heatmap, and writes
that never replace what is not ours.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import tempfile
from typing import TYPE_CHECKING, Any, Optional

from .record import A10G_STACK, QUANTS, RECORD_A10G_PREDICTED, RECORD_RTX3050, SHAPES
from .result import Result, RowFile
from .tables import (
    SWEEP_LEGEND,
    attribution_table,
    determinism_table,
    gb,
    map_summary,
    map_table,
    map_verdict,
    measure_table,
    models_in,
    overestimate_line,
    ratio,
    sdpa_table,
    sweep_cells,
)

if TYPE_CHECKING:  # annotations only: these modules lie above this one
    from .options import Run


def render_markdown(result: Result) -> str:
    """The run as a record in the #395 record's style, ready to paste."""
    env, rows = result.environment, [r for r in result.rows if r.repeat is None]
    md = [f"# Second-stack VRAM record: {env.get('gpu') or 'no GPU'} ({str(env.get('date'))[:10]})", "",
          f"Stack: {env.get('gpu') or 'no GPU'}, driver {env.get('driver') or '-'}, CUDA "
          f"{env.get('cuda') or '-'}, torch {env['torch']}, transformers {env['transformers']}, "
          f"trl {env['trl']}, peft {env['peft']}, Python {env.get('python')}, Soup {env['soup_cli']}, "
          f"{env.get('platform')}. Weights: {env['weights']}. Arms: {env.get('arms')}.", "",
          f"Command: `{env.get('command')}`", "",
          f"Compared against the A10G record: {A10G_STACK}. Predicted = Soup's "
          "`estimate_stream_peak_vram`; real peak = `torch.cuda.max_memory_allocated()` around one "
          "optimizer step, measured by this run.", ""]
    if result.kind == "map":  # the map's own table: quant, Soup's own, the lower of the two
        md += ["```", map_table(rows, env), "", map_summary(rows), "", map_verdict(rows, env), "```", ""]
        rows = []
    for model in models_in(rows):
        names = ("seq", "realised", "batch", "predicted GB", "real peak GB", "pred/real", "corrected GB",
                 "corr/real", "A10G peak GB", "vs A10G")
        md += [f"## {model}", "", "| " + " | ".join(names) + " | verdict |", "|" + "---:|" * len(names) + "---|"]
        for r in (x for x in rows if x.model == model):
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
            md.append(f"| {r.model} | {r.seq} | {r.batch} | {c['14xE GB']} | {c['real peak GB']} | "
                      f"{c['copy fits']} | {c['A10G peak GB']} | {rec_fit} | {gb(r.nonlogits_modelled)} | "
                      f"{c['over-est']} | {ratio(rec_over)} |")
        md += ["", overestimate_line(rows), ""]
        if any(r.attribution for r in rows):
            md += ["## Peak attribution", "", "```", attribution_table(rows, result.control), "```", ""]
    repeats = [r for r in result.rows if r.repeat is not None]
    for title, text in (("Determinism", repeats and determinism_table(repeats)),
                        ("--measure", result.measure and measure_table(result.measure)),
                        ("--sdpa", result.sdpa and sdpa_table(result.sdpa))):
        if text:
            md += [f"## {title}", "", "```", text, "```", ""]
    if result.timings:
        md += ["## Harness cost", "", "```", json.dumps(result.timings, indent=2), "```", ""]
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
            series.setdefault((r.model, r.batch), []).append((r.seq, r.pred_over_real))
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
    ax.axhline(1.0, color="black", linewidth=1)
    ax.text(ax.get_xlim()[0], 0.99, " below 1.0: the prediction under-predicts (the #395 failure)",
            va="top", fontsize=8)
    ax.set(xlabel="sequence length (tokens)", ylabel="predicted / real peak VRAM",
           title=f"Soup stream pre-flight: predicted / real peak ({here}, {str(env.get('date'))[:10]})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def render_heatmap(result: Result, plt: Any) -> bytes:
    """The map as a heatmap of pred/real: family x seq, one panel per quantization and batch;
    a blank cell was not measured (its status says why in the table)."""
    rows = [r for r in result.rows if r.repeat is None]
    families, seqs = models_in(rows), sorted({r.seq for r in rows})
    panels = [(q, b) for q in QUANTS for b in sorted({r.batch for r in rows}) if any(
        r.quant == q and r.batch == b for r in rows)] or [("none", 1)]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels) + 2, 0.45 * len(families) + 2),
                             dpi=110, squeeze=False)
    for ax, (quant, batch) in zip(axes[0], panels):
        grid = [[next((r.margin_ratio for r in rows if r.model == f and r.seq == q and r.quant == quant
                       and r.batch == batch and r.measured), float("nan")) for q in seqs] for f in families]
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0.8, vmax=1.4, aspect="auto")
        for i, line in enumerate(grid):
            for j, v in enumerate(line):
                if v == v:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set(title=f"{quant}, batch {batch}", xticks=range(len(seqs)), xticklabels=seqs,
               yticks=range(len(families)), yticklabels=families if ax is axes[0][0] else [])
        ax.tick_params(labelsize=7)
    fig.colorbar(im, ax=list(axes[0]), label="pred / real (below 1.0: under-predicts)")
    fig.suptitle(f"Soup's pre-flight margin map ({result.environment.get('gpu') or 'this run'})")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def write_output(path: str, data: bytes) -> None:
    """Write an output without ever replacing what is not ours: a symlink is written
    through to its target, a device or FIFO is written to directly, and a regular file
    (or a new one) is replaced atomically through a temp file that never outlives a failure."""
    target = os.path.realpath(path)
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


def write_outputs(result: Result, run: "Run", rows_file: RowFile) -> Optional[str]:
    """--json, --markdown and --plot. Returns one line naming an output that could not be
    written and the one place the rows are kept, or None."""
    for flag, path, render in (
            ("--json", run.json, lambda: json.dumps(result.to_json(), indent=2, default=str) + "\n"),
            ("--markdown", run.markdown, lambda: render_markdown(result)),
            ("--plot", run.plot, lambda: render_plot(result))):
        if not path:
            continue
        try:
            data = render()
            write_output(path, data.encode("utf-8") if isinstance(data, str) else data)
        except OSError as exc:
            keep = (f"the rows are kept in {rows_file.path}" if rows_file.path and rows_file.ok
                    and rows_file.path.exists() else "the rows are in the tables printed above")
            return f"{flag} {path} could not be written ({exc.strerror or exc}); {keep}"
    rows_file.finish()
    return None
