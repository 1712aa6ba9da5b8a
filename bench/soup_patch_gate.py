"""The patched gate, proven by the real `soup train` (issue 39 item 3; bench only, not the harness).

Claim: with --soup-patch's diff applied to the installed soup_cli, Soup's own gate, NOT lifted (no
training.stream_vram_override, the file's gate kept), on an emulated card, (a) admits only runs that
complete every step, and (b) admits up to the measured --find-max limit (measured with the gate lifted,
quoted from the record with --limit) or one resolution step (64 tokens) below it, never past it.

Each probe is --find-max's own (issue395.constraints.findmax: the user's soup.yaml copied with only
PROBE_KEYS changed, here with the override left out; `python -m soup_cli train` in a fresh process
while this process holds a ballast that leaves the card's total free; its outcome from Soup's console
and trainer state). The probes: the limit, one step either side of it, then the longest seq the
patched gate admits at the free memory Soup's gate reported in the first probe (computed by the
patched soup_cli's own corrected_peak module, read from its source as this tool reads any release)
and one step past that, so both edges of the gate are run, not assumed.

    source bench/gpu-box.sh 0.77.0 && (cd /tmp/site && patch -p1 < OUT.diff)
    python3 bench/soup_patch_gate.py --config bench/find-max/qwen-dpo.yaml --card 12GB --limit 1856 \\
        --steps 3 --cache-dir /tmp/issue395-cache --log-dir DIR --json OUT.json

Exit 0 when both claims hold, 1 when one fails (the table says which), 2 on bad input (an unpatched
soup_cli is one line). On a box without CUDA it checks its inputs, prints the plan and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import issue395_second_stack_vram as h  # noqa: E402
from issue395.constraints.findmax import COMPLETED, probe_config, probe_words, run_probe, write_probe_config  # noqa: E402
from issue395.errors import UsageError  # noqa: E402
from issue395.estimator.cards import parse_card  # noqa: E402
from issue395.estimator.releases import soup_dir  # noqa: E402
from issue395.estimator.soup_number import patched, soup_preflight_from_config  # noqa: E402
from issue395.model.registry import by_hub_id, config_json  # noqa: E402
from issue395.run.userconfig import read_soup_config  # noqa: E402
from issue395.tasks import task  # noqa: E402

STEP = 64  # --find-max's resolution on the seq axis
#: Soup's refusal names the free memory it compared against (decide_stream_fit's reason).
REFUSED_FREE = re.compile(r"but only ([0-9.]+) GB is free")


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="soup_patch_gate.py", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the soup.yaml (bench/find-max/*.yaml); its base a registry hub id")
    p.add_argument("--card", required=True, help="a named card or a size, as --emulate-card")
    p.add_argument("--limit", type=int, required=True, help="the measured --find-max limit (gate lifted), from the record")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps a probe (the record's find-max ran 3)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--shard-dir", default=None)
    p.add_argument("--log-dir", default=None, help="each probe's Soup console, one file a probe")
    p.add_argument("--json", default=None, help="every probe and the verdict, as JSON")
    a = p.parse_args(argv)
    try:
        if patched(soup_dir()) is None:
            raise UsageError(f"the installed soup_cli ({soup_dir()}) is not patched: apply --soup-patch's diff first "
                             "(patch -p1 in the folder that holds soup_cli/)")
        a.user = read_soup_config(a.config)
        a.key = by_hub_id(a.user.base)
        if a.key is None:
            raise UsageError(f"--config {a.config}: base {a.user.base!r} is not a registry model's hub id")
        a.card_ = parse_card(a.card)
        if a.limit < STEP or a.limit % STEP or a.steps < 1:
            raise UsageError(f"--limit {a.limit} (a multiple of {STEP}) and --steps {a.steps} (>= 1)")
    except UsageError as exc:
        p.exit(2, f"error: {exc}\n")
    return a


def patched_number(a: argparse.Namespace, seq: int) -> int:
    """The patched gate's number at ``seq``, by the installed (patched) soup_cli's own module."""
    u = a.user
    targets = u.targets[0] if u.targets in (("all-linear",), ("auto",)) else u.targets
    return soup_preflight_from_config(config_json(a.key), quant=u.quant, seq=seq, batch=u.batch, targets=targets,
                                      lora_r=u.lora_r, stream=u.stream_options, task=u.task, optimizer=u.optimizer,
                                      accumulation=u.accumulation)[0]


def longest_admitted(a: argparse.Namespace, free: float) -> Optional[int]:
    """The longest multiple of 64 whose patched number is <= ``free`` (it grows with seq)."""
    best, seq = None, STEP
    while seq <= 65536 and patched_number(a, seq) <= free:
        best, seq = seq, seq + STEP
    return best


def main(argv: Optional[list] = None) -> int:
    a = parse(argv)
    import torch

    from issue395.measure.shapes import family_shape
    from issue395.run.checkpoints import quant_base, synthetic_checkpoint
    from issue395.run.scratch import Scratch

    u, t = a.user, task(a.user.task)
    print(f"the patched gate ({patched(soup_dir())}) on {a.card_.name} ({a.card_.total_bytes:,} B, emulated): "
          f"{a.config} ({u.task} {u.quant}, batch {u.batch}), {a.steps} step(s) a probe, measured limit {a.limit}")
    if not torch.cuda.is_available():
        print(f"plan: probe {a.limit - STEP}, {a.limit}, {a.limit + STEP}, then the longest seq the patched gate admits "
              "at the free memory Soup reports, and one step past it; not run: no CUDA GPU here")
        return 0
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    text = Path(a.config).read_text(encoding="utf-8")
    logs = Path(a.log_dir) if a.log_dir else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    probes: dict = {}
    with Scratch(a.cache_dir, a.shard_dir) as scratch:
        base = quant_base(scratch, str(synthetic_checkpoint(family_shape(a.key), scratch.checkpoint_root())[0]),
                          u.quant, tuple(sorted(u.stream_options.items())))

        def probe(seq: int) -> dict:
            if seq in probes:
                return probes[seq]
            folder = scratch.path("gate", f"seq-{seq}")
            config = probe_config(text, "seq", seq, data=folder / "train.jsonl", output=folder / "out", override=None,
                                  data_format=t.data_format, base=base)
            path = write_probe_config(folder, config, h.task_rows(t.name, seq, u.batch * u.accumulation * a.steps))
            p, _, log = run_probe(path, seq, a.steps, a.card_.total_bytes,
                                  log_to=logs / f"soup-gate-seq-{seq}.log" if logs else None)
            refused = p.line == "refused by Soup's gate"
            free = p.driver_free_gb
            if free is None and REFUSED_FREE.search(log):
                free = float(REFUSED_FREE.search(log).group(1))
            probes[seq] = {"seq": seq, "admitted": not refused, "completed": p.outcome == COMPLETED,
                           "outcome": "refused by Soup's gate" if refused else probe_words(p, a.steps),
                           "soup_gb": p.soup_gb, "free_gb": free, "seconds": p.seconds,
                           "patched_number": patched_number(a, seq)}
            print(f"  probe seq {seq}: {probes[seq]['outcome']} ({p.seconds} s; the patched number "
                  f"{probes[seq]['patched_number'] / 1e9:.2f} GB, Soup's free {free} GB)", flush=True)
            return probes[seq]

        first = probe(a.limit)
        for seq in (a.limit - STEP, a.limit + STEP):
            probe(seq)
        free = first["free_gb"]
        edge = longest_admitted(a, free * 1e9) if free is not None else None
        if edge is not None:
            probe(edge)
            probe(edge + STEP)
    rows = [probes[s] for s in sorted(probes)]
    admitted = [r for r in rows if r["admitted"]]
    never_oom = all(r["completed"] for r in admitted)
    longest = max((r["seq"] for r in admitted), default=None)
    # the gate grows with seq: every probe above the longest admitted one was refused
    tight = longest in (a.limit, a.limit - STEP) and all(not r["admitted"] for r in rows if r["seq"] > longest)
    print(f"{'seq':>6}  {'outcome (measured)':<48} {'Soup printed GB':>15} {'patched number GB':>17} {'free GB':>8}")
    for r in rows:
        print(f"{r['seq']:>6}  {r['outcome'][:48]:<48} {r['soup_gb'] if r['soup_gb'] is not None else '-':>15} "
              f"{r['patched_number'] / 1e9:>17.2f} {r['free_gb'] if r['free_gb'] is not None else '-':>8}")
    print(f"every run the patched gate admitted completed: {'yes' if never_oom else 'NO'}")
    print(f"the longest seq it admitted: {longest} (measured limit {a.limit}, gate lifted): "
          + ("the limit or one step below it" if tight else "NOT the limit or one step below it"))
    if a.json:
        Path(a.json).write_text(json.dumps({"config": a.config, "card": a.card_.name, "limit": a.limit, "steps": a.steps,
                                            "patch": patched(soup_dir()), "probes": rows, "never_oom": never_oom,
                                            "longest_admitted": longest, "tight": tight}, indent=1))
    return 0 if never_oom and tight else 1


if __name__ == "__main__":
    sys.exit(main())
