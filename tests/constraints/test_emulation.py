"""issue395.constraints.emulation (--emulate-card, issue 20): an arm run as if on a smaller card, judged by
issue395.measure.measurement's run_arm; the config an arm's estimate reads and this tool's needs-free for it.
FAKED here, and only these: the CUDA calls (mem_get_info, cudaMalloc, cudaFree: a fake device of
140 GB free) and the step's peak. Real: the ballast's arithmetic, the card table, this tool's
estimator and verdict, Soup's own decide_stream_fit on the free memory the fake device reports,
run_arm's judgement, the row, its JSON and the table."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import FakeDevice, arm_of, cap_of

from issue395.constraints.cap import Cap
from issue395.constraints.emulation import EmulateCard
from issue395.constraints import minfree
from issue395.estimator.cards import budget, parse_card, step_free
from issue395.constraints.emulation import arm_config, tool_needs_free
from issue395.measure.measurement import Measurement, run_arm
from issue395.run.options import settle
from issue395.run.parser import build_parser
from issue395.model.arm import Arm
from issue395.model.registry import FAMILIES, config_json
from issue395.results.result import Result
from issue395.results.row import Row
from issue395.report.tables import render_text


@pytest.fixture
def device(monkeypatch):
    """FAKE: the CUDA calls the ballast and Soup's gate make, over one fake card."""
    dev = FakeDevice(free=140 * 10**9, total=150 * 10**9)
    monkeypatch.setattr(torch.cuda, "mem_get_info", dev.mem_get_info)
    monkeypatch.setattr(minfree, "_cudart", lambda: dev)
    return dev


def protocol_with_fake_step(peak: int, seen: list):
    """The protocol's order around the real gate: before_setup (the ballast), Soup's own
    decide_stream_fit on mem_get_info's free (raising its reason, as stream_setup does), then the
    step, whose peak is FAKED: it raises OOM when the fake card has less free than ``peak``."""
    from soup_cli.utils.layer_stream import decide_stream_fit

    def measure_arm(arm, shape, base, work, *, dry_run=False, snapshot=False, steps=1, hooks=None):
        m = Measurement(realised_width=arm.seq, realised_rows=(arm.seq,) * arm.batch)
        try:
            hooks.before_setup()
            free = torch.cuda.mem_get_info()[0]
            seen.append(free)
            m.soup_predicted = predicted = 6_500_000_000
            m.soup_fit = decide_stream_fit(predicted_bytes=predicted, available_bytes=free)
            if not m.soup_fit.fits:
                raise ValueError(m.soup_fit.reason)
            if peak > free:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")
            m.real_peak, m.resident, m.reserved = peak, 10**9, peak
        except BaseException as exc:  # noqa: BLE001 - as the protocol keeps it
            m.fail(exc)
        return m

    return measure_arm


ARM = Arm("mistral-7b", 512, 1, 0, "nf4")


def mistral_shape():
    from issue395.measure.shapes import family_shape

    return family_shape("mistral-7b")


@pytest.mark.parametrize("card, peak, outcome", [
    ("6GB", 5 * 10**9, "refused by Soup"),             # 5.15 GB free < Soup's 6.5 GB: its gate says no
    ("RTX4090", 7 * 10**9, "admitted and completed"),  # 24.9 GB free
    ("7.5GB", 7 * 10**9, "admitted and OOM"),          # 6.65 GB free: Soup admits 6.5, the step needs 7
])
def test_the_card_decides_and_the_row_says_so_beside_this_tools_verdict(device, tmp_path, card, peak, outcome,
                                                                        monkeypatch):
    monkeypatch.setattr("issue395.measure.measurement.bitsandbytes_present", lambda: True)
    seen = []
    row = run_arm(protocol_with_fake_step(peak, seen), "cuda", ARM, mistral_shape(), "unused", tmp_path,
                  constraint=EmulateCard(card))
    card_free = budget(parse_card(card)).free_bytes
    # Soup's gate read exactly the card's free memory (to the driver's 2 MiB page, never less)
    assert card_free <= seen[0] < card_free + 2 * 2**20 and row.constraint.free == seen[0]
    assert device.free == 140 * 10**9 and not device.held  # the ballast went back
    assert row.emulated_outcome == outcome and row.constraint.card == parse_card(card).name
    assert row.constraint.needs_free == tool_needs_free(config_json_of("mistral-7b"), budget(parse_card(card)), arm_of(
        "mistral-7b", quant="nf4", seq=512, batch=1, targets=mistral_shape().targets))
    assert row.emulated_fits == (row.constraint.needs_free <= step_free(card_free))
    assert row.gate.free == seen[0], "the free memory Soup's gate compared with, kept in the row"
    back = Row.from_json(json.loads(json.dumps(row.to_json())))
    assert back.emulated_outcome == outcome and back.to_json() == row.to_json()
    assert row.to_json()["derived"]["emulated_outcome"] == outcome
    text = render_text(Result(environment={"torch": "x", "transformers": "x", "trl": "x", "peft": "x",
                                           "soup_cli": "0.73.3", "weights": "synthetic"}, rows=[row]))
    line = next(ln for ln in text.splitlines() if ln.startswith("Mistral") and row.constraint.card in ln)
    assert outcome in line and ("does not fit" in line) == (not row.emulated_fits)
    assert line.split().count(f"{seen[0] / 1e9:.4f}") == 2, "free with the ballast held, and Soup's gate's reading"


