"""Issue 36's new user, round four: each defect they hit, on CPU, with the real Soup loader and
estimator code (no torch where the path needs none). A test per item, named for the behaviour."""

from __future__ import annotations

import json
import re
import time

import pytest
from conftest import main, one_error_line

#: The README's soup.yaml (Mistral-7B NF4, LoRA r 8 on q_proj, v_proj).
README_YAML = ("base: {base}\ndata: {{train: data.jsonl, max_length: {seq}}}\n"
               "training:\n  batch_size: {batch}\n  quantization: 4bit\n  stream_layers: true\n"
               "  lora: {{r: {r}, alpha: 16, target_modules: {targets}}}\n{extra}")


def soup_yaml(folder, seq=2048, r=8, targets="[q_proj, v_proj]", extra="", name="soup.yaml", batch=1,
              base="mistralai/Mistral-7B-v0.3"):
    path = folder / name
    path.write_text(README_YAML.format(seq=seq, r=r, targets=targets, extra=extra, batch=batch, base=base))
    return path


def verdicts(out):
    """The verdict lines: the lines under the first that name a card and say fits or not."""
    return [ln.strip() for ln in out.splitlines()[1:] if re.match(r"  \S+: .*(fits|no room)", ln)]


# 3. every verdict line names its task when there are several ---------------------------------

@pytest.mark.parametrize("tasks", ["sft,dpo", "orpo,kto", "dpo,simpo,sft"])
def test_item3_each_verdict_line_names_its_task(capfd, tasks):
    code, out, err = main(capfd, ["--estimate", "--model", "mistral-7b", "--quant", "nf4", "--seq", "2048",
                                  "--batch", "2", "--task", tasks, "--card", "A10G,T4"])
    assert code == 0, err
    lines = verdicts(out)
    assert len(lines) == 2 * len(tasks.split(",")), out
    for t in tasks.split(","):
        assert sum(f" {t} nf4 2048x2:" in f" {ln}" or f": {t} nf4 2048x2:" in ln for ln in lines) == 2, (t, out)
    assert len(set(lines)) == len(lines)


def test_item3_a_map_progress_line_names_a_task_that_is_not_sft(capfd):
    from conftest import SMOL
    from issue395.measure.console import Progress
    from issue395.model.arm import Arm
    from issue395.results.row import arm_row

    row = arm_row(Arm("smol", 512, 2, 0, task="dpo"), SMOL, realised_width=512, realised_rows=(512,) * 4)
    p = Progress(2, time.perf_counter())
    p.arm(row)
    assert " dpo " in capfd.readouterr().err


# 4. the longest seq that fits is the positions, not the memory: said ---------------------------

@pytest.mark.parametrize("model, card", [("phi3-mini", "T4"), ("smol", "H200"), ("qwen", "A100-80GB")])
def test_item4_a_longest_seq_that_is_the_models_positions_says_so(capfd, model, card):
    code, out, err = main(capfd, ["--estimate", "--model", model, "--seq", "1024", "--card", card])
    assert code == 0, err
    (line,) = verdicts(out)
    assert "max positions" in line, line


def test_item4_a_longest_seq_memory_stops_says_no_positions(capfd):
    code, out, err = main(capfd, ["--estimate", "--model", "mistral-7b", "--quant", "nf4", "--seq", "1024",
                                  "--card", "T4"])
    assert code == 0, err
    (line,) = verdicts(out)
    assert "max positions" not in line, line


# 13. a card with no room, the context the legend states, the host RAM beside the verdict -------

@pytest.mark.parametrize("card", ["0.5GB", "1GB", "1GiB"])
def test_item13_a_card_with_no_room_is_one_clear_line_never_a_negative_free_figure(capfd, card):
    code, out, err = main(capfd, ["--estimate", "--model", "smol", "--seq", "512", "--card", f"{card},H200",
                                  "--verbose"])
    assert code == 0, err
    (line,) = [ln for ln in verdicts(out) if ln.startswith(card)]
    assert "no room" in line and "-0." not in line, line
    assert not re.search(r"\s-\d+\.\d+", out), out  # no negative figure anywhere in the table either


