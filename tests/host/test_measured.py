"""issue395.host.measured: a measured run's request carries its run as one Arm (``MeasureRequest.arm``), which every
arm of its grid is at its point, and a child's job file gives the same request back (issue 50 item 2, house5d).
Nothing is faked: the registry's families, the planner's real arms, a real job file."""

from __future__ import annotations

from dataclasses import replace

from issue395.host.grid import PROTOCOL_RUN
from issue395.host.measured import Children, MeasureRequest
from issue395.host.spread import child_run, lost_row, plan_jobs, read_job, write_job
from issue395.model.arm import Adapter, Settings
from issue395.model.streaming import Streaming

LORA = Adapter(("q_proj", "o_proj"), 4, 8)


def test_a_map_runs_arms_carry_the_requests_steps_adapter_and_settings_at_their_own_keys():
    """Every arm of the map is the request's run (its adapter, steps, settings) at its own family, streaming
    modes, quantization, seq, batch and task; a registry family's arm reads no checkpoint."""
    run = MeasureRequest(map=True, models=("smol", "llama32-1b+resident"), quants=("none", "nf4"), seqs=(512,),
                         batches=(1, 2), tasks=("sft", "dpo"),
                         arm=replace(PROTOCOL_RUN, adapter=LORA, steps=3, settings=Settings("adamw_8bit", 2),
                                     checkpoint="/not/read"))
    arms = run.arms()
    assert len(arms) == 2 * 2 * 2 * 2 and [a.index for a in arms] == list(range(16))
    assert {(a.adapter, a.steps, a.settings, a.checkpoint) for a in arms} == {(LORA, 3, Settings("adamw_8bit", 2), None)}
    assert {a.model for a in arms} == {"smol", "llama32-1b+resident"}
    assert {a.streaming for a in arms if a.base == "llama32-1b"} == {Streaming(layers=False)}
    assert {(a.quant, a.batch, a.task) for a in arms} == {(q, b, t) for q in ("none", "nf4") for b in (1, 2)
                                                          for t in ("sft", "dpo")}


def test_a_custom_base_and_determinism_take_the_runs_checkpoint_and_steps():
    run = MeasureRequest(models=("custom",), seqs=(64,), repeats=2, arm=replace(PROTOCOL_RUN, checkpoint="/ckpt", steps=2))
    (arm,) = run.arms()
    assert (arm.base, arm.seq, arm.checkpoint, arm.steps) == ("custom", 64, "/ckpt", 2)
    assert run.determinism_arms() == [arm]  # a custom model's repeats are its own arm, not the record's two
    protocol = MeasureRequest(repeats=2, arm=replace(PROTOCOL_RUN, steps=2))
    assert {(a.steps, a.checkpoint) for a in protocol.determinism_arms()} == {(2, None)}
    assert MeasureRequest().determinism_arms() == []


def test_a_child_reads_back_the_run_arm_and_its_arms_and_a_lost_one_is_that_arm(tmp_path):
    """The job file carries the run's Arm whole (its adapter's targets as a tuple, its settings and streaming), so
    the child's request and arms are the parent's; an arm whose child died is still its run's (task, settings)."""
    run = MeasureRequest(map=True, models=("llama32-1b+resident+gc",), seqs=(512,), tasks=("kto",),
                         children=Children(gpus=(0,)),
                         arm=replace(PROTOCOL_RUN, adapter=LORA, steps=2, settings=Settings("adamw_8bit", 4)))
    (job,) = plan_jobs(run, run.arms())
    sent = child_run(run, job, "out.json", "/tmp/cache")
    write_job(tmp_path / "job.json", sent, job)
    back, back_job = read_job(str(tmp_path / "job.json"))
    assert back == sent and back.arm == run.arm and back_job == job and back.arms() == run.arms()
    assert isinstance(back.arm.adapter.targets, tuple)
    lost = lost_row(back_job.arms[0], back, None, -9)
    assert (lost.task, lost.settings, lost.model_key) == ("kto", Settings("adamw_8bit", 4), "llama32-1b+resident+gc")
