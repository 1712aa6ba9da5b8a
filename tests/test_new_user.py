"""What a hostile new user hits first: a many-layered tiny model's build memory, configs no real
model has, a closed terminal and an early Ctrl-C, and saved results edited by hand. CPU only,
tiny models only."""

from __future__ import annotations

import copy
import json
import os
import time

import pytest
from conftest import ROOT, edited_copy, main, one_error_line


MAP = ROOT / "results/margin-map-h200x2-soup0.73.3-f3ad9d2/map-2gpu.json"
SWEEP = ROOT / "results/margin-map-in-4-parts-h200-soup0.73.3-3238e1a-to-b3a7891/full-cold.json"
SCHEMA1 = ROOT / "results/record-h200x2-soup0.73.3-e7c26f7/h200-2026-11-30-full-cold.json"


# 2. configs no real model has ------------------------------------------------------------------

@pytest.mark.parametrize("field, value, limit", [
    ("num_hidden_layers", 1_000_000, "1024"),
    ("vocab_size", 2**31 - 1, "4194304"),
    ("hidden_size", 2**20, "65536"),
    ("intermediate_size", 2**24, "262144"),
], ids=["layers", "vocab", "hidden", "intermediate"])
def test_a_config_larger_than_any_real_model_is_one_line_naming_the_limit(capfd, tmp_path, field,
                                                                          value, limit):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 512, "max_position_embeddings": 256, field: value}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    t = time.perf_counter()
    line = one_error_line(*main(capfd, ["--dry-run", "--model", path, "--seq", "64"]), field, limit)
    assert time.perf_counter() - t < 30, line


@pytest.mark.skipif(__import__("shutil").which("nvidia-smi") is not None, reason="a GPU box would run the arm")
def test_the_same_soup_yaml_is_estimated_on_cpu_and_asks_for_a_gpu_to_run_as_the_card(capfd, tmp_path):
    """A new user's soup.yaml: --estimate answers for a T4 on this CPU box; the same file run as a T4
    (--emulate-card) needs a GPU, said in one line before anything is built."""
    config = tmp_path / "soup.yaml"
    config.write_text("base: mistralai/Mistral-7B-v0.3\ndata: {train: data.jsonl, max_length: 512}\n"
                      "training: {batch_size: 1, quantization: 4bit, stream_layers: true,\n"
                      "           lora: {r: 16, alpha: 32, target_modules: [q_proj, v_proj]}}\n")
    code, out, err = main(capfd, ["--estimate", "--config", config, "--card", "T4"])
    assert code == 0 and "T4" in out and f"from --config {config}" in out, err
    one_error_line(*main(capfd, ["--config", config, "--emulate-card", "T4"]), "CUDA", "--dry-run")


# 3. signals ------------------------------------------------------------------------------------


def test_after_a_hang_up_a_terminal_stdout_writes_to_dev_null_and_a_pipe_is_kept():
    """In a fresh process whose stdout is a terminal (a pty) and stderr a pipe: writing to a
    hung-up terminal fails with EIO, so it is pointed at /dev/null; the pipe still gets text."""
    import pty
    import subprocess
    import sys

    master, slave = pty.openpty()
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); from issue395.measure.console import terminal_gone; "
            "terminal_gone(); null = os.stat(os.devnull).st_rdev; "
            "sys.stderr.write(f'{os.fstat(1).st_rdev == null} {os.fstat(2).st_rdev == null}')")
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(ROOT)], stdout=slave,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(slave)
        os.close(master)
    assert proc.stderr == "True False", proc.stderr


# 4 and 5. saved results edited by hand ---------------------------------------------------------



def _dup_first_row(d):
    d["rows"].append(copy.deepcopy(d["rows"][0]))


def _margin(**kw):
    return lambda d: d["margins"][0].update(kw)


