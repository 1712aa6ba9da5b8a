"""soup-cli 0.77.0's full default map on one H200 (issue 30 item 2), rendered from the rows it saved, and
0.77.0 against 0.73.3 arm by arm.

Why a script: the map ran in one device call (bench/gpu-map-077-full.sh, results/map-077-full-h200-soup0.77.0-684477c/)
under a time limit; at the limit it was stopped (SIGINT) and, 25 s later, killed by the script's own
timeout while it finished the arm in flight, so it never wrote its --json, --markdown or tables. What
it wrote as each arm finished is its row file (map-077-full.json.rows.jsonl: one row a line, unedited)
and its progress lines (map-077-full.txt). The row file holds no environment; this script supplies the
one stack.txt of the same call records (nvidia-smi and the installed versions), says so, and renders
the rows through the harness's own --from-json as an interrupted run. Nothing is estimated for the
arms that did not run: they are named.

Then the release compare: every arm of the 0.73.3 default grid (results/margin-map-h200x2-*/map-2gpu.json
and results/cap-proof-and-seq512-1024-*/map-512-1024.json, H200) that 0.77.0 also measured here: Soup's own
number on each (computed by each release's setup on the GPU), what moved it, 0.77.0's two new terms
(large_layer_bytes, persistent_bytes, as its setup passed them), and the real peaks.

    .venv/bin/python bench/map_077_full.py > results/map-077-full-h200-soup0.77.0-684477c-render.txt
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from issue395.estimator.stacks import box_stack  # noqa: E402
from issue395.model.registry import FAMILIES, MAP_FAMILIES, RELEASE_FAMILIES, SHAPES  # noqa: E402
from issue395.record import MAP_BATCHES  # noqa: E402
from issue395.results.result import map_order  # noqa: E402
from issue395.run.grid import plan_map  # noqa: E402

NAME = {**{k: f.name for k, f in FAMILIES.items()}, **{k: s.name for k, s in SHAPES.items()}}
RUN = ROOT / "results" / "map-077-full-h200-soup0.77.0-684477c"
OLD = [ROOT / "results" / "margin-map-h200x2-soup0.73.3-f3ad9d2" / "map-2gpu.json",
       ROOT / "results" / "cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37" / "map-512-1024.json"]


def environment() -> dict:
    """The call's stack as its stack.txt records it (the row file holds none)."""
    text = (RUN / "stack.txt").read_text()
    versions = box_stack(text)
    smi = re.search(r"Driver Version: (\S+)\s+CUDA Version: (\S+)", text)
    command = (RUN / "commands.txt").read_text().split("python3 ", 1)[1].strip()
    return {"gpu": re.search(r"\|\s+\d+\s+(NVIDIA [^|]+?)\s{2,}", text).group(1), "driver": smi.group(1),
            "cuda": smi.group(2), "torch": versions["torch"], "transformers": versions["transformers"],
            "trl": versions["trl"], "peft": versions["peft"], "soup_cli": versions["soup-cli"],
            "weights": "synthetic", "dry_run": False,
            "arms": "bare --lanes on one GPU (16 cores / 4: 4 lanes x 4 threads, stack.txt's nproc); "
                    "environment from the call's stack.txt: the run stopped before it wrote its own",
            "command": command}


def rows() -> list[dict]:
    return [json.loads(line) for line in (RUN / "map-077-full.json.rows.jsonl").read_text().splitlines()]


def render(measured: list[dict]) -> str:
    result = {"tool": "issue395_second_stack_vram", "schema": 3, "kind": "map", "environment": environment(),
              "rows": measured, "interrupted": True, "error": None, "timings": {}, "margins": []}
    with tempfile.TemporaryDirectory(prefix="map-077-full-") as tmp:
        path = Path(tmp) / "map-077-full.json"
        path.write_text(json.dumps(result))
        out = subprocess.run([sys.executable, str(ROOT / "issue395_second_stack_vram.py"), "--from-json", str(path)],
                             capture_output=True, text=True, timeout=300)
    return out.stdout.replace(str(path), "<the row file, with stack.txt's environment>")


def old_rows() -> dict:
    out = {}
    for path in OLD:
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


def main() -> None:
    measured = rows()
    progress = re.findall(r"^\[arm (\d+)/(\d+)\].*elapsed ([\d.]+) s", (RUN / "map-077-full.txt").read_text(), re.M)
    wall = (RUN / "commands.txt").read_text().split("wall ", 1)[1].split(" s:")[0]
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
    print(render(measured))
    old = old_rows()
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
    print(f"\n4 lanes against one process: this map's peaks (measured, 4 lanes on one GPU) against every committed "
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


if __name__ == "__main__":
    main()
