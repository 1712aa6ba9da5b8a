"""The margin map: every family Soup streams, from its public config alone, bf16 and NF4.

Shapes are pinned on the meta device against docs/FAMILIES.md's public parameter counts (typed in
here independently of the harness). The real Soup setup runs on CPU through --dry-run
(bitsandbytes is a requirement, so NF4 arms run Soup's 4bit setup too); the margin
arithmetic is checked on rows built by the harness's own constructor, with an allocator
attribution written by hand where a CUDA snapshot would have produced it (it cannot run here).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import SMOL, h, main, make_row

from issue395 import estimate, measurement, options
from issue395.builder import prepare_checkpoint
from issue395.errors import UsageError
from issue395.grid import arm_seconds, plan_map, shard_of
from issue395.margin import estimator_terms, margin_breakdown, shape_classes
from issue395.options import Run
from issue395.outputs import render_plot
from issue395.record import MAP_BATCHES, QUANTS, SHAPES, Arm
from issue395.result import Result, merge
from issue395.row import Row
from issue395.registry import FAMILIES, MAP_FAMILIES, config_json, max_positions
from issue395.shapes import family_shape
from issue395.spread import plan_jobs
from issue395.tables import map_verdict, margins_table

#: docs/FAMILIES.md: the public parameter count of one checkpoint per family.
PUBLIC_PARAMS = {
    "llama32-1b": 1_235_814_400, "qwen3-0.6b": 596_049_920, "mistral-7b": 7_248_023_552,
    "gemma-2b": 2_506_172_416, "gemma2-2b": 2_614_341_888, "gemma3-1b": 999_885_952,
    "phi-2": 2_779_683_840, "phi3-mini": 3_821_079_552, "llama31-8b": 8_030_261_248,
}
UNTIED = {"mistral-7b", "phi-2", "phi3-mini", "llama31-8b"}


def meta_model(key):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = FAMILIES[key].model_type, FAMILIES[key].config
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields),
                                                dtype=torch.bfloat16)


@pytest.mark.parametrize("key", sorted(PUBLIC_PARAMS))
def test_each_family_config_builds_its_public_parameter_count(key):
    assert sum(p.numel() for p in meta_model(key).parameters()) == PUBLIC_PARAMS[key]


@pytest.mark.parametrize("key", sorted(PUBLIC_PARAMS))
def test_family_shape_charges_an_untied_head_in_the_extras(key):
    shape = family_shape(key)
    model = meta_model(key)
    embed = model.get_input_embeddings().weight.numel() * 2
    assert (shape.extras >= 2 * embed) == (key in UNTIED)
    # the meta skeleton's layer and the estimator's closed formula are two derivations: they agree
    assert shape.pool == estimate.pool(estimate.arch_of(config_json(key)), "none")


def test_lora_targets_are_q_and_v_except_phi3s_fused_qkv_and_the_adapter_follows_them():
    phi3 = family_shape("phi3-mini")
    assert phi3.targets == ("qkv_proj",)
    # qkv_proj: 3072 -> 3 x 3072; the grid's count is twice LoRA's A + B on every layer.
    assert phi3.grid_adapter == 2 * 32 * 8 * (3072 + 3 * 3072)
    llama = family_shape("llama32-1b")
    assert llama.targets == ("q_proj", "v_proj")
    assert llama.grid_adapter == 2 * 16 * 8 * ((2048 + 2048) + (2048 + 8 * 64))


def test_the_record_models_in_the_map_are_the_records_shapes():
    assert family_shape("smol") is SHAPES["smol"] and family_shape("qwen") is SHAPES["qwen"]


def test_builder_keeps_an_untied_head_and_sets_gemma_norms_to_their_neutral_zero(tmp_path):
    from safetensors import safe_open

    tiny = dict(n_layers=1, vocab=512, hidden=64, intermediate=128, max_positions=256, record=False)
    gemma = dataclasses.replace(family_shape("gemma-2b"), key="g", **tiny,
                                arch=dict(FAMILIES["gemma-2b"].config, num_attention_heads=2, head_dim=32))
    mistral = dataclasses.replace(family_shape("mistral-7b"), key="m", **tiny,
                                  arch=dict(FAMILIES["mistral-7b"].config, num_attention_heads=2,
                                            num_key_value_heads=1, head_dim=32))
    for shape in (gemma, mistral):
        prepare_checkpoint(shape, tmp_path / shape.key)()
    with safe_open(str(tmp_path / "g" / "model.safetensors"), framework="pt") as f:
        norms = [f.get_tensor(k) for k in f.keys() if "norm" in k]
        assert norms and all(float(t.abs().max()) == 0.0 for t in norms)
        assert "lm_head.weight" not in f.keys()
    with safe_open(str(tmp_path / "m" / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" in f.keys()
        assert all(float(f.get_tensor(k).min()) == 1.0 for k in f.keys() if "norm" in k)


@pytest.mark.slow
def test_map_dry_run_realises_seq_on_every_row_in_bf16_and_nf4_and_captures_soups_own_number(
        capfd, cache_dir, tmp_path):
    out = tmp_path / "map.json"
    code, stdout, err = main(capfd, ["--map", "--dry-run", "--families", "smol", "--seq", "64",
                                     "--batch", "1", "--cache-dir", cache_dir, "--json", out])
    assert code == 0, err
    rows = [Row.from_json(r) for r in json.loads(out.read_text())["rows"]]
    assert [(r.quant, r.realised, r.status) for r in rows] == [("none", 64, "dry-run"),
                                                              ("nf4", 64, "dry-run")]
    # Soup's pre-flight ran inside the setup (on CPU it budgets float32 weights).
    none, nf4 = rows
    assert none.soup_predicted and nf4.soup_predicted and nf4.soup_predicted < none.soup_predicted
    assert none.soup_terms["seq_len"] == 64 and none.soup_terms["layer_bytes"] == SMOL.pool  # fp32
    for needle in ("margin map", "summary per family and quantization", "verdict: nothing measured"):
        assert needle in stdout


def test_model_takes_a_folder_holding_only_a_config_and_builds_from_it(capfd, tmp_path):
    folder = tmp_path / "only-config"
    folder.mkdir()
    fields = dict(FAMILIES["qwen3-0.6b"].config, model_type="qwen3", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=512, max_position_embeddings=256)
    (folder / "config.json").write_text(json.dumps(fields))
    code, stdout, err = main(capfd, ["--model", folder, "--seq", "64", "--dry-run"])
    assert code == 0, err
    assert "weights synthetic" in stdout
    assert [line.split()[:2] for line in stdout.splitlines() if line.split()[:1] == ["64"]] == [["64", "64"]]


@pytest.mark.parametrize("argv, words", [
    (["--map", "--families", "smol,nope"], "unknown family 'nope'"),
    (["--map", "--families", "phi-2", "--seq", "4096"], "beyond phi-2's maximum positions (2048)"),
    (["--map", "--quant", "nf8"], "--quant"),
    (["--map", "--models", "smol"], "exclusive"),
    (["--families", "smol"], "--families goes with --map"),
])
def test_bad_map_input_is_one_line_and_exit_2(capfd, argv, words):
    code, stdout, err = main(capfd, argv)
    assert code == 2 and stdout == ""
    assert len(err.strip().splitlines()) == 1 and words in err


def test_an_explicit_nf4_request_without_bitsandbytes_is_a_usage_error(capfd, monkeypatch):
    monkeypatch.setattr(options, "bitsandbytes_present", lambda: False)
    code, stdout, err = main(capfd, ["--map", "--quant", "nf4", "--families", "smol"])
    assert code == 2 and "bitsandbytes" in err and len(err.strip().splitlines()) == 1


def test_without_bitsandbytes_an_nf4_arm_is_a_skipped_row_with_its_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(measurement, "bitsandbytes_present", lambda: False)
    row = h.protocol().run_arm(Arm("smol", 64, 1, 0, "nf4"), SMOL, "unused", tmp_path, dry_run=True)
    assert row.status == "SKIPPED" and "bitsandbytes" in row.error
    assert Result(environment={}, rows=[row]).exit_code == 0


def test_a_refused_row_is_the_gate_working_not_a_finding_and_has_no_ratio():
    row = make_row(failure="REFUSED", error="a streaming step is predicted to need 240 GB", real_peak=None)
    assert row.status == "REFUSED" and row.margin_ratio is None
    assert Result(environment={}, rows=[row]).exit_code == 0


def test_under_is_judged_on_the_lower_of_soups_own_and_the_record_convention():
    peak = 1_500_000_000
    row = make_row(real_peak=peak, soup_predicted=peak - 1)  # the convention covers it, Soup's own not
    assert row.predicted > peak and row.status == "UNDER"
    assert row.margin_ratio == pytest.approx((peak - 1) / peak)
    assert "verdict: Soup UNDER-predicts 1 of 1" in map_verdict([row])


def test_map_parts_of_different_families_merge_into_one_map_in_the_maps_order():
    part_a = Result(environment={"torch": "t"}, kind="map",
                      rows=[make_row("qwen", 2048, index=0, real_peak=10**9)])
    part_b = Result(environment={"torch": "t"}, kind="map",
                      rows=[make_row("smol", 2048, index=0, real_peak=10**9)])
    merged = merge([part_a, part_b])
    assert [r.model_key for r in merged.rows] == ["smol", "qwen"]
    with pytest.raises(UsageError):
        merge([part_a, part_a])


def test_the_map_heatmap_is_a_png():
    rows = [make_row(k, q, index=i, real_peak=10**9) for i, (k, q) in enumerate([("smol", 2048), ("qwen", 4096)])]
    png = render_plot(Result(environment={"gpu": "test"}, kind="map", rows=rows))
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_map_spread_over_two_gpus_starts_one_child_per_gpu_each_with_whole_families():
    arms = plan_map(("smol", "qwen", "mistral-7b"), ("none",), (2048,), (1,))
    jobs = plan_jobs(Run(map=True, models=("smol", "qwen", "mistral-7b"), gpus=(0, 1)), arms)
    assert [sorted({a.model for a in j.arms}) for j in jobs] == [["mistral-7b"], ["qwen", "smol"]]
    one = plan_jobs(Run(map=True, models=("smol",), gpus=(0, 1)), arms[:1])
    assert len(one) == 1, "a second GPU with no family to run started a child anyway"
