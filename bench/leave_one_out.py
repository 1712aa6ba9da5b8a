"""Leave-one-family-out check of issue395.estimator.estimate on the committed H200 results.

For each family: fit the allocated allowance (the estimator's only fitted allocated-bytes
number) on the OTHER families' committed arms, predict the held-out family, and report
Soup's own pred/real beside the corrected one. Writes nothing; prints the table that
results/estimator-leave-one-family-out.txt holds (tests compare the two).

    .venv/bin/python bench/leave_one_out.py > results/estimator-leave-one-family-out.txt
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from issue395.estimator.estimate import estimate  # noqa: E402
from issue395.model.registry import MAP_FAMILIES, config_json  # noqa: E402

#: The committed results whose rows carry Soup's captured kwargs (results/README.md): the maps
#: and the sweeps measured after the workspace teardown fix.
RESULT_FILES = (
    "margin-map-h200x2-soup0.73.3-f3ad9d2/map-2gpu.json", "margin-map-in-4-parts-h200-soup0.73.3-3238e1a-to-b3a7891/map-a.json",
    "margin-map-in-4-parts-h200-soup0.73.3-3238e1a-to-b3a7891/map-b.json", "margin-map-in-4-parts-h200-soup0.73.3-3238e1a-to-b3a7891/map-c.json",
    "margin-map-in-4-parts-h200-soup0.73.3-3238e1a-to-b3a7891/map-d.json", "untied-seq512-h200x2-soup0.73.3-and-0.77.0-f3ad9d2/map073-untied.json",
    "untied-seq512-h200x2-soup0.73.3-and-0.77.0-f3ad9d2/map077-untied.json", "landed-tree-check-h200-soup0.73.3-115b15d/map-carried.json",
    "margin-map-in-4-parts-h200-soup0.73.3-3238e1a-to-b3a7891/full-cold.json", "margin-map-in-4-parts-h200-soup0.73.3-3238e1a-to-b3a7891/full-warm.json",
    "two-gpu-record-h200x2-soup0.73.3-b3a7891/sweep-1gpu.json", "two-gpu-record-h200x2-soup0.73.3-b3a7891/sweep-2gpu-cold.json",
    "two-gpu-record-h200x2-soup0.73.3-b3a7891/sweep-2gpu.json", "scaling-h200x2-soup0.73.3-eb93db1/det6144.json",
    "scaling-h200x2-soup0.73.3-eb93db1/grid40-1gpu.json", "scaling-h200x2-soup0.73.3-eb93db1/grid40-2gpu.json",
    "scaling-h200x2-soup0.73.3-eb93db1/sweep-1gpu-cold.json", "scaling-h200x2-soup0.73.3-eb93db1/sweep-1gpu.json",
    "scaling-h200x2-soup0.73.3-eb93db1/sweep-2gpu.json",
    # measured after the estimator was built, then added: seq 512 and 1024 on every family
    "cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37/map-512-1024.json",
)


def configs() -> dict:
    """Every dense family's public config, from the one registry (issue395/model/registry.py)."""
    return {k: config_json(k) for k in MAP_FAMILIES + ("llama31-8b",)}


def load_arms(root: Path = ROOT / "results") -> list[dict]:
    """One dict per distinct arm (release, family, quant, seq, batch, targets): measured rows only
    (real_peak, no failure, status ok/UNDER, realised == requested); duplicates keep the highest
    real peak and Soup's captured prediction and kwargs."""
    arms: dict = {}
    for name in RESULT_FILES:
        doc = json.loads((root / name).read_text(encoding="utf-8"))
        release, transformers = doc["environment"]["soup_cli"], doc["environment"]["transformers"]
        for r in doc["rows"]:
            status = (r.get("derived") or {}).get("status")
            if (not r.get("real_peak") or r.get("failure") or r.get("error")
                    or status not in ("ok", "UNDER") or r.get("realised_width") not in (None, r["seq"])):
                continue
            key = (release, r["model_key"], r.get("quant") or "none", r["seq"], r["batch"],
                   tuple(r["targets"]))
            old = arms.get(key)
            if old is None or r["real_peak"] > old["real_peak"]:
                arms[key] = {"release": release, "transformers": transformers, "family": r["model_key"], "quant": key[2],
                             "seq": r["seq"], "batch": r["batch"], "targets": key[5],
                             "real_peak": r["real_peak"], "soup_predicted": r["soup_predicted"],
                             "soup_terms": r["soup_terms"]}
    return list(arms.values())


def predict(arm: dict, cfgs: dict, allowance: int | None = None):
    return estimate(cfgs[arm["family"]], quant=arm["quant"], seq=arm["seq"], batch=arm["batch"],
                    targets=arm["targets"], release=arm["release"], allowance=allowance, transformers=arm["transformers"],
                    soup=False)  # the physics alone: each arm's Soup number is the one it captured


def fit_allowance(arms: list[dict], cfgs: dict) -> int:
    """The smallest allocated allowance under which no arm is under-predicted (0.5 MB steps)."""
    worst = max(a["real_peak"] - predict(a, cfgs, allowance=0).corrected_predicted for a in arms)
    return max(0, -(-worst // 500_000) * 500_000)


def leave_one_out(arms: list[dict] | None = None, cfgs: dict | None = None) -> list[dict]:
    cfgs, arms = cfgs or configs(), arms or load_arms()
    out = []
    for fam in dict.fromkeys(a["family"] for a in arms):
        mine = [a for a in arms if a["family"] == fam]
        allowance = fit_allowance([a for a in arms if a["family"] != fam], cfgs)
        soup = [a["soup_predicted"] / a["real_peak"] for a in mine]
        pred = [predict(a, cfgs, allowance).corrected_predicted for a in mine]
        ours = [p / a["real_peak"] for p, a in zip(pred, mine)]
        short = [a["real_peak"] - p for p, a in zip(pred, mine) if p < a["real_peak"]]
        out.append({"family": fam, "n": len(mine), "allowance": allowance, "under": len(short),
                    "worst_under": max(short, default=0),
                    "soup_min": min(soup), "soup_median": statistics.median(soup),
                    "corrected_min": min(ours), "corrected_median": statistics.median(ours),
                    "corrected_max": max(ours)})
    return out


def render(table: list[dict], n_arms: int) -> str:
    lines = [f"Leave-one-family-out: issue395.estimate on {n_arms} distinct committed H200 arms "
             "(bench/leave_one_out.py)",
             "pred/real = prediction / measured torch.cuda.max_memory_allocated(); "
             "Soup = Soup's own pre-flight (computed by Soup), corrected = this estimator's "
             "allocated peak with the allowance fitted on the other families",
             f"{'family':<12}{'n':>4}{'allowance MB':>14}{'Soup min':>10}{'Soup med':>10}"
             f"{'corr min':>10}{'corr med':>10}{'corr max':>10}{'under':>7}{'by MB':>7}"]
    for r in table:
        lines.append(f"{r['family']:<12}{r['n']:>4}{r['allowance'] / 1e6:>14.1f}"
                     f"{r['soup_min']:>10.4f}{r['soup_median']:>10.4f}{r['corrected_min']:>10.4f}"
                     f"{r['corrected_median']:>10.4f}{r['corrected_max']:>10.4f}{r['under']:>7}"
                     f"{r['worst_under'] / 1e6:>7.2f}")
    return "\n".join(lines) + "\n"


def main() -> int:
    arms = load_arms()
    sys.stdout.write(render(leave_one_out(arms), len(arms)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
