"""Spreading arms over processes: shards, jobs, and children that get their work as a JSON file.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from ..constants import ALLOC_CONF_VAR, EXPANDABLE_SEGMENTS
from ..record import LORA_R
from ..tasks import PROTOCOL_TASK
from ..errors import UsageError, last_line
from ..model.arm import Arm
from ..model.registry import FAMILIES, SHAPES
from ..model.streaming import family_of
from ..results.extras import UserConfig
from ..results.result import Result
from ..results.row import Row, arm_identity
from ..results.saved import RowFile
from ..measure.console import Stop
from .cardlock import DISK_HEADROOM_BYTES, DiskLedger
from .grid import arm_seconds, shard_of
from .measured import Children, MeasureRequest, Outputs, measure_from_json
from .schedule import Need, Room, card_total, claim_order
from .scratch import Scratch, reap_dead_scratch

#: A child process finds its work here: the file names its settled MeasureRequest and its Job.
CHILD_JOB = "ISSUE395_CHILD_JOB"
#: ... and the process id of the parent it must not outlive.
PARENT_PID = "ISSUE395_PARENT_PID"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class Job:
    """One child process: a shard of the grid on one GPU (or none), maybe one repeat."""

    shard: tuple[int, int]
    arms: tuple  # the Arms it owes
    gpu: Optional[int] = None
    repeat: Optional[int] = None
    extra_modes: bool = False  # also --measure/--sdpa, after its arms
    whole_card: bool = False  # --lanes: these arms run alone on their GPU, after its lanes


#: Host cores per lane when --lanes chooses N: the issue's H200 box ran four lanes at
#: OMP_NUM_THREADS=4 on 16 cores at 1.67x a serial run (torch's default threads: 1.14x).
CORES_PER_LANE = 4


@dataclass(frozen=True)
class Lanes:
    """How --lanes runs: lanes per GPU, host threads each, and the arms that need more than a lane's share."""

    count: int
    threads: int
    whole_card: tuple = ()  # the Arms past a lane's 1/N of the card
    share: Optional[int] = None  # bytes of the card each lane may have (None: not bounded, a dry run)
    why: str = ""
    #: those of ``whole_card`` that run in their family's lane beside the other lanes' arms whenever their
    #: bytes fit the card (the map); the rest run after the lanes, alone
    in_lane: tuple = ()
    #: the map: each lane arm's (index, bytes it holds, Soup's number), packed by the lanes' ledger
    needs: tuple = ()
    total: Optional[int] = None  # the card's total as the driver reports it

    @property
    def after(self) -> tuple:
        """The whole-card arms that run after the lanes, alone on their GPU."""
        inside = {a.index for a in self.in_lane}
        return tuple(a for a in self.whole_card if a.index not in inside)

    def label(self, run: MeasureRequest) -> str:
        where = ("on the CPU (a dry run: no GPU)" if run.dry_run else
                 f"on each of GPUs {','.join(map(str, run.children.gpus))}" if run.children.gpus else "on one GPU")
        how = "one fresh process per arm" if run.isolate else "one process per lane running its shard"
        packed = "; packed by bytes: each arm holds this tool's needs-free for it" if self.needs else ""
        need = (f"; {len(self.whole_card)} arm(s) whose needs exceed a lane's share of the card "
                f"({self.share / 1e9:.1f} GB)" if self.whole_card else "")
        if self.in_lane:
            need += (f": {'all' if not self.after else len(self.in_lane)} ran in their family's lane beside the "
                     "other lanes' arms whenever their bytes fit the card with every lane's context"
                     + (f", {len(self.after)} (not fitting beside the idle lanes) after the "
                        "lanes, alone" if self.after else ""))
        elif self.whole_card:
            need += " ran after them, alone"
        return (f"{self.count} lanes {where} ({self.threads} thread{'s' if self.threads != 1 else ''} each; "
                f"{self.why}), {how}, merged{packed}{need}")


