"""--estimate on a resident soup.yaml (training.stream_layers false): the verdict first, Soup's resident gate as
`soup train` runs it (the input its own CLI builds from the file, hardware_fit's number, its verdict on each card's
total), this tool's resident estimate at the file's own run, and one line where it cannot answer. Real Soup loader
and gate code; no GPU is needed for any of it."""

from __future__ import annotations

import json

import pytest
from conftest import main, one_error_line

from issue395.errors import EXIT_FINDING, EXIT_OK

YAML = """base: meta-llama/Llama-3.2-1B
task: sft
data: {{train: ./data.jsonl, max_length: {seq}}}
training:
  batch_size: 1
  quantization: {quant}
  stream_layers: false
  gradient_checkpointing: {gc}
  lora: {{r: 16, alpha: 32, target_modules: [q_proj, v_proj]}}
"""


def resident_yaml(tmp_path, seq=2048, quant="none", gc="true", base=None):
    text = YAML.format(seq=seq, quant=quant, gc=gc)
    path = tmp_path / "soup.yaml"
    path.write_text(text if base is None else text.replace("meta-llama/Llama-3.2-1B", base))
    return path


def test_a_resident_soup_yaml_is_answered_with_soups_resident_gate_and_the_estimate_verdict_first(capfd, tmp_path):
    """The verdict is line 1 and names each card; Soup's number is its own code on the input its CLI builds from
    the file (a hub id's size read from its name, as Soup reads it); the estimate is at the file's checkpointing and
    steady state, and the cards' answers agree with the needs-free in the JSON."""
    from soup_cli.commands.train import _build_hardware_fit_input
    from soup_cli.config.loader import load_config
    from soup_cli.utils.hardware_fit import estimate_peak_vram_gb

    path, out = resident_yaml(tmp_path), tmp_path / "e.json"
    code, text, err = main(capfd, ["--estimate", "--config", path, "--card", "T4,RTX3050-Laptop-4GB", "--json", out])
    assert code == EXIT_OK, err
    first = text.splitlines()[0]
    assert first.startswith("verdict: T4: fits") and "RTX3050-Laptop-4GB: does NOT fit" in first
    got = json.loads(out.read_text())
    inp = _build_hardware_fit_input(load_config(str(path)))
    assert got["resident"] == {"checkpointing": True, "soup_input": {k: getattr(inp, k) for k in inp.__dataclass_fields__}}
    assert got["soup_resident_bytes"] == round(estimate_peak_vram_gb(inp).total_gb * 1e9) and inp.params_b == 1.0
    assert got["steps"] == 2 and got["terms"]["adam_moments"] > 0 and got["terms"]["checkpointed_inputs"] > 0
    assert [c["fits"] for c in got["cards"]] == [True, False] and got["cards"][1]["free_bytes"] < got["needs_free"]
    assert "Soup's resident gate: computed by Soup's own code" in text


def test_exit_code_says_the_resident_run_does_not_fit_a_small_card(capfd, tmp_path):
    """--exit-code answers as for a streamed file: 1 where this tool's estimate does not fit a card."""
    path = resident_yaml(tmp_path, gc="false", seq=1024)
    code, text, err = main(capfd, ["--estimate", "--config", path, "--card", "4GB", "--exit-code"])
    assert code == EXIT_FINDING and text.startswith("verdict: 4GB: does NOT fit"), (text, err)


def test_a_resident_run_the_estimator_does_not_model_says_so_and_exit_code_is_one_line(capfd, tmp_path):
    """Phi-2 resident under NF4 with gradient checkpointing is not modelled: the text says why beside Soup's number;
    asked for an exit code, one line."""
    path = resident_yaml(tmp_path, quant="4bit", base="microsoft/phi-2")
    code, text, err = main(capfd, ["--estimate", "--config", path, "--card", "T4"])
    assert code == EXIT_OK and ("not estimated by this tool (a resident nf4 phi run with gradient checkpointing is not "
                                "yet modelled") in text, err
    one_error_line(*main(capfd, ["--estimate", "--config", path, "--card", "T4", "--exit-code"]),
                   "--exit-code", "phi")


