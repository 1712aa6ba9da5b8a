"""issue395.results.corrected: this tool's corrected estimate for a saved row's arm, from its family's public
config and the Soup release the row ran, never from the row's own measurement; None where the
estimator does not model the arm. Rows are built by the harness's own constructor with a peak standing
in for a CUDA measurement; the estimator is the real one. Nothing else is faked."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import main, make_row, readme_yaml

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


# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


@pytest.mark.slow
@pytest.mark.parametrize("how", ["--model", "--config"])
@pytest.mark.release
def test_a_local_config_json_bases_arm_has_the_corrected_figure_estimate_gives(capfd, tmp_path, cache_dir, how):
    """Issue 36 item 11: a dry-run arm on a local config.json base (by --model or in a --config file) has the
    corrected figure --estimate gives for it, and --from-json prints it."""
    from issue395.model.registry import config_json

    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config_json("smol")))
    if how == "--model":
        argv = ["--model", folder, "--seq", "128"]
        est = ["--estimate", "--model", folder / "config.json", "--seq", "128"]
    else:
        # the measured arm runs the protocol's one micro-batch a step: the estimate it is held to, too
        yaml = readme_yaml(tmp_path, seq=128, base=folder, extra="  gradient_accumulation_steps: 1\n").read_text().replace(
            "quantization: 4bit", "quantization: none")
        (tmp_path / "soup.yaml").write_text(yaml)
        argv = ["--config", tmp_path / "soup.yaml"]
        est = ["--estimate", "--config", tmp_path / "soup.yaml", "--steps", "1"]
    code, out, err = main(capfd, argv + ["--dry-run", "--cache-dir", cache_dir, "--json", tmp_path / "r.json"])
    assert code == 0, err
    (row,) = json.loads((tmp_path / "r.json").read_text())["rows"]
    code, _, err = main(capfd, est + ["--json", tmp_path / "e.json"])
    assert code == 0, err
    (want,) = json.loads((tmp_path / "e.json").read_text())["rows"]
    assert row["corrected_custom"] == want["corrected_predicted"], (row.get("corrected_custom"), want)
    code, out, err = main(capfd, ["--from-json", tmp_path / "r.json"])
    assert f"{want['corrected_predicted'] / 1e9:.4f}" in out, out
