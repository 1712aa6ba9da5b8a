"""issue395.host.spread: jobs and children. A first Ctrl-C to a --gpus parent reaches its children, each
stopping after its own arm in flight; a SIGKILLed parent leaves no orphan (issue 22, defect 9); a
child gets its settled MeasureRequest and Job back as data; a map is dealt one child per GPU with whole
families; a lost arm's row keeps its cap or card.

Real child processes on CPU; each child stands in for the harness's (it reads its job file as the
harness's does, installs the same Stop, and "measures" an arm by sleeping: no Soup, no GPU).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import ROOT, main

from issue395.measure.console import Stop
from issue395.host.grid import PROTOCOL_RUN, plan_map
from issue395.host.measured import Children, MeasureRequest
from issue395.constraints.asked import Constraints
from issue395.results.extras import Capped, UserConfig
from issue395.model.arm import Adapter, Arm, Settings
from issue395.record import QUANTS
from issue395.host.scratch import Scratch
from issue395.host.spread import spread
from issue395.host.spread import Job, child_cache, child_run, plan_jobs, read_job, write_job

#: What every stand-in child does first: the real child's own job file, its stop handler, its row file
#: with a header (a stand-in stack), as the real child's runner starts it.
CHILD_PREAMBLE = """
    import os, sys, time
    sys.path.insert(0, {root!r})
    from issue395.measure.console import Stop
    from issue395.results.saved import RowFile
    from issue395.host.spread import CHILD_JOB, die_with_parent, lost_row, read_job

    die_with_parent()
    run, job = read_job(os.environ[CHILD_JOB])
    Stop.install(quiet=True)
    rows = RowFile(run.outputs.json, {{"torch": "stand-in", "command": "child"}}, "map" if run.map else "sweep")
"""

SLEEPY_CHILD = textwrap.dedent(CHILD_PREAMBLE + """    try:
        for arm in job.arms:
            if Stop.requested:
                break
            with Stop.arm():
                with open({started!r}, "a") as fh:
                    fh.write(f"{{os.getpid()}}\\n")
                time.sleep({arm_s})
            rows.add(lost_row(arm, run, None, 0))
    except KeyboardInterrupt:
        pass
""")


def sleepy_child(tmp_path: Path, arm_s: float) -> tuple[Path, Path]:
    started = tmp_path / "started"
    script = tmp_path / "child.py"
    script.write_text(SLEEPY_CHILD.format(root=str(ROOT), started=str(started), arm_s=arm_s))
    return script, started


def wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_one_ctrl_c_to_a_gpus_parent_stops_each_child_after_its_arm_in_flight(tmp_path):
    script, started = sleepy_child(tmp_path, arm_s=1.5)
    arms = [Arm("smol", 64, 1, i) for i in range(4)]
    run = MeasureRequest(models=("smol",), seqs=(64,), children=Children(gpus=(0, 1)), dry_run=True)
    rows = []

    def ctrl_c_once_both_children_measure():
        if wait_for(lambda: started.exists() and len(started.read_text().split()) >= 2):
            os.kill(os.getpid(), signal.SIGINT)

    Stop.install(quiet=True)
    threading.Thread(target=ctrl_c_once_both_children_measure, daemon=True).start()
    with Scratch() as scratch, Stop.arm():
        spread(run, arms, scratch, rows.append, str(script))
    assert Stop.requested
    # Two children, two arms each: each finished the arm it had in flight and began no other.
    assert len(started.read_text().split()) == 2, started.read_text()
    assert len(rows) == 2 and all(r.failure == "FAILED" for r in rows)


PARENT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from issue395.host.measured import Children, MeasureRequest
    from issue395.model.arm import Arm, Settings
    from issue395.host.scratch import Scratch
    from issue395.host.spread import spread

    with Scratch() as scratch:
        spread(MeasureRequest(models=("smol",), seqs=(64,), children=Children(gpus=(0,)), dry_run=True), [Arm("smol", 64, 1, 0)],
               scratch, print, {script!r})
""")


