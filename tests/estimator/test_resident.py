"""issue395.estimator.resident: the corrected peak of a resident run (stream_layers off), held to the committed
resident rows (results/resident-map-*: real peaks measured on an H200), and its refusals, one line each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ROOT

from issue395.errors import UsageError
from issue395.estimator.resident import estimate_resident, refused
from issue395.estimator.arch import arch_from_config
from issue395.model.registry import config_json, stream_mode
from issue395.results.corrected import corrected
from issue395.results.row import Row


def committed_resident_rows() -> list[Row]:
    return [Row.from_json(r) for path in sorted((ROOT / "results").glob("resident-map-*/call-*/*.json"))
            for r in json.loads(path.read_text())["rows"]]


def test_the_resident_estimate_is_never_under_and_tight_on_every_committed_arm_it_models():
    """Every committed resident row the estimator models, bf16 and NF4 (the map's corrected column, from the family's
    public config alone) is at or above its real peak, within 1.09x, median at most 1.015x, and within 1.004x with
    checkpointing; the ones it does not model (MoE and hybrid layers, phi, past a sliding window without
    checkpointing) get no figure."""
    import statistics

    rows = [r for r in committed_resident_rows() if r.measured]
    env = {"soup_cli": "0.77.0", "transformers": "5.16.1"}
    got = [(r, corrected(r, env)) for r in rows]
    modelled = [(r, c / r.real_peak) for r, c in got if c is not None]
    assert len(modelled) >= 140 and any(r.quant == "nf4" for r, _ in modelled), len(modelled)
    assert all(1.0 <= v <= 1.09 for _, v in modelled), [(r.model_key, r.seq, round(v, 4)) for r, v in modelled]
    assert all(v <= 1.004 for r, v in modelled if "+gc" in r.model_key)
    assert statistics.median(v for _, v in modelled) <= 1.015
    assert all(c is None for r, c in got if r.model_key.startswith(("moonlight", "qwen3.5", "phi-2")))


@pytest.mark.parametrize("key, quant, words", [
    ("gemma3-1b+resident", "none", "sliding window"),
    ("llama32-1b+resident+gc", "8bit", "8bit"),
    ("moonlight+resident+gc", "none", "deepseek_v3"),
    ("phi-2+resident+gc", "none", "phi run"),
])
def test_a_resident_run_it_does_not_model_is_one_line_naming_why(key, quant, words):
    """Refused, never estimated as if it were modelled: no checkpointing, NF4, layers of several kinds, phi."""
    family, modes = stream_mode(key)
    with pytest.raises(UsageError, match=words):
        estimate_resident(config_json(family), quant=quant, seq=1024, checkpointing=bool(modes.get("gradient_checkpointing")))
    assert refused(arch_from_config(config_json(family)), quant, bool(modes.get("gradient_checkpointing")), 1024)


def test_the_resident_weights_replace_the_pool_and_the_extras_and_an_untied_head_is_on_the_card():
    """The resident estimate carries every layer's weights and no streamed pool or extras; for an untied model
    (Llama-3.1-8B) both vocab matrices count (nothing streams them): its weights exceed a tied twin's by V x h x 2."""
    e = estimate_resident(config_json("llama31-8b"), seq=1024, checkpointing=True)
    assert e.terms["pool"] == 0 and e.terms["extras"] == 0 and e.soup_predicted is None
    tied = dict(config_json("llama31-8b"), tie_word_embeddings=True)
    c = config_json("llama31-8b")
    assert (e.terms["resident_weights"] - estimate_resident(tied, seq=1024, checkpointing=True).terms["resident_weights"]
            >= 2 * c["vocab_size"] * c["hidden_size"])


def test_a_resident_runs_steady_state_holds_the_optimizers_states_and_accumulation_the_gradients():
    """From step 2 the adapter's Adam moments are live beside the peak, and with accumulation its gradients are held
    through micro-batch 2's phases: each estimate exceeds the one-step figure by at least those bytes (8 and 4 B a
    fp32 LoRA parameter); r64 on all seven linears makes them large."""
    from issue395.estimator.arch import lora_params

    c = config_json("llama32-1b")
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    n = lora_params(arch_from_config(c), targets, 64)
    one = estimate_resident(c, seq=1024, checkpointing=True, targets=targets, lora_r=64).corrected_predicted
    steady = estimate_resident(c, seq=1024, checkpointing=True, targets=targets, lora_r=64, steps=2)
    held = estimate_resident(c, seq=1024, checkpointing=True, targets=targets, lora_r=64, accumulation=4)
    assert steady.corrected_predicted - one >= 8 * n and steady.terms["adam_moments"] == 8 * n
    assert held.corrected_predicted - one >= 3 * n and held.terms["held_gradients"] == 4 * n


def test_nf4_weights_are_bitsandbytes_packing_and_fp32_for_the_rest():
    """A resident QLoRA run holds far less than bf16 in its layers but its embedding in fp32: Llama-3.2-1B's NF4
    weights are under half its bf16 weights, and more than its fp32 embedding alone (V x h x 4)."""
    from issue395.estimator.resident import resident_weights

    a = arch_from_config(config_json("llama32-1b"))
    nf4, bf16 = resident_weights(a, "nf4"), resident_weights(a, "none")
    assert 4 * a.V * a.h < nf4 < bf16 * 0.7


