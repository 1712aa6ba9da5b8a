"""issue395.run.userconfig: the user's own inputs (issue 20): a soup.yaml read by Soup's own loader
drives --estimate (its measured arm: test_configarm), and a hub id's config.json comes from the
local Hugging Face cache (a fake cache dir here: no network)."""

from __future__ import annotations

import json

import pytest
from conftest import main, one_error_line

from issue395.model.registry import config_json
from issue395.measure.shapes import soup_has_stream_modes

YAML = """base: {base}
task: sft
data:
  train: data.jsonl
  max_length: {seq}
training:
  batch_size: 2
  quantization: 4bit
  stream_layers: {stream}
  lora:
    r: 16
    alpha: 32
    target_modules: [q_proj, k_proj, v_proj]
{extra}"""


def soup_yaml(tmp_path, base="mistralai/Mistral-7B-v0.3", seq=1024, stream="true", extra=""):
    path = tmp_path / "soup.yaml"
    path.write_text(YAML.format(base=base, seq=seq, stream=stream, extra=extra))
    return path


def test_the_files_own_values_drive_the_estimate(capfd, tmp_path):
    out = tmp_path / "e.json"
    code, text, err = main(capfd, ["--estimate", "--config", soup_yaml(tmp_path), "--card", "A10G", "--json", out])
    assert code == 0, err
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["quant"], row["seq"], row["batch"]) == ("nf4", 1024, 2)
    from issue395.estimator.estimate import estimate

    e = estimate(config_json("mistral-7b"), quant="nf4", seq=1024, batch=2, targets=("q_proj", "k_proj", "v_proj"),
                 lora_r=16, steps=2, accumulation=4)  # --config answers the run's steady state (issue 29), at
    # Soup's default gradient_accumulation_steps (the file sets none)
    assert (row["soup_predicted"], row["needs_free"]) == (e.soup_predicted, e.needs_free)
    assert "from --config" in text and row["cards"][0]["card"] == "A10G"


@pytest.mark.parametrize("change, words", [
    (dict(stream="false"), ["stream_layers", "would not stream"]),
    (dict(extra="  stream_buffers: 3\n"), ["stream_buffers", "does not model"]),
    (dict(seq=16), ["Soup refuses"]),  # Soup's own schema: max_length under its minimum
])
def test_a_config_soup_would_not_stream_or_the_estimator_does_not_model_is_one_line(capfd, tmp_path, change, words):
    if "extra" in change:  # training.* keys go under training:
        change = dict(extra="", stream="true\n" + change["extra"])
    one_error_line(*main(capfd, ["--estimate", "--config", soup_yaml(tmp_path, **change)]), *words)


def test_config_and_the_options_it_replaces_are_exclusive(capfd, tmp_path):
    one_error_line(*main(capfd, ["--estimate", "--config", soup_yaml(tmp_path), "--seq", "512"]), "--seq")


