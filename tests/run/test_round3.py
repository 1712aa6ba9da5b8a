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
    data, _ = estimate_json(capfd, tmp_path, soup_yaml(tmp_path), "--card", "T4", "--context", "2")
    (card,) = data["rows"][0]["cards"]
    assert card["context_bytes"] == 2 * 10**9 and card["step_free_bytes"] > 0


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


# 4. training.stream_vram_override and training.stream_vram_probe: Soup's gate as the file sets it --

def estimate_json(capfd, tmp_path, config, *extra):
    out = tmp_path / "e.json"
    code, text, err = main(capfd, ["--estimate", "--config", config, "--json", out, *extra])
    assert code == 0, err
    return json.loads(out.read_text()), text


def test_item4_an_override_of_1GB_makes_soup_refuse_the_readmes_run(capfd, tmp_path):
    """Soup's resolve_available_vram_bytes replaces the driver's free memory with the override: its
    number (2.47 GB at the README's run) against 1 GB refuses, whatever the card holds."""
    plain, _ = estimate_json(capfd, tmp_path, soup_yaml(tmp_path), "--card", "T4")
    (row,) = plain["rows"]
    assert row["cards"][0]["soup_admits"] is True
    over = soup_yaml(tmp_path, extra="  stream_vram_override: 1000000000\n", name="o.yaml")
    data, text = estimate_json(capfd, tmp_path, over, "--card", "T4")
    (card,) = data["rows"][0]["cards"]
    assert card["soup_admits"] is False and card["gate_free_bytes"] == 10**9
    assert card["fits"] is True  # the card is what it is: only Soup's gate moved
    assert card["longest_seq_soup_admits"] < row["cards"][0]["longest_seq_soup_admits"]
    assert "Soup refuses it" in text.splitlines()[2] and "stream_vram_override" in text


def test_item4_an_override_above_the_card_lets_soup_admit_what_does_not_fit(capfd, tmp_path):
    over = soup_yaml(tmp_path, seq=8192, extra="  stream_vram_override: 100000000000\n")
    data, _ = estimate_json(capfd, tmp_path, over, "--card", "RTX3050-Laptop-4GB")
    (card,) = data["rows"][0]["cards"]
    assert (card["fits"], card["soup_admits"]) == (False, True)
    assert card["disagreement"] == "Soup admits a run that will OOM"


def test_item4_the_probe_answers_by_the_measured_rule_on_one_step(capfd, tmp_path):
    """decide_measured_fit: one measured step against the free memory. Where Soup's number is over
    the free memory but the step (no optimizer state) fits, the formula refuses and the probe admits."""
    base, _ = estimate_json(capfd, tmp_path, soup_yaml(tmp_path, seq=3136), "--card", "RTX3050-Laptop-4GB",
                            "--steps", "1")
    probed = soup_yaml(tmp_path, seq=3136, extra="  stream_vram_probe: true\n", name="p.yaml")
    data, text = estimate_json(capfd, tmp_path, probed, "--card", "RTX3050-Laptop-4GB", "--steps", "1")
    (plain,), (card,) = base["rows"][0]["cards"], data["rows"][0]["cards"]
    row = data["rows"][0]
    assert card["gate_rule"].startswith("measured probe")
    assert card["soup_admits"] == (row["corrected_predicted"] <= card["gate_free_bytes"])
    assert plain["longest_seq_soup_admits"] != card["longest_seq_soup_admits"]
    assert "stream_vram_probe" in text and "decide_measured_fit" in text


def test_item4_the_probe_refuses_past_four_times_the_free_memory_without_measuring(capfd, tmp_path):
    from issue395.estimator.fits import Gate

    gate = Gate(probe=True)
    assert gate.admits(soup_predicted=3 * 10**9, one_step_allocated=10**9, available=10**9)
    assert not gate.admits(soup_predicted=5 * 10**9, one_step_allocated=10**9, available=10**9)


# 10. every key of the file that changes the peak or Soup's gate is read or named -----------------

def file_lines(text):
    return [line for line in text.splitlines() if line.startswith("  from the file: ")]


def test_item10_a_typo_is_named_with_the_key_it_meant(capfd, tmp_path):
    path = soup_yaml(tmp_path)
    path.write_text(path.read_text().replace("max_length: 2048}", "max_length: 2048, max_lenght: 8192}"))
    code, out, err = main(capfd, ["--estimate", "--config", path, "--card", "T4"])
    if code == 2:  # soup-cli 0.77.0 refuses an unknown key itself: its line, said as Soup's
        one_error_line(code, out, err, "Soup refuses it", "max_lenght")
        return
    assert code == 0, err
    (line,) = [ln for ln in file_lines(out) if "max_lenght" in ln]
    assert "data.max_lenght is not a key" in line and "Soup ignores it" in line and "data.max_length" in line