def test_item13_a_cards_context_cell_is_what_the_legend_says_it_is(capfd):
    code, out, err = main(capfd, ["--estimate", "--model", "smol", "--seq", "512", "--card", "H200,T4",
                                  "--verbose"])
    assert code == 0, err
    for card in ("H200", "T4"):
        i = out.splitlines().index(next(ln for ln in out.splitlines() if ln.startswith(f"{card}: total GB")))
        label, value = re.match(r"\s+context GB \((.+)\)\s+(\S+)$", out.splitlines()[i + 1]).groups()
        # the legend names this label and the figure it stands for on this card
        (legend,) = [ln for ln in out.splitlines() if ln.startswith("fits: ")]
        assert f"'{label}'" in legend, (label, legend)
        if card == "H200":
            assert label != "bound" and value != "0.8500"
            assert f"{card} " in legend or "H200" in legend, legend


@pytest.mark.parametrize("model", ["deepseek-v3", "kimi-k2", "mistral-7b"])
def test_item13_the_host_ram_the_streamed_store_needs_is_beside_the_verdict(capfd, model):
    from issue395.measure.shapes import soup_has_stream_modes

    if model != "mistral-7b" and not soup_has_stream_modes():
        pytest.skip("soup-cli 0.73.3 does not stream deepseek_v3")
    code, out, err = main(capfd, ["--estimate", "--model", model, "--quant", "nf4", "--seq", "512", "--card", "H100"])
    assert code == 0, err
    lines = out.splitlines()
    (i,) = [k for k, ln in enumerate(lines) if ln.startswith("  H100: ")]
    assert "host RAM" in lines[i + 1] and "GB" in lines[i + 1], lines[i + 1]
    gbs = float(re.search(r"store[^0-9]*([0-9.]+) GB", lines[i + 1]).group(1))
    assert (gbs > 20) == (model != "mistral-7b"), lines[i + 1]  # the store of the config's own depth (4 of 61 layers here)
    assert not any(ln.startswith("note: not estimated: host RAM") for ln in lines)


# 7 and Polish: Soup's refusals in Soup's words, the typo first, cut at a word --------------------

@pytest.mark.parametrize("typo, meant", [("batchsize: 8", "training.batch_size"),
                                         ("batch_sise: 4", "training.batch_size")])
def test_item7_a_typo_soup_then_refuses_for_is_named_first(capfd, tmp_path, typo, meant):
    path = soup_yaml(tmp_path)
    path.write_text(path.read_text().replace("batch_size: 1", typo))
    code, out, err = main(capfd, ["--estimate", "--config", path, "--card", "T4"])
    line = one_error_line(code, out, err, "did you mean", meant)
    assert line.index("did you mean") < line.index("Soup refuses it") if "Soup refuses it" in line else True, line


def test_polish_soups_refusal_has_no_pydantic_prefix_even_when_its_words_hold_a_colon(capfd, tmp_path):
    path = soup_yaml(tmp_path)
    path.write_text(path.read_text().replace("batch_size: 1", "batch_size: auto"))
    line = one_error_line(*main(capfd, ["--estimate", "--config", path]), "Soup refuses it")
    assert ": :" not in line and "Value error" not in line, line


def test_polish_a_long_refusal_is_cut_at_a_word_with_an_ellipsis(capfd, tmp_path):
    from issue395.errors import cut

    text = "word " * 100
    short = cut(text.strip(), 52)
    assert short.endswith("...") and len(short) <= 52 and short[:-3].endswith("word"), short
    assert cut("short enough", 52) == "short enough"
    path = soup_yaml(tmp_path)
    path.write_text(path.read_text().replace("batch_size: 1", "batch_size: auto"))
    line = one_error_line(*main(capfd, ["--estimate", "--config", path]), "Soup refuses it")
    if len(line) > 300:
        assert line.endswith("...") and line[-4] != " " and re.search(r"[\w.,'=)]\.\.\.$", line), line


