"""The corrected estimator on soup-cli 0.77.0's families and streaming modes, family by family,
against every peak measured on them (results/*soup0.77.0*/). Its only fitted number, the 6.0 MB
allocated allowance, was fitted on the dense families alone (bench/leave_one_out.py), so every
arm here is outside that fit; the new terms were read from these arms' allocator histories,
except the out-of-sample ones, whose estimates were committed before they ran.

    .venv/bin/python bench/new_families.py > results/estimator-0.77.0-families.txt

Soup's own number beside it is the one each arm's setup computed; "equal" counts the arms where
this tool, from the config alone, computes the same number to the byte."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from issue395.estimator.estimate import estimate_key  # noqa: E402
from issue395.model.registry import stream_mode  # noqa: E402

NEW = ("moonlight", "deepseek-v3", "kimi-k2", "qwen3.5", "qwen3.5-moe")


def arms() -> list[dict]:
    """Every distinct measured arm of a new family or a streaming mode, with the file it is in."""
    seen: dict = {}
    for path in sorted(ROOT.glob("results/*soup0.77.0*/*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("kind") == "estimate":
            continue
        for r in data.get("rows", []):
            family, stream = stream_mode(r["model_key"])
            # a preference task's arm is bench/task_terms.py's
            if r.get("real_peak") and not r.get("failure") and (family in NEW or stream) and not r.get("task"):
                seen.setdefault((r["model_key"], r["quant"], r["seq"], r["batch"]), dict(r, file=path.parent.name))
    return list(seen.values())


def main() -> None:
    by: dict = {}
    for r in arms():
        e = estimate_key(r["model_key"], quant=r["quant"], seq=r["seq"], batch=r["batch"],
                         targets=tuple(r["targets"]), release="0.77.0", soup=False)
        by.setdefault(r["model_key"], []).append((e.corrected_predicted / r["real_peak"],
                                                  r["soup_predicted"] / r["real_peak"],
                                                  "oos" if r["file"].startswith("out-of-sample") else "in"))
    print("corrected / real (this tool's estimator, from the config) and Soup's own / real (its setup's "
          "number), per family and streaming mode, soup-cli 0.77.0, H200")
    print(f"{'family and mode':<26}{'arms':>5}{'out of sample':>15}{'corrected min':>15}{'median':>9}"
          f"{'max':>9}{'Soup min':>10}{'Soup UNDER':>12}")
    for key in sorted(by):
        v = by[key]
        c = [x for x, _, _ in v]
        s = [y for _, y, _ in v]
        print(f"{key:<26}{len(v):>5}{sum(1 for *_, w in v if w == 'oos'):>15}{min(c):>14.4f}x"
              f"{statistics.median(c):>8.4f}x{max(c):>8.4f}x{min(s):>9.3f}x{sum(1 for y in s if y < 1):>12}")
    every = [x for v in by.values() for x, _, _ in v]
    print(f"all: {len(every)} arms; corrected under on {sum(1 for x in every if x < 1)}; median "
          f"{statistics.median(every):.4f}x; per-family medians at most "
          f"{max(statistics.median([x for x, _, _ in v]) for v in by.values()):.4f}x")


if __name__ == "__main__":
    main()
