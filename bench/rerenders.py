"""Renders of committed device results, each rerun against today's tree; each prints the text a committed
file under results/ holds (tests compare the two) and writes nothing:

  map-077       soup-cli 0.77.0's full default map, rendered from the row file its stopped run saved, and
                0.77.0 against 0.73.3 arm by arm: results/map-077-full-h200-soup0.77.0-684477c-render.txt
  stack-latest  issue 37: the latest stack soup-cli 0.77.0 resolves against the pinned one, arm by arm:
                results/stack-latest-vs-pinned.txt
  fit4          issue 34: the corrected estimate against the allocator's history of large adapters and
                accumulation, the pages under expandable segments and --find-max's measured limits:
                results/fit4-anatomy-findmax-render.txt

    .venv/bin/python bench/rerenders.py map-077|stack-latest|fit4

Each subcommand's function (cmd_*) says what it renders and from which committed results."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from issue395.estimator.estimate import estimate_key  # noqa: E402
from issue395.estimator.stacks import box_stack  # noqa: E402
from issue395.model.registry import FAMILIES, MAP_FAMILIES, RELEASE_FAMILIES, SHAPES  # noqa: E402
from issue395.record import MAP_BATCHES  # noqa: E402
from issue395.results.result import map_order  # noqa: E402
from issue395.host.grid import plan_map  # noqa: E402

NAME = {**{k: f.name for k, f in FAMILIES.items()}, **{k: s.name for k, s in SHAPES.items()}}

#: map-077: the stopped run's folder, and the 0.73.3 default grid it is set against (H200)
MAP077 = ROOT / "results" / "map-077-full-h200-soup0.77.0-684477c"
MAP073 = [ROOT / "results" / "margin-map-h200x2-soup0.73.3-f3ad9d2" / "map-2gpu.json",
          ROOT / "results" / "cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37" / "map-512-1024.json"]

#: fit4: issue 34's anatomy and find-max calls, and the next session's pages, find-max and stack calls
FIT4 = next(ROOT.glob("results/fit4-anatomy-findmax-h200-soup0.77.0-*"))
FIT4_ANATOMY = FIT4 / "call-1-2"  # its anatomy runs, default allocator (stack-latest's pinned Gemma-2 too)
FIT4_PAGES = next(ROOT.glob("results/fit4-pages-findmax-stack-h200-soup0.77.0-*"))
#: the next session's expandable-segments reruns of the arms that read under with the default allocator
PAGES2 = next(ROOT.glob("results/pages2-soup-patch-map4-modes-h200-soup0.77.0-*"))
#: every folder of pages-*.json (bench/gpu-fit4-pages.sh, PART=1 then PART=2)
PAGE_CALLS = (FIT4_PAGES / "call-1", PAGES2 / "call-1-3")
#: each folder's find-max calls, the later call first where one config ran twice (the run that answered)
FIND_MAX_CALLS = ((FIT4, ("call-3-4", "call-1-2")), (FIT4_PAGES, ("call-4", "call-2")))
#: the registry key each anatomy file's checkpoint was built from (bench/gpu-fit4-anatomy.sh's `an` lines)
FAMILY = {"llama32": "llama32-1b", "qwen": "qwen", "phi3": "phi3-mini", "qwen3": "qwen3-0.6b",
          "mistral": "mistral-7b", "gemma2": "gemma2-2b", "smol": "smol"}
#: the estimator's terms that are allocated before the first step (the replayed window's base)
RESIDENT_TERMS = ("pool", "extras", "lora_weights", "cublas_workspace", "resident_rounding")
STEP = {"seq": 64, "batch": 1}  # --find-max's resolution per axis

#: stack-latest: the latest stack's task maps and anatomy, the pinned stack's, and the KTO NF4 arms alone
LATEST = FIT4_PAGES / "call-3"
PINNED = next(ROOT.glob("results/task-map-h200-soup0.77.0-*"))
ISOLATED = FIT4_PAGES / "call-5"  # bench/gpu-stack-kto.sh: the KTO NF4 arms alone, on both stacks
PACKAGES = ("torch", "transformers", "peft", "trl", "bitsandbytes", "soup_cli")


# --- map-077 ------------------------------------------------------------------------------------------

def map077_environment() -> dict:
    """The call's stack as its stack.txt records it (the row file holds none)."""
    text = (MAP077 / "stack.txt").read_text()
    versions = box_stack(text)
    smi = re.search(r"Driver Version: (\S+)\s+CUDA Version: (\S+)", text)
    command = (MAP077 / "commands.txt").read_text().split("python3 ", 1)[1].strip()
    return {"gpu": re.search(r"\|\s+\d+\s+(NVIDIA [^|]+?)\s{2,}", text).group(1), "driver": smi.group(1),
            "cuda": smi.group(2), "torch": versions["torch"], "transformers": versions["transformers"],
            "trl": versions["trl"], "peft": versions["peft"], "soup_cli": versions["soup-cli"],
            "weights": "synthetic", "dry_run": False,
            "arms": "bare --lanes on one GPU (16 cores / 4: 4 lanes x 4 threads, stack.txt's nproc); "
                    "environment from the call's stack.txt: the run stopped before it wrote its own",
            "command": command}


