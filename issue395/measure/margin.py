"""Where an arm's margin goes: Soup's estimator split into its terms, the blocks live at the peak
named by shape, and the arms worth attributing (the map's grid and shards: issue395.host.grid).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..constants import GB
from ..model.arm import Arm
from ..model.registry import Shape
from ..results.row import Row
from ..tasks import PROTOCOL_TASK
from .cuda import logits_kind


def shape_classes(shape: Shape, seq: int, batch: int) -> Callable[[int], str]:
    """Names a block live at the peak by its shape, for the estimator term meant to charge it:
    logits, activations (attention scores, small multiples of hidden or intermediate), rest."""
    elements, tokens = seq * shape.vocab * batch, seq * batch

    def classify(size: int) -> str:
        if logits_kind(size, elements):
            return "logits"
        if size % (seq * seq) == 0 and size // (seq * seq) <= 4 * batch * 64:
            return "activations"  # attention scores: batch x heads x seq^2
        for dim in (shape.intermediate, shape.hidden):
            if size % (tokens * dim) == 0 and size // (tokens * dim) <= 16:
                return "activations"
        return "rest"

    return classify


def estimator_terms(kwargs: dict[str, Any], predicted: int) -> dict[str, int]:
    """Soup's prediction split into its terms, by Soup's own term functions, from the exact
    arguments its pre-flight passed; "rest" is its fixed slack and any term a later Soup adds."""
    from soup_cli.utils import layer_stream as ls

    kw = kwargs
    chunk = kw.get("loss_chunk")  # 0.77.0's chunked loss: Soup charges the logits of one chunk
    logit_tokens = min(kw["seq_len"], chunk) if chunk else kw["seq_len"]
    terms = {
        "weights": kw["layer_bytes"] * kw["buffers"] + kw["extras_bytes"] + kw.get("large_layer_bytes", 0)
        + kw.get("persistent_bytes", 0),
        "logits": int(ls.estimate_logits_bytes(vocab_size=kw["vocab_size"], seq_len=logit_tokens,
                                               batch_size=kw.get("batch_size", 1),
                                               bytes_per_element=kw.get("logits_bytes_per_element"))),
        "activations": int(ls.estimate_activation_bytes(
            hidden_size=kw["hidden_size"], intermediate_size=kw["intermediate_size"],
            n_layers=kw["n_layers"], seq_len=kw["seq_len"], batch_size=kw.get("batch_size", 1),
            dtype=kw.get("dtype", "bfloat16")))
        + (int(ls.estimate_loss_chunk_bytes(hidden_size=kw["hidden_size"], seq_len=kw["seq_len"],
                                            batch_size=kw.get("batch_size", 1))) if chunk else 0),
    }
    terms["rest"] = predicted - sum(terms.values())  # optimizer state, slack, anything newer
    return terms


def margin_breakdown(row: Row) -> dict[str, Any]:
    """Where one arm's margin goes: each estimator term against the blocks live at the peak
    that it is meant to charge, and, where the margin is thin, which term misses what."""
    a = row.attribution
    classes, tokens = a.get("classes") or {}, row.seq * row.batch
    measured = {"weights": a["resident_at_peak"], "logits": classes.get("logits", 0),
                "activations": classes.get("activations", 0), "rest": classes.get("rest", 0)}
    charged = estimator_terms(row.gate and row.gate.terms, row.soup_predicted)
    per = {"logits": (row.elements, "per logits element"), "activations": (tokens, "per token")}
    terms = [{"term": t, "charged": charged[t], "measured": measured[t],
              "missed": measured[t] - charged[t], "per": per.get(t)} for t in charged]
    ratio = row.soup_predicted / row.real_peak
    return {"model": row.label, "model_key": row.model_key, **({"task": row.task} if row.task else {}), "quant": row.quant, "seq": row.seq,
            "batch": row.batch, "real_peak": row.real_peak, "soup_predicted": row.soup_predicted,
            "ratio": ratio, "complete": bool(a.get("complete")), "terms": terms,
            **({"physical": a["physical"]} if a.get("physical") else {}),
            **({"live_blocks": a["live_blocks"]} if a.get("live_blocks") else {}),
            "note": margin_note({"model": row.label, "quant": row.quant, "seq": row.seq, "batch": row.batch,
                                 "ratio": ratio, "terms": terms})}


def margin_arms(rows: list[Row]) -> list[Arm]:
    """The arms worth attributing: the tightest measured row of each family (and task), and every UNDER. Not a
    resident row's: the breakdown splits Soup's streamed estimator's terms, which a resident run has none of (the
    resident calls of results/resident-map-* ran each UNDER arm twice for nothing, before this). Nor a probed row's
    (training.stream_vram_probe): its step's margin is the plain key's, and a re-run would run Soup's probe again."""
    rows = [r for r in rows if r.soup_resident is None and r.soup_probe is None]
    picked: dict[int, Row] = {}
    for fam, name in dict.fromkeys((r.model_key, r.task) for r in rows):
        measured = [r for r in rows if (r.model_key, r.task) == (fam, name) and r.measured and r.soup_predicted]
        if measured:
            tight = min(measured, key=lambda r: r.margin_ratio)
            picked[tight.index] = tight
    picked.update({r.index: r for r in rows if r.status == "UNDER"})
    return [Arm.at(r.model_key, r.seq, r.batch, r.index, r.quant, r.task or PROTOCOL_TASK)
            for _, r in sorted(picked.items())]


