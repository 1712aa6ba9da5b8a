"""issue395.measure.measurement: one arm around the protocol, judged into its row. What the protocol saw is
handed in as a Measurement by a stand-in for the entry script's measured arm (FAKED: no Soup setup
and no CUDA step run here; the peaks are given, and ``apply_cap``, a CUDA call, is recorded instead
of made). Real: run_arm and its judgement, Soup's own decide_stream_fit (its gate's words), torch's
OutOfMemoryError, the row built by the harness's own constructor, the timings from the phases. An NF4
arm without bitsandbytes (its absence FAKED) is skipped by the entry script's own protocol in a dry
run before Soup is set up."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import SMOL, h

import issue395.constraints.cap as cap
from issue395.constraints.cap import Cap
from issue395.results.extras import Capped, UserConfig
from issue395.measure import measurement
from issue395.measure.measurement import Measurement, run_arm
from issue395.model.arm import Arm
from issue395.results.result import Result

ARM = Arm("smol", 2048)
GB = 10**9


def protocol(error=None, fit=None, peak=None, teardown_error=None, phases=(), soup_predicted=None, soup_resident=None):
    """A stand-in for the entry script's measure_arm: calls the hooks at their moments and returns
    what it was told the protocol saw."""
    def measure_arm(arm, shape, base, work, *, dry_run=False, snapshot=False, steps=1, hooks=None):
        m = Measurement(realised_width=arm.seq, realised_rows=(arm.seq,) * arm.batch,
                        soup_predicted=soup_predicted, soup_fit=fit, teardown_error=teardown_error,
                        soup_resident=soup_resident)
        hooks.before_setup()
        for phase, pause in phases:
            time.sleep(pause)
            hooks.mark(phase)
        hooks.before_step(m)
        if error is not None:
            m.fail(error)
        elif peak is not None:
            m.real_peak, m.resident, m.reserved, m.step_s = peak, GB // 10, peak, 0.25
        return m
    return measure_arm


def judged(tmp_path, **seen):
    return run_arm(protocol(**seen), "cpu", ARM, SMOL, "unused", tmp_path)


def test_a_refusal_by_soups_own_gate_is_refused_and_any_other_error_failed(tmp_path):
    from soup_cli.utils.layer_stream import decide_stream_fit

    no = decide_stream_fit(predicted_bytes=6 * GB, available_bytes=5 * GB)
    refused = judged(tmp_path, fit=no, error=ValueError(no.reason))
    assert refused.status == "REFUSED" and refused.error == f"ValueError: {no.reason}"[:300]
    # Soup said no, but what stopped the arm was something else: that is a failure, not its gate
    other = judged(tmp_path, fit=no, error=RuntimeError("tokenizer went missing"))
    assert other.status == "FAILED" and other.error == "RuntimeError: tokenizer went missing"
    yes = decide_stream_fit(predicted_bytes=GB, available_bytes=5 * GB)
    failed = judged(tmp_path, fit=yes, error=RuntimeError(f"boom\n{yes.reason}"))
    assert failed.status == "FAILED" and failed.oom_request is None


def test_an_oom_is_its_own_finding_with_the_size_it_asked_for(tmp_path):
    row = judged(tmp_path, error=torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB"))
    assert row.status == "OOM" and row.oom_request == int(1.5 * 2**30) and row.real_peak is None


def test_a_teardown_error_sits_beside_the_measurement_never_over_it(tmp_path):
    row = judged(tmp_path, peak=GB, teardown_error="RuntimeError: could not free the pool")
    assert row.measured and row.real_peak == GB and row.status == "ok"
    assert row.ran.teardown_error == "RuntimeError: could not free the pool"


def test_the_timings_are_the_phases_the_protocol_marks(tmp_path):
    row = judged(tmp_path, peak=GB, phases=(("setup", 0.05), ("teardown", 0.02)))
    t = row.ran.timings
    assert set(t) == {"setup_s", "step_s", "teardown_s"} and t["step_s"] == 0.25
    assert 0.05 <= t["setup_s"] < 1 and 0 <= t["teardown_s"] < t["setup_s"]
    unmarked = judged(tmp_path, error=RuntimeError("x")).ran.timings  # no step: no step_s
    assert set(unmarked) == {"setup_s", "teardown_s"}


def test_cap_soup_caps_at_soups_own_number_before_the_step_and_never_on_a_dry_run(tmp_path, monkeypatch):
    capped = []
    monkeypatch.setattr(cap, "apply_cap", capped.append)  # FAKE: the CUDA fraction call
    seen = dict(peak=GB, soup_predicted=3 * GB)
    row = run_arm(protocol(**seen), "cpu", ARM, SMOL, "unused", tmp_path, constraint=Cap("soup"))
    assert capped == [3 * GB] and row.constraint == Capped("soup", 3 * GB)
    dry = run_arm(protocol(**seen), "cpu", ARM, SMOL, "unused", tmp_path, constraint=Cap("soup"), dry_run=True)
    assert capped == [3 * GB] and dry.constraint is None


def test_cap_soup_caps_a_resident_arm_at_its_resident_gates_number(tmp_path, monkeypatch):
    """Issue 51 item 1: a resident run's own Soup number is its resident gate's (hardware_fit's, which `soup train`
    runs before any setup; Soup's setup computes no streamed number there), so --cap soup caps a resident arm at
    it, not at nothing. FAKE: the CUDA fraction call and the step (the stand-in protocol)."""
    from issue395.results.extras import ResidentGate

    capped = []
    monkeypatch.setattr(cap, "apply_cap", capped.append)
    gate = ResidentGate(peak=2 * GB)
    row = run_arm(protocol(peak=GB, soup_resident=gate), "cpu", Arm.at("smol+resident", 2048), SMOL, "unused", tmp_path,
                  constraint=Cap("soup"))
    assert capped == [2 * GB] and row.constraint == Capped("soup", 2 * GB) and row.soup_resident == gate


def test_a_kept_failure_drops_its_frames_so_teardown_can_free_the_model():
    def setup_that_fails():
        model = torch.zeros(1024)  # noqa: F841 - what the frame would keep alive
        try:
            raise KeyError("weights")
        except KeyError as inner:
            raise RuntimeError("setup failed") from inner

    m = Measurement()
    with pytest.raises(RuntimeError) as caught:
        setup_that_fails()
    m.fail(caught.value)
    assert m.error is caught.value and m.error.__traceback__ is None and m.error.__cause__.__traceback__ is None


def test_without_bitsandbytes_an_nf4_arm_is_a_skipped_row_with_its_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(measurement, "bitsandbytes_present", lambda: False)
    row = h.protocol().run_arm(Arm("smol", 64, 1, 0, "nf4"), SMOL, "unused", tmp_path, dry_run=True)
    assert row.status == "SKIPPED" and "bitsandbytes" in row.error
    assert Result(environment={}, rows=[row]).exit_code == 0


def test_a_config_arms_row_names_its_file_and_the_lora_r_and_alpha_it_ran_and_a_protocol_row_does_not(tmp_path):
    """--config's arm: the row says which soup.yaml it is and the r and alpha its shape ran with, in
    its JSON too; every other row leaves the three out, so its JSON stays as it was."""
    from dataclasses import replace

    own = run_arm(protocol(peak=GB), "cpu", ARM, replace(SMOL, lora_r=4, lora_alpha=8), "unused", tmp_path,
                  soup_config="soup.yaml")
    assert (own.config, own.rank) == (UserConfig("soup.yaml", 4, 8), 4)
    assert own.to_json()["config"] == {"path": "soup.yaml", "lora_r": 4, "lora_alpha": 8}
    plain = judged(tmp_path, peak=GB)
    assert (plain.config, plain.rank) == (None, 8) and plain.to_json()["config"] is None
