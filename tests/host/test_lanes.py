"""--lanes (issue 30) end to end on CPU: the harness's own children, the real Soup setup on CPU, with
only the CUDA peak faked (a function of the arm alone, as max_memory_allocated is per process) and the
parent's check that a GPU is visible answered yes. Lanes 1 and lanes 2 give the same rows and tables;
Soup's shards land in --shard-dir, the checkpoints in --cache-dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT

STAND_IN = textwrap.dedent("""
    import contextlib, os, sys, time
    sys.path.insert(0, {root!r})
    import issue395_second_stack_vram as h
    from issue395.run import measure_mode, runner
    from issue395.host.arms import Protocol

    # the one fake: the CUDA peak, the arm's alone (under Soup's number even for a toy checkpoint)
    def fake_peak(trainer, snapshot=False, steps=1):
        seq = int(trainer.args.max_length)
        time.sleep({step_s})
        return {{"real_peak": 1_003 * seq, "resident": 4096, "reserved": 2_000 * seq, "step_s": 0.01,
                 "snapshot": None}}

    h.STEP_DEVICE, h.real_peak = "cpu", fake_peak
    if {small}:  # the checkpoint each lane builds, at toy sizes: 2 layers, hidden 64, vocab 512 (its key, its
        import dataclasses  # estimate and its Soup setup are the family's; only the weights built are smaller)
        from issue395.host import checkpoints

        real_prepare = checkpoints.prepare_checkpoint

        def small_checkpoint(shape, dest):
            return real_prepare(dataclasses.replace(shape, n_layers=2, hidden=64, intermediate=128, vocab=512,
                                                    arch=dict(shape.arch, num_attention_heads=4,
                                                              num_key_value_heads=2)), dest)

        checkpoints.prepare_checkpoint = small_checkpoint
    if os.environ.get("LEDGER_LOG"):  # not a fake: each lane's ledger, logged as it admits and frees an arm
        from issue395.host import cardlock

        held = cardlock.CardLedger.held

        @contextlib.contextmanager
        def logged(self, need):
            with held(self, need) as beside:
                with open(os.environ["LEDGER_LOG"], "a") as log:
                    log.write(f"got {{os.getpid()}} {{time.monotonic()}} {{need.holds if need else 'all'}} {{beside}}\\n")
                try:
                    yield beside
                finally:
                    with open(os.environ["LEDGER_LOG"], "a") as log:
                        log.write(f"free {{os.getpid()}} {{time.monotonic()}}\\n")

        cardlock.CardLedger.held = logged
    measure_mode.visible_gpu_count = lambda: 1  # no GPU here
    if {total} is not None:  # the card's total as the driver would report it (faked: no nvidia-smi here)
        measure_mode.gpu_total_bytes = lambda gpu: {total}
    sys.exit(runner.cli(sys.argv[1:], Protocol(h.measure_arm, "cpu", __file__)))
""")


def stand_in(tmp_path: Path, total=None, step_s: float = 0.0, small: bool = True) -> Path:
    """The harness as a script whose one fake is the CUDA peak; with ``small`` (the default) each family's
    checkpoint is built at toy sizes into a --cache-dir of the test's own (never the session's: the
    checkpoint keeps the family's name), so a lane's build and Soup's setup take a second, not twenty."""
    script = tmp_path / "harness.py"
    script.write_text(STAND_IN.format(root=str(ROOT), total=total, step_s=step_s, small=small))
    return script


def comparable(path: Path) -> tuple[list[dict], dict]:
    data = json.loads(path.read_text())
    # a row's own seconds and the process that measured it are all that may differ
    return [dict(r, ran={k: v for k, v in r["ran"].items() if k not in ("timings", "pid")}) for r in data["rows"]], \
        data["timings"]