@pytest.mark.parametrize("source, edit, words", [
    (SCHEMA1, lambda d: d.update(determinism=[1]), ["determinism"]),
    (SCHEMA1, lambda d: d.update(determinism={"arms": {"a": 1}}), ["determinism"]),
    (SCHEMA1, lambda d: d.update(determinism={"arms": [1]}), ["determinism"]),
    (SCHEMA1, lambda d: d.update(determinism={"arms": [{"rows": 3}]}), ["determinism"]),
    (SCHEMA1, lambda d: d.update(determinism={"arms": [{"rows": [dict(d["rows"][0], repeat="x")]}]}),
     ["repeat"]),
    (SCHEMA1, lambda d: d["rows"][0].update(elements="x"), ["elements"]),
    (SCHEMA1, _dup_first_row, ["twice"]),
    (MAP, lambda d: d.update(margins=[{}]), ["margin"]),
    (MAP, lambda d: d.update(margins={"a": 1}), ["margins"]),
    (MAP, lambda d: d.update(margins=[1]), ["margin"]),
    (MAP, _margin(ratio="x"), ["ratio"]),
    (MAP, _margin(ratio=float("nan")), ["ratio"]),
    (MAP, _margin(model_key=["smol"]), ["model_key"]),
    (MAP, _margin(complete="yes"), ["complete"]),
    (MAP, _margin(terms=3), ["terms"]),
    (MAP, _margin(terms=[{}]), ["terms"]),
    (MAP, _margin(terms=[{"term": "x", "charged": 1, "measured": 1, "missed": 0, "per": [0, "x"]}]),
     ["per"]),
    (MAP, _margin(note=3), ["note"]),
    (MAP, lambda d: d["rows"][0].update(model_key=["smol"]), ["model_key"]),
    (MAP, lambda d: d["rows"][0].update(model=["x"]), ["model"]),
    (MAP, _dup_first_row, ["twice"]),
    (SWEEP, _dup_first_row, ["twice"]),
    (SWEEP, lambda d: d.update(timings=[1]), ["timings"]),
    (SWEEP, lambda d: d["environment"].update(torch=["2.9"]), ["torch"]),
    (SWEEP, lambda d: d["environment"].update(date={"x": 1}), ["date"]),
    (SWEEP, lambda d: d.update(kind=["map"]), ["kind"]),
    (SWEEP, lambda d: d.update(kind="bogus"), ["kind"]),
    (SWEEP, lambda d: d.update(interrupted="no"), ["interrupted"]),
    (SWEEP, lambda d: d.update(error=["x"]), ["error"]),
    (SWEEP, lambda d: d.update(control=[1]), ["control"]),
    (SWEEP, lambda d: d.update(measure=[1]), ["measure"]),
    (SWEEP, lambda d: d.update(sdpa="x"), ["sdpa"]),
    (SWEEP, lambda d: d.update(schema=True), ["schema"]),
    (SWEEP, lambda d: d["rows"][0].update(timings=[1]), ["timings"]),
    (SWEEP, lambda d: d["rows"][0].update(error=["x"]), ["error"]),
    (SWEEP, lambda d: d["rows"][0].update(gpu=["x"]), ["gpu"]),
    (SWEEP, lambda d: d["rows"][0].update(log=5), ["log"]),
    (SWEEP, lambda d: d["rows"][0].update(dry_run="yes"), ["dry_run"]),
    (SWEEP, lambda d: d["rows"][0].update(soup_terms=[1]), ["soup_terms"]),
    (SWEEP, lambda d: d["rows"][0].update(targets=3), ["targets"]),
], ids=["s1-determinism-list", "s1-determinism-arms-object", "s1-determinism-arm-number",
        "s1-determinism-rows-number", "s1-determinism-repeat-string", "s1-elements-string",
        "s1-duplicate-arm", "map-margin-empty", "map-margins-object", "map-margin-number",
        "map-margin-ratio-string", "map-margin-ratio-nan", "map-margin-model-key-list",
        "map-margin-complete-string", "map-margin-terms-number", "map-margin-term-empty",
        "map-margin-per-zero", "map-margin-note-number", "map-row-model-key-list",
        "map-row-model-list", "map-duplicate-arm", "sweep-duplicate-arm", "timings-list",
        "environment-value-list", "environment-value-object", "kind-list", "kind-unknown",
        "interrupted-string", "error-list", "control-list", "measure-list", "sdpa-string",
        "schema-true", "row-timings-list", "row-error-list", "row-gpu-list", "row-log-number",
        "row-dry-run-string", "row-soup-terms-list", "row-targets-number"])
