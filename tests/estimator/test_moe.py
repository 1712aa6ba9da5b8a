"""issue395.estimator.moe (and its place in arch, soup_number and estimate): soup-cli 0.77.0's new families read
for the estimator. The union of every layer kind's tensors is checked against transformers' own meta
build of each family; Soup's own number against every number Soup's setup computed on the GPU
(committed results); the corrected estimate against the peaks measured there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import main, one_error_line

from issue395.estimator import estimate as E
from issue395.estimator.arch import arch_from_config, protocol_targets
from issue395.errors import UsageError
from issue395.estimator.moe import union_bytes
from issue395.estimator.layer import retained_by_layer
from issue395.model.registry import FAMILIES, config_json, stream_mode
from issue395.estimator.arch import nf4_bytes
from issue395.estimator.soup_number import supported_archs

ROOT = Path(__file__).resolve().parents[2]
NEW = ("moonlight", "deepseek-v3", "kimi-k2", "qwen3.5", "qwen3.5-moe")
SOUP077 = "deepseek_v3" in supported_archs()
needs_077 = pytest.mark.skipif(not SOUP077, reason="soup-cli 0.77.0 streams these families; this release does not")


def meta_union(key: str) -> dict:
    """transformers' own layers on the meta device, merged as Soup merges them (relative name ->
    the largest element count any layer has for it), fused experts under their in-memory names."""
    import torch
    from transformers import AutoModelForCausalLM

    from issue395.measure.builder import hf_config
    from issue395.measure.shapes import family_shape

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(family_shape(key)), dtype=torch.bfloat16)
    union: dict = {}
    for layer in model.model.layers:
        for name, t in layer.state_dict().items():
            union[name] = max(union.get(name, 0), t.numel())
    return union


@needs_077
@pytest.mark.parametrize("key", NEW)
def test_the_union_of_layer_kinds_is_transformers_own_tensor_for_tensor(key):
    a = arch_from_config(config_json(key))
    got = sorted(n for n, _ in a.layers.union)
    assert got == sorted(meta_union(key).values())


@needs_077
@pytest.mark.parametrize("key", NEW)
def test_the_protocols_targets_are_the_registrys_and_exist_in_the_model(key):
    a = arch_from_config(config_json(key))
    assert protocol_targets(a) == (FAMILIES[key].targets or ("q_proj", "v_proj"))
    assert all(t in a.modules for t in protocol_targets(a))


def committed_new_rows():
    """Every measured row of 0.77.0's families and streaming modes committed under results/."""
    seen = {}
    for path in sorted(ROOT.glob("results/*soup0.77.0*/*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("kind") == "estimate":
            continue
        for r in data.get("rows", []):
            family, stream = stream_mode(r["model_key"])
            if r.get("soup_predicted") and (family in NEW or stream) and not r.get("task"):  # tasks: a subcommand of their own
                seen.setdefault((r["model_key"], r["quant"], r["seq"], r["batch"]), (r, stream, path.name))
    return list(seen.values())


ROWS = committed_new_rows()


def test_the_committed_rows_cover_every_new_family_measured_and_every_mode():
    keys = {r["model_key"] for r, _, _ in ROWS}
    assert {"moonlight", "moonlight+per_expert", "deepseek-v3", "deepseek-v3+per_expert", "qwen3.5",
            "qwen3.5-moe", "smol+chunk512", "moonlight+chunk512", "smol+recompute-off",
            "moonlight+recompute-off"} <= keys


@needs_077
@pytest.mark.parametrize("row, stream, name", ROWS, ids=[f"{r['model_key']}-{r['quant']}-{r['seq']}x{r['batch']}-{n}"
                                                        for r, _, n in ROWS])
def test_soups_own_number_is_the_one_its_setup_computed_on_the_gpu_to_the_byte(row, stream, name):
    family, _ = stream_mode(row["model_key"])
    e = E.estimate(config_json(family), quant=row["quant"], seq=row["seq"], batch=row["batch"],
                   targets=tuple(row["targets"]), release="0.77.0", stream=stream)
    assert e.soup_predicted == row["soup_predicted"]
    terms = row["soup_terms"] if "soup_terms" in row else row["gate"]["terms"]  # schema 3: the Gate record
    assert {k: e.soup_terms[k] for k in terms} == terms


MEASURED = [x for x in ROWS if x[0].get("real_peak")]


@needs_077
@pytest.mark.parametrize("row, stream, name", MEASURED,
                         ids=[f"{r['model_key']}-{r['quant']}-{r['seq']}x{r['batch']}" for r, _, _ in MEASURED])
def test_the_corrected_estimate_is_never_under_a_committed_peak_and_within_4_percent(row, stream, name):
    # in sample: these arms are the ones the new terms were read from (their allocator histories);
    # results/estimator-predictions-before-out-of-sample-arms.txt holds the out-of-sample check
    family, _ = stream_mode(row["model_key"])
    e = E.estimate(config_json(family), quant=row["quant"], seq=row["seq"], batch=row["batch"],
                   targets=tuple(row["targets"]), release="0.77.0", stream=stream)
    # Loose where it is known loose: the chunked loss on Qwen3.5 (measured out of sample) is 10.7%
    # over; what its chunk keeps is not traced (results/README.md, "soup-cli 0.77.0")
    loose = 1.11 if row["model_key"] == "qwen3.5+chunk256" else 1.04
    assert row["real_peak"] <= e.corrected_predicted <= loose * row["real_peak"]


def test_nf4_quantises_nn_linear_weights_only_and_per_expert_takes_the_experts_out():
    # hand arithmetic on Moonlight's union (hidden 2048, 64 experts of 1408): the fused experts stay
    # bf16 under NF4 (3 x 2048 x 1408 x 64 x 2 B = 1,107,296,256) and leave the buffer per-expert
    a = arch_from_config(config_json("moonlight"))
    fused_nf4 = union_bytes(a.layers.union, "nf4", False, nf4_bytes)
    per_expert_nf4 = union_bytes(a.layers.union, "nf4", True, nf4_bytes)
    assert fused_nf4 - per_expert_nf4 == 3 * 2048 * 1408 * 64 * 2
    # the router (64 x 2048) stays bf16 and its score bias fp32: 262,144 + 256 B in either
    assert (64 * 2048, "bf16") in a.layers.union and (64, "fp32") in a.layers.union


def test_a_model_type_soup_streams_without_traits_here_is_one_line_not_another_architecture():
    with pytest.raises(UsageError, match="not one this estimator reads"):
        arch_from_config({**config_json("mistral-7b"), "model_type": "qwen4_exp"})


@needs_077
def test_estimate_refuses_per_expert_where_soup_refuses_it(capfd):
    one_error_line(*main(capfd, ["--estimate", "--model", "qwen3.5-moe", "--seq", "512", "--expert-layout",
                                 "per_expert"]), "per_expert", "deepseek_v3")


@needs_077
def test_estimate_of_a_deepseek_config_is_not_a_llamas(capfd):
    code, out, err = main(capfd, ["--estimate", "--model", "deepseek-v3", "--quant", "nf4", "--seq", "512"])
    assert code == 0, err
    llama = E.estimate({**config_json("deepseek-v3"), "model_type": "llama"}, quant="nf4", seq=512,
                       targets=("q_proj", "v_proj"))
    corrected = float(next(ln for ln in out.splitlines() if ln.startswith("corrected: allocated")).split()[-1])
    assert abs(corrected - llama.corrected_predicted / 1e9) > 1.0  # 22.9 GB of experts vs a dense layer


@pytest.mark.skipif(SOUP077, reason="0.77.0 streams deepseek_v3")
def test_on_0733_a_deepseek_config_cannot_be_streamed(capfd):
    one_error_line(*main(capfd, ["--estimate", "--model", "deepseek-v3", "--seq", "512"]), "cannot be layer-streamed")


# -- what the review of the streaming modes found (each failed before its fix) --

def test_recompute_off_is_charged_in_the_layer_phase_too():
    # DeepSeek-V3 NF4 at 64 tokens: the first dense layer's recompute binds; with recompute off the
    # other layers' activations are still held there, so the estimate must grow by them, less what only
    # the recompute's forward end holds (the last linear's dequant in flight with its fp32 absmax:
    # layer.forward_end_weights), which recompute off never runs inside the backward
    c = config_json("deepseek-v3")
    on = E.estimate(c, quant="nf4", seq=64, release="0.77.0", soup=False)
    off = E.estimate(c, quant="nf4", seq=64, release="0.77.0", soup=False, stream={"stream_recompute": "off"})
    assert on.phase == "layer" and off.terms["retained_beside_layer"] > 0
    forward_end_only = on.terms["dequantised_layer"] - off.terms["dequantised_layer"]
    assert 0 < forward_end_only < off.terms["retained_beside_layer"]
    assert off.corrected_predicted >= on.corrected_predicted + off.terms["retained_beside_layer"] - forward_end_only


def test_no_corrected_number_for_a_layout_soup_refuses():
    with pytest.raises(UsageError, match="per_expert"):
        E.estimate(config_json("qwen3.5-moe"), seq=512, release="0.77.0", soup=False,
                   stream={"stream_expert_layout": "per_expert"})


def test_a_streaming_mode_is_capped_at_its_own_estimate():
    from conftest import cap_of

    kw = dict(quant="none", seq=512, batch=1, targets=("q_proj", "v_proj"), release="0.77.0")
    assert cap_of("corrected", "smol+recompute-off", **kw) > cap_of("corrected", "smol", **kw) + 200e6


def test_a_hub_wrapper_config_is_read_as_its_text_decoder_and_kv_must_divide_heads():
    wrapper = {"model_type": "qwen3_5_moe", "text_config": config_json("qwen3.5-moe")}
    assert arch_from_config(wrapper).model_type == "qwen3_5_moe_text"
    with pytest.raises(UsageError, match="num_key_value_heads"):
        arch_from_config(dict(config_json("qwen3.5-moe"), num_key_value_heads=3))
    with pytest.raises(UsageError, match="qk_nope_head_dim"):
        arch_from_config(dict(config_json("moonlight"), qk_nope_head_dim=128.5))


def test_a_familys_streaming_modes_stay_in_one_shard_and_a_lost_row_names_the_family():
    from issue395.host.grid import shard_of
    from issue395.host.measured import MeasureRequest
    from issue395.model.arm import Arm
    from issue395.host.spread import lost_row

    arms = [Arm.at(k, 512, 1, i) for i, k in enumerate(("smol", "smol+chunk512", "qwen", "qwen+chunk512"))]
    for k in (1, 2):
        families = {a.model.split("+")[0] for a in shard_of(arms, (k, 2), whole_models=True)}
        assert len(families) == 1
    row = lost_row(Arm.at("smol+chunk512", 512, 1, 0), MeasureRequest(), None, 9)
    assert row.model == "SmolLM2-135M" and row.vocab == 49152


def test_a_streaming_modes_blocks_are_named_by_its_familys_classes():
    from issue395.estimator.anatomy import classifier_for

    assert classifier_for("smol+chunk512", quant="none", seq=512, batch=1) is not None


@needs_077
@pytest.mark.parametrize("argv, words", [
    (["--sweep", "--models", "smol", "--loss-chunk", "512", "--dry-run"], ["--loss-chunk", "--map"]),
    (["--map", "--families", "smol", "--expert-layout", "per_expert", "--dry-run", "--seq", "64"], ["routed experts"]),
    (["--estimate", "--model", "moonlight", "--seq", "512", "--loss-chunk", "99999"], ["16 to 8192"]),
    (["--map", "--families", "smol", "--loss-chunk", "10000", "--dry-run", "--seq", "64"], ["8192"]),
], ids=["mode-outside-map", "per-expert-no-moe", "chunk-past-soup-estimate", "chunk-past-soup-map"])
def test_streaming_mode_options_soup_would_not_take_are_one_line(capfd, argv, words):
    one_error_line(*main(capfd, argv), *words)


def test_the_committed_new_families_report_is_what_the_script_prints_now():
    import subprocess
    import sys

    committed = (ROOT / "results" / "estimator-0.77.0-families.txt").read_text()
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "estimator_checks.py"), "families"], capture_output=True,
                         text=True, check=True).stdout
    assert out == committed
    assert "corrected under on 0;" in committed


