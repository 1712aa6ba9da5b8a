"""Issue 37: the stack a fresh `pip install "soup-cli[all]==0.77.0"` resolves (transformers 5.24.0, peft
0.21.2) against the pinned one (5.16.1, 0.20.0), arm by arm, on one H200 (soup-cli 0.77.0 on both).

Measured: the task map's families and tasks on the latest stack (results/fit4-pages-findmax-stack-*/call-3/
task-map-*latest.json: SFT, DPO, ORPO, SimPO at batch 1 and KTO at batch 2, seq 512 and 2048, bf16 and
NF4) beside the pinned stack's committed task maps (results/task-map-h200-soup0.77.0-*/task-map-*.json),
and Gemma-2-2B DPO bf16 1024x1 with the allocator's history on both stacks (…/call-3/anatomy-*-latest.json,
results/fit4-anatomy-findmax-*/call-1-2/anatomy-*-pinned.json), and SmolLM2 KTO NF4 at 512x2 and 2048x2 alone in
one process each on both stacks (…/call-5/), where the maps' rows were 1,024 B apart. Computed: this tool's corrected estimate
for each arm on the stack it ran (its transformers release picks the attention the estimator charges).
Every difference in bytes is set beside what the allocator's history shows.

    .venv/bin/python bench/stack_latest.py > results/stack-latest-vs-pinned.txt
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from issue395.estimator.estimate import estimate_key  # noqa: E402
from issue395.model.registry import FAMILIES, SHAPES  # noqa: E402

LATEST = next(ROOT.glob("results/fit4-pages-findmax-stack-h200-soup0.77.0-*")) / "call-3"
PINNED = next(ROOT.glob("results/task-map-h200-soup0.77.0-*"))
PINNED_ANATOMY = next(ROOT.glob("results/fit4-anatomy-findmax-h200-soup0.77.0-*")) / "call-1-2"
ISOLATED = LATEST.parent / "call-5"  # bench/gpu-stack-kto.sh: the KTO NF4 arms alone, on both stacks
NAME = {**{k: f.name for k, f in FAMILIES.items()}, **{k: s.name for k, s in SHAPES.items()}}
PACKAGES = ("torch", "transformers", "peft", "trl", "bitsandbytes", "soup_cli")


def rows(paths) -> tuple[dict, dict]:
    """Each measured row by arm (family, task, quant, seq, batch), and the environment of its file."""
    out, envs = {}, {}
    for path in paths:
        d = json.loads(path.read_text(encoding="utf-8"))
        for r in d["rows"]:
            if r.get("real_peak") and not r.get("failure"):
                key = (r["model_key"], r.get("task") or "sft", r["quant"], r["seq"], r["batch"])
                out[key], envs[key] = r, d["environment"]
    return out, envs


def corrected(key: tuple, r: dict, env: dict) -> int:
    family, task, quant, seq, batch = key
    return estimate_key(family, quant=quant, seq=seq, batch=batch, targets=tuple(r["targets"]) or None,
                        release=env["soup_cli"], soup=False, task=task,
                        transformers=env["transformers"]).corrected_predicted


def live_at_peak(d: dict) -> dict:
    """The replayed history's largest live blocks at the step's peak (the phase of the highest maximum):
    size -> count, the eight sizes holding the most bytes (bench/task_peak_anatomy.py's phases)."""
    return {int(s): n for s, n in max(d["phases"], key=lambda p: p["max"])["live"].items()}


def listed_difference(a: dict, b: dict) -> dict:
    """Sizes whose count differs between two such lists, where both would list them: a size's bytes above
    the smallest listed in each (a size left off one list holds fewer bytes than that list's last). Each
    list is the eight sizes holding the most, so a difference among the smaller sizes is not seen: what
    this returns is at least what differs."""
    floor = max(min(s * n for s, n in a.items()), min(s * n for s, n in b.items()))
    return {s: b.get(s, 0) - a.get(s, 0) for s in set(a) | set(b)
            if b.get(s, 0) != a.get(s, 0) and max(s * a.get(s, 0), s * b.get(s, 0)) > floor}


def main() -> None:
    new, new_env = rows(sorted(LATEST.glob("task-map-*latest.json")))
    old, old_env = rows(sorted(PINNED.glob("task-map-*.json")))
    # the one-process arms ran on the same wheels as each side's task map (bench/gpu-stack-*.sh)
    latest_tv, pinned_tv = next(iter(new_env.values()))["transformers"], next(iter(old_env.values()))["transformers"]
    env_line = lambda e: ", ".join(f"{p.replace('_', '-')} {e[p]}" for p in PACKAGES if e.get(p))  # noqa: E731
    print("the latest stack against the pinned one (one H200, soup-cli 0.77.0; real peaks measured, "
          "corrected computed by this tool for the stack each arm ran)")
    print(f"  latest: {env_line(next(iter(new_env.values())))} ({LATEST.parent.name}/{LATEST.name})")
    print(f"  pinned: {env_line(next(iter(old_env.values())))} ({PINNED.name})\n")
    shared = [k for k in new if k in old]
    print(f"{'family':<36}{'task':>6}{'quant':>6}{'seq':>6}{'batch':>6}{'pinned B':>16}{'latest B':>16}{'latest - pinned':>16}"
          f"{'corrected/latest':>17}")
    apart = []
    for k in shared:
        a, b = old[k]["real_peak"], new[k]["real_peak"]
        c = corrected(k, new[k], new_env[k])
        apart += [k] if a != b else []
        print(f"{NAME[k[0]]:<36}{k[1]:>6}{k[2]:>6}{k[3]:>6}{k[4]:>6}{a:>16,}{b:>16,}{b - a:>16,}{c / b:>16.4f}x")
    only = [k for k in new if k not in old]
    print(f"\n{len(shared)} arms measured on both stacks: {len(shared) - len(apart)} equal to the byte, {len(apart)} apart "
          f"({', '.join(sorted({f'{b - a:+,} B' for k in apart for a, b in [(old[k]['real_peak'], new[k]['real_peak'])]}))}: "
          + "; ".join(f"{NAME[k[0]]} {k[1]} {k[2]} {k[3]}x{k[4]}" for k in apart) + ")")
    iso = {(s, side): json.loads((ISOLATED / f"anatomy-kto-smol-nf4-{s}x2-{side}.json").read_text(encoding="utf-8"))
           for s in (512, 2048) for side in ("pinned", "latest")}
    print("  the same arm in one process each, on each stack, with the allocator's history "
          f"({ISOLATED.parent.name}/{ISOLATED.name}, SmolLM2-135M KTO NF4):")
    for s in (512, 2048):
        a, b = iso[(s, "pinned")], iso[(s, "latest")]
        c = estimate_key("smol", quant="nf4", seq=s, batch=2, release="0.77.0", task="kto", soup=False,
                         transformers=latest_tv).corrected_predicted
        print(f"    {s}x2: max_memory_allocated pinned {a['real_peak']:,} B, latest {b['real_peak']:,} B "
              f"({b['real_peak'] - a['real_peak']:+,}); replayed {a['replayed_peak']:,} B against {b['replayed_peak']:,} B "
              f"({b['replayed_peak'] - a['replayed_peak']:+,}); corrected {c:,} B, {c / b['real_peak']:.4f}x")
    key = ("smol", "kto", "nf4", 512, 2)
    one = iso[(512, "pinned")]["real_peak"]
    print(f"  so it is not the stack: the two maps' SmolLM2 row sits {old[key]['real_peak'] - one:+,} B (pinned) and "
          f"{new[key]['real_peak'] - one:+,} B (latest) from the one-process peak both stacks share: it moves with the "
          "process a map ran the arm in (a lane runs many arms in one), not with the package.")
    ratios = [corrected(k, new[k], new_env[k]) / new[k]["real_peak"] for k in new]
    print(f"\nmeasured on the latest stack only ({len(only)} arms: the pinned task maps did not run them): corrected/real "
          f"{min(corrected(k, new[k], new_env[k]) / new[k]['real_peak'] for k in only):.4f}x to "
          f"{max(corrected(k, new[k], new_env[k]) / new[k]['real_peak'] for k in only):.4f}x")
    print(f"all {len(new)} latest-stack arms: corrected/real {min(ratios):.4f}x to {max(ratios):.4f}x, "
          f"{sum(r < 1 for r in ratios)} under")

    pinned = json.loads((PINNED_ANATOMY / "anatomy-dpo-gemma2-bf16-1024x1-r8-pinned.json").read_text(encoding="utf-8"))
    latest = json.loads((LATEST / "anatomy-dpo-gemma2-bf16-1024x1-r8-latest.json").read_text(encoding="utf-8"))
    print("\nGemma-2-2B DPO bf16 1024x1, r8 on q,v, with the allocator's history on each stack (one process each, "
          "default allocator)")
    for label, d, tv in (("pinned", pinned, pinned_tv), ("latest", latest, latest_tv)):
        c = estimate_key("gemma2-2b", quant="none", seq=1024, batch=1, release="0.77.0", task="dpo", soup=False,
                         transformers=tv)
        print(f"  {label}: max_memory_allocated {d['real_peak']:,} B, replayed {d['replayed_peak']:,} B; corrected "
              f"(transformers {tv}) {c.corrected_predicted:,} B, {c.corrected_predicted / d['real_peak']:.4f}x, "
              f"eager masks charged {c.terms.get('eager_masks', 0):,} B")
    extra = listed_difference(live_at_peak(pinned), live_at_peak(latest))
    frames = {g["size"]: g["frames"] for g in latest["groups"]}
    print(f"  replayed latest - pinned: {latest['replayed_peak'] - pinned['replayed_peak']:+,} B; the live set at the "
          "peak differs by at least " + "; ".join(f"{n:+d} block(s) of {s:,} B ({', '.join(frames.get(s, {}))})"
                                         for s, n in sorted(extra.items())))


if __name__ == "__main__":
    main()