@pytest.mark.slow
def test_polish_many_unknown_keys_are_a_capped_list_and_cost_little_beyond_soups_own_loader(capfd, tmp_path):
    """300,000 keys took 357 s in the issue; 30,000 here (the same per-key cost, a tenth of the wait):
    the tool's own work beside Soup's loader, which reads the file once as `soup train` does, is small."""
    from soup_cli.config.loader import load_config_from_string

    n = 30_000
    path = soup_yaml(tmp_path, extra="".join(f"  bogus_key_{i}: 1\n" for i in range(n)))
    t = time.perf_counter()
    try:
        load_config_from_string(path.read_text())
    except ValueError:
        pass
    soups = time.perf_counter() - t
    t = time.perf_counter()
    code, out, err = main(capfd, ["--estimate", "--config", path, "--card", "T4"])
    took = time.perf_counter() - t
    assert took < 2 * soups + 10, (took, soups)
    if code == 2:  # a release whose schema refuses unknown keys itself: one line
        one_error_line(code, out, err, "Soup refuses it")
        return
    assert code == 0, err
    named = [ln for ln in out.splitlines() if "bogus_key_" in ln]
    assert len(named) == 10, len(named)
    (more,) = [ln for ln in out.splitlines() if " more keys " in ln]
    assert f"and {n - 10:,} more keys" in more, more


def test_readme_accumulation_line_is_soups_default_when_the_file_does_not_set_it(capfd, tmp_path):
    code, out, err = main(capfd, ["--estimate", "--config", soup_yaml(tmp_path), "--card", "T4"])
    assert code == 0, err
    (line,) = [ln for ln in out.splitlines() if "gradient_accumulation_steps" in ln]
    assert "Soup's default" in line and "not set in the file" in line, line
    code, out, err = main(capfd, ["--estimate", "--config",
                                  soup_yaml(tmp_path, extra="  gradient_accumulation_steps: 8\n"), "--card", "T4"])
    (line,) = [ln for ln in out.splitlines() if "gradient_accumulation_steps" in ln]
    assert "Soup's default" not in line and " 8:" in line, line


# 12. lora.dropout: answered, exactly for any p > 0, as a labelled bound for 0 -----------------------

@pytest.mark.parametrize("dropout", ["0.1", "0.3", "0.0", "0"])
def test_item12_a_lora_dropout_is_answered_and_said_how(capfd, tmp_path, dropout):
    base = main(capfd, ["--estimate", "--config", soup_yaml(tmp_path, name="a.yaml"), "--card", "T4", "--json",
                        tmp_path / "a.json"])
    path = soup_yaml(tmp_path, targets=f"[q_proj, v_proj]}}\n  lora_dropout_: 0\n  lora: {{dropout: {dropout}, r: 8")
    path.write_text(soup_yaml(tmp_path).read_text().replace("alpha: 16,", f"alpha: 16, dropout: {dropout},"))
    code, out, err = main(capfd, ["--estimate", "--config", path, "--card", "T4", "--json", tmp_path / "b.json"])
    assert base[0] == 0 and code == 0, err
    (line,) = [ln for ln in out.splitlines() if "training.lora.dropout" in ln]
    a, b = (json.loads((tmp_path / f).read_text())["rows"][0] for f in ("a.json", "b.json"))
    assert a["needs_free"] == b["needs_free"] and a["soup_predicted"] == b["soup_predicted"]
    if float(dropout) > 0:
        assert "modelled" in line and "bound" not in line, line
    else:
        assert "upper bound" in line, line


# 1. a row file of a run that did not finish is never deleted --------------------------------------

def unfinished_row_file(tmp_path, name="m.json", header=True):
    """A row file as a killed run leaves it: its header (since 0439a03) and a row's line."""
    from issue395.results.saved import RowFile

    rows = RowFile.path_for(str(tmp_path / name))
    lines = ([json.dumps({RowFile.HEADER: 1, "tool": "x", "kind": "map", "environment": {}})] if header else [])
    rows.write_text("\n".join(lines + [json.dumps({"model": "smol", "seq": 512})]) + "\n")
    return rows