def test_soup_profiles_own_number_is_said_beside_its_gate_as_its_cli_prints_it(capfd, tmp_path):
    """Issue 51 item 2: `soup profile` has an estimator of its own, which no gate reads. --estimate on a resident
    file says its number, and it is what Soup's own `soup profile --config F --json` command prints for the file."""
    from typer.testing import CliRunner
    from soup_cli.cli import app

    config = resident_yaml(tmp_path, seq=1024, quant="4bit")
    out = tmp_path / "e.json"
    code, text, err = main(capfd, ["--estimate", "--config", config, "--card", "24GB", "--json", out])
    assert code == EXIT_OK, err
    mine = json.loads(out.read_text())["soup_profile"]
    done = CliRunner().invoke(app, ["profile", "--config", str(config), "--json"])
    assert done.exit_code == 0, done.output
    soups = json.loads(done.output[done.output.index("{"):])
    assert mine["total_bytes"] == round(soups["total_memory_gb"] * 1e9) and mine["model_params_b"] == soups["model_params_b"]
    assert f"`soup profile`: {soups['total_memory_gb']:.2f} GB (computed by Soup" in text


def test_a_full_fine_tuning_file_is_answered_with_soups_gate_on_its_clis_input_and_the_full_estimate(capfd, tmp_path):
    """Issue 51 item 1: a resident file with training.lora.r 0 (Soup's full fine-tuning) is answered, not refused:
    Soup's resident number is its own estimate_peak_vram_gb on the input its own CLI builds from the file (computed
    by Soup, whatever peft mode its release passes), `soup profile`'s beside it, and this tool's estimate is the
    full fine-tuning's: every parameter's gradient and the optimizer's states, no adapter."""
    from soup_cli.commands.train import _build_hardware_fit_input
    from soup_cli.config.loader import load_config
    from soup_cli.utils.hardware_fit import estimate_peak_vram_gb

    path = resident_yaml(tmp_path, seq=1024)
    path.write_text(path.read_text().replace("lora: {r: 16, alpha: 32, target_modules: [q_proj, v_proj]}", "lora: {r: 0}"))
    out = tmp_path / "e.json"
    code, text, err = main(capfd, ["--estimate", "--config", path, "--card", "H200", "--json", out])
    assert code == EXIT_OK, err
    got = json.loads(out.read_text())
    inp = _build_hardware_fit_input(load_config(str(path)))
    assert got["soup_resident_bytes"] == round(estimate_peak_vram_gb(inp).total_gb * 1e9)
    assert got["soup_profile"]["total_bytes"] > 0 and "`soup profile`" in text
    if got["not_estimated"]:  # a release whose full fine-tuning the estimate does not model: said, no figure
        assert "not estimated by this tool (soup-cli" in text and got["corrected"] is None
        return
    assert "full fine-tuning (training.lora.r 0" in text and "lora_weights" not in got["terms"]
    assert got["terms"]["parameter_gradients"] > 0 and got["terms"]["adam_moments"] > got["terms"]["parameter_gradients"]
    assert got["cards"][0]["fits"] is True


def test_a_full_fine_tuning_of_a_base_peft_has_no_auto_targets_for_is_answered(capfd, tmp_path):
    """Reviewer item 2: a full fine-tuning (lora.r 0, target_modules left at Soup's default auto) of Moonlight
    (deepseek_v3, which peft's default table lacks) is answered: a run with no adapter never reaches peft, so its
    targets are not resolved. A LoRA run of it is still refused in one line (`soup train` would fail too)."""
    path = resident_yaml(tmp_path, seq=512, base="moonshotai/Moonlight-16B-A3B")
    path.write_text(path.read_text().replace("lora: {r: 16, alpha: 32, target_modules: [q_proj, v_proj]}", "lora: {r: 0}"))
    code, text, err = main(capfd, ["--estimate", "--config", path])
    assert code == EXIT_OK and "full fine-tuning (training.lora.r 0" in text and "peft" not in err, err
    assert "layers of several kinds" in text  # its corrected figure: not modelled, said so (Soup's gate answers)
    path.write_text(path.read_text().replace("lora: {r: 0}", "lora: {r: 16, alpha: 32}"))
    one_error_line(*main(capfd, ["--estimate", "--config", path]), "peft has no default LoRA targets for model_type 'deepseek_v3'")


def test_a_full_fine_tunings_accumulation_line_says_the_trained_parameters_gradients(capfd, tmp_path):
    """Reviewer item 3: --estimate's line for gradient accumulation on a full fine-tuning file (lora.r 0) says the
    trained parameters' gradients are held from micro-batch 2 on, not an adapter's it does not have; a LoRA file's
    line still says the adapter's."""
    path = resident_yaml(tmp_path, seq=512)
    lora = path.read_text().replace("  lora:", "  gradient_accumulation_steps: 2\n  lora:")
    for text_in, whose, not_whose in ((lora.replace("lora: {r: 16, alpha: 32, target_modules: [q_proj, v_proj]}",
                                                    "lora: {r: 0}"), "the trained parameters'", "the adapter's"),
                                      (lora, "the adapter's", "the trained parameters'")):
        path.write_text(text_in)
        code, text, err = main(capfd, ["--estimate", "--config", path])
        line = next(x for x in text.splitlines() if "from the file: training.gradient_accumulation_steps 2" in x)
        assert code == EXIT_OK and f"every phase holds {whose} gradients" in line and not_whose not in line, err


