"""issue395.run.estimate_mode: --estimate settled from the options or from a soup.yaml read once by Soup's own
loader, each value's error naming where it came from (the option, or the file's key) where it is read,
never a flag the user did not type. Real Soup loader and estimator; nothing is faked."""

from __future__ import annotations

import pytest
from conftest import main, one_error_line
import json
from conftest import estimate_config_json, readme_yaml, verdicts

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


ALL_LINEAR = "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]"


# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


@pytest.mark.parametrize("edit, words", [
    (dict(seq=40960), ["data.max_length 40960", "maximum positions"]),
    (dict(extra="  batch_size: 5000\n"), ["training.batch_size 5000"]),
    (dict(r=4096), ["training.lora.r 4096"]),
    (dict(targets="[q_proj, foo]"), ["foo", "base mistralai/Mistral-7B-v0.3"]),
], ids=["seq", "batch", "r", "targets"])
def test_errors_from_the_file_name_its_keys_not_flags(capfd, tmp_path, edit, words):
    """Issue 29 item 7: with --config alone, a bad value from the file is one line naming --config FILE and
    the file's key (data.max_length, training.batch_size, training.lora.r, a target and the base), never a
    flag that was not typed."""
    path = readme_yaml(tmp_path, **{k: v for k, v in edit.items() if k != "extra"})
    if "extra" in edit:
        path.write_text(path.read_text().replace("  batch_size: 1\n", edit["extra"]))
    line = one_error_line(*main(capfd, ["--estimate", "--config", path]), f"--config {path}", *words)
    for flag in ("--seq", "--batch", "--lora-r", "--targets", "--model"):
        assert flag not in line, line


def test_the_verdict_is_one_line_a_card_above_the_table(capfd, tmp_path):
    """Issue 29 item 14: each card's verdict is one line above the table (fits, longest seq that fits, Soup
    admits or refuses); the legends only with --verbose."""
    code, out, err = main(capfd, ["--estimate", "--config", readme_yaml(tmp_path), "--card", "T4,RTX3050-Laptop-4GB"])
    assert code == 0, err
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("soup-cli"))
    verdicts = [ln for ln in lines[:head] if ln.startswith(("  T4: ", "  RTX3050-Laptop-4GB: "))]
    assert len(verdicts) == 2 and lines[2] == verdicts[0]
    for line in verdicts:
        assert ("fits" in line) and ("longest seq that fits" in line) and ("Soup admits" in line or "Soup refuses" in line)
    assert "peak = resident" not in out  # the legends: --verbose
    code, verbose, err = main(capfd, ["--estimate", "--config", readme_yaml(tmp_path), "--card", "T4", "--verbose"])
    assert code == 0 and "peak = resident" in verbose and "MagicQuill" in verbose, err


def test_exit_code_says_whether_it_fits(capfd, tmp_path):
    """Issue 29 item 14: --exit-code is 0 where the run fits and 1 where it does not; without it 0; without
    --card, or outside --estimate, one line."""
    fits = ["--estimate", "--config", readme_yaml(tmp_path), "--card", "T4", "--exit-code"]
    assert main(capfd, fits)[0] == 0
    assert main(capfd, fits[:-2] + ["T4,2GB", "--exit-code"])[0] == 1
    assert main(capfd, fits[:-1])[0] == 0 == main(capfd, fits[:-2] + ["2GB"])[0]  # without it: 0, the answer printed
    one_error_line(*main(capfd, ["--estimate", "--config", readme_yaml(tmp_path), "--exit-code"]), "--exit-code", "--card")
    one_error_line(*main(capfd, ["--dry-run", "--exit-code"]), "--exit-code", "--estimate")


def test_the_json_carries_the_config_path_the_alpha_and_the_streaming_modes(capfd, tmp_path):
    """Issue 29 item 14: --estimate --config's JSON carries the file's path, its LoRA alpha and its streaming
    modes."""
    data, _ = estimate_config_json(capfd, tmp_path, readme_yaml(tmp_path))
    assert data["config"].endswith("soup.yaml") and data["lora_alpha"] == 16 and data["stream"] == {}
    from issue395.measure.shapes import soup_has_stream_modes

    if soup_has_stream_modes():
        chunked, _ = estimate_config_json(capfd, tmp_path, readme_yaml(tmp_path, extra="  stream_loss_chunk: 512\n", name="c.yaml"))
        assert chunked["stream"] == {"stream_loss_chunk": 512}