@pytest.mark.parametrize("argv", [
    ["--map", "--families", "smol", "--quant", "none", "--seq", "512", "--batch", "1", "--dry-run"],
    ["--dry-run", "--models", "smol", "--seq", "64"],
    ["--estimate", "--model", "smol", "--seq", "512"],
])
@pytest.mark.parametrize("header", [True, False])
def test_item1_a_json_whose_row_file_holds_an_unfinished_runs_rows_is_refused_and_kept(capfd, tmp_path, argv,
                                                                                       header):
    rows = unfinished_row_file(tmp_path, header=header)
    before = rows.read_bytes()
    line = one_error_line(*main(capfd, argv + ["--json", tmp_path / "m.json"]), str(rows), "--from-json")
    assert "move it" in line, line
    assert rows.read_bytes() == before


def test_item1_an_empty_row_file_holds_no_rows_and_is_no_bar(capfd, tmp_path):
    from issue395.results.saved import RowFile

    RowFile.path_for(str(tmp_path / "m.json")).write_text("")
    code, out, err = main(capfd, ["--estimate", "--model", "smol", "--seq", "512", "--json", tmp_path / "m.json"])
    assert code == 0, err


# 5. a row file that cannot be written to mid-run: the run goes on, nothing is deleted --------------

EROFS = (30, "Read-only file system")


def test_item5_a_row_file_on_a_folder_turned_read_only_keeps_its_rows_and_the_run_goes_on(capfd, tmp_path, monkeypatch):
    """The fault is faked (root ignores a read-only mode): the row file's appends and its removal
    raise EROFS from the second row on, as on a remounted folder."""
    from pathlib import Path

    from issue395.results.saved import RowFile

    rf = RowFile(str(tmp_path / "o.json"), {"command": "x"})
    rf.write({"row": 1})
    real_open, real_unlink = open, Path.unlink

    def ro_open(path, mode="r", *a, **kw):
        if str(path) == str(rf.path) and "a" in mode:
            raise OSError(*EROFS)
        return real_open(path, mode, *a, **kw)

    def ro_unlink(self, *a, **kw):
        if str(self) == str(rf.path):
            raise OSError(*EROFS)
        return real_unlink(self, *a, **kw)

    monkeypatch.setattr("builtins.open", ro_open)
    monkeypatch.setattr(Path, "unlink", ro_unlink)
    rf.write({"row": 2})  # no exception: the run goes on
    rf.write({"row": 3})
    monkeypatch.undo()
    assert [json.loads(ln) for ln in rf.path.read_text().splitlines()][1:] == [{"row": 1}]
    err = capfd.readouterr().err
    assert err.count("warning") == 1 and "Read-only file system" in err and str(rf.path) in err


# 9. target_modules auto on a model peft has no table for: the suggestion is the model's own ------

@pytest.mark.parametrize("model", ["moonlight", "qwen3.5", "deepseek-v3"])
def test_item9_auto_targets_suggest_modules_the_model_has_and_the_suggestion_is_taken(capfd, model):
    from issue395.measure.shapes import soup_has_stream_modes

    if not soup_has_stream_modes():
        pytest.skip("soup-cli 0.73.3 does not stream these families")
    base = ["--estimate", "--model", model, "--quant", "nf4", "--seq", "512"]
    code, out, err = main(capfd, base + ["--targets", "auto"])
    if code == 0:  # peft has a table for it: nothing suggested
        return
    line = one_error_line(code, out, err, "--targets")
    suggested = re.search(r"--targets (\S+) \(or some of them\)", line).group(1)
    code, out, err = main(capfd, base + ["--targets", suggested])
    assert code == 0, err


# 11. a local config.json base has its corrected column ---------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("how", ["--model", "--config"])
def test_item11_a_local_config_json_bases_arm_has_the_corrected_figure_estimate_gives(capfd, tmp_path, cache_dir, how):
    from issue395.model.registry import config_json

    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config_json("smol")))
    if how == "--model":
        argv = ["--model", folder, "--seq", "128"]
        est = ["--estimate", "--model", folder / "config.json", "--seq", "128"]
    else:
        # the measured arm runs the protocol's one micro-batch a step: the estimate it is held to, too
        yaml = soup_yaml(tmp_path, seq=128, base=folder, extra="  gradient_accumulation_steps: 1\n").read_text().replace(
            "quantization: 4bit", "quantization: none")
        (tmp_path / "soup.yaml").write_text(yaml)
        argv = ["--config", tmp_path / "soup.yaml"]
        est = ["--estimate", "--config", tmp_path / "soup.yaml", "--steps", "1"]
    code, out, err = main(capfd, argv + ["--dry-run", "--cache-dir", cache_dir, "--json", tmp_path / "r.json"])
    assert code == 0, err
    (row,) = json.loads((tmp_path / "r.json").read_text())["rows"]
    code, _, err = main(capfd, est + ["--json", tmp_path / "e.json"])
    assert code == 0, err
    (want,) = json.loads((tmp_path / "e.json").read_text())["rows"]
    assert row["corrected_custom"] == want["corrected_predicted"], (row.get("corrected_custom"), want)
    code, out, err = main(capfd, ["--from-json", tmp_path / "r.json"])
    assert f"{want['corrected_predicted'] / 1e9:.4f}" in out, out