def test_a_sigkilled_gpus_parent_leaves_no_child_running(tmp_path):
    script, started = sleepy_child(tmp_path, arm_s=120)
    parent = tmp_path / "parent.py"
    parent.write_text(PARENT.format(root=str(ROOT), script=str(script)))
    proc = subprocess.Popen([sys.executable, str(parent)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: started.exists() and started.read_text().strip())
        child = int(started.read_text().split()[0])
        proc.kill()
        proc.wait()

        def gone() -> bool:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return True
            # a zombie the init process has not yet reaped counts as gone
            stat = Path(f"/proc/{child}/stat")
            return stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z"

        assert wait_for(gone, timeout=15), "the child outlived its SIGKILLed parent"
    finally:
        proc.kill()
        if started.exists():
            for pid in started.read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass

# issue395.host.spread: children get their settled MeasureRequest and Job back as data, their own scratch and cache.

def child_job(tmp_path, **run):
    """A child's work as its parent hands it over (a job file) and as the child reads it back."""
    job = Job((1, 2), (Arm("smol", 2048),), gpu=1, repeat=2, extra_modes=True)
    path = tmp_path / "job.json"
    write_job(path, child_run(MeasureRequest(**run), job, "out.json", "/tmp/cache"), job)
    return job, read_job(str(path))


def test_a_child_of_a_model_run_gets_its_settled_run_and_job_back_as_data(tmp_path):
    job, (run, back) = child_job(tmp_path, arm=replace(PROTOCOL_RUN, checkpoint="/some/checkpoint"), models=("custom",),
                                 seqs=(64,), weights="local", isolate=True, children=Children(gpus=(0, 1)),
                                 measure=True)
    assert back == job
    assert (run.arm.checkpoint, run.models, run.seqs, run.weights) == ("/some/checkpoint", ("custom",), (64,),
                                                                      "local")
    assert (run.isolate, run.children) == (False, Children(gpus=None, shard=(1, 2), child=True, repeat_tag=2))
    assert (run.outputs.json, run.cache_dir, run.measure) == ("out.json", "/tmp/cache", True)


def test_a_map_child_inherits_the_default_quantizations_rather_than_demanding_nf4(tmp_path):
    _, (run, _) = child_job(tmp_path, map=True, models=("smol",), quants=QUANTS, batches=(1, 4))
    assert run.map and run.quants == QUANTS and run.batches == (1, 4)


def test_a_map_spread_gives_children_their_own_scratch_so_each_family_can_be_freed(tmp_path):
    with Scratch() as scratch:
        assert child_cache(MeasureRequest(map=True, models=("smol",)), scratch) is None
        shared = child_cache(MeasureRequest(models=("smol",)), scratch)
        assert shared is not None and Path(shared).is_relative_to(scratch.root)
        assert child_cache(MeasureRequest(map=True, cache_dir=str(tmp_path)), scratch) == str(tmp_path)


def test_a_capped_map_child_shares_the_cache_and_a_lost_capped_arm_stays_in_the_cap_table():
    from issue395.host.spread import lost_row

    with Scratch() as scratch:
        assert child_cache(MeasureRequest(map=True, models=("smol",), constraints=Constraints(cap="soup")), scratch) is not None
    row = lost_row(Arm("smol", 2048), MeasureRequest(constraints=Constraints(cap="soup")), None, 139)
    assert row.constraint == Capped("soup") and row.status == "FAILED"


def test_a_lost_emulated_arm_keeps_its_card():
    from issue395.host.spread import lost_row

    row = lost_row(Arm("smol", 2048), MeasureRequest(constraints=Constraints(emulate_card="t4")), None, 139)
    assert row.constraint.card == "T4" and row.emulated_outcome == "FAILED"


def test_a_map_spread_over_two_gpus_starts_one_child_per_gpu_each_with_whole_families():
    arms = plan_map(("smol", "qwen", "mistral-7b"), ("none",), (2048,), (1,))
    jobs = plan_jobs(MeasureRequest(map=True, models=("smol", "qwen", "mistral-7b"), children=Children(gpus=(0, 1))), arms)
    assert [sorted({a.model for a in j.arms}) for j in jobs] == [["mistral-7b"], ["qwen", "smol"]]
    one = plan_jobs(MeasureRequest(map=True, models=("smol",), children=Children(gpus=(0, 1))), arms[:1])
    assert len(one) == 1, "a second GPU with no family to run started a child anyway"


def test_a_config_arms_child_gets_the_files_adapter_and_quantization_and_a_lost_one_names_them(tmp_path):
    """--config's arm under --emulate-card runs in a fresh child: the settled MeasureRequest it reads back is the
    parent's to the field (the file, its targets, r and alpha), its one arm at the file's NF4, optimizer and
    accumulation (Soup's defaults, which the file leaves); a child that dies leaves a row naming the same file,
    adapter and run."""
    from issue395.run.options import settle
    from issue395.run.parser import build_parser
    from issue395.host.spread import lost_row

    config = tmp_path / "soup.yaml"
    config.write_text("base: mistralai/Mistral-7B-v0.3\ndata: {train: d.jsonl, max_length: 512}\ntraining:\n"
                      "  batch_size: 1\n  quantization: 4bit\n  stream_layers: true\n  lora: {r: 4, alpha: 8, target_modules: [q_proj]}\n")
    argv = ["--config", str(config), "--emulate-card", "T4"]
    parent = settle(build_parser().parse_args(argv), argv)
    (job,) = plan_jobs(parent, parent.arms())
    path = tmp_path / "job.json"
    sent = child_run(parent, job, "out.json", "/tmp/cache")
    write_job(path, sent, job)
    run, back = read_job(str(path))
    from soup_cli.config.schema import TrainingConfig

    accumulation = TrainingConfig.model_fields["gradient_accumulation_steps"].default  # Soup's: the file sets none
    assert run == sent and back == job and back.arms == (
        Arm("mistral-7b", 512, 1, 0, "nf4", settings=Settings("adamw_torch", accumulation, 2),
            adapter=Adapter(("q_proj",), 4, 8, str(config))),)
    assert run.arm.adapter == Adapter(("q_proj",), 4, 8, str(config))
    row = lost_row(back.arms[0], run, None, 139)
    assert (row.config, row.targets, row.quant) == (UserConfig(str(config), 4, 8), ("q_proj",), "nf4")
    assert (row.settings.optimizer, row.settings.accumulation) == ("adamw_torch", accumulation)


# --lanes (issue 30): lanes at once on one GPU, whole-card arms alone after them, a dead lane's arms FAILED

LANE_CHILD = textwrap.dedent(CHILD_PREAMBLE + """    log = open({log!r}, "a")
    log.write(f"start {{os.getpid()}} {{time.monotonic()}} {{job.whole_card}} {{os.environ['OMP_NUM_THREADS']}}\\n")
    log.flush()
    for arm in job.arms:
        time.sleep(0.4)
        if arm.index == {dies_at}:
            os._exit(3)  # the lane dies before it reports this arm
        rows.add(lost_row(arm, run, None, 0))
    log.write(f"end {{os.getpid()}} {{time.monotonic()}} {{job.whole_card}}\\n")
""")


def lane_child(tmp_path: Path, dies_at: int = -1) -> tuple[Path, Path]:
    log = tmp_path / "lanes.log"
    script = tmp_path / "lane.py"
    script.write_text(LANE_CHILD.format(root=str(ROOT), log=str(log), dies_at=dies_at))
    return script, log


def spans(log: Path) -> dict[str, dict]:
    """Each child's start and end (monotonic seconds), whole-card flag and threads."""
    out: dict[str, dict] = {}
    for line in log.read_text().splitlines():
        word, pid, t, whole, *threads = line.split()
        out.setdefault(pid, {"whole": whole == "True"})[word] = float(t)
        if threads:
            out[pid]["threads"] = threads[0]
    return out


def test_two_lanes_run_at_once_on_one_gpu_and_a_whole_card_arm_runs_alone_after_them(tmp_path):
    """Stand-in children (no Soup, no GPU): four arms in two lanes at once, threads bounded per lane;
    the arm that needs the card to itself starts only once both lanes have exited."""
    from issue395.host.spread import Lanes

    script, log = lane_child(tmp_path)
    arms = [Arm("smol", 64 * (i + 1), 1, i) for i in range(5)]
    lanes = Lanes(2, 3, whole_card=(arms[4],), share=1, why="test")
    rows = []
    with Scratch() as scratch:
        spread(MeasureRequest(children=Children(lanes=2), dry_run=True), arms, scratch, rows.append, str(script), lanes)
    assert sorted(r.index for r in rows) == [0, 1, 2, 3, 4]
    children = spans(log)
    lane, whole = [c for c in children.values() if not c["whole"]], [c for c in children.values() if c["whole"]]
    assert len(lane) == 2 and len(whole) == 1
    assert max(c["start"] for c in lane) < min(c["end"] for c in lane), "the two lanes did not overlap"
    assert whole[0]["start"] >= max(c["end"] for c in lane), "the whole-card arm ran beside a lane"
    assert {c["threads"] for c in lane} == {"3"}


def test_a_lane_that_dies_leaves_a_failed_row_for_each_arm_it_did_not_report_never_a_lost_row(tmp_path):
    """Stand-in children: the lane holding arm 1 exits with code 3 before reporting it; its later arm
    and the other lane's arms are all rows, grid order kept by index."""
    from issue395.host.spread import Lanes

    script, _ = lane_child(tmp_path, dies_at=1)
    arms = [Arm("smol", 64 * (i + 1), 1, i) for i in range(4)]
    rows = []
    with Scratch() as scratch:
        spread(MeasureRequest(children=Children(lanes=2), dry_run=True), arms, scratch, rows.append, str(script), Lanes(2, 1, why="test"))
    by_index = {r.index: r for r in rows}
    assert sorted(by_index) == [0, 1, 2, 3], "an arm of the dead lane was lost"
    dead = [i for i, r in by_index.items() if "exited with code 3" in (r.error or "")]
    assert dead == [1, 3] and all(by_index[i].failure == "FAILED" for i in dead)
    assert all("code 3" not in (by_index[i].error or "") for i in (0, 2))


SAVES_THEN_DIES = textwrap.dedent(CHILD_PREAMBLE + """    for arm in job.arms:
        rows.add(lost_row(arm, run, None, 42))  # a row only its row file holds: the child writes no JSON
    os._exit(3)
""")


def test_a_lanes_rows_past_its_row_files_header_reach_the_parent_when_it_dies_before_its_json(tmp_path):
    """Stand-in children that save every arm's row (marked code 42) to a row file with a header, then
    exit 3 with no JSON: the parent has each row from the file, none as lost with code 3."""
    from issue395.host.spread import Lanes

    script = tmp_path / "saves.py"
    script.write_text(SAVES_THEN_DIES.format(root=str(ROOT)))
    arms = [Arm("smol", 64 * (i + 1), 1, i) for i in range(4)]
    rows = []
    with Scratch() as scratch:
        spread(MeasureRequest(children=Children(lanes=2), dry_run=True), arms, scratch, rows.append, str(script), Lanes(2, 1, why="test"))
    assert sorted(r.index for r in rows) == [0, 1, 2, 3]
    assert all("code 42" in (r.error or "") for r in rows), [r.error for r in rows]


def test_a_map_in_lanes_runs_a_familys_whole_card_arms_in_its_own_lane_and_a_sweep_after_the_lanes():
    """The real estimator on the registry's configs: on a 10 GB card in two lanes (5 GB each),
    Qwen2.5 at 2048 (Soup's number 4.85 GB) and SmolLM2 at 6144 (4.59 GB) cannot share the card but
    are admitted alone; SmolLM2 at 2048 fits a lane; Qwen2.5 at 6144 (13.8 GB) is refused by Soup's
    gate alone, so beside neighbours too, and stays in its lane. On the map the two whole-card arms
    run in their family's lane (its checkpoint is there), no whole-card job; a sweep of the same
    arms (whose children share one cache) keeps them for a job after the lanes."""
    from issue395.host.spread import Lanes, lane_jobs, plan_lanes

    run = MeasureRequest(map=True, models=("smol", "qwen"), children=Children(lanes=2))
    arms = plan_map(("smol", "qwen"), ("none",), (2048, 6144), (1,))
    plan = plan_lanes(run, arms, total=10 * 10**9, cores=8)
    assert (plan.count, plan.threads) == (2, 4)
    assert [(a.model, a.seq) for a in plan.whole_card] == [("smol", 6144), ("qwen", 2048)]
    assert plan.in_lane == plan.whole_card and plan.after == ()
    jobs = lane_jobs(run, arms, plan)
    assert not any(j.whole_card for j in jobs), "the map spawned a separate whole-card job"
    assert sorted(sorted((a.model, a.seq) for a in j.arms) for j in jobs) == [
        [("qwen", 2048), ("qwen", 6144)], [("smol", 2048), ("smol", 6144)]]
    assert "all ran in their family's lane beside the other lanes' arms whenever their bytes fit" in plan.label(run)
    assert "packed by bytes: each arm holds this tool's needs-free for it" in plan.label(run)
    # every map arm is packed by its own bytes: this tool's needs-free and Soup's number
    from issue395.estimator.estimate import estimate_key
    assert {i: (h, s) for i, h, s in plan.needs} == {
        a.index: (estimate_key(a.model, seq=a.seq).needs_free, estimate_key(a.model, seq=a.seq).soup_predicted)
        for a in arms}
    sweep = MeasureRequest(models=("smol", "qwen"), children=Children(lanes=2))
    alone = [j for j in lane_jobs(sweep, arms, plan_lanes(sweep, arms, total=10 * 10**9, cores=8)) if j.whole_card]
    assert [[(a.model, a.seq) for a in j.arms] for j in alone] == [[("smol", 6144), ("qwen", 2048)]]
    assert plan_lanes(run, arms, total=None, cores=8).whole_card == (), "a dry run has no card to share"
    bare = plan_lanes(MeasureRequest(map=True, models=("smol", "qwen"), children=Children(lanes=0)), arms, total=None, cores=16)
    assert bare.count == 2 and "only 2 families" in bare.why, "bare --lanes ran more lanes than families"
    assert Lanes(4, 4, why="x").label(MeasureRequest()).startswith("4 lanes on one GPU (4 threads each; x)")


def test_a_map_arm_that_does_not_fit_beside_the_idle_lanes_runs_after_them_alone():
    """On a 6.8 GB card in two lanes the idle lane keeps its context bound and the step's runtime
    growth (1.11 GB): SmolLM2 at 6144 (Soup's number 4.59 GB) still fits beside it and runs in its
    lane; Qwen2.5 at 2048 (4.85 GB) would be admitted alone but not beside it, so it runs after the
    lanes, alone, as Soup's gate would see an idle card."""
    from issue395.host.spread import lane_jobs, plan_lanes

    run = MeasureRequest(map=True, models=("smol", "qwen"), children=Children(lanes=2))
    arms = plan_map(("smol", "qwen"), ("none",), (2048, 6144), (1,))
    plan = plan_lanes(run, arms, total=6_800_000_000, cores=8)
    assert [(a.model, a.seq) for a in plan.in_lane] == [("smol", 6144)]
    assert [(a.model, a.seq) for a in plan.after] == [("qwen", 2048)]
    alone = [j for j in lane_jobs(run, arms, plan) if j.whole_card]
    assert [[(a.model, a.seq) for a in j.arms] for j in alone] == [[("qwen", 2048)]]
    assert "1 (not fitting beside the idle lanes) after the lanes, alone" in plan.label(run)


def test_a_lanes_whole_card_judgement_reads_the_arms_task():
    """A DPO arm's needs are DPO's (its policy and reference logits over 2 x batch rows), not SFT's at
    the same shape: a lane's share is judged on what the arm will hold (it read SFT's before)."""
    from issue395.estimator.estimate import estimate_key
    from issue395.host.spread import arm_needs

    run = MeasureRequest()
    sft, dpo = (arm_needs(Arm("qwen", 2048, 2, 0, "none", t), run) for t in ("sft", "dpo"))
    assert dpo == (estimate_key("qwen", seq=2048, batch=2, task="dpo").needs_free,
                   estimate_key("qwen", seq=2048, batch=2, task="dpo").soup_predicted)
    assert dpo[0] > 1.4 * sft[0]


def test_a_lane_runs_its_families_costliest_first_and_each_familys_arms_in_grid_order():
    """Two lanes over four families (the grid's rough cost: 3 s an arm plus 0.7 s a billion parameters):
    each lane builds its largest checkpoint first, one family ahead while the next runs."""
    from issue395.host.spread import Lanes, lane_jobs

    families = ("smol", "qwen", "llama32-1b", "mistral-7b")
    run = MeasureRequest(map=True, models=families, children=Children(lanes=2))
    arms = plan_map(families, ("none",), (512, 1024), (1,))
    jobs = lane_jobs(run, arms, Lanes(2, 2, why="test"))
    order = [list(dict.fromkeys(a.model for a in j.arms)) for j in jobs]
    assert order == [["mistral-7b"], ["llama32-1b", "qwen", "smol"]]
    for j in jobs:
        for fam in {a.model for a in j.arms}:
            mine = [a.index for a in j.arms if a.model == fam]
            assert mine == sorted(mine)


def test_a_map_lanes_child_gets_its_gpus_ledger_the_cards_bytes_and_its_own_arms_needs(tmp_path):
    """spread hands each lane child the ledger of its GPU, the bytes CUDA hands out of the card (the
    H200's driver total less its hidden 616 MiB) and, of the plan's needs, those of its own arms only;
    the child's settled Run reads them back (stand-in children: no Soup, no GPU)."""
    from issue395.estimator.cards import CARDS
    from issue395.host.spread import Lanes

    script, _ = lane_child(tmp_path)
    arms = [Arm(("smol", "qwen")[i // 2], 64 * (i + 1), 1, i) for i in range(4)]
    h200 = CARDS["h200"]
    lanes = Lanes(2, 1, why="test", needs=tuple((a.index, 10**9 * (a.index + 1), None) for a in arms),
                  total=h200.total_bytes)
    seen = []
    with Scratch() as scratch:
        spread(MeasureRequest(map=True, children=Children(lanes=2), dry_run=True), arms, scratch, lambda r: None, str(script),
               lanes)
        for job_file in sorted(Path(scratch.path("children")).rglob("*.job.json")):
            seen.append(read_job(str(job_file)))
    assert len(seen) == 2
    ledgers = {run.children.ledger for run, _ in seen}
    assert len(ledgers) == 1 and None not in ledgers, "the lanes of one GPU did not share one ledger"
    for run, job in seen:
        assert run.children.card_total == h200.total_bytes - h200.hidden_bytes
        assert [tuple(n) for n in run.children.needs] == [(a.index, 10**9 * (a.index + 1), None) for a in job.arms]


# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


@pytest.mark.slow
def test_lanes_on_a_cpu_dry_run_say_cpu_not_one_gpu_and_count_in_the_singular(capfd, cache_dir):
    """Issue 36 polish: --lanes on a CPU dry run says the CPU, not one GPU, and counts one arm in the
    singular."""
    code, out, err = main(capfd, ["--dry-run", "--lanes", "1000", "--models", "smol", "--seq", "64",
                                  "--cache-dir", cache_dir])
    assert code == 0, err
    head = out.splitlines()[0]
    assert "only 1 arm)" in head or "only 1 arm," in head, head
    assert "1 arms" not in head and "1 families" not in head
    code, out, err = main(capfd, ["--dry-run", "--lanes", "2", "--models", "smol", "--seq", "64,128",
                                  "--cache-dir", cache_dir])
    assert code == 0, err
    head = out.splitlines()[0]
    assert "GPU none" in head and "on one GPU" not in head and "on the CPU" in head, head


def test_a_full_fine_tunings_packing_need_is_at_least_its_resident_estimate():
    """A full fine-tuning (lora.r 0) is packed by the corrected resident estimate, never by the LoRA packing bound,
    which charges no parameter gradient or optimizer state (it gave Llama-3.2-1B 512x1 7.67 GB against the
    estimate's 12.90 GB): its lane need is at least the estimate, and the bound refuses r 0 (reviewer item 1)."""
    from issue395.errors import UsageError
    from issue395.estimator.resident import estimate_resident
    from issue395.host.spread import arm_needs, resident_packing_bound
    from issue395.model.registry import config_json

    for family in ("llama32-1b", "gemma2-2b"):
        arm = Arm.at(f"{family}+resident", 512, adapter=Adapter(lora_r=0))
        try:  # the installed stack's: gemma2 on a stack whose transformers runs it eager, on fp32 master weights, is
            # refused (full.py says why)
            want = estimate_resident(config_json(family), seq=512, lora_r=0).corrected_predicted
        except UsageError:
            assert arm_needs(arm, MeasureRequest()) is None  # refused: not packed blind
            continue
        need, soup = arm_needs(arm, MeasureRequest())
        assert need >= want and soup == 0
        with pytest.raises(UsageError):
            resident_packing_bound(arm.model, quant="none", seq=512, batch=1, lora_r=0)
    # where the estimate refuses a full fine-tuning (NF4: Soup's loader refuses it) it is not packed blind
    assert arm_needs(Arm.at("qwen+resident", 512, quant="nf4", adapter=Adapter(lora_r=0)), MeasureRequest()) is None


def test_a_custom_base_arm_gets_a_lane_estimate_from_its_checkpoints_config(tmp_path):
    """A custom checkpoint's arm (--model, --config) is estimated from its own config.json (read once a run) for the
    lanes, as the registry family with that config is; without it, none (reviewer item 1)."""
    import json

    from issue395.host.spread import arm_needs, run_config
    from issue395.model.registry import config_json

    (tmp_path / "config.json").write_text(json.dumps(config_json("qwen")))
    run = MeasureRequest(models=("custom", "custom+resident"), seqs=(1024,),
                         arm=replace(PROTOCOL_RUN, checkpoint=str(tmp_path)))
    config = run_config(run)
    custom = run.arms()
    assert [a.base for a in custom] == ["custom", "custom"] and config == config_json("qwen")
    for arm, key in zip(custom, ("qwen", "qwen+resident")):
        assert arm_needs(arm, run, config) == arm_needs(Arm.at(key, 1024), MeasureRequest())
        assert arm_needs(arm, run) is None  # no config read: not estimated, so it is run alone
