"""The corrected estimator on the preference losses, against every committed task anatomy arm
(results/task-anatomy-*/anatomy-*.json: one streamed step of SFT, DPO, ORPO, SimPO or KTO through
Soup's real wrappers on an H200, its real allocated peak beside Soup's own number), then every
measured row of the harness's task maps (results/task-map-*/task-map-*.json; ORPO and SimPO, Mistral-7B
NF4 512 and DPO on the record's two models on 0.73.3 in results/tasks-rest-*/), which the terms were
not read from: out of sample for every family but SmolLM2 and Qwen2.5. The task terms
were read from these arms' allocator histories (the groups of live blocks at the peak) as bytes of
live tensors, none fitted to them; the allowance is the dense SFT fit's (bench/leave_one_out.py).
An arm whose step raised (0.73.3's DPO: its "ref" adapter left on meta) has no peak to hold.

    .venv/bin/python bench/task_terms.py > results/estimator-tasks.txt

The leave-one-family-out column: the median ratio over the other families' arms, where the
estimator holds no number fitted to any arm (so it is the median without that family)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from issue395.estimator.estimate import estimate_key  # noqa: E402
from issue395.estimator.stacks import box_stack  # noqa: E402

def arms() -> list[dict]:
    """Every committed task anatomy arm whose step completed, with its file and family."""
    out = []

    def box_transformers(folder) -> str:  # the release the box ran, from its stack.txt (pip list)
        return box_stack((folder / "stack.txt").read_text())["transformers"]
    for path in sorted(ROOT.glob("results/task-anatomy-*/anatomy-*.json")):
        d = json.loads(path.read_text(encoding="utf-8"))
        if d.get("step_error"):
            continue
        release = "0.77.0" if path.stem.split("-")[1] == "077" else "0.73.3"
        family = path.stem.split("-")[3]  # the registry key the arm's checkpoint was built from
        out.append(dict(d, file=f"{path.parent.name}/{path.name}", release=release, family=family,
                        transformers=box_transformers(path.parent)))
    maps = [*ROOT.glob("results/task-map-*/task-map-*.json"), *ROOT.glob("results/tasks-rest-*/task-map-*.json"),
            *ROOT.glob("results/tasks-rest-*/mistral-*.json"), *ROOT.glob("results/tasks-rest-*/sweep-*.json")]
    for path in sorted(maps):
        d = json.loads(path.read_text(encoding="utf-8"))
        release = d.get("stack", {}).get("soup_cli") or d.get("environment", {}).get("soup_cli")
        transformers = d.get("environment", {}).get("transformers") or box_transformers(path.parent)
        for r in d.get("rows", []):
            if r.get("real_peak") and not r.get("failure"):
                out.append(dict(r, file=f"{path.parent.name}/{path.name}", release=release,
                                family=r["model_key"], task=r.get("task") or "sft", transformers=transformers))
    return out


def main() -> None:
    rows = []
    for r in arms():
        e = estimate_key(r["family"], quant=r["quant"], seq=r["seq"], batch=r["batch"], release=r["release"],
                         task=r["task"], targets=tuple(r.get("targets") or ()) or None, soup=False,
                         transformers=r["transformers"])  # Soup's own number is the one the arm's setup computed
        rows.append((r, e, e.corrected_predicted / r["real_peak"], r["soup_predicted"] / r["real_peak"]))
    print("corrected / real (this tool's estimator, from the config) and Soup's own / real (its setup's number), "
          "per task arm, H200, one streamed step")
    print(f"{'release':<8}{'task':<7}{'family':<12}{'quant':<6}{'seq x batch':>12}{'real GB':>10}"
          f"{'corrected GB':>14}{'corrected':>11}{'Soup':>8}  phase")
    for r, e, c, s in rows:
        print(f"{r['release']:<8}{r['task']:<7}{r['family']:<12}{r['quant']:<6}{r['seq']:>7}x{r['batch']:<4}"
              f"{r['real_peak'] / 1e9:>10.4f}{e.corrected_predicted / 1e9:>14.4f}{c:>10.4f}x{s:>7.3f}x  {e.phase}")
    every = [c for *_, c, _ in rows]
    families = sorted({r["family"] for r, *_ in rows})
    held = {f: statistics.median([c for r, _, c, _ in rows if r["family"] != f]) for f in families}
    print(f"all: {len(every)} arms; corrected under on {sum(1 for c in every if c < 1)}; min {min(every):.4f}x; "
          f"median {statistics.median(every):.4f}x; max {max(every):.4f}x; Soup under on "
          f"{sum(1 for *_, s in rows if s < 1)}")
    print("leave-one-family-out median (the other families' arms): "
          + "; ".join(f"without {f} {m:.4f}x" for f, m in held.items()))


if __name__ == "__main__":
    main()