# 8. the tool's own results are named for what they are; the README says how the map's row file renders

def test_item8_a_find_max_json_is_named_as_one_not_as_a_foreign_file(capfd, tmp_path):
    path = tmp_path / "fm.json"
    path.write_text(json.dumps({"tool": "issue395-second-stack-vram", "schema": 3, "kind": "find-max",
                                "measured": {"probes": []}}))
    line = one_error_line(*main(capfd, ["--from-json", path]), "--find-max result")
    assert "not a result this tool" not in line, line


def test_item8_the_readme_says_what_renders_the_committed_full_maps_row_file(capfd):
    from conftest import ROOT

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    sentence = readme[readme.index("results/map-077-full-h200-soup0.77.0-684477c/`"):][:400]
    assert "bench/map_077_full.py" in sentence, sentence
    rows = ROOT / "results/map-077-full-h200-soup0.77.0-684477c/map-077-full.json.rows.jsonl"
    line = one_error_line(*main(capfd, ["--from-json", rows]), "row file")
    assert "bench/" in line, line  # the committed ones: the script that renders them


# 6. a mode whose packages are not installed is one line before any work --------------------------

BLOCKER = '''import os, sys
BLOCK = set(os.environ["ISSUE395_TEST_BLOCK"].split(","))
class Blocker:  # stands for a venv that lacks these (a `pip install --no-deps soup-cli`)
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCK:
            raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}", name=name.split(".")[0])
sys.meta_path.insert(0, Blocker())
'''


def without(run_cli, tmp_path, modules, argv):
    """The command line in a fresh process where ``modules`` cannot be imported (a sitecustomize
    finder refuses them, as a venv without them would)."""
    import os

    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), ISSUE395_TEST_BLOCK=",".join(modules))
    return run_cli(argv, cwd=tmp_path, env=env, timeout=120)


@pytest.mark.parametrize("argv", [["--dry-run", "--models", "smol", "--seq", "64"],
                                  ["--map", "--dry-run", "--families", "smol", "--quant", "none"],
                                  ["--dry-run", "--config", "soup.yaml"],
                                  ["--models", "smol", "--seq", "64", "--isolate", "--dry-run"]])
@pytest.mark.parametrize("missing", [["torch"], ["trl", "peft"], ["datasets"]])
def test_item6_a_run_of_arms_without_its_packages_is_one_line_naming_them_and_pip(run_cli, tmp_path, argv, missing):
    soup_yaml(tmp_path, base="HuggingFaceTB/SmolLM2-135M", seq=64)
    out = without(run_cli, tmp_path, missing, argv)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1 and out.stdout == "", (out.stdout, out.stderr)
    assert all(m in lines[0] for m in missing) and "pip install" in lines[0] and "Traceback" not in out.stderr
    assert "building" not in out.stderr


def test_item6_plot_without_matplotlib_says_so_before_the_run(run_cli, tmp_path):
    out = without(run_cli, tmp_path, ["matplotlib"], ["--dry-run", "--models", "smol", "--seq", "64", "--plot",
                                                      tmp_path / "p.png"])
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "matplotlib" in lines[0] and "pip install" in lines[0], out.stderr
    assert out.stdout == ""


def test_item6_estimate_needs_none_of_them(run_cli, tmp_path):
    out = without(run_cli, tmp_path, ["torch", "transformers", "trl", "peft", "datasets", "accelerate"],
                  ["--estimate", "--model", "smol", "--seq", "512", "--card", "T4"])
    assert out.returncode == 0, out.stderr


