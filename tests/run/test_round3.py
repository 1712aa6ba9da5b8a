"""Issue 29's new user, round three: each defect they hit, on CPU, with the real Soup loader."""

from __future__ import annotations

import json
import os

import pytest
from conftest import main, one_error_line

#: The README's soup.yaml (Mistral-7B NF4, LoRA r 8 on q_proj, v_proj).
README_YAML = ("base: mistralai/Mistral-7B-v0.3\ndata: {{train: data.jsonl, max_length: {seq}}}\n"
               "training:\n  batch_size: 1\n  quantization: 4bit\n  stream_layers: true\n"
               "  lora: {{r: {r}, alpha: 16, target_modules: {targets}}}\n{extra}")


def soup_yaml(folder, seq=2048, r=8, targets="[q_proj, v_proj]", extra="", name="soup.yaml"):
    path = folder / name
    path.write_text(README_YAML.format(seq=seq, r=r, targets=targets, extra=extra))
    return path


# 1. --json never overwrites the user's soup.yaml ------------------------------------------------

@pytest.mark.parametrize("spelling", ["same", "dot", "dotdot", "symlink", "dry-run"])
def test_item1_json_onto_the_soup_yaml_is_one_line_and_the_file_is_kept(capfd, tmp_path, monkeypatch, spelling):
    sub = tmp_path / "sub"
    sub.mkdir()
    config = soup_yaml(tmp_path)
    before = config.read_text()
    monkeypatch.chdir(sub)
    out = {"same": str(config), "dot": "./../soup.yaml", "dotdot": f"../sub/../soup.yaml",
           "symlink": "link.yaml", "dry-run": "../soup.yaml"}[spelling]
    if spelling == "symlink":
        os.symlink(config, sub / "link.yaml")
    argv = (["--dry-run"] if spelling == "dry-run" else ["--estimate"]) + ["--config", config, "--json", out]
    one_error_line(*main(capfd, argv), "--json", "--config", "overwrite")
    assert config.read_text() == before


# 5. a config transformers writes itself -------------------------------------------------------

