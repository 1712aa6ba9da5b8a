"""issue395.run.estimate_mode: --estimate settled from the options or from a soup.yaml read once by Soup's own
loader, each value's error naming where it came from (the option, or the file's key) where it is read,
never a flag the user did not type. Real Soup loader and estimator; nothing is faked."""

from __future__ import annotations

import pytest
from conftest import main, one_error_line

YAML = """base: mistralai/Mistral-7B-v0.3
task: sft
data: {{train: data.jsonl, max_length: {seq}}}
training:
  batch_size: {batch}
  quantization: none
  stream_layers: true
  lora: {{r: {r}, alpha: 16, target_modules: {targets}}}
"""


def soup_yaml(tmp_path, seq=512, batch=1, r=8, targets="[q_proj, v_proj]"):
    path = tmp_path / "soup.yaml"
    path.write_text(YAML.format(seq=seq, batch=batch, r=r, targets=targets))
    return path


@pytest.mark.parametrize("values, words", [
    (dict(seq=65536), ["data.max_length 65536", "maximum positions"]),
    (dict(batch=2048), ["training.batch_size 2048", "more than 1024"]),
    (dict(r=4096), ["training.lora.r 4096", "more than 1024"]),
    (dict(targets="[q_proj, q_proj]"), ["training.lora.target_modules q_proj,q_proj", "named twice"]),
    (dict(targets="[auto, q_proj]"), ["training.lora.target_modules auto,q_proj", "stand alone"]),
])
def test_a_files_value_the_estimate_refuses_is_one_line_naming_its_key_never_a_flag(capfd, tmp_path, values, words):
    path = soup_yaml(tmp_path, **values)
    line = one_error_line(*main(capfd, ["--estimate", "--config", path]), f"--config {path}: ", *words)
    assert not any(flag in line for flag in ("--seq", "--batch", "--lora-r", "--targets", "--model"))


def test_the_same_value_from_an_option_names_the_option(capfd):
    one_error_line(*main(capfd, ["--estimate", "--model", "mistral-7b", "--seq", "512", "--lora-r", "4096"]),
                   "--lora-r 4096", "more than 1024")
    one_error_line(*main(capfd, ["--estimate", "--model", "mistral-7b", "--seq", "512", "--targets", "q_proj,q_proj"]),
                   "--targets q_proj,q_proj", "named twice")