# 14. --find-max: a failure in Soup's words; Soup's own checks on the probe's file before any probe --

def test_item14_a_search_stopped_by_a_non_oom_failure_says_what_failed_not_none_raised_oom():
    from issue395.constraints.findmax import FAILED, FindMax, Probe, find_max, measured_words

    line = "Error: ValueError: Tokenizer has no chat_template. Pass data.chat_template: chatml"
    found = find_max(lambda v: Probe(v, FAILED, 0, line, 1.0, 1), "seq", 2048, 64, 64, 4096)
    words = measured_words(found, 2)
    assert "None" not in words and "raised OOM" not in words and "Tokenizer has no chat_template" in words, words
    oom = find_max(lambda v: Probe(v, "OOM", 0, "CUDA out of memory", 1.0, 1), "seq", 64, 64, 64, 4096)
    assert "the smallest, 64, raised OOM" in measured_words(oom, 2)


def test_item14_judge_quotes_soups_error_line_not_its_verbose_hint():
    from issue395.constraints.findmax import judge

    log = ("Loading ...\n\nError: OSError: We couldn't connect to 'https://huggingface.co' to load the files.\n"
           "Check your internet connection.\nRun with --verbose for the full traceback.\n")
    p = judge(2048, log, 1, None, 2)
    assert p.line.startswith("Error: OSError: We couldn't connect"), p.line


@pytest.mark.slow
@pytest.mark.parametrize("template, refused", [("", True), ("  chat_template: chatml\n", False)])
def test_item14_soups_own_checks_run_on_the_probes_file_before_any_probe(tmp_path, cache_dir, template, refused):
    """The synthetic checkpoint's tokenizer has no chat template: an SFT file that names none is
    refused by Soup's own format check (at setup, before any step), here on CPU, costing no probe."""
    from issue395.constraints.findmax import probe_config, soup_checks, write_probe_config
    from issue395.run.checkpoints import synthetic_checkpoint
    from issue395.model.registry import SHAPES
    from conftest import h

    base = synthetic_checkpoint(SHAPES["smol"], cache_dir / "checkpoints")[0]
    text = soup_yaml(tmp_path, seq=128, base=base).read_text().replace("quantization: 4bit", "quantization: none")
    text = text.replace("max_length: 128}", "max_length: 128}\n").replace("data: {train: data.jsonl, max_length: 128}",
                                                                          "data:\n  train: data.jsonl\n  max_length: 128\n"
                                                                          + template)
    config = probe_config(text, "seq", 128, data=tmp_path / "p" / "train.jsonl", output=tmp_path / "p" / "out",
                          override=10**10, data_format="chatml")
    path = write_probe_config(tmp_path / "p", config, h.task_rows("sft", 128, 4))
    line = soup_checks(path, "sft")
    if refused:
        assert line is not None and "chat_template" in line and "Value error" not in line, line
    else:
        assert line is None, line


# 2. --exit-code answers "will soup train run it to the end" -------------------------------------

@pytest.mark.parametrize("seq, override, want", [
    (19000, None, 3),            # fits on a T4, Soup's gate refuses it: soup train will not start
    (19000, 20_000_000_000, 0),  # the file's override lifts Soup's gate: it fits and runs
    (2048, None, 0),             # fits and Soup admits it
    (2048, 1_000_000_000, 3),    # an override below Soup's number: Soup refuses what fits
    (32768, 40_000_000_000, 1),  # Soup admits (override), but it does not fit: 1, as before
])
def test_item2_exit_code_is_zero_only_where_it_fits_and_soups_gate_admits_it(capfd, tmp_path, seq, override, want):
    from issue395.estimator.releases import installed_release

    extra = f"  stream_vram_override: {override}\n" if override else ""
    path = soup_yaml(tmp_path, seq=seq, extra=extra)
    code, out, err = main(capfd, ["--estimate", "--config", path, "--card", "T4", "--exit-code", "--steps", "1"])
    (line,) = verdicts(out)
    fits, admits = " fits (" in line, "Soup admits" in line
    assert code == (0 if fits and admits else 1 if not fits else 3), (code, line)
    if installed_release() == "0.73.3":  # the figures this table was read off
        assert code == want, (code, line)