def config_json_of(key):
    return arm_config(key, None)


def test_the_ballast_goes_back_when_the_arm_raises_past_the_protocol(device, tmp_path, monkeypatch):
    monkeypatch.setattr("issue395.measure.measurement.bitsandbytes_present", lambda: True)

    def measure_arm(arm, shape, base, work, *, hooks=None, **kw):
        hooks.before_setup()
        assert device.held  # held while Soup sets up
        raise KeyboardInterrupt  # the one thing the protocol lets through

    with pytest.raises(KeyboardInterrupt):
        run_arm(measure_arm, "cuda", ARM, mistral_shape(), "unused", tmp_path, constraint=EmulateCard("RTX4090"))
    assert not device.held and device.free == 140 * 10**9


def test_a_gpu_with_less_free_than_the_card_is_a_failed_row_not_a_false_emulation(device, tmp_path, monkeypatch):
    monkeypatch.setattr("issue395.measure.measurement.bitsandbytes_present", lambda: True)
    device.free = 10 * 10**9
    row = run_arm(protocol_with_fake_step(10**9, []), "cuda", ARM, mistral_shape(), "unused", tmp_path,
                  constraint=EmulateCard("RTX4090"))
    assert row.status == "FAILED" and "less than" in row.error and not device.held


def test_a_model_arm_is_capped_and_emulated_from_its_own_config(tmp_path, device, monkeypatch):
    """--model arms measured like a family: the cap and the verdict read the checkpoint's own
    config.json. FAKED: the CUDA calls (the device fixture; apply_cap's fraction) and the step."""
    import issue395.constraints.cap as cap
    import issue395.measure.measurement as measurement
    from issue395.estimator.estimate import estimate

    (tmp_path / "config.json").write_text(json.dumps(config_json("mistral-7b")))
    argv = ["--model", str(tmp_path / "config.json"), "--seq", "512", "--cap", "needs-free"]
    assert settle(build_parser().parse_args(argv), argv).constraints.cap == "needs-free"
    capped_at = []
    monkeypatch.setattr(cap, "apply_cap", capped_at.append)
    monkeypatch.setattr(measurement, "bitsandbytes_present", lambda: True)
    arm = Arm("custom", 512, 1, 0, "nf4")
    row = run_arm(protocol_with_fake_step(10**9, []), "cuda", arm, mistral_shape(), str(tmp_path), tmp_path,
                  constraint=Cap("needs-free"))
    want = estimate(config_json("mistral-7b"), quant="nf4", seq=512, batch=1, targets=mistral_shape().targets)
    assert capped_at == [want.needs_free] == [row.constraint.bytes] and row.constraint.bytes == cap_of(
        "needs-free", "custom", quant="nf4", seq=512, batch=1, targets=mistral_shape().targets,
        config=config_json("mistral-7b"))
    row = run_arm(protocol_with_fake_step(10**9, []), "cuda", arm, mistral_shape(), str(tmp_path), tmp_path,
                  constraint=EmulateCard("T4"))
    assert row.constraint.needs_free is not None and row.emulated_outcome == "admitted and completed"


def test_an_arms_config_is_its_familys_public_one_else_its_checkpoints_own(tmp_path):
    """A family (with or without a streaming mode) and the record's two read the registry's public
    config; a --model arm reads its checkpoint's config.json, and one it cannot read is None."""
    assert arm_config("mistral-7b", "/no/such/checkpoint") == config_json("mistral-7b")
    assert arm_config("moonlight+per_expert", None) == config_json("moonlight") and "moonlight" in FAMILIES
    assert arm_config("smol", None) == config_json("smol")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert arm_config("custom", str(tmp_path)) == {"model_type": "llama", "hidden_size": 64}
    assert arm_config("custom", None) is None
    for text in ("not json {", "[1, 2]"):
        (tmp_path / "config.json").write_text(text)
        assert arm_config("custom", str(tmp_path)) is None, text
    assert arm_config("custom", str(tmp_path / "missing")) is None


def test_needs_free_is_the_estimators_on_the_card_and_none_where_it_cannot_model_the_arm(monkeypatch):
    """The card's own cuBLAS workspace reaches the verdict: a CUBLAS_WORKSPACE_CONFIG above the
    estimator's 32 MiB raises needs-free on the card and not without one; an arm the estimator
    refuses (an architecture Soup cannot stream) has no number, never a guess."""
    from issue395.estimator.estimate import estimate

    mistral = config_json("mistral-7b")
    kw = dict(quant="nf4", seq=512, batch=1, targets=("q_proj", "v_proj"))
    plain = estimate(mistral, **kw).needs_free
    l4 = budget(parse_card("L4"))
    assert tool_needs_free(mistral, None, arm_of("mistral-7b", **kw)) == plain == tool_needs_free(mistral, l4, arm_of("mistral-7b", **kw))
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:16")
    assert tool_needs_free(mistral, l4, arm_of("mistral-7b", **kw)) > plain == tool_needs_free(mistral, None, arm_of("mistral-7b", **kw))
    assert tool_needs_free(None, l4, arm_of("mistral-7b", **kw)) is None
    assert tool_needs_free({"model_type": "bert", "hidden_size": 64}, None, arm_of("custom", **kw)) is None


