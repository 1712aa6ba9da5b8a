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
