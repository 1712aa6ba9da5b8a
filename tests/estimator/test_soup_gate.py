"""Soup's gate as a soup.yaml sets it (estimator/soup_gate.py): training.stream_vram_override replaces the
driver's free memory in Soup's fit check, training.stream_vram_probe answers by the measured one-step rule
(decide_measured_fit); both read through --estimate --config with the real Soup loader."""

from __future__ import annotations
from conftest import estimate_config_json, readme_yaml


# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


def test_an_override_of_1GB_makes_soup_refuse_the_readmes_run(capfd, tmp_path):
    """Soup's resolve_available_vram_bytes replaces the driver's free memory with the override: its
    number (2.47 GB at the README's run) against 1 GB refuses, whatever the card holds."""
    plain, _ = estimate_config_json(capfd, tmp_path, readme_yaml(tmp_path), "--card", "T4")
    (row,) = plain["rows"]
    assert row["cards"][0]["soup_admits"] is True
    over = readme_yaml(tmp_path, extra="  stream_vram_override: 1000000000\n", name="o.yaml")
    data, text = estimate_config_json(capfd, tmp_path, over, "--card", "T4")
    (card,) = data["rows"][0]["cards"]
    assert card["soup_admits"] is False and card["gate_free_bytes"] == 10**9
    assert card["fits"] is True  # the card is what it is: only Soup's gate moved
    assert card["longest_seq_soup_admits"] < row["cards"][0]["longest_seq_soup_admits"]
    assert "Soup refuses it" in text.splitlines()[2] and "stream_vram_override" in text


def test_an_override_above_the_card_lets_soup_admit_what_does_not_fit(capfd, tmp_path):
    """Issue 29 item 4: a training.stream_vram_override above the card lets Soup's gate admit a run that does
    not fit, and the disagreement says so."""
    over = readme_yaml(tmp_path, seq=8192, extra="  stream_vram_override: 100000000000\n")
    data, _ = estimate_config_json(capfd, tmp_path, over, "--card", "RTX3050-Laptop-4GB")
    (card,) = data["rows"][0]["cards"]
    assert (card["fits"], card["soup_admits"]) == (False, True)
    assert card["disagreement"] == "Soup admits a run that will OOM"


def test_the_probe_answers_by_the_measured_rule_on_one_step(capfd, tmp_path):
    """decide_measured_fit: one measured step against the free memory. Where Soup's number is over
    the free memory but the step (no optimizer state) fits, the formula refuses and the probe admits."""
    base, _ = estimate_config_json(capfd, tmp_path, readme_yaml(tmp_path, seq=3136), "--card", "RTX3050-Laptop-4GB",
                            "--steps", "1")
    probed = readme_yaml(tmp_path, seq=3136, extra="  stream_vram_probe: true\n", name="p.yaml")
    data, text = estimate_config_json(capfd, tmp_path, probed, "--card", "RTX3050-Laptop-4GB", "--steps", "1")
    (plain,), (card,) = base["rows"][0]["cards"], data["rows"][0]["cards"]
    row = data["rows"][0]
    assert card["gate_rule"].startswith("measured probe")
    assert card["soup_admits"] == (row["corrected_predicted"] <= card["gate_free_bytes"])
    assert plain["longest_seq_soup_admits"] != card["longest_seq_soup_admits"]
    assert "stream_vram_probe" in text and "decide_measured_fit" in text


def test_single_quantisation_leaves_a_bf16_resident_run_modelled_and_dora_does_not():
    """Sweep: bnb_4bit_use_double_quant is bitsandbytes' 4-bit setting, so false on a bf16 resident run leaves it
    modelled (it made the patched gate keep Soup's formula); on a 4-bit run it, and DoRA on any, are not modelled.
    Soup's own loader builds the configs."""
    from soup_cli.config.loader import load_config_from_string

    from issue395.estimator.soup_gate import resident_unmodelled

    def cfg(quant, lora=""):
        return load_config_from_string(
            f"base: meta-llama/Llama-3.2-1B\ndata: {{train: d.jsonl, max_length: 512}}\ntraining: {{batch_size: 1, "
            f"quantization: {quant}, stream_layers: false, bnb_4bit_use_double_quant: false, lora: {{r: 8{lora}}}}}\n")

    assert resident_unmodelled(cfg("none")) is None
    assert resident_unmodelled(cfg("4bit")).startswith("training.bnb_4bit_use_double_quant false is not modelled")
    assert resident_unmodelled(cfg("none", ", use_dora: true")).startswith("training.lora.use_dora true")


def test_the_patched_gate_reads_the_card_soup_runs_on_from_the_torch_soup_imported(monkeypatch):
    """soup_gate.device_dispatch: inside Soup's process, the card's SM count and compute capability from the torch
    Soup has imported (the bundle imports nothing), which decide where NF4's gemm_4bit fuses. CUDA cannot run here,
    so torch's device queries are faked (said so): an H100's answer is its Dispatch; a card without bf16, no CUDA,
    or no torch imported gives none (the card-agnostic estimate)."""
    import sys
    from types import SimpleNamespace as S

    from issue395.estimator.gemm4bit import Dispatch
    from issue395.estimator.soup_gate import device_dispatch

    def fake_torch(available: bool, major: int):
        props = S(multi_processor_count=132, major=major, minor=0)
        return S(cuda=S(is_available=lambda: available, current_device=lambda: 0,
                        get_device_properties=lambda i: props))

    monkeypatch.setitem(sys.modules, "torch", fake_torch(True, 9))
    assert device_dispatch() == Dispatch(132, 9, 0)
    monkeypatch.setitem(sys.modules, "torch", fake_torch(True, 7))
    assert device_dispatch() is None
    monkeypatch.setitem(sys.modules, "torch", fake_torch(False, 9))
    assert device_dispatch() is None
    monkeypatch.delitem(sys.modules, "torch")
    assert device_dispatch() is None