def test_a_resident_answers_terms_each_say_the_phases_they_are_live_in(capfd, tmp_path):
    """Reviewer item 7: a full fine-tuning's terms, listed under its peak, sum past the peak (every phase's terms);
    each term line, text and JSON, says the phases it is live in, so the resident, allowance and binding phase's
    terms are told apart from the others, and those hold no more than the peak."""
    path = resident_yaml(tmp_path, seq=1024)
    path.write_text(path.read_text().replace("lora: {r: 16, alpha: 32, target_modules: [q_proj, v_proj]}", "lora: {r: 0}"))
    out = tmp_path / "e.json"
    code, text, err = main(capfd, ["--estimate", "--config", path, "--json", out])
    got = json.loads(out.read_text())
    if got["not_estimated"]:
        return  # a release whose full fine-tuning the estimate does not model: no terms
    assert code == EXIT_OK, err
    terms, phases, peak = got["terms"], got["term_phases"], got["corrected"]
    binding = text.split("corrected allocated peak ", 1)[1].split("(", 1)[1].split(" phase)", 1)[0]
    assert set(phases) == set(terms) and sum(terms.values()) > peak
    held = {"resident", "allowance", binding, "steady state"}
    assert sum(v for k, v in terms.items() if held & set(phases[k])) <= peak
    for k, v in terms.items():
        if v:
            assert f"    {k:<28} {v / 1e9:.4f} GB  {', '.join(phases[k])}" in text.splitlines()
    assert phases["logits"] == ["loss"] and phases["parameter_gradients"] == ["optimizer"]


def test_a_resident_answer_says_its_need_holds_on_expandable_segments_and_a_refused_one_does_not(capfd, tmp_path):
    """`soup train` leaves a resident run on the default allocator (it sets expandable segments for a streamed run
    only), where the resident need was measured short (results/resident-findmax-h200-soup0.77.0-faaa21d: Gemma-2B
    died one step past it): an answered file says, in its text and its JSON, the setting its need holds under; a
    file the estimate does not model (phi-2 under NF4) has no need, and no such line or setting."""
    path, out = resident_yaml(tmp_path), tmp_path / "e.json"
    code, text, err = main(capfd, ["--estimate", "--config", path, "--card", "T4", "--json", out])
    assert code == EXIT_OK, err
    assert "the need holds on expandable segments: run it with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in text
    assert json.loads(out.read_text())["needs_free_allocator"] == "expandable_segments:True"
    refused = resident_yaml(tmp_path, quant="4bit", base="microsoft/phi-2")
    code, text, err = main(capfd, ["--estimate", "--config", refused, "--card", "T4", "--json", out])
    got = json.loads(out.read_text())
    assert got["needs_free"] is None and got["needs_free_allocator"] is None, (text, err)
    assert "expandable segments" not in text


def completed_resident_probes():
    """Every committed resident --find-max probe that completed: its search's soup.yaml (as committed beside it, at
    the probe's seq), and the allocator's peaks Soup's own process read as it exited (measured, real `soup train`)."""
    import re

    from conftest import ROOT

    for path in sorted((ROOT / "results").glob("resident-findmax*/find-max-*.json")):
        d = json.loads(path.read_text())
        text = (path.parent / "configs" / d["config"].rsplit("/", 1)[-1]).read_text()
        for p in d["measured"]["probes"]:
            if p["outcome"] == "completed" and p["allocator"]:
                yield (f"{path.stem} {p['value']}", re.sub(r"max_length: \d+", f"max_length: {p['value']}", text),
                       p["allocator"])