def test_the_file_is_answered_at_the_runs_steady_state_and_steps_1_keeps_one_step(capfd, tmp_path):
    """Mistral-7B NF4 seq 1024, r 64 on all seven linears, a 4 GB laptop card: the first step fits,
    the run (Adam's states live from step 2) does not, and the output says which answer it is."""
    config = readme_yaml(tmp_path, seq=1024, r=64, targets=ALL_LINEAR)
    run, run_text = estimate_config_json(capfd, tmp_path, config, "--card", "RTX3050-Laptop-4GB")
    one, one_text = estimate_config_json(capfd, tmp_path, config, "--card", "RTX3050-Laptop-4GB", "--steps", "1")
    assert (run["steps"], one["steps"]) == (2, 1)
    assert run["rows"][0]["needs_free"] > one["rows"][0]["needs_free"]
    assert (run["rows"][0]["cards"][0]["fits"], one["rows"][0]["cards"][0]["fits"]) == (False, True)
    assert "steady state" in run_text.splitlines()[1] and "one step" in one_text.splitlines()[1]
    assert "steady state" not in one_text.splitlines()[1]


def test_without_a_file_estimate_keeps_the_protocols_one_step(capfd, tmp_path):
    """Issue 29 (what to build 2): --estimate without a file answers the protocol's one step and says so."""
    out = tmp_path / "e.json"
    code, text, err = main(capfd, ["--estimate", "--model", "mistral-7b", "--quant", "nf4", "--seq", "512", "--json", out])
    assert code == 0 and json.loads(out.read_text())["steps"] == 1 and "one step" in text.splitlines()[1], err


@pytest.mark.parametrize("tasks", ["sft,dpo", "orpo,kto", "dpo,simpo,sft"])
def test_each_verdict_line_names_its_task(capfd, tasks):
    """Issue 36 item 3: with several tasks, every verdict line names its task, one line per task and card,
    none repeated."""
    code, out, err = main(capfd, ["--estimate", "--model", "mistral-7b", "--quant", "nf4", "--seq", "2048",
                                  "--batch", "2", "--task", tasks, "--card", "A10G,T4"])
    assert code == 0, err
    lines = verdicts(out)
    assert len(lines) == 2 * len(tasks.split(",")), out
    for t in tasks.split(","):
        assert sum(f" {t} nf4 2048x2:" in f" {ln}" or f": {t} nf4 2048x2:" in ln for ln in lines) == 2, (t, out)
    assert len(set(lines)) == len(lines)


@pytest.mark.parametrize("seq, override, want", [
    (19000, None, 3),            # fits on a T4, Soup's gate refuses it: soup train will not start
    (19000, 20_000_000_000, 0),  # the file's override lifts Soup's gate: it fits and runs
    (2048, None, 0),             # fits and Soup admits it
    (2048, 1_000_000_000, 3),    # an override below Soup's number: Soup refuses what fits
    (32768, 40_000_000_000, 1),  # Soup admits (override), but it does not fit: 1, as before
])
def test_exit_code_is_zero_only_where_it_fits_and_soups_gate_admits_it(capfd, tmp_path, seq, override, want):
    """Issue 36 item 2: --exit-code is 0 only where the run fits and Soup's gate admits it, 3 where it fits
    and Soup refuses, 1 where it does not fit (the figures pinned on 0.73.3)."""
    from issue395.estimator.releases import installed_release

    extra = f"  stream_vram_override: {override}\n" if override else ""
    path = readme_yaml(tmp_path, seq=seq, extra=extra)
    code, out, err = main(capfd, ["--estimate", "--config", path, "--card", "T4", "--exit-code", "--steps", "1"])
    (line,) = verdicts(out)
    fits, admits = " fits (" in line, "Soup admits" in line
    assert code == (0 if fits and admits else 1 if not fits else 3), (code, line)
    if installed_release() == "0.73.3":  # the figures this table was read off
        assert code == want, (code, line)


def test_estimate_alone_names_both_of_what_it_needs(capfd):
    """Issue 36 polish: --estimate alone is one line naming both --model and --config."""
    one_error_line(*main(capfd, ["--estimate"]), "--model", "--config")
@pytest.mark.parametrize("variant, base", [
    ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B"),
    ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B"),
    ("mistralai/Mistral-7B-Instruct-v0.3", "mistralai/Mistral-7B-v0.3"),
    ("google/gemma-2-2b-it", "google/gemma-2-2b"),
])
def test_an_instruct_variant_of_a_known_family_is_answered_offline_saying_which_shape(
        capfd, tmp_path, monkeypatch, variant, base):
    """Issue 53 item 12: the instruct and chat variants of the families this tool knows have the same shapes;
    offline, with an empty hub cache, --estimate answers them from the family's committed config, with the
    same figures as the base's, and a `shape:` line (and the JSON's `shape`) naming which config answered."""
    import json

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    out_json = tmp_path / "fit.json"
    code, out, err = main(capfd, ["--estimate", "--model", variant, "--seq", "512", "--card", "T4", "--json", out_json])
    assert code == 0, err
    assert any(ln.startswith(f"  shape: {variant} is answered by {base}'s public config") for ln in out.splitlines())
    assert json.loads(out_json.read_text())["shape"]["hub_id"] == base
    code, plain, err = main(capfd, ["--estimate", "--model", base, "--seq", "512", "--card", "T4"])
    assert code == 0, err
    figures = lambda text: [ln for ln in text.splitlines() if ln.startswith(("  T4: ", "corrected", "Soup's own"))]  # noqa: E731
    assert figures(out) == figures(plain) and figures(out)