def test_item10_a_key_of_another_release_is_named(capfd, tmp_path):
    from issue395.measure.shapes import soup_has_stream_modes

    code, out, err = main(capfd, ["--estimate", "--config",
                                  soup_yaml(tmp_path, extra="  stream_loss_chunk: 512\n")])
    assert code == 0, err
    named = [ln for ln in file_lines(out) if "stream_loss_chunk" in ln]
    if soup_has_stream_modes():
        assert named and "modelled" in named[0]
    else:
        assert named and "not a key of soup-cli" in named[0] and "Soup ignores it" in named[0]


@pytest.mark.parametrize("key, value, words", [
    ("stream_vram_override", "2000000000", ["2.00 GB", "modelled"]),
    ("stream_vram_probe", "true", ["decide_measured_fit"]),
    ("gradient_accumulation_steps", "8", ["modelled", "held_gradients"]),
    ("moe_lora", "true", ["NOT modelled"]),
    ("bnb_4bit_use_double_quant", "false", ["NOT modelled", "double-quantised"]),
])
def test_item10_each_memory_key_is_one_line_saying_how_it_is_read(capfd, tmp_path, key, value, words):
    code, out, err = main(capfd, ["--estimate", "--config", soup_yaml(tmp_path, extra=f"  {key}: {value}\n")])
    if code == 2 and "Soup refuses it" in err:  # the installed release's own schema says no
        pytest.skip(err.strip())
    assert code == 0, err
    (line,) = [ln for ln in file_lines(out) if f"training.{key}" in ln]
    for word in words:
        assert word in line, line


def test_item10_the_scale_cache_is_named_not_modelled(capfd, tmp_path):
    from issue395.measure.shapes import soup_has_stream_modes

    if not soup_has_stream_modes():
        pytest.skip("soup-cli 0.73.3 has no stream_nf4_scale_cache")
    code, out, err = main(capfd, ["--estimate", "--config", soup_yaml(tmp_path, extra="  stream_nf4_scale_cache: true\n")])
    assert code == 0, err
    assert any("stream_nf4_scale_cache" in ln and "NOT modelled" in ln for ln in file_lines(out))


def test_item10_an_8bit_optimizer_is_modelled_or_refused_never_charged_as_adamw_silently(capfd, tmp_path):
    adamw, _ = estimate_json(capfd, tmp_path, soup_yaml(tmp_path))
    out = tmp_path / "o.json"
    argv = ["--estimate", "--config", soup_yaml(tmp_path, extra="  optimizer: adamw_8bit\n", name="o.yaml"),
            "--json", out]
    code, text, err = main(capfd, argv)
    if code == 2:  # this tree's estimator has no 8-bit optimizer states yet: one line naming it
        one_error_line(code, text, err, "adamw_8bit", "not modelled")
        return
    assert code == 0, err
    assert json.loads(out.read_text())["rows"][0]["needs_free"] < adamw["rows"][0]["needs_free"]


def test_item10_target_modules_auto_in_the_file_is_what_targets_auto_gives(capfd, tmp_path):
    data, _ = estimate_json(capfd, tmp_path, soup_yaml(tmp_path, targets="auto",  # --model takes one micro-batch
                                                       extra="  gradient_accumulation_steps: 1\n"), "--steps", "1")
    out = tmp_path / "m.json"
    code, _, err = main(capfd, ["--estimate", "--model", "mistralai/Mistral-7B-v0.3", "--quant", "nf4", "--seq", "2048",
                                "--targets", "auto", "--json", out])
    assert code == 0, err
    flag = json.loads(out.read_text())
    assert data["targets"] == flag["targets"] and data["rows"][0]["needs_free"] == flag["rows"][0]["needs_free"]


def test_item10_an_unmodelled_stream_buffers_stays_one_line(capfd, tmp_path):
    one_error_line(*main(capfd, ["--estimate", "--config", soup_yaml(tmp_path, extra="  stream_buffers: 3\n")]),
                   "training.stream_buffers", "not")


# 14. a verdict a person reads first, --card list, --exit-code, the JSON's file facts --------------

ALL_LINEAR = "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]"


def test_item14_the_verdict_is_one_line_a_card_above_the_table(capfd, tmp_path):
    code, out, err = main(capfd, ["--estimate", "--config", soup_yaml(tmp_path), "--card", "T4,RTX3050-Laptop-4GB"])
    assert code == 0, err
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("soup-cli"))
    verdicts = [ln for ln in lines[:head] if ln.startswith(("  T4: ", "  RTX3050-Laptop-4GB: "))]
    assert len(verdicts) == 2 and lines[2] == verdicts[0]
    for line in verdicts:
        assert ("fits" in line) and ("longest seq that fits" in line) and ("Soup admits" in line or "Soup refuses" in line)
    assert "peak = resident" not in out  # the legends: --verbose
    code, verbose, err = main(capfd, ["--estimate", "--config", soup_yaml(tmp_path), "--card", "T4", "--verbose"])
    assert code == 0 and "peak = resident" in verbose and "MagicQuill" in verbose, err