def test_a_hand_edited_saved_result_is_one_line_and_exit_2(capfd, tmp_path, source, edit, words):
    path = edited_copy(tmp_path, source, edit)
    one_error_line(*main(capfd, ["--from-json", path]), "--from-json", *words)


def test_two_maps_whose_row_model_key_is_a_list_are_one_line_not_a_traceback(capfd, tmp_path):
    bad = edited_copy(tmp_path, MAP, lambda d: d["rows"][0].update(model_key=["smol"]))
    good = tmp_path / "good.json"
    good.write_text(MAP.read_text())
    one_error_line(*main(capfd, ["--from-json", bad, good]), "model_key")


def test_the_committed_results_still_load(capfd):
    for path in (MAP, SWEEP, SCHEMA1):
        code, out, err = main(capfd, ["--from-json", path])
        assert code in (0, 1) and out and "error" not in err, (path, err)


# 6. an output never destroys its input -----------------------------------------------------------

def _copies(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_bytes(SWEEP.read_bytes())
    b.write_bytes(SWEEP.read_bytes())
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "vocab_size": 512, "max_position_embeddings": 256}))
    (tmp_path / "link.json").symlink_to(a)
    return a, b, cfg


@pytest.mark.parametrize("argv, named", [
    (["--from-json", "a.json", "--markdown", "a.json"], "--from-json"),
    (["--from-json", "a.json", "--compare", "b.json", "--markdown", "b.json"], "--compare"),
    (["--from-json", "a.json", "--json", "a.json"], "--from-json"),
    (["--from-json", "a.json", "--json", "./a.json"], "--from-json"),
    (["--from-json", "a.json", "--json", "link.json"], "--from-json"),
    (["--from-json", "link.json", "b.json", "--markdown", "b.json"], "--from-json"),
    (["--estimate", "--model", "config.json", "--seq", "128", "--json", "config.json"], "--model"),
    (["--estimate", "--model", ".", "--seq", "128", "--json", "config.json"], "--model"),
], ids=["markdown-over-from-json", "markdown-over-compare", "json-over-from-json", "dot-slash-spelling",
        "symlink-spelling", "markdown-over-second-shard", "estimate-json-over-config", "estimate-json-in-model-folder"])
def test_an_output_that_names_an_input_is_one_line_and_the_input_is_untouched(capfd, tmp_path, monkeypatch,
                                                                              argv, named):
    monkeypatch.chdir(tmp_path)
    files = _copies(tmp_path)
    before = [f.read_bytes() for f in files]
    one_error_line(*main(capfd, argv), named, "input")
    assert [f.read_bytes() for f in files] == before


def test_a_sweep_output_over_its_model_config_is_one_line_before_anything_runs(capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    *_, cfg = _copies(tmp_path)
    before = cfg.read_bytes()
    one_error_line(*main(capfd, ["--dry-run", "--model", "config.json", "--seq", "64", "--markdown", "./config.json"]),
                   "--markdown", "--model")
    assert cfg.read_bytes() == before


# 7. whole numbers: odd spellings and sizes no real run has ----------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["--seq", "256,--512"], ["--seq", "--512"]),
    (["--batch=--1"], ["--batch", "--1"]),
    (["--batch", "+5"], ["--batch", "+5"]),
    (["--batch", "5.0"], ["--batch", "5.0"]),
    (["--batch", "0x10"], ["--batch", "0x10"]),
    (["--batch", "\uff15"], ["--batch"]),
    (["--seq", "1" * 5000], ["--seq", "not a whole number"]),
    (["--gpus", "0,--1"], ["--gpus"]),
    (["--determinism=--3"], ["--determinism"]),
], ids=["double-minus-in-list", "double-minus-equals", "plus", "decimal", "hex", "full-width", "5000-digits",
        "gpus-double-minus", "determinism-double-minus"])