def test_a_variant_with_another_version_is_no_variant(capfd, tmp_path, monkeypatch):
    """Mistral-7B-Instruct-v0.2 has another vocabulary than v0.3: a version is not a variant word, so it is
    looked up as any hub id (offline with no cache: one line), never answered by v0.3's shapes."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    one_error_line(*main(capfd, ["--estimate", "--model", "mistralai/Mistral-7B-Instruct-v0.2", "--seq", "512"]),
                   "no config.json in the local Hugging Face cache, and offline")


@pytest.mark.parametrize("targets, r, modules, said", [
    ("auto", 16, "q_proj,v_proj", "(target_modules auto, resolved as Soup's LoraConfig does)"),
    ("all-linear", 32, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
     "(target_modules all-linear, resolved as Soup's LoraConfig does)"),
    ("[q_proj, k_proj]", 4, "q_proj,k_proj", ""),
])
def test_the_text_names_the_lora_rank_and_the_targets_the_figures_are_at(capfd, tmp_path, targets, r, modules, said):
    """Issue 53 item 9: the text never named the adapter; now one line gives its rank, alpha and targets, auto
    (peft's table for mistral) and all-linear (every linear module of a layer) resolved."""
    code, out, err = main(capfd, ["--estimate", "--config", soup_yaml(tmp_path, r=r, targets=targets), "--card", "T4"])
    assert code == 0, err
    (line,) = [ln.strip() for ln in out.splitlines() if ln.startswith("  LoRA ")]
    assert f"r {r}, alpha 16, on {len(modules.split(','))} module(s) a layer: {modules}" in line and line.endswith(said)


@pytest.mark.parametrize("optimizer", ["adafactor", "adamw_hf"])
def test_an_optimizer_not_modelled_is_answered_as_an_upper_bound_labelled_as_one(capfd, tmp_path, optimizer):
    """Issue 53 item 14: an optimizer the estimator does not model was refused; the answer is now an upper
    bound, said on the verdict's line, on its own line and in the JSON, never below Soup's default's figures."""
    import json

    from soup_cli.config.loader import load_config_from_string

    path = soup_yaml(tmp_path)
    path.write_text(path.read_text() + f"  optimizer: {optimizer}\n")
    try:
        load_config_from_string(path.read_text())
    except Exception:  # a release whose own schema refuses it (0.77.0: adamw_hf): Soup's refusal, in one line
        one_error_line(*main(capfd, ["--estimate", "--config", path, "--card", "T4"]), "Soup refuses it", optimizer)
        return
    out_json = tmp_path / "bound.json"
    code, out, err = main(capfd, ["--estimate", "--config", path, "--card", "T4", "--json", out_json])
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"verdict (an UPPER BOUND: training.optimizer {optimizer} is not modelled; ")
    assert f"  an upper bound: training.optimizer {optimizer} is not modelled" in out
    bound = json.loads(out_json.read_text())
    assert bound["upper_bound"].startswith("an upper bound")
    default = tmp_path / "default.json"
    code, _, err = main(capfd, ["--estimate", "--config", soup_yaml(tmp_path), "--card", "T4", "--json", default])
    assert bound["rows"][0]["needs_free"] >= json.loads(default.read_text())["rows"][0]["needs_free"]


@pytest.mark.parametrize("change, words", [
    ({"hidden_size": 2050, "num_attention_heads": 32, "num_key_value_heads": 2},
     ["hidden_size 2050 is not a multiple of num_attention_heads 32", "each head is taken 64 wide", "check the config"]),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, ["quantization_config (gptq) is NOT modelled"]),
])
def test_a_config_the_figures_do_not_follow_is_said_under_the_verdict(capfd, tmp_path, change, words):
    """Issue 53 item 11: a config.json with hidden 2050 and 32 heads, or with quantization_config gptq, was
    answered without a word (the gptq note stood below the table): each is a `config:` line under the verdict."""
    import json

    from issue395.model.registry import config_json

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config_json("qwen"), **change}))
    code, out, err = main(capfd, ["--estimate", "--model", path, "--seq", "512", "--card", "T4"])
    assert code == 0, err
    head = out.split("\n(Soup's pre-flight:", 1)[0].splitlines()  # the verdict block, above the table
    (line,) = [ln for ln in head if ln.startswith("  config: ")]
    for w in words:
        assert w in line, (w, line)