def host_cores() -> int:
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def gpu_total_bytes(gpu: Optional[int]) -> Optional[int]:
    """The card's total as the driver reports it (nvidia-smi, MiB), without importing torch."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits",
                              "-i", visible_gpu(gpu or 0)], capture_output=True, text=True, timeout=20)
        return int(out.stdout.split()[0]) * 2**20 if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def resident_packing_bound(key: str, *, quant: str, seq: int, batch: int, targets=None, lora_r: int = LORA_R,
                           task: str = PROTOCOL_TASK) -> int:
    """An UPPER BOUND on a resident LoRA run's allocated peak (stream_layers off), for the map's lanes to pack by
    where the corrected resident estimate (``resident.estimate_run``) refuses the arm, and for nothing else: it is
    never printed, and is no estimate. Every term is charged at its most: the whole model with its linears in bf16
    and every vocab matrix in fp32 (NF4: what bitsandbytes does not quantise is cast to fp32); the adapter's
    fp32 weights, gradients and Adam states (16 B a parameter); every layer's saved activations and backward
    transients at once, in fp32 (an NF4 run's residual is fp32; checkpointing not credited); under NF4 every
    layer's weights in fp32 too (Qwen3.5-MoE's fused experts stay unquantised and are cast); 16 B a logits
    element (the loss's three fp32 blocks and a bf16 copy), twice for a task with a reference forward; and
    1 GiB. Measured against it: every committed resident row (tests/run/test_resident.py). A full fine-tuning
    (``lora_r`` 0: every parameter's gradient and optimizer states, none of which this bound charges) has none:
    refused (UsageError), so such an arm is never packed blind."""
    from ..estimator.arch import arch_from_config, layer_bytes, lora_params, protocol_targets
    from ..estimator.layer import kind_per_token, layer_per_token
    from ..model.registry import config_json, stream_mode
    from ..model.targets import soup_targets
    from ..tasks import task as task_named

    if lora_r == 0:
        raise UsageError("a full fine-tuning (lora.r 0) has no packing bound: it trains every parameter")
    family, _ = stream_mode(key)
    a = arch_from_config(config_json(family))
    tk = task_named(task)
    targets = protocol_targets(a) if targets is None else targets
    targets = soup_targets((targets,) if isinstance(targets, str) else tuple(targets), config_json(family), a,
                           str(targets))
    T = seq * batch * tk.rows_per_example * (2 if tk.kl_batch else 1)
    wide = 2 if quant == "nf4" else 1  # NF4: a MoE's fused experts are no Linear bnb quantises, so fp32 too
    weights = wide * a.L * layer_bytes(a, "none") + 4 * a.V * a.h * (1 if a.tied else 2)
    adapter = 16 * lora_params(a, tuple(t for t in targets if t in a.modules), lora_r)
    per_token = 2 * a.L * layer_per_token(a, "none", tuple(t for t in targets if t in a.modules), lora_r) \
        if a.layers is None else 4 * a.L * max(kind_per_token(a, k, targets, lora_r) for k in a.layers.kinds)
    return weights + adapter + T * per_token + 16 * T * a.V * (2 if tk.reference else 1) + 2**30


def run_config(run: MeasureRequest) -> Optional[dict]:
    """The config.json a custom base's arms are estimated from (its checkpoint's own, read once a run), or None:
    a registry base's public one is read by the estimate itself."""
    from ..constraints.emulation import arm_config

    return arm_config("custom", run.arm.checkpoint) if run.arm.checkpoint else None


def arm_needs(arm: Arm, run: MeasureRequest, config: Optional[dict] = None) -> Optional[tuple[int, int]]:
    """This tool's corrected needs-free and Soup's own number for an arm (None: not estimated here), by
    ``resident.estimate_run`` from the family's public config or ``config``, a custom base's checkpoint's
    (``run_config``). A resident arm the estimate refuses is packed by ``resident_packing_bound`` (a full
    fine-tuning's refused too: not packed blind); Soup's resident gate reads the card's total, never its free
    memory, so neighbours cannot turn its verdict (0: nothing to fit)."""
    from ..model.registry import known
    from ..estimator.estimate import needs_free
    from ..estimator.resident import estimate_run

    if arm.base == "custom" and config is None or arm.base != "custom" and not known(arm.model):
        return None
    resident = arm.streaming.resident
    try:
        e = estimate_run(arm, config)
        return e.needs_free, 0 if resident else e.soup_predicted
    except (UsageError, ValueError, TypeError):
        if not resident or arm.base == "custom":
            return None
    try:
        return needs_free(resident_packing_bound(arm.model, quant=arm.quant, seq=arm.seq, batch=arm.batch,
                                                 targets=arm.adapter.targets, lora_r=arm.adapter.lora_r,
                                                 task=arm.task)), 0
    except (UsageError, ValueError, TypeError):
        return None


def plan_lanes(run: MeasureRequest, arms: list[Arm], total: Optional[int] = None, cores: Optional[int] = None) -> Lanes:
    """--lanes N (or, bare, cores/4), at most as many lanes as there is work for, and the arms that must
    run alone: side by side each lane may have 1/N of the card, and Soup's gate reads the card's free
    memory, so an arm it admits alone is run alone unless its own number and this tool's needs-free
    both fit a lane's share (an arm Soup refuses alone is refused beside neighbours too).

    On the map (whole families per lane, no shared checkpoint cache) every arm runs in its family's lane,
    packed by bytes (issue 38, host/schedule.py): each holds this tool's needs-free for it, and arms run
    together while their bytes fit what the card leaves beside every live lane's CUDA context and growth,
    and Soup's number fits the free memory its gate reads. An arm that cannot fit beside the idle lanes
    runs after the lanes instead, so Soup's gate decides as it would alone."""
    from ..estimator.cards import Card, budget

    cores = cores or host_cores()
    units = len({family_of(a.model) for a in arms}) if run.map and not run.isolate else len(arms)
    count = run.children.lanes or max(1, cores // CORES_PER_LANE)
    why = f"--lanes {run.children.lanes}" if run.children.lanes else f"{cores} cores / {CORES_PER_LANE}"
    if count > units:
        unit = ("famil" + ("y" if units == 1 else "ies")) if run.map and not run.isolate else "arm" + ("" if units == 1 else "s")
        count, why = max(1, units), f"{why}, but only {units} {unit}"
    if total is None or count == 1:  # a dry run has no card to share
        return Lanes(count, max(1, cores // count), why=why)
    whole_card, lane = budget(Card("the card", total)), budget(Card("a lane's share", total // count))
    room = Room(card_total(total), count)
    packed = run.map and not run.isolate
    alone, in_lane, needs = [], [], []
    config = run_config(run)
    for arm in arms:
        found = arm_needs(arm, run, config)
        need = Need(*found) if found is not None else None
        fits = packed and need is not None and room.fits_beside_lanes(need)
        if fits:
            needs.append((arm.index, need.holds, need.soup))
        if found is None or not (found[1] > whole_card.harness_gate_free_bytes
                                 or (lane.fits(found[0]) and found[1] <= lane.harness_gate_free_bytes)):
            alone.append(arm)
            if fits:
                in_lane.append(arm)
        elif packed and not fits:  # fits a lane's share but not beside the idle lanes' contexts
            alone.append(arm)
    return Lanes(count, max(1, cores // count), tuple(alone), total // count, why, tuple(in_lane), tuple(needs), total)


def costliest_first(arms: list[Arm]) -> list[Arm]:
    """A lane's arms, its families costliest first (grid.arm_seconds' rough cost): its largest checkpoints
    are built first, one family ahead while its arms run, and the run's end is not one large family
    alone; each family's arms in grid order (rows are put back in grid order)."""
    cost: dict[str, float] = {}
    for a in arms:
        cost[family_of(a.model)] = cost.get(family_of(a.model), 0.0) + arm_seconds(a)
    rank = {f: i for i, f in enumerate(claim_order(cost))}
    return sorted(arms, key=lambda a: (rank[family_of(a.model)], a.index))


def visible_ids() -> Optional[list[str]]:
    """CUDA_VISIBLE_DEVICES as a list, or None when it is not set (every GPU is visible)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if visible is None else [v.strip() for v in visible.split(",") if v.strip()]


def visible_gpu(ordinal: int) -> str:
    """--gpus counts the GPUs this process sees; a child needs the id behind it."""
    ids = visible_ids() or []
    return ids[ordinal] if ordinal < len(ids) else str(ordinal)


def plan_jobs(run: MeasureRequest, arms: list[Arm], lanes: Optional[Lanes] = None) -> list[Job]:
    if lanes is not None:
        return lane_jobs(run, arms, lanes)
    if run.repeats:
        gpu = run.children.gpus[0] if run.children.gpus else None
        return [Job((a.index + 1, len(arms)), (a,), gpu, rep, extra_modes=(rep == 1 and a.index == 0))
                for rep in range(1, run.repeats + 1) for a in arms]
    if run.isolate:
        gpus = run.children.gpus or (None,)
        return [Job((a.index + 1, len(arms)), (a,), gpus[i % len(gpus)],
                    extra_modes=i == 0) for i, a in enumerate(arms)]
    n = len(run.children.gpus)
    jobs = [Job((k, n), tuple(shard_of(arms, (k, n), whole_models=run.map)), g, extra_modes=k == 1)
            for k, g in enumerate(run.children.gpus, 1)]
    return [j for j in jobs if j.arms or j.extra_modes]  # one family, two GPUs: one child


def lane_jobs(run: MeasureRequest, arms: list[Arm], lanes: Lanes) -> list[Job]:
    """--lanes: each GPU's lanes get shards of the arms that fit a lane (the map: whole families,
    dealt evenly, with their whole-card arms that run in the lane), or with --isolate one job per
    arm; the arms that need the card alone after the lanes come last."""
    gpus = run.children.gpus or (None,)
    alone = {a.index for a in lanes.after}
    fit = [a for a in arms if a.index not in alone]
    n = lanes.count * len(gpus)
    if run.isolate:
        jobs = [Job((a.index + 1, len(arms)), (a,), gpus[i % len(gpus)], extra_modes=i == 0)
                for i, a in enumerate(fit)]
    else:
        dealt = [costliest_first(shard_of(fit, (k, n), whole_models=True)) if run.map else fit[k - 1::n]
                 for k in range(1, n + 1)]
        jobs = [Job((k, n), tuple(d), gpus[(k - 1) % len(gpus)], extra_modes=k == 1)
                for k, d in enumerate(dealt, 1) if d or k == 1]
    alone_arms, m = list(lanes.after), len(gpus)
    if run.isolate:
        jobs += [Job((a.index + 1, len(arms)), (a,), gpus[i % m], whole_card=True) for i, a in enumerate(alone_arms)]
    else:
        jobs += [Job((k, m), tuple(shard_of(alone_arms, (k, m), whole_models=True) if run.map
                                   else alone_arms[k - 1::m]), g, whole_card=True) for k, g in enumerate(gpus, 1)]
    return [j for j in jobs if j.arms or j.extra_modes]


def spread(run: MeasureRequest, arms: list[Arm], scratch: Scratch, on_row: Callable[[Row], None],
           script: str, lanes: Optional[Lanes] = None) -> list[Result]:
    """Each job in a fresh process, one GPU's jobs in turn (with --lanes, up to N at once, a
    whole-card job alone), GPUs at once, rows taken up as each child saves them; a child that dies
    leaves a FAILED row for each arm it did not report, never a gap."""
    queues = gpu_queues(plan_jobs(run, arms, lanes))
    slots = lanes.count if lanes else 1
    running: dict[tuple[Optional[int], int], dict[str, Any]] = {}
    results: list[Result] = []
    count = 0
    cache = child_cache(run, scratch)
    folder = Path(tempfile.mkdtemp(dir=scratch.path("children")))  # one per spread: no stale files
    threads = child_threads(len(queues))
    needs = {n[0]: n for n in lanes.needs} if lanes else {}  # the map's lanes share their GPU's ledger
    disk = children_disk(cache, folder, scratch, lanes)

    def launch(gpu: Optional[int], slot: int) -> None:
        nonlocal count
        job = queues[gpu].pop(0)
        count += 1
        out = folder / f"{count:04d}.json"
        env = child_env(run, job, gpu, out, threads, lanes)
        write_job(Path(env[CHILD_JOB]), child_run(run, job, str(out), cache,
                                                  **card_ledger(job, gpu, folder, needs, lanes),
                                                  disk_ledger=disk.path if disk else None), job)
        # Its own process group: a terminal's Ctrl-C reaches the parent alone, which relays it
        # once (the child would otherwise get two, the second meaning "stop now").
        with open(out.with_suffix(".stdout"), "w") as fh:
            proc = subprocess.Popen([sys.executable, os.path.abspath(script)], env=env, stdout=fh,
                                    process_group=0)
        running[(gpu, slot)] = {"proc": proc, "job": job, "out": out, "seen": set(), "read": 0}

    def launch_free() -> None:
        for gpu in queues:
            while not Stop.requested and (slot := free_slot(queues, running, gpu, slots)) is not None:
                launch(gpu, slot)

    def settle(key: tuple[Optional[int], int]) -> None:
        entry = running.pop(key)
        job, code = entry["job"], entry["proc"].returncode
        if code:  # a child killed before its clean-up leaves its checkpoints: gone before the disk is given out again
            reap_dead_scratch(Path(tempfile.gettempdir()))
        take_rows(entry, new_rows(entry), on_row)
        with contextlib.suppress(OSError, ValueError):
            res = Result.from_json(json.loads(entry["out"].read_text()))
            take_rows(entry, res.rows, on_row)
            results.append(res)
        if not Stop.requested:
            for arm in job.arms:
                if (arm.index, job.repeat) not in entry["seen"]:
                    take_rows(entry, [lost_row(arm, run, job.repeat, code)], on_row)

    def relay() -> None:
        interrupt_children(running)

    Stop.relays.append(relay)
    try:
        launch_free()
        while running:
            time.sleep(0.2)
            for key in list(running):
                entry = running[key]
                take_rows(entry, new_rows(entry), on_row)
                if entry["proc"].poll() is not None:
                    settle(key)
            launch_free()
    finally:
        Stop.relays.remove(relay)
        terminate_children(running)  # a second Ctrl-C, SIGTERM or an error here
        for key in list(running):
            wait_or_kill(running[key]["proc"])
            settle(key)
    return results


def gpu_queues(jobs: list[Job]) -> dict[Optional[int], list[Job]]:
    """The jobs in queues by GPU, each in its planned order."""
    queues: dict[Optional[int], list[Job]] = {}
    for job in jobs:
        queues.setdefault(job.gpu, []).append(job)
    return queues


def take_rows(entry: dict[str, Any], rows: Iterable[Row], on_row: Callable[[Row], None]) -> None:
    """A child's rows handed on once each, however often the child's files are read."""
    for row in rows:
        if (row.index, row.repeat) not in entry["seen"]:
            entry["seen"].add((row.index, row.repeat))
            on_row(row)


def child_threads(gpus: int) -> str:
    """The threads a child takes, side by side with the children of ``gpus`` GPUs (without --lanes)."""
    # Each child would take a thread per core; side by side they stall each other's parallel
    # copies into Soup's pinned store (measured on CPU: 0.06-0.15 s alone, up to 1.9 s beside
    # a busy twin). A share of the cores each; host-side only. --lanes: cores/N each (the issue's
    # measurement), a whole-card job all of them.
    return str(max(1, min(8, (os.cpu_count() or 2) // max(1, gpus) - 2)))


def children_disk(cache: Optional[str], folder: Path, scratch: Scratch, lanes: Optional[Lanes]) -> Optional[DiskLedger]:
    """The disk ledger children that build and free their own checkpoints share (none where they share a
    cache), so builds at once never outgrow the disk they are built on; with --lanes, its budget said."""
    disk = None if cache else DiskLedger.create(str(folder / "disk.json"), str(scratch.root))
    if disk is not None and lanes:
        print(f"checkpoints' disk: {disk.budget / 1e9:.1f} GB for the lanes' builds at once (its free bytes at the "
              f"start, measured, less {DISK_HEADROOM_BYTES / 2**30:.0f} GiB for logs and rows)", file=sys.stderr, flush=True)
    return disk


def free_slot(queues: dict, running: dict, gpu: Optional[int], slots: int) -> Optional[int]:
    """A lane of this GPU its next job may take now: a whole-card job waits for an idle GPU,
    and nothing starts beside one."""
    mine = [k for g, k in running if g == gpu]
    if not queues[gpu] or any(running[(gpu, k)]["job"].whole_card for k in mine):
        return None
    if queues[gpu][0].whole_card:
        return 0 if not mine else None
    return next((k for k in range(slots) if k not in mine), None)


def child_env(run: MeasureRequest, job: Job, gpu: Optional[int], out: Path, threads: str,
              lanes: Optional[Lanes]) -> dict:
    """A child's environment: its GPU, its share of the host's threads, the allocator `soup train` sets
    where the arm needs a fresh process, and where its job and its parent are."""
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_gpu(gpu)
    mine = threads if lanes is None else str(host_cores() if job.whole_card else lanes.threads)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
        env.setdefault(var, mine) if lanes is None else env.__setitem__(var, mine)
    if run.constraints.fresh:  # as `soup train` sets it, before CUDA starts: only a fresh process can
        env[ALLOC_CONF_VAR] = EXPANDABLE_SEGMENTS
    env[CHILD_JOB] = str(out.with_suffix(".job.json"))
    env[PARENT_PID] = str(os.getpid())
    return env


def card_ledger(job: Job, gpu: Optional[int], folder: Path, needs: dict, lanes: Optional[Lanes]) -> dict:
    """Where a lane's job claims its arms' bytes of the card beside the other lanes (the ledger its GPU's
    lanes share, the card's total, each arm's need); none for a whole-card job or where nothing is known."""
    return {} if job.whole_card or not needs or lanes.total is None else dict(
        ledger=str(folder / f"card-{gpu if gpu is not None else 'visible'}.json"),
        card_total=card_total(lanes.total), needs=tuple(needs[a.index] for a in job.arms if a.index in needs))


def new_rows(entry: dict[str, Any]) -> list[Row]:
    """The rows a child saved since the last look: whole lines only (the last may be
    half-written), past its header; a line that does not parse is left for the child's final JSON."""
    try:
        with open(RowFile.path_for(str(entry["out"])), "rb") as fh:
            fh.seek(entry["read"])
            chunk = fh.read()
        whole, done = RowFile.whole_lines(chunk)
        lines = [json.loads(line) for line in whole]
        rows = [Row.from_json(line) for line in lines if not RowFile.is_header(line)]
    except (OSError, ValueError):
        return []
    entry["read"] += done
    return rows


def interrupt_children(running: dict) -> None:
    """A Ctrl-C relayed once to every child still running (each is its own process group)."""
    for entry in running.values():
        if entry["proc"].poll() is None:
            with contextlib.suppress(OSError):
                entry["proc"].send_signal(signal.SIGINT)


def terminate_children(running: dict) -> None:
    """SIGTERM to every child still running: the parent is stopping now."""
    for entry in running.values():
        if entry["proc"].poll() is None:
            entry["proc"].send_signal(signal.SIGTERM)


def wait_or_kill(proc: subprocess.Popen) -> None:
    """A child given 30 s to end after SIGTERM, then killed."""
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def child_cache(run: MeasureRequest, scratch: Scratch) -> Optional[str]:
    """Children share one cache so a model is built and sharded once; but the map's families would
    not fit a disk together, so there each child keeps its own and frees each family after it. A
    --cap child runs one arm: it shares, or every arm would build and shard its family again."""
    shared = not run.map or run.constraints.fresh
    return run.cache_dir or (str(scratch.path("cache")) if shared else None)


def child_run(run: MeasureRequest, job: Job, out: str, cache: Optional[str], ledger: Optional[str] = None,
              card_total: Optional[int] = None, needs: tuple = (), disk_ledger: Optional[str] = None) -> MeasureRequest:
    """The settled run a child executes: its parent's, narrowed to one job in one process, its
    rows saved to its own JSON (a lane of the map: its GPU's ledger, the card's bytes and what each of
    its arms holds). Nothing is re-parsed: the child gets this as data."""
    return replace(run, outputs=Outputs(json=out), cache_dir=cache, children=Children(
                   shard=job.shard, child=True, repeat_tag=job.repeat, ledger=ledger, card_total=card_total,
                   needs=needs, disk_ledger=disk_ledger),
                   isolate=False, repeats=None, run_arms=True,
                   measure=run.measure and job.extra_modes, sdpa=run.sdpa and job.extra_modes)


def die_with_parent() -> None:
    """A child whose parent is SIGKILLed gets SIGTERM (it stops as on any SIGTERM) rather than
    running on as an orphan holding a GPU. Linux only; elsewhere the parent's clean-up is all."""
    parent = os.environ.pop(PARENT_PID, None)
    if not parent or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != int(parent):  # it died before prctl: that signal will never come
        os.kill(os.getpid(), signal.SIGTERM)


def write_job(path: Path, run: MeasureRequest, job: Job) -> None:
    path.write_text(json.dumps({"run": asdict(run), "job": dict(
        asdict(job), arms=[asdict(a) for a in job.arms])}, indent=1), encoding="utf-8")


def read_job(path: str) -> tuple[MeasureRequest, Job]:
    """A child's work, as its parent wrote it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        j = data["job"]
        job = Job(shard=tuple(j["shard"]), arms=tuple(map(Arm.from_json, j["arms"])), gpu=j["gpu"],
                  repeat=j["repeat"], extra_modes=j["extra_modes"], whole_card=j.get("whole_card", False))
        return measure_from_json(data["run"]), job
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"child job {path}: cannot be read ({last_line(exc)})") from None


def lost_row(arm: Arm, run: MeasureRequest, repeat: Optional[int], code: Optional[int]) -> Row:
    """A FAILED row for an arm whose process died before reporting it (no prediction: this
    process does not import Soup); a --config arm's names its file and adapter as a live one does, and it
    carries its arm's task, optimizer and accumulation as a live one's row does (``arm_identity``)."""
    shape = SHAPES.get(family_of(arm.model))
    family = FAMILIES.get(family_of(arm.model))  # a streaming mode is its family's
    name = shape.name if shape else family.name if family else (arm.checkpoint or arm.model)
    vocab = shape.vocab if shape else family.vocab if family else 1
    a = arm.adapter
    adapter = (dict(config=UserConfig(a.soup_config, a.lora_r, a.lora_alpha, a.dropout), targets=tuple(a.targets or ()) if a.lora_r else ())
               if a.soup_config else {})
    return Row(model=name, model_key=arm.model, seq=arm.seq, batch=arm.batch, index=arm.index,
               constraint=run.constraints.lost(),
               predicted=None, logits14=None, loss_bytes_per_element=None, vocab=vocab,
               quant=arm.quant, repeat=repeat,
               dry_run=run.dry_run, failure="FAILED",
               error=f"its process exited with code {code} before this arm reported", **adapter,
               **arm_identity(arm))


def visible_gpu_count() -> int:
    """GPUs this process may use, without importing torch (a fan-out parent never does)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        count = len([ln for ln in out.stdout.splitlines() if ln.startswith("GPU ")]) if out.returncode == 0 else 0
    except (OSError, subprocess.TimeoutExpired):
        count = 0
    ids = visible_ids()
    return count if ids is None else min(count, len(ids))