@needs_077
def test_the_map_takes_the_streaming_mode_axes_it_names():
    # the check that refuses a mode flag outside --map must not refuse it on --map itself
    from issue395.run.options import settle
    from issue395.run.parser import build_parser

    argv = ["--map", "--dry-run", "--families", "smol,moonlight", "--seq", "64", "--batch", "1",
            "--quant", "none", "--loss-chunk", "off,32", "--recompute", "on,off", "--expert-layout", "fused,per_expert"]
    run = settle(build_parser().parse_args(argv), argv)
    assert run.models == ("smol", "smol+recompute-off", "smol+chunk32", "smol+chunk32+recompute-off",
                          "moonlight", "moonlight+recompute-off", "moonlight+chunk32", "moonlight+chunk32+recompute-off",
                          "moonlight+per_expert", "moonlight+per_expert+recompute-off", "moonlight+per_expert+chunk32",
                          "moonlight+per_expert+chunk32+recompute-off")


MODES_CALL = next(ROOT.glob("results/pages2-soup-patch-map4-modes-h200-soup0.77.0-*/call-5"))


def modes_rows(name: str) -> list[dict]:
    return [r for r in json.loads((MODES_CALL / name).read_text())["rows"] if r.get("real_peak")]


def corrected(row: dict) -> int:
    family, stream = stream_mode(row["model_key"])
    return E.estimate(config_json(family), quant=row["quant"], seq=row["seq"], batch=row["batch"],
                      targets=tuple(row["targets"]), release="0.77.0", stream=stream, soup=False).corrected_predicted