def map077_rows() -> list[dict]:
    return [json.loads(line) for line in (MAP077 / "map-077-full.json.rows.jsonl").read_text().splitlines()]


def map077_render(measured: list[dict]) -> str:
    result = {"tool": "issue395_second_stack_vram", "schema": 3, "kind": "map", "environment": map077_environment(),
              "rows": measured, "interrupted": True, "error": None, "timings": {}, "margins": []}
    with tempfile.TemporaryDirectory(prefix="map-077-full-") as tmp:
        path = Path(tmp) / "map-077-full.json"
        path.write_text(json.dumps(result))
        out = subprocess.run([sys.executable, str(ROOT / "issue395_second_stack_vram.py"), "--from-json", str(path)],
                             capture_output=True, text=True, timeout=300)
    return out.stdout.replace(str(path), "<the row file, with stack.txt's environment>")


def map073_rows() -> dict:
    out = {}
    for path in MAP073:
        for r in json.loads(path.read_text())["rows"]:
            if r.get("real_peak") and not r.get("failure"):
                out[(r["model_key"], r["quant"], r["seq"], r["batch"])] = r
    return out


def one_process_runs(new: dict) -> list[tuple[str, int, list]]:
    """Every committed 0.77.0 H200 run made in one process (no lanes, no cap) that measured an arm this
    map measured too: (its file, arms equal to the byte, [(arm, bytes apart)])."""
    out = []
    for path in sorted(ROOT.glob("results/*soup0.77.0*/*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            continue
        if not isinstance(data, dict) or (data.get("environment") or {}).get("arms") != "in one process":
            continue
        same, apart = 0, []
        for r in data.get("rows", []):
            key = (r.get("model_key"), r.get("quant"), r.get("seq"), r.get("batch"))
            mine = new.get(key)
            if r.get("task") or not r.get("real_peak") or mine is None or r.get("targets") != mine.get("targets"):
                continue
            if r["real_peak"] == mine["real_peak"]:
                same += 1
            else:
                apart.append((key, r["real_peak"] - mine["real_peak"]))
        if same or apart:
            out.append((f"{path.parent.name}/{path.name}", same, apart))
    return out


def cmd_map_077() -> None:
    """soup-cli 0.77.0's full default map on one H200 (issue 30 item 2), rendered from the rows it saved, and
    0.77.0 against 0.73.3 arm by arm.

    Why a render of its own: the map ran in one device call (bench/gpu-map-077-full.sh, results/map-077-full-h200-soup0.77.0-684477c/)
    under a time limit; at the limit it was stopped (SIGINT) and, 25 s later, killed by the script's own
    timeout while it finished the arm in flight, so it never wrote its --json, --markdown or tables. What
    it wrote as each arm finished is its row file (map-077-full.json.rows.jsonl: one row a line, unedited)
    and its progress lines (map-077-full.txt). The row file holds no environment; this subcommand supplies the
    one stack.txt of the same call records (nvidia-smi and the installed versions), says so, and renders
    the rows through the harness's own --from-json as an interrupted run. Nothing is estimated for the
    arms that did not run: they are named.

    Then the release compare: every arm of the 0.73.3 default grid (results/margin-map-h200x2-*/map-2gpu.json
    and results/cap-proof-and-seq512-1024-*/map-512-1024.json, H200) that 0.77.0 also measured here: Soup's own
    number on each (computed by each release's setup on the GPU), what moved it, 0.77.0's two new terms
    (large_layer_bytes, persistent_bytes, as its setup passed them), and the real peaks.

        .venv/bin/python bench/rerenders.py map-077 > results/map-077-full-h200-soup0.77.0-684477c-render.txt
    """
    measured = map077_rows()
    progress = re.findall(r"^\[arm (\d+)/(\d+)\].*elapsed ([\d.]+) s", (MAP077 / "map-077-full.txt").read_text(), re.M)
    wall = (MAP077 / "commands.txt").read_text().split("wall ", 1)[1].split(" s:")[0]
    # 0.77.0's default map, whichever Soup renders it: it streams every release family
    planned = plan_map(MAP_FAMILIES + RELEASE_FAMILIES + ("llama31-8b",), ("none", "nf4"), None, MAP_BATCHES)
    done = {r["index"] for r in measured}
    missing = [a for a in planned if a.index not in done]
    real = [r for r in measured if r.get("real_peak") and not r.get("failure")]
    print("soup-cli 0.77.0's full default map, one H200, one device call (bench/gpu-map-077-full.sh; measured there)")
    print(f"  planned {len(planned)} arms; {len(measured)} reported ({len(real)} measured, "
          f"{sum(1 for r in measured if r.get('failure'))} refused or failed as their rows say) by the last progress "
          f"line, arm {progress[-1][0]} of {progress[-1][1]} at {progress[-1][2]} s; the command's wall {wall} s "
          f"(commands.txt): {len(real) / float(progress[-1][2]) * 60:.1f} measured arms per minute at 4 lanes")
    print(f"  not run ({len(missing)}: the call's time limit stopped the map): " + "; ".join(
        f"{NAME[k]} x{sum(1 for a in missing if a.model == k)}" for k in dict.fromkeys(a.model for a in missing)))
    print("  the tables below: the harness's own --from-json over the row file, as an interrupted run\n")
    print(map077_render(measured))
    map077_compare(real)


def map077_compare(real: list[dict]) -> None:
    """The release compare (0.73.3's measured arms against this map's ``real`` rows), then this map's 4 lanes
    against every committed one-process 0.77.0 run of the same arm."""
    old = map073_rows()
    shared = sorted(((old[k], r) for r in real for k in [(r["model_key"], r["quant"], r["seq"], r["batch"])] if k in old),
                    key=lambda p: map_order(p[1]["model_key"], p[1]["quant"], p[1]["seq"], p[1]["batch"]))
    print(f"0.77.0 against 0.73.3, arm by arm ({len(shared)} arms both measured on an H200; Soup's own number: computed "
          "by each release's setup; real peak: measured)")
    print(f"{'family':<24}{'quant':>6}{'seq':>7}{'batch':>6}{'Soup 0.73.3 GB':>16}{'Soup 0.77.0 GB':>16}"
          f"{'moved MB':>10}{'large_layer MB':>16}{'persistent MB':>15}{'real 0.73.3':>13}{'real 0.77.0':>13}"
          f"{'verdict':>14}")
    moved = 0
    for o, n in shared:
        terms = (n.get("gate") or {}).get("terms") or {}
        d = n["soup_predicted"] - o["soup_predicted"]
        moved += d != 0
        verdict = "/".join("UNDER" if r["soup_predicted"] < r["real_peak"] else "ok" for r in (o, n))
        print(f"{NAME[n['model_key']][:23]:<24}{n['quant']:>6}{n['seq']:>7}{n['batch']:>6}"
              f"{o['soup_predicted'] / 1e9:>16.4f}{n['soup_predicted'] / 1e9:>16.4f}{d / 1e6:>10.1f}"
              f"{terms.get('large_layer_bytes', 0) / 1e6:>16.1f}{terms.get('persistent_bytes', 0) / 1e6:>15.1f}"
              f"{o['real_peak'] / 1e9:>13.4f}{n['real_peak'] / 1e9:>13.4f}{verdict:>14}")
    same = sum(1 for o, n in shared if o["real_peak"] == n["real_peak"])
    print(f"real peaks equal to the byte on {same} of {len(shared)} shared arms (0.73.3: one process a GPU, two GPUs; "
          "0.77.0: 4 lanes on one GPU); where 0.77.0's runtime differs the peak moves with it")
    lanes = one_process_runs({(r["model_key"], r["quant"], r["seq"], r["batch"]): r for r in real})
    print("\n4 lanes against one process: this map's peaks (measured, 4 lanes on one GPU) against every committed "
          "0.77.0 H200 run of the same arm made in one process")
    for name, same, apart in lanes:
        print(f"  {name}: {same} of {same + len(apart)} equal to the byte" + ("; " + ", ".join(
            f"{NAME[k[0]]} {k[1]} {k[2]}x{k[3]} {d:+,} B" for k, d in apart) if apart else ""))
    total = sum(same + len(apart) for _, same, apart in lanes)
    print(f"  {sum(same for _, same, _ in lanes)} of {total} equal to the byte; every other is an NF4 arm 1,024 B "
          "apart, the size of bitsandbytes' dynamic map (results/carried-bytes-h200x2-soup0.73.3-8e62cc5/carried.txt); "
          "which run's step allocated it inside its peak was not traced" if all(
              abs(d) == 1024 and k[1] == "nf4" for _, _, apart in lanes for k, d in apart) else "")
    flips = [(o, n) for o, n in shared if (o["soup_predicted"] < o["real_peak"]) != (n["soup_predicted"] < n["real_peak"])]
    print(f"Soup's number moved on {moved} of {len(shared)} arms; its verdict (UNDER or not) changed on {len(flips)}: "
          + ("; ".join(f"{NAME[n['model_key']]} {n['quant']} {n['seq']}x{n['batch']} "
                       f"{'UNDER' if o['soup_predicted'] < o['real_peak'] else 'ok'} -> "
                       f"{'UNDER' if n['soup_predicted'] < n['real_peak'] else 'ok'}" for o, n in flips) or "none"))


# --- stack-latest -------------------------------------------------------------------------------------

def stack_rows(paths) -> tuple[dict, dict]:
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


def cmd_stack_latest() -> None:
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

        .venv/bin/python bench/rerenders.py stack-latest > results/stack-latest-vs-pinned.txt
    """
    new, new_env = stack_rows(sorted(LATEST.glob("task-map-*latest.json")))
    old, old_env = stack_rows(sorted(PINNED.glob("task-map-*.json")))
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
    stack_gemma(pinned_tv, latest_tv)


def stack_gemma(pinned_tv: str, latest_tv: str) -> None:
    """Gemma-2-2B DPO bf16 1024x1 with the allocator's history on each stack (transformers ``pinned_tv``
    and ``latest_tv``): the peaks, the corrected estimate on each, and the live blocks that differ."""
    pinned = json.loads((FIT4_ANATOMY / "anatomy-dpo-gemma2-bf16-1024x1-r8-pinned.json").read_text(encoding="utf-8"))
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


# --- fit4 ---------------------------------------------------------------------------------------------

def anatomy(folder: Path = FIT4_ANATOMY, prefix: str = "anatomy-") -> list[tuple[str, dict, object]]:
    out = []
    for path in sorted(folder.glob(f"{prefix}*.json")):
        d = json.loads(path.read_text(encoding="utf-8"))
        name = path.stem[len(prefix):]
        targets = tuple(d["targets"].split(",")) if d.get("targets") else None
        e = estimate_key(FAMILY[name.split("-")[1]], quant=d["quant"], seq=d["seq"], batch=d["batch"],
                         release="0.77.0", task=d["task"], targets=targets, lora_r=d.get("r") or 8,
                         steps=d.get("steps") or 1, accumulation=d.get("accum") or 1, soup=False,
                         transformers=box_stack((folder / "stack.txt").read_text())["transformers"])
        out.append((name, d, e))
    return out


def cmd_fit4() -> None:
    """Issue 34, measure first: the corrected estimate against the allocator's history of 11 streamed runs
    (results/fit4-anatomy-findmax-*/call-1-2/anatomy-*.json: soup-cli 0.77.0 on one H200, 1 to 3 optimizer
    steps, large adapters, gradient accumulation 1 against 4 or 2), then --find-max's measured limits
    beside this tool's longest seq or batch (…/call-1-2 and …/call-3-4/find-max-*.json); then, from the next
    session's calls (results/fit4-pages-findmax-stack-*/): the allocator's reserve at the peak under expandable
    segments, read off the history of 8 more runs (call-1/pages-*.json, page_need), and three more --find-max
    configs (call-2, call-4), every config's like-for-like longest both as its run printed it and as this tree's
    estimator computes it now; and the twelfth session's five reruns under expandable segments of the arms the
    default allocator read under (results/pages2-soup-patch-map4-modes-*/call-1-3/pages-*.json).

    Three peaks per arm, each labelled:
      measured   torch.cuda.max_memory_allocated over the run (the allocator's own count: block sizes);
      replayed   the allocator's history replayed (its trace records each allocation's REQUESTED size,
                 torch's CUDACachingAllocator record_trace(ALLOC, orig_size), while allocated_bytes counts
                 the block's size);
      corrected  this tool's estimator, computed for the arm's task, quant, seq, batch, r, targets, steps and
                 accumulation.
    measured - replayed is what the trace cannot see: the bytes of blocks bigger than their request. Without
    expandable segments (these anatomy processes: Soup printed "expandable_segments allocator hint not
    enabled"), a large-pool block keeps a remainder of up to 1 MiB unsplit (should_split: remaining >
    kSmallSize); with them (`soup train`, --cap, --emulate-card, --find-max) it splits at 512 B, so the
    replayed peak is the one an expandable-segments run allocates. The replayed peak's base is the
    allocated bytes when the window opened, so it still holds the setup's own remainders.

        .venv/bin/python bench/rerenders.py fit4 > results/fit4-anatomy-findmax-render.txt"""
    rows = anatomy()
    print("corrected estimate against the allocator's history (H200, soup-cli 0.77.0; "
          f"{FIT4_ANATOMY.parent.name}/{FIT4_ANATOMY.name})")
    print(f"{'arm':<46}{'measured GB':>12}{'replayed GB':>12}{'unseen MB':>10}{'unsplit MB':>11}{'corrected GB':>13}"
          f"{'/measured':>10}{'split GB':>10}{'/replayed':>10}  phase")
    for name, d, e in rows:
        real, rep, c = d["real_peak"], d["replayed_peak"], e.corrected_predicted
        print(f"{name:<46}{real / 1e9:>12.4f}{rep / 1e9:>12.4f}{(real - rep) / 1e6:>10.1f}"
              f"{(c - e.split_allocated) / 1e6:>11.1f}{c / 1e9:>13.4f}"
              f"{c / real:>9.4f}x{e.split_allocated / 1e9:>10.4f}{e.split_allocated / rep:>9.4f}x  {e.phase}")
    print("measured: max_memory_allocated (the allocator's block bytes); replayed: the allocator's history replayed "
          "(requested sizes); unseen: measured - replayed (blocks larger than their request); corrected: computed by "
          "this tool's estimator, with unsplit (its bound on the unsplit remainders of the adapter blocks live in the "
          "binding phase, the terms unsplit_remainders, gradient_remainders, transient_remainders); split: corrected "
          "less unsplit (every block split to its request)")
    print("\nthe same peaks split at the window's start (allocated when the first step began: the resident), "
          "bytes; corrected's resident terms: pool, extras, lora_weights, cublas_workspace, resident_rounding")
    print(f"{'arm':<46}{'resident meas.':>15}{'resident est.':>15}{'diff':>13}{'step (replayed)':>17}"
          f"{'step (est.)':>15}{'est. - replayed':>17}")
    for name, d, e in rows:
        res = sum(e.terms.get(k, 0) for k in RESIDENT_TERMS)
        dyn, dyn_e = d["replayed_peak"] - d["resident_before"], e.corrected_predicted - res
        print(f"{name:<46}{d['resident_before']:>15,}{res:>15,}{d['resident_before'] - res:>13,}{dyn:>17,}"
              f"{dyn_e:>15,}{dyn_e - dyn:>17,}")
    by = {name: (d, e) for name, d, e in rows}
    print("\ngradient accumulation: the same arm at 1 micro-batch and at 4 (or 2); the difference is the adapter's "
          "held gradients (and, on the paired losses, nothing else); estimated: the split peaks' (requests, as the "
          "history replays them: the held gradients' unsplit remainders are the corrected peak's alone)")
    print(f"{'pair':<44}{'measured MB':>12}{'replayed MB':>12}{'estimated MB':>13}")
    for a1 in sorted(n for n in by if n.endswith("-a1")):
        stem = a1[:-len("-s3-a1")]
        other = next((n for n in by if n.startswith(stem) and n != a1 and "-a" in n[len(stem):]), None)
        if other is None:
            continue
        (d1, e1), (d2, e2) = by[a1], by[other]
        print(f"{stem + ' ' + other[len(stem) + 1:] + ' - a1':<44}{(d2['real_peak'] - d1['real_peak']) / 1e6:>12.1f}"
              f"{(d2['replayed_peak'] - d1['replayed_peak']) / 1e6:>12.1f}"
              f"{(e2.split_allocated - e1.split_allocated) / 1e6:>13.1f}")
    print("\nthe held-gradient and moment terms the estimate charged (bytes, estimator terms)")
    for name, d, e in rows:
        t = e.terms
        print(f"{name:<46} adapter {t.get('lora_weights', 0):>13,}  held grads {t.get('held_gradients', 0):>13,}  "
              f"moments {t.get('adam_moments', 0):>13,}  transients {t.get('optimizer_transients', 0):>13,}")
    pages(rows)
    findmax()


def pages(default_rows: list[tuple[str, dict, object]]) -> None:
    """The reserve a card cannot do without, under expandable segments (what `soup train` runs): at the
    replayed peak, the 20 MiB (large pool) and 2 MiB (small pool) pages the live blocks touch; and each
    arm also among ``default_rows`` (the first table's, default allocator) set beside itself."""
    from issue395.constants import EXPANDABLE_PAGE_BYTES
    from issue395.estimator.estimate import EXPANDABLE_RESERVE_BYTES, EXPANDABLE_RESERVE_PAGES

    rows = [r for call in PAGE_CALLS for r in anatomy(call, "pages-")]
    print("\nunder expandable segments, as `soup train` runs (H200, soup-cli 0.77.0; "
          + ", ".join(f"{c.parent.name}/{c.name}" for c in PAGE_CALLS) + "): the allocated "
          "peak, and the pages its live blocks touch at the replayed peak (measured, page_need)")
    print(f"{'arm':<46}{'allocated GB':>13}{'corrected GB':>13}{'/allocated':>11}{'pages GB':>10}{'reserve MB':>11}"
          f"{'in pages':>9}{'charged MB':>11}{'needs free - pages MB':>22}")
    for name, d, e in rows:
        p, c = d["page_need"], e.split_allocated  # expandable segments split every block to its request
        print(f"{name:<46}{p['allocated'] / 1e9:>13.4f}{c / 1e9:>13.4f}{c / p['allocated']:>10.4f}x{p['pages'] / 1e9:>10.4f}"
              f"{p['reserve'] / 1e6:>11.1f}{p['reserve'] / EXPANDABLE_PAGE_BYTES['large']:>9.2f}{(e.needs_free - c) / 1e6:>11.1f}"
              f"{(e.needs_free - p['pages']) / 1e6:>22.1f}")
    print(f"allocated: the replayed peak (requested sizes at 512 B; under expandable segments a block splits to its "
          f"request, so it equals max_memory_allocated to the difference below); reserve: pages - allocated; "
          f"charged: {EXPANDABLE_RESERVE_PAGES} pages of {EXPANDABLE_PAGE_BYTES['large'] // 2**20} MiB ({EXPANDABLE_RESERVE_BYTES:,} B), the whole pages above "
          "the most measured here and in torch's OOM messages below")
    unseen = max(d["real_peak"] - d["requested_peak"] for _, d, _ in rows)
    print(f"max_memory_allocated - the requested peak, the most on these arms: {unseen:,} B")
    default = {name: d for name, d, _ in default_rows}
    print("\nthe same arm under the default allocator (the first table: its max_memory_allocated counts unsplit block "
          "remainders) and under expandable segments (above): corrected / max_memory_allocated")
    for name, d, e in rows:
        if name in default:
            c = e.corrected_predicted
            print(f"{name:<46} default {c / default[name]['real_peak']:.4f}x  expandable {e.split_allocated / d['real_peak']:.4f}x")


def findmax() -> None:
    print("\n--find-max on emulated cards (the real `python -m soup_cli train`, 3 steps a probe, Soup's gate lifted): "
          "the measured limit beside this tool's longest (computed) and Soup's gate's longest (computed by Soup)")
    print(f"{'config':<34}{'axis':<6}{'card':<22}{'limit':>7}{'OOM at':>8}{'like (run)':>11}{'like (now)':>11}"
          f"{'bound ctx':>10}{'Soup gate':>10}{'under (now)':>12}{'probes':>7}")
    seen = set()
    for folder, calls in FIND_MAX_CALLS:
        for call in calls:
            for path in sorted((folder / call).glob("find-max-*.json")):
                d = json.loads(path.read_text(encoding="utf-8"))
                m = d.get("measured") or {}
                if path.name in seen or m.get("limit") is None:
                    continue
                seen.add(path.name)
                axis, limit, above = m["axis"], m["limit"], m.get("oom_above")
                like, soup = d.get("this_tool_longest_like_for_like"), d.get("soup_gate_longest")
                now, bound = longest_now(d)
                under = (limit - now) // STEP[axis] if now is not None else None
                print(f"{path.stem[len('find-max-'):]:<34}{axis!s:<6}{d['card']['card']:<22}{limit!s:>7}{above!s:>8}"
                      f"{like!s:>11}{now!s:>11}{bound!s:>10}{soup!s:>10}{under!s:>12}{len(m.get('probes') or ()):>7}")
    print("like (run): this tool's longest with the box's own context, as the run printed it (the tree of its day); "
          "like (now): the same, computed by this tree's estimator; bound ctx: now, with the card's bound context; "
          "under: (limit - like (now)) / the resolution (64 tokens, 1 row); 0 is exact; never above the limit is the claim")
    oom_readings()


def run_arm(d: dict, value: int | None = None) -> tuple[dict, object, dict]:
    """A find-max JSON's config file read by Soup's own loader, as --estimate reads it
    (issue395.run.userconfig), as the estimator takes it: the family's config.json, the file's Arm (the JSON's
    steps; the axis at ``value``, else the file's) and what is not the run (the JSON's stack, no Soup number)."""
    from issue395.model.registry import by_hub_id, config_json
    from issue395.run.userconfig import read_soup_config

    arm = replace(read_soup_config(str(ROOT / d["config"])).arm, steps=d["steps"])
    if value is not None:
        arm = replace(arm, **{d["measured"]["axis"]: value})
    extra = dict(soup=False, release=d["stack"]["packages"]["soup-cli"],
                 transformers=d["stack"]["packages"]["transformers"])
    return config_json(by_hub_id(arm.checkpoint)), arm, extra


def longest_now(d: dict) -> tuple[int | None, int | None]:
    """This tree's longest along the run's axis on its card: with the box's own context (like for like),
    and with the card's bound context."""
    from issue395.estimator.cards import budget, parse_card
    from issue395.estimator.fits import longest

    config, arm, extra = run_arm(d)
    card = parse_card(d["card"]["card"])
    axis = d["measured"]["axis"]
    return tuple(longest(axis, config, budget(card, ctx).step_free_bytes, arm, **card.kernels(), **extra)
                 for ctx in (d["box_context_bytes"], None))


def oom_readings() -> None:
    """Each OOM probe whose Soup console holds torch's own out-of-memory message: the margin's parts
    at that moment, measured inside Soup's process, beside what this tool charges at that seq."""
    from issue395.estimator.cards import STEP_GROWTH_BYTES
    from issue395.estimator.resident import estimate_run
    from issue395.constraints.findmax import oom_reading

    print("\ntorch's out-of-memory message in Soup's own process (measured, as torch printed it) against this tool's "
          "charge at that seq (computed; context: the box's, measured by the probing process)")
    print(f"{'probe':<40}{'allocated+tried GB':>19}{'corrected GB':>13}{'reserve MB':>11}{'charged MB':>11}"
          f"{'outside MB':>11}{'charged MB':>11}")
    seen = set()  # a config run twice (FIND_MAX_CALLS: the later call first) is read once, as findmax() reads it
    for folder, calls in FIND_MAX_CALLS:
        for call in calls:
            for logs in sorted((folder / call).glob("find-max-*-logs")):
                name = logs.name[len("find-max-"):-len("-logs")]
                if name in seen:
                    continue
                seen.add(name)
                d = json.loads((logs.parent / f"find-max-{name}.json").read_text(encoding="utf-8"))
                for log in sorted(logs.glob("soup-find-max-seq-*.log")):
                    r = oom_reading(log.read_text(encoding="utf-8", errors="replace"))
                    if r is None:
                        continue
                    seq = int(log.stem.rsplit("-", 1)[1])
                    config, arm, extra = run_arm(d, seq)
                    e = estimate_run(arm, config, **extra)
                    charged = e.needs_free - e.split_allocated
                    outside = d["box_context_bytes"] + STEP_GROWTH_BYTES
                    print(f"{name + ' seq ' + str(seq):<40}{(r.allocated + r.tried) / 1e9:>19.4f}"
                          f"{e.split_allocated / 1e9:>13.4f}{r.reserved_unallocated / 1e6:>11.1f}{charged / 1e6:>11.1f}"
                          f"{r.outside_allocator / 1e6:>11.1f}{outside / 1e6:>11.1f}")
    print("allocated+tried: the allocated bytes when the request failed plus the request; reserve: torch's reserved but "
          "unallocated (expandable segments, after the allocator released what it could); outside: this process's memory "
          "in use less both (the CUDA context and the runtime's growth). Accumulation: the file's, else Soup's default 4")



COMMANDS = {"map-077": cmd_map_077, "stack-latest": cmd_stack_latest, "fit4": cmd_fit4}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in COMMANDS:
        print(f"usage: bench/rerenders.py {'|'.join(COMMANDS)} (one subcommand; got {' '.join(argv) or 'none'})",
              file=sys.stderr)
        return 2
    COMMANDS[argv[0]]()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