def test_item5_a_gemma2_config_saved_by_transformers_is_estimated(capfd, tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("gemma2").save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["use_bidirectional_attention"] is None
    code, out, err = main(capfd, ["--estimate", "--model", tmp_path, "--seq", "512"])
    assert code == 0 and "needs free" in out, err


# 6. soup-cli installed --no-deps: what is missing is named -------------------------------------

@pytest.mark.parametrize("module, package", [("yaml", "pyyaml"), ("pydantic", "pydantic"), ("rich", "rich")])
def test_item6_a_no_deps_soup_cli_names_the_missing_package_not_soup_cli(capfd, tmp_path, monkeypatch, module,
                                                                        package):
    import sys

    for name in [n for n in sys.modules if n == module or n.startswith(module + ".")
                 or n.startswith("soup_cli.config")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # as if pip install --no-deps soup-cli
    line = one_error_line(*main(capfd, ["--estimate", "--config", soup_yaml(tmp_path)]), package, "--no-deps")
    assert "needs soup-cli installed" not in line


def test_item6_the_readme_does_not_say_no_deps_is_enough_for_config():
    from conftest import ROOT

    text = " ".join((ROOT / "README.md").read_text().split())
    assert "`pip install --no-deps soup-cli` is enough" not in text
    assert "pyyaml" in text


# 7. with --config alone, errors name the file's keys, not flags never typed ----------------------

@pytest.mark.parametrize("edit, words", [
    (dict(seq=40960), ["data.max_length 40960", "maximum positions"]),
    (dict(extra="  batch_size: 5000\n"), ["training.batch_size 5000"]),
    (dict(r=4096), ["training.lora.r 4096"]),
    (dict(targets="[q_proj, foo]"), ["foo", "base mistralai/Mistral-7B-v0.3"]),
], ids=["seq", "batch", "r", "targets"])
def test_item7_errors_from_the_file_name_its_keys_not_flags(capfd, tmp_path, edit, words):
    path = soup_yaml(tmp_path, **{k: v for k, v in edit.items() if k != "extra"})
    if "extra" in edit:
        path.write_text(path.read_text().replace("  batch_size: 1\n", edit["extra"]))
    line = one_error_line(*main(capfd, ["--estimate", "--config", path]), f"--config {path}", *words)
    for flag in ("--seq", "--batch", "--lora-r", "--targets", "--model"):
        assert flag not in line, line


# 8. a --log-dir no file can be made in ----------------------------------------------------------

@pytest.mark.parametrize("folder", ["/proc/x", "/proc/x/y", "/proc"])
def test_item8_a_log_dir_where_nothing_can_be_made_is_one_line_before_any_arm(capfd, tmp_path, folder):
    argv = ["--dry-run", "--config", soup_yaml(tmp_path), "--log-dir", folder]
    one_error_line(*main(capfd, argv), "--log-dir", folder)


# 9. a --context the card cannot hold ----------------------------------------------------------

@pytest.mark.parametrize("context, card", [("20", "T4"), ("16", "T4"), ("4.2", "RTX3050-Laptop-4GB"), ("3", "3GB")])
def test_item9_a_context_as_large_as_the_card_is_one_line(capfd, tmp_path, context, card):
    argv = ["--estimate", "--config", soup_yaml(tmp_path), "--card", f"A10G,{card}", "--context", context]
    one_error_line(*main(capfd, argv), "--context", card)


def test_item9_a_context_the_card_holds_still_answers(capfd, tmp_path):
    code, out, err = main(capfd, ["--estimate", "--config", soup_yaml(tmp_path), "--card", "T4", "--context", "2"])
    assert code == 0 and "-0." not in out and "-1" not in out, err


# 11. an uncached hub id: a fast line, never 23 s of retries in silence ----------------------------

HUB_YAML = ("base: someorg/some-uncached-model\ndata: {train: data.jsonl, max_length: 512}\n"
            "training: {batch_size: 1, quantization: 4bit, stream_layers: true,\n"
            "           lora: {r: 8, alpha: 16, target_modules: [q_proj, v_proj]}}\n")


def test_item11_an_unreachable_hub_is_one_line_at_once_without_the_download_retries(capfd, tmp_path, monkeypatch):
    import socket
    import time

    import huggingface_hub

    def unreachable(*a, **k):
        raise socket.gaierror(-2, "Name or service not known")

    def retried(*a, **k):  # huggingface_hub's own path: 5 retries with back-off, 23 s measured
        raise AssertionError("hf_hub_download was reached")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", retried)
    (tmp_path / "s.yaml").write_text(HUB_YAML)
    t = time.perf_counter()
    one_error_line(*main(capfd, ["--estimate", "--config", tmp_path / "s.yaml"]), "someorg/some-uncached-model",
                   "cannot be reached", "Name or service not known")
    assert time.perf_counter() - t < 5


def test_item11_a_reachable_hub_says_it_is_fetching_before_it_waits(capfd, tmp_path, monkeypatch):
    import socket

    import huggingface_hub
    from issue395.model.registry import config_json

    class Open:
        def close(self):
            pass

    fetched = tmp_path / "config.json"
    fetched.write_text(json.dumps(config_json("mistral-7b")))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: Open())
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: str(fetched))
    (tmp_path / "s.yaml").write_text(HUB_YAML)
    code, out, err = main(capfd, ["--estimate", "--config", tmp_path / "s.yaml"])
    assert code == 0 and "fetching" in err and "someorg/some-uncached-model" in err, err


# 12. wording ------------------------------------------------------------------------------------

def test_item12_soups_whole_file_refusal_has_no_empty_location_nor_pydantics_prefix(capfd, tmp_path):
    path = soup_yaml(tmp_path, extra="")
    path.write_text(path.read_text().replace("stream_layers: true", "stream_layers: false\n  stream_vram_probe: true"))
    line = one_error_line(*main(capfd, ["--estimate", "--config", path]), "Soup refuses it", "stream_layers")
    assert ": :" not in line and "Value error" not in line, line


@pytest.mark.parametrize("mode", [["--estimate", "--model", "mistral-7b", "--seq", "512"], ["--map", "--dry-run"]])
def test_item12_quant_4bit_is_told_soups_4bit_is_nf4_here(capfd, mode):
    one_error_line(*main(capfd, mode + ["--quant", "4bit"]), "--quant", "nf4", "Soup's 4bit")


def test_item12_a_card_no_seq_fits_on_says_so_not_oom_past_none():
    from issue395.estimator.fits import seq_direction

    text = seq_direction({"longest_seq": None, "longest_seq_soup_admits": 4096})
    assert "past none" not in text and "4096" in text and "no seq" in text, text


def test_item12_a_schema1_row_with_an_impossible_seq_blames_seq_not_vocab(capfd, tmp_path):
    from conftest import ROOT

    saved = json.loads((ROOT / "results/record-h200x2-soup0.73.3-e7c26f7/h200-2026-11-30-full-cold.json").read_text())
    saved["rows"][0]["seq"] = 10**30
    (tmp_path / "bad.json").write_text(json.dumps(saved))
    line = one_error_line(*main(capfd, ["--from-json", tmp_path / "bad.json"]), "'seq'")
    assert "vocab" not in line, line


def test_item12_soup_refusing_every_seq_says_so_not_past_none():
    from issue395.estimator.fits import seq_direction

    text = seq_direction({"longest_seq": 2048, "longest_seq_soup_admits": None})
    assert "past none" not in text and "every seq" in text, text