@pytest.mark.parametrize("name", ["modes-qwen35moe-recompute-off.json", "modes-moonlight-per-expert-chunk512.json"])
def test_the_modes_measured_with_the_allocators_history_are_within_2_percent_never_under(name):
    """Issue 38 item 5. Qwen3.5-MoE with stream_recompute off read 1.173x and 1.218x while every layer
    was charged its widest kind's retained bytes; its rows are where "a layer before the first LoRA
    target keeps nothing" was read (in sample). Moonlight per-expert with a 512-token chunked loss was
    measured after its terms were written (held out)."""
    rows = modes_rows(name)
    assert len(rows) >= 2
    for r in rows:
        assert r["real_peak"] <= corrected(r) <= 1.02 * r["real_peak"], (r["model_key"], r["quant"], r["seq"])


def test_kimi_k2_at_2048_in_both_layouts_is_never_under():
    """Issue 38 item 4: Kimi K2 (2 of 61 layers, full width) NF4 at 2048, fused and per-expert, with and
    without the chunked loss. Known loose: per-expert with the chunk at 2048 (its layer phase binds)."""
    rows = modes_rows("kimi-k2-2048-fused.json") + modes_rows("kimi-k2-2048-per-expert.json")
    assert {r["seq"] for r in rows} >= {2048} and len(rows) == 5
    assert all(corrected(r) >= r["real_peak"] for r in rows)