def test_item2_the_rule_is_in_help():
    from issue395.run.parser import build_parser

    flat = " ".join(build_parser().format_help().split())
    assert "--exit-code" in flat and "Soup's gate" in flat[flat.index("--exit-code"):] and " 3 " in flat, flat


# Polish: a base that is a path and is not there --------------------------------------------------

@pytest.mark.parametrize("base", ["./models/my-llama", "models/my-llama", "../nowhere/x", "a/b/c", "~/no-such-model-x"])
@pytest.mark.parametrize("mode", [["--estimate"], ["--dry-run"], ["--find-max", "seq", "--card", "T4", "--dry-run"]])
def test_polish_a_base_path_that_is_not_there_is_no_such_folder(capfd, tmp_path, monkeypatch, base, mode):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    path = soup_yaml(tmp_path, base=base)
    line = one_error_line(*main(capfd, mode + ["--config", path]), "no such folder", base)
    assert "hub" not in line.split("no such folder")[0], line


# Polish: the parser takes no abbreviation and suggests the flag meant ------------------------------

@pytest.mark.parametrize("typed, meant", [("--estimat", "--estimate"), ("--sek", "--seq"), ("--famlies", "--families"),
                                          ("--exitcode", "--exit-code"), ("--dryrun", "--dry-run")])
def test_polish_an_unknown_or_abbreviated_flag_is_refused_with_the_flag_meant(capfd, typed, meant):
    argv = [typed, "512"] if typed in ("--sek",) else ["--estimate", "--model", "smol", "--seq", "512", typed]
    if typed == "--estimat":
        argv = ["--estimat", "--model", "smol", "--seq", "512"]
    if typed == "--famlies":
        argv = ["--map", "--famlies", "smol", "--dry-run"]
    line = one_error_line(*main(capfd, argv), typed, f"did you mean {meant}?")
    assert line.count(typed) >= 1


def test_polish_estimate_alone_names_both_of_what_it_needs(capfd):
    one_error_line(*main(capfd, ["--estimate"]), "--model", "--config")


# Polish: lanes' words on a CPU dry run -------------------------------------------------------------

@pytest.mark.slow
def test_polish_lanes_on_a_cpu_dry_run_say_cpu_not_one_gpu_and_count_in_the_singular(capfd, cache_dir):
    code, out, err = main(capfd, ["--dry-run", "--lanes", "1000", "--models", "smol", "--seq", "64",
                                  "--cache-dir", cache_dir])
    assert code == 0, err
    head = out.splitlines()[0]
    assert "only 1 arm)" in head or "only 1 arm," in head, head
    assert "1 arms" not in head and "1 families" not in head
    code, out, err = main(capfd, ["--dry-run", "--lanes", "2", "--models", "smol", "--seq", "64,128",
                                  "--cache-dir", cache_dir])
    assert code == 0, err
    head = out.splitlines()[0]
    assert "GPU none" in head and "on one GPU" not in head and "on the CPU" in head, head


# 10. --find-max --dry-run --json writes its plan ------------------------------------------------------

def test_item10_find_max_dry_run_json_writes_the_plan_and_from_json_names_it(capfd, tmp_path):
    path = soup_yaml(tmp_path, base="HuggingFaceTB/SmolLM2-135M", seq=512).read_text()
    (tmp_path / "s.yaml").write_text(path.replace("quantization: 4bit", "quantization: none"))
    out_json = tmp_path / "fm.json"
    code, out, err = main(capfd, ["--find-max", "seq", "--config", tmp_path / "s.yaml", "--card", "T4", "--dry-run",
                                  "--json", out_json])
    assert code == 0, err
    data = json.loads(out_json.read_text())
    assert data["kind"] == "find-max" and data["dry_run"] is True and data["measured"] is None
    assert data["this_tool_longest"] is not None and data["plan"], data
    assert f"--json {out_json}" in out + err or str(out_json) in out + err  # said where it went
    one_error_line(*main(capfd, ["--from-json", out_json]), "--find-max")