def test_a_config_arm_is_capped_and_emulated_at_its_own_lora_r(tmp_path, device, monkeypatch):
    import issue395.constraints.cap as cap
    """A --config arm's shape carries the file's r (32 here, on q_proj alone): the cap and the
    card's verdict are the estimator's at that adapter, never the protocol's r 8 on q_proj/v_proj.
    FAKED: the CUDA calls (the device fixture; apply_cap's fraction) and the step."""
    from dataclasses import replace

    import issue395.measure.measurement as measurement
    from issue395.estimator.estimate import estimate

    capped_at = []
    monkeypatch.setattr(cap, "apply_cap", capped_at.append)
    monkeypatch.setattr(measurement, "bitsandbytes_present", lambda: True)
    own = replace(mistral_shape(), targets=("q_proj",), lora_r=32, lora_alpha=64)
    kw = dict(quant="nf4", seq=512, batch=1)
    want = estimate(config_json("mistral-7b"), targets=("q_proj",), lora_r=32, **kw).needs_free
    assert want != estimate(config_json("mistral-7b"), **kw).needs_free
    row = run_arm(protocol_with_fake_step(10**9, []), "cuda", ARM, own, "unused", tmp_path, constraint=Cap("needs-free"),
                  soup_config="soup.yaml")
    assert capped_at == [want] == [row.constraint.bytes] and row.rank == 32
    row = run_arm(protocol_with_fake_step(10**9, []), "cuda", ARM, own, "unused", tmp_path, constraint=EmulateCard("T4"),
                  soup_config="soup.yaml")
    assert row.constraint.needs_free == tool_needs_free(config_json("mistral-7b"), budget(parse_card("T4")), arm_of(
        "mistral-7b", targets=("q_proj",), lora_r=32, **kw)) and (row.config.lora_r, row.config.lora_alpha) == (32, 64)


def test_the_cards_verdict_on_a_preference_arm_is_its_own_tasks_needs_free():
    """--emulate-card with --task dpo: this tool's verdict is the estimator's needs-free for DPO's step
    on the card, which is not SFT's (before the card decides; no CUDA is touched)."""
    from issue395.constraints.constraint import ArmSetting
    from issue395.estimator.estimate import estimate_key
    from issue395.measure.shapes import family_shape

    kw = dict(quant="none", seq=512, batch=1, targets=("q_proj", "v_proj"), soup=False)
    dpo, sft = estimate_key("smol", task="dpo", **kw).needs_free, estimate_key("smol", **kw).needs_free
    assert dpo > sft
    t4 = budget(parse_card("T4"))
    tool_kw = {k: v for k, v in kw.items() if k != "soup"}
    assert tool_needs_free(config_json("smol"), None, arm_of("smol", task="dpo", **tool_kw)) == dpo
    assert tool_needs_free(config_json("smol"), t4, arm_of("smol", task="dpo", **tool_kw)) == dpo  # T4's workspace is the estimator's
    e = EmulateCard("T4")
    e.before_arm(ArmSetting(Arm("smol", 512, 1, task="dpo"), family_shape("smol"), "unused"))
    assert e.needs_free == dpo
    e.before_arm(ArmSetting(Arm("smol", 512, 1), family_shape("smol"), "unused"))
    assert e.needs_free == sft


def test_a_resident_arms_card_verdict_and_cap_are_the_resident_estimates():
    """Issue 51 item 1: a resident arm (the map's `family+resident[+gc]`, or a resident --config file) under
    --emulate-card and --cap is judged by the corrected resident estimate at its checkpointing, never the streamed
    step's (which refused it: no verdict) nor a stream_buffers it does not read (no CUDA is touched)."""
    from issue395.constraints.constraint import ArmSetting
    from issue395.estimator.resident import estimate_resident
    from issue395.measure.shapes import family_shape, with_modes
    from issue395.model.arm import Settings

    kw = dict(quant="none", seq=1024, batch=1, targets=("q_proj", "v_proj"))
    for key, gc in (("qwen+resident", False), ("qwen+resident+gc", True)):
        want = estimate_resident(config_json("qwen"), checkpointing=gc, **kw)
        e = EmulateCard("T4")
        e.before_arm(ArmSetting(Arm.at(key, 1024, 1, settings=Settings(buffers=2)), with_modes(family_shape("qwen"), key),
                                "unused"))
        assert e.needs_free == want.needs_free
        assert cap_of("corrected", key, run={"buffers": 2}, **kw) == want.corrected_predicted
    assert estimate_resident(config_json("qwen"), checkpointing=True, **kw).needs_free < \
        estimate_resident(config_json("qwen"), checkpointing=False, **kw).needs_free
