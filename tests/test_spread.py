"""issue395.spread: children get their settled Run and Job back as data, their own scratch and cache."""

from __future__ import annotations
from pathlib import Path
from issue395.options import Run
from issue395.record import QUANTS, Arm
from issue395.scratch import Scratch
from issue395.spread import Job, child_cache, child_run, read_job, write_job


def child_job(tmp_path, **run):
    """A child's work as its parent hands it over (a job file) and as the child reads it back."""
    job = Job((1, 2), (Arm("smol", 2048),), gpu=1, repeat=2, extra_modes=True)
    path = tmp_path / "job.json"
    write_job(path, child_run(Run(**run), job, "out.json", "/tmp/cache"), job)
    return job, read_job(str(path))


def test_a_child_of_a_model_run_gets_its_settled_run_and_job_back_as_data(tmp_path):
    job, (run, back) = child_job(tmp_path, custom_model="/some/checkpoint", models=("custom",),
                                 seqs=(64,), weights="local", isolate=True, gpus=(0, 1), measure=True)
    assert back == job
    assert (run.custom_model, run.models, run.seqs, run.weights) == ("/some/checkpoint", ("custom",), (64,),
                                                                      "local")
    assert (run.child, run.isolate, run.gpus, run.shard, run.repeat_tag) == (True, False, None, (1, 2), 2)
    assert (run.json, run.cache_dir, run.measure) == ("out.json", "/tmp/cache", True)


def test_a_map_child_inherits_the_default_quantizations_rather_than_demanding_nf4(tmp_path):
    _, (run, _) = child_job(tmp_path, map=True, models=("smol",), quants=QUANTS, batches=(1, 4))
    assert run.map and run.quants == QUANTS and run.batches == (1, 4)


def test_a_map_spread_gives_children_their_own_scratch_so_each_family_can_be_freed(tmp_path):
    with Scratch() as scratch:
        assert child_cache(Run(map=True, models=("smol",)), scratch) is None
        shared = child_cache(Run(models=("smol",)), scratch)
        assert shared is not None and Path(shared).is_relative_to(scratch.root)
        assert child_cache(Run(map=True, cache_dir=str(tmp_path)), scratch) == str(tmp_path)


def test_a_capped_map_child_shares_the_cache_and_a_lost_capped_arm_stays_in_the_cap_table():
    from issue395.spread import lost_row

    with Scratch() as scratch:
        assert child_cache(Run(map=True, models=("smol",), cap="soup"), scratch) is not None
    row = lost_row(Arm("smol", 2048), Run(cap="soup"), None, 139)
    assert row.cap_at == "soup" and row.status == "FAILED"