def test_an_odd_spelling_of_a_whole_number_is_one_line(capfd, argv, words):
    one_error_line(*main(capfd, argv), *words)


@pytest.mark.parametrize("argv, words", [
    (["--batch", "1000000"], ["--batch", "1024"]),
    (["--batch", str(10**30)], ["--batch", "1024"]),
    (["--seq", "1048577"], ["--seq", "1048576"]),
    (["--map", "--batch", "2048"], ["--batch", "1024"]),
    (["--steps", "0"], ["--steps", "at least 1"]),
    (["--steps", "1001"], ["--steps", "1000"]),
    (["--determinism", "1000"], ["--determinism", "100"]),
    (["--estimate", "--model", "smol", "--seq", "128", "--batch", "1000000"], ["--batch", "1024"]),
    (["--estimate", "--model", "smol", "--seq", "128", "--lora-r", "0"], ["--lora-r", "at least 1"]),
    (["--estimate", "--model", "smol", "--seq", "128", "--lora-r", "4096"], ["--lora-r", "1024"]),
    (["--estimate", "--model", "smol", "--seq", "128", "--steps", "10000"], ["--steps", "1000"]),
], ids=["batch-million", "batch-10e30", "seq-past-any-model", "map-batch", "steps-zero", "steps-1001",
        "determinism-1000", "estimate-batch", "estimate-lora-r-zero", "estimate-lora-r-4096", "estimate-steps"])
def test_a_size_no_real_run_has_is_one_line_naming_the_limit(capfd, argv, words):
    one_error_line(*main(capfd, argv), *words)


# 8. saved results that cannot be merged, rendered or compared; a terminal that cannot encode ------


@pytest.mark.parametrize("source", [SWEEP, MAP], ids=["full-cold", "map-with-non-ascii"])
def test_a_terminal_that_cannot_encode_still_gets_the_tables_and_the_markdown(tmp_path, source):
    import subprocess
    import sys

    env = dict(os.environ, PYTHONIOENCODING="ascii")
    md = tmp_path / "OUT.md"
    proc = subprocess.run([sys.executable, str(ROOT / "issue395_second_stack_vram.py"), "--from-json", str(source),
                           "--markdown", str(md)], env=env, capture_output=True, timeout=300)
    assert proc.returncode in (0, 1) and b"Traceback" not in proc.stderr, proc.stderr[-2000:]
    if source == SWEEP:
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert md.exists() and md.stat().st_size > 0 and proc.stdout


# 9. --model paths, hub ids, and output paths --------------------------------------------------------

@pytest.mark.parametrize("model", ["/nonexistent/config.json", "./no-such-model", "~/no-such-model-395",
                                   "results/no-such-model", "x/y/z", "cfg.json", "../up"],
                         ids=["absolute-config", "dot-slash", "tilde", "under-an-existing-folder",
                              "two-slashes", "bare-json", "dot-dot"])
def test_a_model_path_that_is_not_there_is_one_line_not_a_hub_lookup(capfd, monkeypatch, model):
    monkeypatch.chdir(ROOT)
    t = time.perf_counter()
    one_error_line(*main(capfd, ["--dry-run", "--model", model, "--seq", "64"]), model, "no such")
    assert time.perf_counter() - t < 5


@pytest.mark.parametrize("flag", ["--json", "--markdown", "--plot", "--log-dir", "--cache-dir", "--snapshot-dir"])
def test_an_empty_path_says_it_is_empty(capfd, flag):
    line = one_error_line(*main(capfd, [f"{flag}=", "--dry-run"] if flag != "--snapshot-dir" else [f"{flag}="]),
                          flag, "empty")
    assert "folder;" not in line and "is a folder" not in line


def test_an_unwritable_output_folder_names_the_value_given_and_the_folder(capfd, tmp_path, monkeypatch):
    import issue395.run.options as options

    (tmp_path / "ro").mkdir()
    monkeypatch.chdir(tmp_path)
    real = os.access
    monkeypatch.setattr(options.os, "access",
                        lambda p, mode, **kw: False if mode & os.W_OK and "ro" in str(p) else real(p, mode, **kw))
    line = one_error_line(*main(capfd, ["--dry-run", "--json", "ro/out.json"]), "cannot be written",
                          str(tmp_path / "ro"))
    assert line.startswith("error: --json ro/out.json:"), line