@pytest.mark.slow
def test_a_map_in_two_lanes_gives_the_rows_and_tables_of_one_lane_in_grid_order(tmp_path):
    """A two-family map (4 arms) in one lane and in two: the same rows (but each row's own seconds and
    pid) in grid order, the same tables, the header saying how it ran, two child processes for two lanes.
    The lanes share one --cache-dir (the test's own: the checkpoints are built at toy sizes)."""
    script = stand_in(tmp_path)
    args = ["--map", "--families", "smol,qwen", "--quant", "none", "--seq", "512,1024", "--batch", "1",
            "--cache-dir", tmp_path / "cache"]
    runs = {}
    for n in (1, 2):
        out = tmp_path / f"lanes{n}.json"
        p = subprocess.run([sys.executable, str(script), *map(str, args), "--lanes", str(n), "--json", str(out)],
                           capture_output=True, text=True, timeout=900, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[n] = (p.stdout, *comparable(out))
    (out1, rows1, t1), (out2, rows2, t2) = runs[1], runs[2]
    assert [(r["model_key"], r["seq"]) for r in rows2] == [("smol", 512), ("smol", 1024), ("qwen", 512),
                                                          ("qwen", 1024)]
    assert rows1 == rows2 and all(r["real_peak"] for r in rows2)
    tables = [[ln for ln in o.splitlines() if not ln.startswith(("stack:", "wall "))] for o in (out1, out2)]
    assert tables[0] == tables[1]
    assert "2 lanes on one GPU" in out2.splitlines()[0] and "1 lane, in one process" in out1.splitlines()[0]
    assert (t1["lanes"], t2["lanes"]) == (1, 2) and t2["arms"] == 4 and t2["arms_per_minute"] > 0
    assert len(t2["children"]) == 2, "two lanes, two processes"


@pytest.mark.slow
@pytest.mark.release
def test_soups_shards_land_in_shard_dir_and_the_checkpoint_in_cache_dir(tmp_path):
    """A fresh process's dry run with --cache-dir and --shard-dir: Soup writes its layer shards under
    --shard-dir (the installed release honours the folder it is told), the checkpoint lands in --cache-dir,
    and neither folder holds the other's files (the checkpoint built at toy sizes)."""
    cache, shards = tmp_path / "ckpt", tmp_path / "shm"
    p = subprocess.run([sys.executable, str(stand_in(tmp_path)), "--dry-run", "--models", "smol", "--seq", "64",
                        "--cache-dir", str(cache), "--shard-dir", str(shards)],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert list((shards / "layer-stream").glob("*/index.json")), "Soup's shards are not in --shard-dir"
    assert list((cache / "checkpoints").glob("smol-*/model.safetensors"))
    assert not (cache / "layer-stream").exists() or not any((cache / "layer-stream").iterdir())
    assert not (shards / "checkpoints").exists()


@pytest.mark.slow
def test_a_map_familys_whole_card_arm_runs_in_its_own_lane_packed_by_bytes_as_the_plan_says(tmp_path):
    """A faked 6 GB card in two lanes (3 GB each): Qwen2.5 at 1024 (Soup's number 2.60 GB) is past a lane's
    share, the other arms fit one. With no --cache-dir each lane builds its family's checkpoint in its own
    scratch (at toy sizes): Qwen2.5's whole-card arm runs in Qwen2.5's lane (the process that measured its other arm),
    each family is built once, no third process is started. The lanes' ledger, logged as it admits and
    frees each arm (the one fake: the CUDA peak, which sleeps 2 s a step so the lanes' arms meet): each arm
    held exactly this tool's needs-free for it, the arms held at once never summed past the card less the
    two lanes' contexts and growth, and the two lanes' arms ran side by side."""
    from issue395.estimator.estimate import estimate_key
    from issue395.host.schedule import Room, card_total

    script = stand_in(tmp_path, total=6 * 10**9, step_s=2.0)
    out, log = tmp_path / "lanes2.json", tmp_path / "ledger.log"
    p = subprocess.run([sys.executable, str(script), "--map", "--families", "smol,qwen", "--quant", "none",
                        "--seq", "512,1024", "--batch", "1", "--lanes", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path,
                       env=dict(os.environ, LEDGER_LOG=str(log)))
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads(out.read_text())
    t = data["timings"]
    assert (t["whole_card_arms"], t["whole_card_in_lanes"]) == (1, 1), "the faked card made no arm whole-card"
    pids = {}
    for r in data["rows"]:
        assert r["real_peak"], r
        pids.setdefault(r["model_key"], set()).add(r["ran"]["pid"])
    assert all(len(v) == 1 for v in pids.values()) and pids["smol"] != pids["qwen"], pids
    assert len(t["children"]) == 2, "a separate whole-card job was spawned for the map"
    assert [r["index"] for r in data["rows"]] == sorted(r["index"] for r in data["rows"])  # grid order, as run or not
    builds = [family for child in t["children"] for family in child["build_s"]]
    assert sorted(builds) == ["qwen", "smol"], f"a family's checkpoint was built more than once: {builds}"
    assert "all ran in their family's lane beside the other lanes' arms" in p.stdout.splitlines()[0]
    # the schedule the run kept
    needs = {estimate_key(m, seq=s).needs_free for m in ("smol", "qwen") for s in (512, 1024)}
    spans, open_ = [], {}
    for line in log.read_text().splitlines():
        word, pid, when, *rest = line.split()
        if word == "got":
            open_[pid] = (float(when), int(rest[0]), int(rest[1]))
        else:
            start, holds, beside = open_.pop(pid)
            spans.append((start, float(when), holds, beside, pid))
    assert not open_ and len(spans) >= 4, spans
    assert {holds for _, _, holds, _, _ in spans} <= needs, "an arm held other than its needs-free"
    room = Room(card_total(6 * 10**9), 2).arm_bytes
    for start, _, _, _, _ in spans:
        assert sum(h for a, b, h, _, _ in spans if a <= start < b) <= room, "the arms at once held more than the card"
    assert any(beside > 0 for _, _, _, beside, _ in spans) and any(
        a2 < b1 and a1 < b2 for a1, b1, _, _, p1 in spans for a2, b2, _, _, p2 in spans if p1 != p2), \
        "the two lanes' arms never ran side by side"