def test_item14_card_list_names_every_card_with_its_source(capfd):
    from issue395.estimator.cards import CARDS

    code, out, err = main(capfd, ["--card", "list"])
    assert code == 0, err
    for card in CARDS.values():
        (line,) = [ln for ln in out.splitlines() if ln.split()[0] == card.name]
        assert card.source in line
    one_error_line(*main(capfd, ["--card", "list", "--seq", "512"]), "--card list", "--seq")


def test_item14_exit_code_says_whether_it_fits(capfd, tmp_path):
    fits = ["--estimate", "--config", soup_yaml(tmp_path), "--card", "T4", "--exit-code"]
    assert main(capfd, fits)[0] == 0
    assert main(capfd, fits[:-2] + ["T4,2GB", "--exit-code"])[0] == 1
    assert main(capfd, fits[:-1])[0] == 0 == main(capfd, fits[:-2] + ["2GB"])[0]  # without it: 0, the answer printed
    one_error_line(*main(capfd, ["--estimate", "--config", soup_yaml(tmp_path), "--exit-code"]), "--exit-code", "--card")
    one_error_line(*main(capfd, ["--dry-run", "--exit-code"]), "--exit-code", "--estimate")


def test_item14_the_json_carries_the_config_path_the_alpha_and_the_streaming_modes(capfd, tmp_path):
    data, _ = estimate_json(capfd, tmp_path, soup_yaml(tmp_path))
    assert data["config"].endswith("soup.yaml") and data["lora_alpha"] == 16 and data["stream"] == {}
    from issue395.measure.shapes import soup_has_stream_modes

    if soup_has_stream_modes():
        chunked, _ = estimate_json(capfd, tmp_path, soup_yaml(tmp_path, extra="  stream_loss_chunk: 512\n", name="c.yaml"))
        assert chunked["stream"] == {"stream_loss_chunk": 512}


# What to build 2: the run's answer by default; --steps 1 the protocol's step --------------------

def test_build2_the_file_is_answered_at_the_runs_steady_state_and_steps_1_keeps_one_step(capfd, tmp_path):
    """Mistral-7B NF4 seq 1024, r 64 on all seven linears, a 4 GB laptop card: the first step fits,
    the run (Adam's states live from step 2) does not, and the output says which answer it is."""
    config = soup_yaml(tmp_path, seq=1024, r=64, targets=ALL_LINEAR)
    run, run_text = estimate_json(capfd, tmp_path, config, "--card", "RTX3050-Laptop-4GB")
    one, one_text = estimate_json(capfd, tmp_path, config, "--card", "RTX3050-Laptop-4GB", "--steps", "1")
    assert (run["steps"], one["steps"]) == (2, 1)
    assert run["rows"][0]["needs_free"] > one["rows"][0]["needs_free"]
    assert (run["rows"][0]["cards"][0]["fits"], one["rows"][0]["cards"][0]["fits"]) == (False, True)
    assert "steady state" in run_text.splitlines()[1] and "one step" in one_text.splitlines()[1]
    assert "steady state" not in one_text.splitlines()[1]


def test_build2_without_a_file_estimate_keeps_the_protocols_one_step(capfd, tmp_path):
    out = tmp_path / "e.json"
    code, text, err = main(capfd, ["--estimate", "--model", "mistral-7b", "--quant", "nf4", "--seq", "512", "--json", out])
    assert code == 0 and json.loads(out.read_text())["steps"] == 1 and "one step" in text.splitlines()[1], err


# 13. a --dry-run's Soup number is said to be the CPU budget's; the checkpoint build is not silent --

def test_item13_a_checkpoint_build_says_so_on_stderr_when_it_is_not_a_terminal(capfd):
    from conftest import TINY

    from issue395.run.checkpoints import Checkpoints
    from issue395.run.request import MeasureRequest
    from issue395.run.scratch import Scratch

    with Scratch() as scratch:
        checkpoints = Checkpoints(["tiny"], {"tiny": TINY}, MeasureRequest(models=("tiny",), weights="synthetic"), scratch)
        checkpoints.get("tiny")
        checkpoints.close()
    err = capfd.readouterr().err
    assert "building" in err and "synthetic checkpoint" in err and "built in" in err, err


def test_item13_a_dry_run_table_says_soups_number_there_is_the_cpu_budgets():
    from dataclasses import replace as swap

    from issue395.report.tables import sweep_table
    from issue395.results.result import Result
    from conftest import ROOT

    saved = Result.from_json(json.loads((ROOT / "results/margin-map-in-4-parts-h200-soup0.73.3-3238e1a-to-b3a7891/"
                                         "full-cold.json").read_text()))
    measured = sweep_table(saved.rows[:2])
    assert "float32" not in measured
    dry = sweep_table([swap(r, dry_run=True, real_peak=None) for r in saved.rows[:2]])
    (line,) = [ln for ln in dry.splitlines() if "float32" in ln]
    assert "--estimate" in line and "CPU" in line