def test_recompute_off_keeps_nothing_in_the_layers_before_the_first_lora_target():
    # Qwen3.5-MoE's q_proj and v_proj are in its full-attention layers only (the 4th of 4 here): a
    # delta-net target (in_proj_qkv) puts a graph in every layer, and the retained bytes grow
    c = config_json("qwen3.5-moe")
    off = {"stream_recompute": "off"}
    attn = E.estimate(c, seq=2048, release="0.77.0", soup=False, stream=off, targets=("q_proj", "v_proj"))
    every = E.estimate(c, seq=2048, release="0.77.0", soup=False, stream=off, targets=("q_proj", "v_proj", "in_proj_qkv"))
    kept = retained_by_layer(arch_from_config(c), "none", ("q_proj", "v_proj"), 8)
    assert kept[:3] == [0, 0, 0] and kept[3] > 0
    assert attn.terms["retained_beside_layer"] == 0  # the last layer's backward runs first: nothing else kept
    assert every.terms["retained_activations"] > 3 * attn.terms["retained_activations"]


def test_each_layer_has_its_kind_dense_first_and_a_hybrids_every_fourth_full_attention():
    # DeepSeek-V3's first_k_dense_replace dense layers come first; Qwen3.5's layer_types (or every
    # full_attention_interval-th layer) cut to the depth built
    assert arch_from_config(config_json("deepseek-v3")).layers.order == (0, 0, 0, 1)
    assert arch_from_config(config_json("moonlight")).layers.order == (0, 1, 1, 1)
    c = dict(config_json("qwen3.5-moe"))
    c["layer_types"] = ["linear_attention", "full_attention"] * 20  # longer than the 4 layers built
    a = arch_from_config(c)
    kinds = [a.layers.kinds[j] for j in a.layers.order]
    assert len(kinds) == a.L and ["q_proj" in k.dequant for k in kinds] == [False, True, False, True]
    kept = retained_by_layer(a, "none", ("q_proj", "v_proj"), 8)
    assert kept[0] == 0 and kept[1] > 0 and kept[2] > 0  # from the first target's layer on, every layer