def test_an_output_inside_a_regular_file_names_the_value_given(capfd, tmp_path, monkeypatch):
    (tmp_path / "plain").write_text("x")
    monkeypatch.chdir(tmp_path)
    line = one_error_line(*main(capfd, ["--dry-run", "--markdown", "plain/out.md"]), "not a folder")
    assert line.startswith("error: --markdown plain/out.md:"), line


# 10. --estimate with what a hostile user types ---------------------------------------------------

def _config(tmp_path, name="config.json", **over):
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
           "max_position_embeddings": 256}
    cfg.update(over)
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("make, extra, words", [
    (lambda t: t, [], ["--model", "config.json"]),
    (lambda t: ((t / "c.json").write_text("[1, 2]"), t / "c.json")[1], [], ["--model", "JSON object"]),
    (lambda t: _config(t, hidden_size=None), [], ["--model", "hidden_size"]),
    (lambda t: _config(t, max_position_embeddings=None), [], ["--model", "max_position_embeddings"]),
    (lambda t: _config(t), ["--seq", "512"], ["--seq 512", "256"]),
    (lambda t: _config(t, partial_rotary_factor="x"), [], ["--model"]),
    (lambda t: _config(t, num_key_value_heads="x"), [], ["--model", "heads"]),
    (lambda t: _config(t), ["--card", "1" * 400 + "GB"], ["--card"]),
    (lambda t: _config(t), ["--card", "0.0000000001GB"], ["--card", "1 byte"]),
    (lambda t: _config(t), ["--card", "24TB"], ["--card"]),
    (lambda t: _config(t), ["--targets", "q_proj,q_proj"], ["--targets", "twice"]),
    (lambda t: _config(t), ["--targets", "nope"], ["nope"]),
    (lambda t: _config(t), ["--targets", ","], ["--targets"]),
    (lambda t: _config(t), ["--lora-r", "8.5"], ["--lora-r"]),
    (lambda t: _config(t), ["--steps", "--2"], ["--steps"]),
    (lambda t: _config(t), ["--quant", "int8"], ["--quant"]),
], ids=["folder-without-config", "config-a-list", "missing-size", "missing-positions", "seq-past-positions",
        "rotary-factor-string", "kv-heads-string", "card-400-digits", "card-under-a-byte", "card-unit",
        "targets-twice", "target-unknown", "targets-empty", "lora-r-decimal", "steps-double-minus",
        "quant-unknown"])
def test_estimate_with_odd_values_is_one_line(capfd, tmp_path, make, extra, words):
    path = make(tmp_path)
    argv = ["--estimate", "--model", path] + (extra if "--seq" in extra else ["--seq", "128"] + extra)
    one_error_line(*main(capfd, argv), *words)


@pytest.mark.parametrize("shard", ["1/" + "9" * 5000, "9" * 5000 + "/1", "\uff11/\uff12", "+1/2", " 1/2"],
                         ids=["n-5000-digits", "k-5000-digits", "full-width", "plus", "space"])
def test_an_odd_shard_is_one_line(capfd, shard):
    one_error_line(*main(capfd, ["--dry-run", "--shard", shard]), "--shard")


@pytest.mark.parametrize("argv, flag", [
    (["--json", "a" * 5000], "--json"), (["--markdown", "/tmp/" + "a" * 5000 + "/x.md"], "--markdown"),
    (["--log-dir", "a" * 5000], "--log-dir"),
    (["--estimate", "--model", "a" * 5000, "--seq", "128"], "--model"),
], ids=["json", "markdown-folder", "log-dir", "estimate-model"])
def test_a_path_no_filesystem_takes_is_one_line_naming_its_option(capfd, argv, flag):
    one_error_line(*main(capfd, argv), flag, "too long")