def test_a_hub_id_reads_config_json_from_the_local_cache(capfd, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snap = cache / "models--someorg--tiny-llama" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(config_json("smol")))
    (cache / "models--someorg--tiny-llama" / "refs").mkdir()
    (cache / "models--someorg--tiny-llama" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as K

    monkeypatch.setattr(K, "HF_HUB_CACHE", str(cache))
    code, text, err = main(capfd, ["--estimate", "--model", "someorg/tiny-llama", "--seq", "512"])
    assert code == 0, err
    assert "--estimate: someorg/tiny-llama" in text
    one_error_line(*main(capfd, ["--estimate", "--model", "someorg/not-cached", "--seq", "512"]),
                   "someorg/not-cached", "offline")


@pytest.mark.skipif(not soup_has_stream_modes(), reason="soup-cli 0.77.0's streaming modes")
def test_the_files_streaming_modes_reach_the_estimate_and_auto_is_one_line(capfd, tmp_path):
    """0.77.0's modes the estimator models (a loss chunk, recompute off) are the file's own, as
    --loss-chunk and --recompute would give them; recompute auto (a step measured at setup) is not."""
    out = tmp_path / "e.json"
    extra = "  stream_loss_chunk: 512\n  stream_recompute: 'off'\n"
    config = soup_yaml(tmp_path, stream="true\n" + extra)
    code, text, err = main(capfd, ["--estimate", "--config", config, "--json", out])
    assert code == 0, err
    (row,) = json.loads(out.read_text())["rows"]
    from issue395.estimator.estimate import estimate

    e = estimate(config_json("mistral-7b"), quant="nf4", seq=1024, batch=2, targets=("q_proj", "k_proj", "v_proj"),
                 lora_r=16, stream={"stream_loss_chunk": 512, "stream_recompute": "off"}, steps=2,
                 accumulation=4)  # the run's (issue 29)
    assert row["corrected_predicted"] == e.corrected_predicted
    assert row["corrected_predicted"] != estimate(config_json("mistral-7b"), quant="nf4", seq=1024, batch=2,
                                                  targets=("q_proj", "k_proj", "v_proj"), lora_r=16,
                                                  steps=2, accumulation=4).corrected_predicted
    one_error_line(*main(capfd, ["--estimate", "--config", soup_yaml(tmp_path, stream="true\n  stream_recompute: auto\n")]),
                   "stream_recompute", "auto")


@pytest.mark.parametrize("task", ["dpo", "orpo", "simpo", "kto"])
def test_a_preference_tasks_file_is_answered_with_soups_number_at_its_rows(capfd, tmp_path, task):
    """Before: 'task ... the estimator does not model (sft only)', exit 2. Now Soup's own number at the
    task's rows (its release's _STREAM_ROWS_PER_EXAMPLE, the refill slot), the gate's verdict per card,
    and the corrected estimate at the task's own physics, never the SFT figure."""
    from issue395.estimator.estimate import estimate

    path = soup_yaml(tmp_path)
    path.write_text(path.read_text().replace("task: sft", f"task: {task}"))
    out = tmp_path / "e.json"
    code, text, err = main(capfd, ["--estimate", "--config", path, "--card", "A10G", "--json", out])
    assert code == 0, err
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    # a --config answer is the run's steady state (step 2 on: the optimizer's states live)
    e = estimate(config_json("mistral-7b"), quant="nf4", seq=1024, batch=2, targets=("q_proj", "k_proj", "v_proj"),
                 lora_r=16, task=task, steps=2, accumulation=4)
    sft = estimate(config_json("mistral-7b"), quant="nf4", seq=1024, batch=2, targets=("q_proj", "k_proj", "v_proj"),
                   lora_r=16, steps=2, accumulation=4)
    assert data["tasks"] == [task] and row["task"] == task and row["soup_predicted"] == e.soup_predicted
    assert row["soup_predicted"] != sft.soup_predicted or task == "kto"
    assert row["corrected_predicted"] == e.corrected_predicted != sft.corrected_predicted
    assert row["cards"][0]["fits"] is not None and row["cards"][0]["soup_admits"] is True


def test_estimate_answers_each_task_named_on_the_command_line(capfd, tmp_path):
    out = tmp_path / "e.json"
    code, _, err = main(capfd, ["--estimate", "--model", "smol", "--seq", "512", "--batch", "2",
                                "--task", "sft,dpo,kto", "--json", out])
    assert code == 0, err
    rows = json.loads(out.read_text())["rows"]
    assert [r["task"] for r in rows] == ["sft", "dpo", "kto"]
    # each task at its own physics: DPO's two policy/reference logits over 2 x batch rows exceed SFT's
    assert rows[1]["corrected_predicted"] > rows[0]["corrected_predicted"] > 0


@pytest.mark.parametrize("argv, words", [
    (["--estimate", "--model", "smol", "--seq", "512", "--task", "kto"], "refuses a kto batch under 2"),
    (["--estimate", "--model", "smol", "--seq", "512", "--task", "ppo"], "choose from sft,dpo,orpo,simpo,kto"),
])
def test_a_task_soup_refuses_is_one_line(capfd, argv, words):
    one_error_line(*main(capfd, argv), words)