# -- Full fine-tuning (Soup's training.lora.r 0; issue 51 item 1). No measured full-FT row exists: these hold
#    the construction to Soup's own setup and to the physics' own rules, not to a peak --


def test_soups_own_cpu_setup_of_a_full_fine_tuning_trains_exactly_the_tensors_the_estimate_charges(tmp_path):
    """Soup's SFT setup (real, CPU) of a tiny resident lora.r 0 run on the harness's own checkpoint: every tensor
    it leaves trainable is one the estimate charges a gradient and the optimizer's states for, element for
    element, at the dtype it charges (the checkpoint's own: Soup passes no dtype, transformers 5 loads "auto")."""
    import yaml
    from conftest import TINY
    from soup_cli.config.loader import load_config_from_string
    from soup_cli.trainer.sft import SFTTrainerWrapper

    from issue395.estimator.resident import FULL_FT_BYTES, full_params, full_refused
    from issue395.measure.builder import prepare_checkpoint

    base = tmp_path / "tiny"
    prepare_checkpoint(TINY, base)()
    config = json.loads((base / "config.json").read_text())
    a = arch_from_config(config)
    if full_refused(a, config, quant="none", task="sft", release=None, transformers=None):
        pytest.skip("the installed Soup's full fine-tuning is one the estimate refuses (its release's line says why)")
    cfg = load_config_from_string(yaml.safe_dump({
        "base": str(base), "task": "sft", "data": {"train": "t.jsonl", "max_length": 64},
        "training": {"batch_size": 1, "quantization": "none", "stream_layers": False, "lora": {"r": 0}}}))
    wrapper = SFTTrainerWrapper(cfg, device="cpu")
    wrapper._setup_transformers(cfg, cfg.training)
    trained = [p for p in wrapper.model.parameters() if p.requires_grad]
    assert sorted(p.numel() for p in trained) == sorted(full_params(a))
    assert {p.element_size() for p in trained} == {FULL_FT_BYTES}


def test_a_full_fine_tuning_charges_no_adapter_and_every_parameters_gradient_and_states():
    """Llama-3.2-1B SFT 1024x1, lora.r 0: no LoRA weights; the optimizer's step holds every parameter's gradient
    and AdamW's two states of each (bf16, as the parameters) and binds; it needs more than the same run with a
    LoRA adapter by more than those states; from step 2 on the states sit beside every phase."""
    from issue395.estimator.resident import full_params

    config = config_json("llama32-1b")
    n = sum(full_params(arch_from_config(config)))
    full = estimate_resident(config, seq=1024, lora_r=0, steps=2, checkpointing=True)
    lora = estimate_resident(config, seq=1024, lora_r=8, steps=2, checkpointing=True)
    t = full.terms
    assert "lora_weights" not in t and full.phase == "optimizer"
    assert 2 * 2 * n <= t["adam_moments"] < 2 * 2 * n * 1.05 and 2 * n <= t["parameter_gradients"] < 2 * n * 1.05
    assert full.corrected_predicted - lora.corrected_predicted > t["adam_moments"]
    one = estimate_resident(config, seq=1024, lora_r=0, steps=1, checkpointing=True)
    assert one.phase == "optimizer" and one.terms["adam_moments"] == t["adam_moments"]  # made at step 1's step


def test_without_checkpointing_a_fully_trained_layer_keeps_more_than_a_frozen_one():
    """Every linear's input and every norm's normed tensor kept for its weight's gradient: the retained
    activations of a full fine-tuning are above a LoRA run's on q and v at the same tokens."""
    config = config_json("llama32-1b")
    full = estimate_resident(config, seq=1024, lora_r=0, checkpointing=False)
    lora = estimate_resident(config, seq=1024, lora_r=8, checkpointing=False)
    assert full.terms["retained_activations"] > lora.terms["retained_activations"] > 0


@pytest.mark.parametrize("kwargs,words", [
    (dict(task="dpo"), "task dpo is not a run Soup builds"),
    (dict(quant="nf4"), "Soup's loader refuses it"),
])
def test_a_full_fine_tuning_soup_does_not_build_is_one_line(kwargs, words):
    with pytest.raises(UsageError, match=words):
        estimate_resident(config_json("llama32-1b"), seq=512, batch=2, lora_r=0, **kwargs)


def test_a_release_that_loads_fp32_master_weights_is_refused_in_one_line(tmp_path, monkeypatch):
    """soup-cli 0.77.0's SFT setup loads a fully fine-tuned base in fp32 (its resolve_base_load_dtype): not
    modelled, said so naming the release (a soup_cli folder whose sft.py calls it stands for the release)."""
    from issue395.estimator.releases import SOURCE_ENV

    src = tmp_path / "soup_cli"
    (src / "trainer").mkdir(parents=True)
    (src / "trainer" / "sft.py").write_text("dtype = resolve_base_load_dtype(device, full_finetune=True)\n")
    (tmp_path / "soup_cli-0.77.0.dist-info").mkdir()
    monkeypatch.setenv(SOURCE_ENV, str(src))
    with pytest.raises(UsageError, match="soup-cli 0.77.0 loads a fully fine-tuned base as fp32 master weights"):
        estimate_resident(config_json("llama32-1b"), seq=512, lora_r=0)