def test_the_repository_ignores_the_readmes_pip_venv():
    """Issue 53 item 11: the README's `.venv-pip` was not git-ignored."""
    import subprocess

    from conftest import ROOT

    done = subprocess.run(["git", "check-ignore", "-q", ".venv-pip/bin/issue395"], cwd=ROOT)
    assert done.returncode == 0


def test_stack_names_the_training_boxs_packages_and_the_answer_follows_them(capfd, tmp_path):
    """Issue 53 items 10 and 16: the stack line described the machine running the estimate (a laptop), while
    the number moves with the training box's transformers (Gemma-2 runs eager from 5.24.0). --stack names the
    training box's packages: the stack line checks them, said as the training box's, the JSON keeps them, and
    Gemma-2's eager masks are charged under transformers 5.25.0 as on that box."""
    import json

    argv = ["--estimate", "--model", "gemma2-2b", "--task", "dpo", "--seq", "1024", "--card", "T4"]
    here, boxed = tmp_path / "here.json", tmp_path / "boxed.json"
    # the laptop's side named too, so the test holds whatever transformers this machine has
    assert main(capfd, [*argv, "--stack", "transformers=5.16.1", "--json", here])[0] == 0
    code, out, err = main(capfd, [*argv, "--stack", "transformers=5.25.0,torch=2.11.0+cu130", "--json", boxed])
    assert code == 0, err
    (line,) = [ln for ln in out.splitlines() if ln.startswith("  stack")]
    assert line.startswith("  stack (the training box's, by --stack transformers=5.25.0,torch=2.11.0+cu130; ")
    assert "transformers 5.25.0" in line and "torch 2.11.0+cu130" in line
    saved = json.loads(boxed.read_text())
    assert saved["stack"]["given"] == {"transformers": "5.25.0", "torch": "2.11.0+cu130"}
    plain = json.loads(here.read_text())["rows"][0]
    assert saved["rows"][0]["terms"]["eager_masks"] > plain["terms"].get("eager_masks", 0)
    assert saved["rows"][0]["needs_free"] > plain["needs_free"]


def test_stack_naming_a_verified_stack_is_said_verified_on_a_box_without_it(capfd):
    """A laptop without torch (or with another) read "not verified"; naming the training box's verified stack
    is answered as verified."""
    argv = ["--estimate", "--model", "qwen", "--seq", "512", "--stack",
            "torch=2.11.0+cu130,transformers=5.16.1,peft=0.20.0,trl=0.29.1"]
    code, out, err = main(capfd, argv)
    from issue395.estimator.releases import installed_release

    assert code == 0, err
    (line,) = [ln for ln in out.splitlines() if ln.startswith("  stack")]
    assert ("verified on this stack" in line and "not verified" not in line) or installed_release() not in (
        "0.73.3", "0.77.0"), line


@pytest.mark.parametrize("argv, words", [
    (["--estimate", "--model", "qwen", "--seq", "512", "--stack", "soup-cli=0.77.0"], ["soup-cli is not named here"]),
    (["--estimate", "--model", "qwen", "--seq", "512", "--stack", "numpy=2.0"], ["'numpy=2.0' is not PACKAGE=VERSION"]),
    (["--estimate", "--model", "qwen", "--seq", "512", "--stack", "transformers"], ["is not PACKAGE=VERSION"]),
    (["--estimate", "--model", "qwen", "--seq", "512", "--stack", "trl=1,trl=2"], ["trl is named twice"]),
    (["--dry-run", "--stack", "torch=2.11.0"], ["--stack goes with --estimate"]),
])
def test_a_bad_stack_is_one_line(capfd, argv, words):
    one_error_line(*main(capfd, argv), *words)


def test_an_option_beside_a_config_that_is_wrong_is_said_as_the_options_fault_not_the_files(capfd, tmp_path):
    """A bad --context, --card or --steps beside --config is one line about the option; the file is not blamed
    (it used to read '--config soup.yaml: --context ...'), while a fault of the file's stays under its name."""
    path = tmp_path / "soup.yaml"
    path.write_text("base: meta-llama/Llama-3.2-1B\ndata: {train: d.jsonl, max_length: 2048}\ntraining: {batch_size: 1, "
                    "quantization: none, stream_layers: false, lora: {r: 8, alpha: 16}}\n")
    for args, first in ((["--context", "-1", "--card", "T4"], "error: --context '-1'"),
                        (["--card", "T4x"], "error: --card 'T4x'"), (["--steps", "0"], "error: --steps 0")):
        assert one_error_line(*main(capfd, ["--estimate", "--config", path, *args])).startswith(first)
    path.write_text(path.read_text().replace("max_length: 2048", "max_length: 999999"))
    assert one_error_line(*main(capfd, ["--estimate", "--config", path])).startswith(f"error: --config {path}")
