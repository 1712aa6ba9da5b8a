"""issue395.estimator.soup_number: Soup's own pre-flight number computed by Soup's own code (its estimator read
from the installed soup-cli's source, no torch), fed what Soup's setup computes from the config. Against
every soup_predicted a GPU captured (the committed arms bench/estimator_checks.py leave-one-out reads), and against
Soup's real setup run here on CPU through --dry-run (where it budgets float32 weights); --estimate's
Soup number for a committed map arm (Mistral-7B NF4 512 x 1, read back through Result) is the one its
setup computed on the GPU. Nothing is faked."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import ROOT, SMOL, main

from issue395.model.registry import config_json
from issue395.results.result import Result
from issue395.estimator.releases import installed_release, release_source, soup_dir as _soup_dir
from issue395.estimator.soup_number import features, soup_namespace, soup_preflight_from_config, supported_archs

_spec = importlib.util.spec_from_file_location("estimator_checks", ROOT / "bench" / "estimator_checks.py")
LOO = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(LOO)
ARMS = LOO.load_arms()


@pytest.mark.parametrize("arm", [a for a in ARMS if a["release"] == installed_release()],
                         ids=lambda a: f"{a['family']}-{a['quant']}-{a['seq']}x{a['batch']}")
def test_soup_number_from_config_equals_the_committed_capture(arm):
    got, terms = soup_preflight_from_config(config_json(arm["family"]), quant=arm["quant"], seq=arm["seq"],
                                            batch=arm["batch"], targets=arm["targets"], lora_r=8,
                                            release=arm["release"])
    assert abs(got - arm["soup_predicted"]) <= 16
    assert terms == arm["soup_terms"]


@pytest.mark.skipif(release_source("0.77.0") is None, reason="soup-cli 0.77.0's own code is not here (its venv runs it)")
@pytest.mark.parametrize("arm", [a for a in ARMS if a["release"] == "0.77.0"],
                         ids=lambda a: f"{a['family']}-{a['quant']}-{a['seq']}")
def test_soup_077_kwargs_and_number_match_the_untied_map(arm):
    got, terms = soup_preflight_from_config(config_json(arm["family"]), quant=arm["quant"], seq=arm["seq"],
                                            batch=arm["batch"], targets=arm["targets"], lora_r=8,
                                            release="0.77.0")
    assert abs(got - arm["soup_predicted"]) <= 16 and terms == arm["soup_terms"]


def test_soup_number_is_soups_own_function_not_a_copy():
    ns = soup_namespace()
    src = (_soup_dir() / "utils" / "layer_stream.py").read_text()
    assert ns["estimate_stream_peak_vram"].__code__.co_filename.endswith("layer_stream.py")
    assert f"STREAM_FIXED_SLACK_BYTES = {ns['STREAM_FIXED_SLACK_BYTES']:_}" in src
    # docs/FAMILIES.md's nine (0.73.3); a later Soup may stream more (0.77.0 adds two)
    assert "SUPPORTED_STREAM_ARCHS" in src and {"llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2",
                                                 "gemma3_text", "phi", "phi3"} <= set(supported_archs())


@pytest.mark.slow
@pytest.mark.release
def test_soups_number_from_the_config_is_what_soups_own_setup_computes_on_cpu(smol_map_dry_run):
    """SmolLM2 at seq 64, bf16 and NF4, through Soup's real setup (--map --dry-run on CPU: the session's
    conftest.smol_map_dry_run). Soup's setup budgets the weights it holds, float32 on CPU: every other
    argument it passes its estimator is the one computed here from the config, and its number is Soup's
    estimator (as read here) on them."""
    code, _, err, saved = smol_map_dry_run
    assert code == 0, err
    rows = {r["quant"]: r for r in saved["rows"]}
    for quant, row in rows.items():
        _, mine = soup_preflight_from_config(config_json("smol"), quant=quant, seq=64, batch=1,
                                             targets=("q_proj", "v_proj"), lora_r=8)
        setup = row["gate"]["terms"]
        weights = ("layer_bytes", "extras_bytes")
        assert {k: v for k, v in setup.items() if k not in weights} == \
            {k: v for k, v in mine.items() if k not in weights}, quant
        assert setup["extras_bytes"] == 2 * mine["extras_bytes"]  # embedding and final norm in fp32
        # bf16: every weight of a layer in fp32; NF4: the linears' packed bytes as counted here, and
        # the layer's two RMSNorm weights in fp32 (2 more bytes each)
        grown = mine["layer_bytes"] if quant == "none" else 2 * SMOL.hidden * 2
        assert setup["layer_bytes"] == mine["layer_bytes"] + grown, quant
        assert soup_namespace()["estimate_stream_peak_vram"](**setup) == row["soup_predicted"], quant


#: A release without the streaming modes (0.73.3) refuses them; one with them refuses per_expert off DeepSeek-V3.
_MODES = "stream_loss_chunk" in features().stream_modes


@pytest.mark.parametrize("key, kw, words", [
    ("smol", dict(release="0.70.0"), "not here"),
    ("llama31-8b", dict(stream={"stream_expert_layout": "per_expert"}),
     "deepseek_v3 only" if _MODES else "has no stream_expert_layout"),
] + ([] if _MODES else [("smol", dict(stream={"stream_loss_chunk": 512}), "has no stream_loss_chunk")]))
def test_what_soup_would_refuse_or_this_does_not_know_is_a_usage_error_not_a_number(key, kw, words):
    from issue395.errors import UsageError

    with pytest.raises(UsageError, match=words):
        soup_preflight_from_config(config_json(key), quant="none", seq=512, batch=1, targets=("q_proj", "v_proj"),
                                   lora_r=8, **kw)


#: A committed map arm of Mistral-7B NF4 512 x 1 for each tested Soup release.
SAVED = {"0.73.3": "results/cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37/map-512-1024.json",
         "0.77.0": "results/untied-seq512-h200x2-soup0.73.3-and-0.77.0-f3ad9d2/map077-untied.json"}


def test_soups_own_number_from_the_config_is_the_one_its_setup_computed_on_the_gpu(capfd, tmp_path):
    saved = Result.from_json(json.loads((ROOT / SAVED[installed_release()]).read_text()))
    assert saved.environment["soup_cli"] == installed_release()
    arm = next(r for r in saved.rows if (r.model_key, r.quant, r.seq, r.batch) == ("mistral-7b", "nf4", 512, 1))
    out = tmp_path / "e.json"
    code, _, err = main(capfd, ["--estimate", "--model", "mistral-7b", "--quant", "nf4", "--seq", "512",
                                "--json", out])
    assert code == 0, err
    (row,) = json.loads(out.read_text())["rows"]
    assert row["soup_predicted"] == arm.soup_predicted
    assert row["corrected_predicted"] >= arm.real_peak > row["soup_predicted"]  # the miss, and the fix


#: What Soup's own setup computed on an H200 for each task (soup_predicted and the keywords it passed
#: its estimator), SmolLM2 and Qwen2.5 in bf16 and Qwen2.5 in NF4, soup-cli 0.77.0 and 0.73.3; LoRA
#: r 8 on q_proj/v_proj (bench/task_peak_anatomy.py). Its calibrated logits bytes were 14.0 there.
TASK_CAPTURES = sorted((ROOT / "results" / "task-anatomy-h200-soup0.77.0-and-0.73.3-3f5620a").glob("anatomy-*.json"))


def _capture_release(path):
    return {"073": "0.73.3", "077": "0.77.0"}[path.name.split("-")[1]]


@pytest.mark.parametrize("path", TASK_CAPTURES, ids=lambda p: p.stem)
def test_each_tasks_soup_number_from_the_config_is_what_its_setup_computed_on_the_gpu(path):
    release = _capture_release(path)
    if release_source(release) is None:
        pytest.skip(f"soup-cli {release}'s own code is not here (its venv runs it)")
    cap = json.loads(path.read_text())
    model = path.name.split("-")[3]
    got, kwargs = soup_preflight_from_config(config_json(model), quant=cap["quant"], seq=cap["seq"], batch=cap["batch"],
                                             targets=("q_proj", "v_proj"), lora_r=8, release=release, task=cap["task"])
    assert cap["soup_kwargs"]["logits_bytes_per_element"] == 14.0
    assert (got, kwargs) == (cap["soup_predicted"], cap["soup_kwargs"])


def test_every_task_captured_on_the_gpu_is_checked():
    assert {json.loads(p.read_text())["task"] for p in TASK_CAPTURES} == {"dpo", "orpo", "simpo", "kto", "sft"}
    assert {_capture_release(p) for p in TASK_CAPTURES} == {"0.73.3", "0.77.0"}


#: Every preference-task map row the H200 measured (and its SFT rows beside them): soup_predicted is
#: what Soup's own setup computed there, per the release the run had installed.
TASK_MAP_RUNS = sorted([*(ROOT / "results").glob("task-map-h200-*/*.json"),
                        *(ROOT / "results").glob("tasks-rest-h200-*/*.json")])


@pytest.mark.parametrize("path", TASK_MAP_RUNS, ids=lambda p: f"{p.parent.name[:24]}/{p.stem}")
def test_soups_number_for_every_task_map_row_is_what_its_setup_computed_on_the_gpu(path):
    from issue395.estimator.estimate import estimate

    data = json.loads(path.read_text())
    release = data["environment"]["soup_cli"]
    if release_source(release) is None:
        pytest.skip(f"soup-cli {release}'s own code is not here (its venv runs it)")
    rows = [r for r in data["rows"] if r.get("soup_predicted")]
    assert rows
    for r in rows:
        e = estimate(config_json(r["model_key"]), quant=r["quant"], seq=r["seq"], batch=r["batch"],
                     targets=tuple(r["targets"]), release=release, task=r.get("task") or "sft")
        assert e.soup_predicted == r["soup_predicted"], (r["model_key"], r.get("task"), r["quant"], r["seq"], r["batch"])


@pytest.mark.parametrize("key, fields", [
    ("smol", dict(seq=4096, batch=1)),
    ("mistral-7b", dict(seq=512, batch=2, quant="nf4")),
    ("qwen+probe", dict(seq=1024, batch=2)),
    ("llama32-1b", dict(seq=2048, batch=1, task="dpo")),
])
def test_soups_number_of_an_arm_is_the_one_every_estimate_of_it_carries(key, fields):
    """Issue 50 item 2 (house5b, house5c): Soup's number for one Arm is the one estimate_run's estimate of it carries
    (every production caller takes it there: soup_number_of, its one-arm wrapper, had no caller and is gone): what is
    not the run (a card's cuBLAS workspace) leaves it, and a --config file's adapter and settings move it (r 16 on
    all-linear, adamw_8bit, accumulation 4, three buffers)."""
    from dataclasses import replace

    from issue395.estimator.resident import estimate_run
    from issue395.model.arm import Adapter, Arm, Settings

    arm = Arm.at(key, **fields)
    plain = estimate_run(arm).soup_predicted
    assert estimate_run(arm, workspace=64 * 2**20).soup_predicted == plain
    filed = replace(arm, adapter=Adapter(("all-linear",), 16, 32), settings=Settings("adamw_8bit", 4, 3))
    assert estimate_run(filed).soup_predicted != plain
