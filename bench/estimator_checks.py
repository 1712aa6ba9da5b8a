"""The corrected estimator (issue395.estimator.estimate) against the committed H200 results, one check a
subcommand; each prints the table a committed file under results/ holds (tests compare the two) and writes
nothing:

  leave-one-out  the leave-one-family-out fit of the allocated allowance on the dense families' maps and
                 sweeps: results/estimator-leave-one-family-out.txt
  families       soup-cli 0.77.0's families and streaming modes: results/estimator-0.77.0-families.txt
  tasks          the preference losses (task anatomy arms and task maps): results/estimator-tasks.txt

    .venv/bin/python bench/estimator_checks.py leave-one-out|families|tasks

Each subcommand's function (cmd_*) says what it checks and on which committed results."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from issue395.estimator.estimate import estimate, estimate_key  # noqa: E402
from issue395.estimator.stacks import box_stack  # noqa: E402
from issue395.model.registry import MAP_FAMILIES, config_json, is_resident, stream_mode  # noqa: E402

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

#: soup-cli 0.77.0's new families (the families subcommand's arms, beside the streaming modes)
NEW = ("moonlight", "deepseek-v3", "kimi-k2", "qwen3.5", "qwen3.5-moe")


# --- leave-one-out ------------------------------------------------------------------------------------

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


def render_leave_one_out(table: list[dict], n_arms: int) -> str:
    lines = [f"Leave-one-family-out: issue395.estimate on {n_arms} distinct committed H200 arms "
             "(bench/estimator_checks.py leave-one-out)",
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


def cmd_leave_one_out() -> None:
    """Leave-one-family-out check of issue395.estimator.estimate on the committed H200 results.

    For each family: fit the allocated allowance (the estimator's only fitted allocated-bytes
    number) on the OTHER families' committed arms, predict the held-out family, and report
    Soup's own pred/real beside the corrected one. Writes nothing; prints the table that
    results/estimator-leave-one-family-out.txt holds (tests compare the two).

        .venv/bin/python bench/estimator_checks.py leave-one-out > results/estimator-leave-one-family-out.txt
    """
    arms = load_arms()
    sys.stdout.write(render_leave_one_out(leave_one_out(arms), len(arms)))


# --- families -----------------------------------------------------------------------------------------

def families_arms() -> list[dict]:
    """Every distinct measured arm of a new family or a streaming mode, with the file it is in (streamed: a resident
    row, full fine-tuning's among them, is the resident estimate's, tests/estimator/test_resident.py's)."""
    seen: dict = {}
    for path in sorted(ROOT.glob("results/*soup0.77.0*/*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("kind") == "estimate":
            continue
        for r in data.get("rows", []):
            family, stream = stream_mode(r["model_key"])
            # a preference task's arm is the tasks subcommand's
            if (r.get("real_peak") and not r.get("failure") and (family in NEW or stream) and not r.get("task")
                    and not is_resident(r["model_key"])):
                seen.setdefault((r["model_key"], r["quant"], r["seq"], r["batch"]), dict(r, file=path.parent.name))
    return list(seen.values())


def cmd_families() -> None:
    """The corrected estimator on soup-cli 0.77.0's families and streaming modes, family by family,
    against every peak measured on them (results/*soup0.77.0*/). Its only fitted number, the allocated
    allowance (issue395.estimator.estimate.ALLOCATED_ALLOWANCE_BYTES), was fitted on the dense families alone (the leave-one-out subcommand), so every
    arm here is outside that fit; the new terms were read from these arms' allocator histories,
    except the out-of-sample ones, whose estimates were committed before they ran.

        .venv/bin/python bench/estimator_checks.py families > results/estimator-0.77.0-families.txt

    Soup's own number beside it is the one each arm's setup computed; "equal" counts the arms where
    this tool, from the config alone, computes the same number to the byte."""
    by: dict = {}
    for r in families_arms():
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


# --- tasks --------------------------------------------------------------------------------------------

def tasks_arms() -> list[dict]:
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


def cmd_tasks() -> None:
    """The corrected estimator on the preference losses, against every committed task anatomy arm
    (results/task-anatomy-*/anatomy-*.json: one streamed step of SFT, DPO, ORPO, SimPO or KTO through
    Soup's real wrappers on an H200, its real allocated peak beside Soup's own number), then every
    measured row of the harness's task maps (results/task-map-*/task-map-*.json; ORPO and SimPO, Mistral-7B
    NF4 512 and DPO on the record's two models on 0.73.3 in results/tasks-rest-*/), which the terms were
    not read from: out of sample for every family but SmolLM2 and Qwen2.5. The task terms
    were read from these arms' allocator histories (the groups of live blocks at the peak) as bytes of
    live tensors, none fitted to them; the allowance is the dense SFT fit's (the leave-one-out subcommand).
    An arm whose step raised (0.73.3's DPO: its "ref" adapter left on meta) has no peak to hold.

        .venv/bin/python bench/estimator_checks.py tasks > results/estimator-tasks.txt

    The leave-one-family-out column: the median ratio over the other families' arms, where the
    estimator holds no number fitted to any arm (so it is the median without that family)."""
    rows = []
    for r in tasks_arms():
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


COMMANDS = {"leave-one-out": cmd_leave_one_out, "families": cmd_families, "tasks": cmd_tasks}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in COMMANDS:
        print(f"usage: bench/estimator_checks.py {'|'.join(COMMANDS)} (one subcommand; got {' '.join(argv) or 'none'})",
              file=sys.stderr)
        return 2
    COMMANDS[argv[0]]()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