def margin_note(m: dict[str, Any], margins: Optional[list[dict[str, Any]]] = None) -> Optional[str]:
    """Why a thin margin (under 5%) is thin, naming the term whose slack is gone: a scaling term
    (logits, activations) that charges less than is live; or, where only the fixed terms (weights,
    rest: the same tens of MB in every family) fall short, the scaling term left with no slack to
    cover them. ``margins`` (the other arms) give what that term usually spares."""
    if m["ratio"] >= 1.05 or not any(t["missed"] > 0 for t in m["terms"]):
        return None
    head = f"{m['model']} {m['quant']} seq {m['seq']} batch {m['batch']}: margin {m['ratio'] - 1:+.1%}; "
    scaling = [t for t in m["terms"] if t["per"]]
    short = max((t for t in scaling if t["missed"] > 0), key=lambda t: t["missed"], default=None)
    if short is not None:
        unit = short["per"]
        return (head + f"the {short['term']} term misses {short['missed'] / 1e6:.1f} MB "
                f"({short['missed'] / unit[0]:.2f} bytes {unit[1]}): charging that much more {unit[1]} "
                "would cover it")
    if not scaling:
        worst = max(m["terms"], key=lambda t: t["missed"])
        return head + f"the {worst['term']} term misses {worst['missed'] / 1e6:.1f} MB"
    gone = max(scaling, key=lambda t: t["missed"] / t["charged"] if t["charged"] else float("-inf"))
    unit = gone["per"]
    fixed = [t for t in m["terms"] if not t["per"] and t["missed"] > 0]
    usual = sorted(t["missed"] / t["per"][0] for o in (margins or []) if o is not m and o.get("complete")
                   for t in o["terms"] if t["term"] == gone["term"] and t["per"])
    spare = -gone["missed"]
    return (head + f"the {gone['term']} term's slack is gone: it charges {gone['charged'] / GB:.4f} GB and "
            f"{gone['measured'] / GB:.4f} GB is live ({spare / 1e6:.1f} MB, {spare / unit[0]:.2f} bytes "
            f"{unit[1]} to spare"
            + (f"; the other arms here spare {-usual[len(usual) // 2]:.2f}" if usual else "") + "), so nothing "
            "in it covers " + " and ".join(f"the {t['term']} term's {t['missed'] / 1e6:+.1f} MB" for t in fixed)
            + f" (a fixed cost every family shows, which the {gone['term']} slack covers elsewhere)")
