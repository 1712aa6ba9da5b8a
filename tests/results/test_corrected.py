"""issue395.results.corrected: this tool's corrected estimate for a saved row's arm, from its family's public
config and the Soup release the row ran, never from the row's own measurement; None where the
estimator does not model the arm. Rows are built by the harness's own constructor with a peak standing
in for a CUDA measurement; the estimator is the real one. Nothing else is faked."""

from __future__ import annotations

from dataclasses import replace

from conftest import make_row

from issue395.results.extras import UserConfig
from issue395.results.corrected import corrected, corrected_ratio
from issue395.estimator.estimate import estimate
from issue395.model.registry import config_json

ENV = {"soup_cli": "0.73.3"}


def test_a_rows_corrected_estimate_is_its_familys_from_the_public_config_whatever_it_measured():
    row = make_row("smol", 2048, real_peak=10**9)
    want = estimate(config_json("smol"), seq=2048, batch=1, targets=("q_proj", "v_proj"), release="0.73.3", soup=False)
    assert corrected(row, ENV) == want.corrected_predicted
    assert corrected(replace(row, real_peak=3 * 10**9), ENV) == corrected(row, ENV)  # not from the peak
    assert corrected_ratio(row, ENV) == want.corrected_predicted / 10**9


def test_the_run_steps_and_shape_reach_it():
    row = make_row("qwen", 4096, batch=1, real_peak=10**9)
    assert corrected(row, dict(ENV, steps=3)) > corrected(row, ENV)
    assert corrected(make_row("qwen", 4096, batch=2, real_peak=10**9), ENV) > corrected(row, ENV)


def test_a_config_rows_own_lora_r_reaches_it():
    """A --config row ran the file's r (4 here): its corrected estimate is at that r, not the protocol's 8."""
    row = make_row("smol", 2048, real_peak=10**9, config=UserConfig("soup.yaml", 4, 8))
    want = estimate(config_json("smol"), seq=2048, batch=1, targets=("q_proj", "v_proj"), lora_r=4, release="0.73.3", soup=False)
    assert corrected(row, ENV) == want.corrected_predicted < corrected(make_row("smol", 2048, real_peak=10**9), ENV)


def test_a_streaming_modes_row_is_estimated_under_its_mode_never_as_if_it_were_absent():
    env = {"soup_cli": "0.77.0"}
    row = make_row("smol", 2048, real_peak=10**9)
    chunked = corrected(replace(row, model_key="smol+chunk512"), env)
    want = estimate(config_json("smol"), seq=2048, batch=1, targets=("q_proj", "v_proj"), release="0.77.0",
                    stream={"stream_loss_chunk": 512}, soup=False)
    assert chunked == want.corrected_predicted and chunked != corrected(row, env)


def test_an_arm_the_estimator_does_not_model_has_none_and_no_ratio():
    row = make_row("smol", 2048, real_peak=10**9)
    assert corrected(replace(row, model_key="custom"), ENV) is None  # a --model run: no public config
    assert corrected_ratio(replace(row, model_key="custom"), ENV) is None
    assert corrected_ratio(make_row("smol", 2048, failure="OOM", real_peak=None), ENV) is None  # nothing measured


def test_an_arm_the_estimator_refuses_has_none_whatever_its_family():
    """A known family under a mode Soup refuses for it (per_expert off DeepSeek-V3), or past its
    positions: the estimator does not model it, so no corrected figure stands beside the row."""
    row = make_row("smol", 2048, real_peak=10**9)
    assert corrected(replace(row, model_key="smol+per_expert"), {"soup_cli": "0.77.0"}) is None
    assert corrected(replace(row, seq=10**6), ENV) is None