def test_the_steady_state_estimate_is_never_under_what_soup_trains_own_process_allocated(capfd, tmp_path):
    """Issue 51 item 3, on the real `soup train` (results/resident-findmax-*: 2 optimizer steps, the optimizer's
    states live from step 2): --estimate --config at the probe's seq, with --steps 2, is at or above the allocated
    peak Soup's process read at its exit, on every completed probe of every committed resident search. Its need
    (needs free) is above what the run requested at its peak."""
    probes = list(completed_resident_probes())
    assert len(probes) >= 6, probes
    for name, text, allocator in probes:
        path, out = tmp_path / "soup.yaml", tmp_path / "e.json"
        path.write_text(text)
        code, _, err = main(capfd, ["--estimate", "--config", path, "--steps", "2", "--json", out])
        assert code == EXIT_OK, (name, err)
        got = json.loads(out.read_text())
        assert got["corrected"] >= allocator["allocated_peak"], (name, got["corrected"], allocator)
        assert got["needs_free"] >= allocator["requested_peak"], (name, got["needs_free"], allocator)


@pytest.mark.parametrize("stream", ["false", "true"])
def test_a_lora_target_the_model_lacks_is_one_line_for_a_resident_file_as_for_a_streamed_one(capfd, tmp_path, stream):
    """peft refuses a target the model lacks, so no stack starts the run: --estimate --config and --find-max's plan
    say so in one line and exit 2 whether the file streams or not (a resident file used to get "not estimated"
    beside Soup's gate, exit 0, as if the run were only beyond the estimator)."""
    path = resident_yaml(tmp_path, gc="false", seq=1024)
    path.write_text(path.read_text().replace("[q_proj, v_proj]", "[nope_proj]")
                    .replace("stream_layers: false", f"stream_layers: {stream}"))
    for args in (["--estimate", "--config", path, "--card", "T4"],
                 ["--find-max", "seq", "--config", path, "--card", "T4", "--dry-run"]):
        one_error_line(*main(capfd, args), "nope_proj not in a llama layer")


def test_a_resident_fit_on_a_hopper_card_charges_the_runtime_growth_measured_there_and_a_plain_size_the_bound(
        capfd, tmp_path):
    """Issue 51: on a named Hopper card (H100, compute capability 9.0) the resident verdict charges the runtime growth
    measured in `soup train`'s own resident runs (176.9 MB); on a plain size (no compute capability) the 262.1 MB bound.
    The step's free memory differs by exactly that, the verdict is read against it, and the text names which."""
    from issue395.estimator.cards import (GROWTH_BOUND, GROWTH_RESIDENT, RESIDENT_STEP_GROWTH_BYTES,
                                          STEP_GROWTH_BYTES)

    path, out = resident_yaml(tmp_path), tmp_path / "e.json"
    code, text, err = main(capfd, ["--estimate", "--config", path, "--card", "H100,24GB", "--json", out])
    assert code == EXIT_OK, err
    got = json.loads(out.read_text())
    h100, plain = got["cards"]
    assert h100["free_bytes"] - h100["step_free_bytes"] == h100["growth_bytes"] == RESIDENT_STEP_GROWTH_BYTES
    assert plain["free_bytes"] - plain["step_free_bytes"] == plain["growth_bytes"] == STEP_GROWTH_BYTES
    assert (h100["growth_source"], plain["growth_source"]) == (GROWTH_RESIDENT, GROWTH_BOUND)
    assert all(c["fits"] is (got["needs_free"] <= c["step_free_bytes"]) for c in got["cards"])
    assert f"(176.9 MB, {GROWTH_RESIDENT})" in text and f"(262.1 MB, {GROWTH_BOUND})" in text


def test_a_resident_fit_flips_on_the_measured_growth_where_the_bound_would_refuse_it(capfd, tmp_path):
    """Where the run needs more than the step's free memory under the bound but no more than under the measured
    growth, an H100's verdict is a fit: --context sets the H100's free memory so (CUDA's figures are not faked)."""
    from issue395.estimator.cards import CARDS, RESIDENT_STEP_GROWTH_BYTES, STEP_GROWTH_BYTES

    path, out = resident_yaml(tmp_path), tmp_path / "e.json"
    code, _, err = main(capfd, ["--estimate", "--config", path, "--card", "H100", "--json", out])
    needs = json.loads(out.read_text())["needs_free"]
    kb = (CARDS["h100"].total_bytes - needs - RESIDENT_STEP_GROWTH_BYTES) // 1000 - 1  # --context's GB, to the KB
    code, text, err = main(capfd, ["--estimate", "--config", path, "--card", "H100", "--context", f"{kb / 1e6:.6f}",
                                   "--json", out])
    (h100,) = json.loads(out.read_text())["cards"]
    assert code == EXIT_OK and h100["fits"] is True, err
    assert 0 <= h100["step_free_bytes"] - needs < 2001 < STEP_GROWTH_BYTES - RESIDENT_STEP_GROWTH_BYTES, \
        "a step's free memory the bound would leave short of the need"
