"""The command line end to end: real Soup setups on CPU through --dry-run, shards and their
merge, bad input, the CUDA-required exit, fresh-process modes, the checkpoint cache,
--model and --help.

Every arm here is a real ``SFTTrainerWrapper(config).setup`` with transformers, TRL, PEFT
and torch on CPU. Nothing is faked but torch.cuda.is_available (the CUDA-required test)
and spread.spread (one test that reads the plan of processes instead of starting them).
A dry-run arm is the expensive part (a fresh process pays ~20 s of imports and setup), so
runs are made in process with the session's --cache-dir, and a run several tests read is
made once (``once``) by whichever of them comes first. Only --isolate/--determinism (whose
point is fresh processes) and the unknown-option test start processes.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import replace
from importlib import metadata
from pathlib import Path

import pytest
from conftest import QWEN, SMOL, h, main, one_error_line, table_rows

from issue395.measure.builder import checkpoint_fingerprint, prepare_checkpoint
from issue395.host.checkpoints import synthetic_checkpoint
from issue395.errors import EXIT_OK
from issue395.model.arm import predicted_bytes
from issue395.measure.shapes import load_custom_shape

SOUP_CONSOLE_TEXT = ("Layer streaming", "LoRA applied", "Preparing layer shards",
                     "Loading tokenizer", "chat_template override", "Map:", "Truncating",
                     "\u256d", "\u2502", "\u2570")


def err_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


# ---------------------------------------------------------------------------
# Runs shared by several tests, made once by whichever test needs one first
# ---------------------------------------------------------------------------

_RUNS: dict[str, tuple] = {}


def run_args(name: str, cache_dir: Path) -> list:
    c = ["--cache-dir", cache_dir]
    return {
        "both": ["--dry-run", "--seq", "64"] + c,
        "shard1": ["--dry-run", "--seq", "64", "--shard", "1/2"] + c,
        "shard2": ["--dry-run", "--seq", "64", "--shard", "2/2"] + c,
        "batch2": ["--batch", "2", "--dry-run", "--seq", "64"] + c,
        # Two fresh processes each (each costs a process start and a Soup setup).
        "isolate": ["--dry-run", "--isolate", "--models", "smol", "--seq", "64,96"] + c,
        "determinism": ["--dry-run", "--determinism", "2", "--models", "smol", "--seq", "64"] + c,
    }[name]


def once(capfd, tmp_path_factory, cache_dir, name, fresh=False):
    """(code, stdout, stderr, json path, saved result) of a named run, made at most once
    (``fresh`` makes it again and keeps the new one). The record's two checkpoints are in the
    session's cache first (built here if no test before this one in this process built them), so
    a run's stderr is its arms' progress, never a build's."""
    if fresh or name not in _RUNS:
        for shape in (SMOL, QWEN):
            synthetic_checkpoint(shape, cache_dir / "checkpoints")
        capfd.readouterr()
        path = tmp_path_factory.mktemp(name) / f"{name}.json"
        code, out, err = main(capfd, run_args(name, cache_dir) + ["--json", path])
        saved = json.loads(path.read_text()) if path.exists() else None
        _RUNS[name] = (code, out, err, path, saved)
    return _RUNS[name]


# ---------------------------------------------------------------------------
# A real dry run of both models
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.release
def test_dry_run_both_models_realises_requested_seq_and_keeps_soup_text_off_stdout(
        capfd, cache_dir, tmp_path_factory):
    code, out, err, _, result = once(capfd, tmp_path_factory, cache_dir, "both")
    assert code == EXIT_OK, err
    rows = result["rows"]
    assert [r["model_key"] for r in rows] == ["smol", "qwen"]
    for r in rows:
        assert r["seq"] == r["realised_width"] == r["derived"]["realised"] == 64
        assert r["realised_rows"] == [64]
        assert r["derived"]["status"] == "dry-run" and r["real_peak"] is None
        assert r["error"] is None and r["failure"] is None

    # One row per model, under that model's heading, realised 64, no peak.
    lines = out.splitlines()
    smol_at = next(i for i, line in enumerate(lines) if line.startswith("SmolLM2-135M  (predicted"))
    qwen_at = next(i for i, line in enumerate(lines) if line.startswith("Qwen2.5-0.5B  (predicted"))
    printed = table_rows(out, 64)
    assert len(printed) == 2
    for line in printed:
        assert line.split()[:3] == ["64", "64", "1"]
        assert "n/a (dry run)" in line and line.split()[-1] == "dry-run"
    assert smol_at < lines.index(printed[0]) < qwen_at < lines.index(printed[1])

    # Soup's panels, bars and banners went to the per-arm log, not the console; stderr holds
    # only the harness's own progress lines.
    for text in SOUP_CONSOLE_TEXT:
        assert text not in out, f"Soup console text {text!r} reached stdout"
        assert text not in err, f"Soup console text {text!r} reached stderr"
    assert [line[:8] for line in err_lines(err)] == ["[arm 1/2", "[arm 2/2"], err

    header = lines[0]
    assert header.startswith("stack: ")
    for label, dist in (("torch", "torch"), ("transformers", "transformers"), ("trl", "trl"),
                        ("peft", "peft"), ("soup-cli", "soup-cli")):
        assert f"{label} {metadata.version(dist)}" in header
    assert "weights synthetic" in header and header.endswith("| arms in one process")


# ---------------------------------------------------------------------------
# Shards: --shard K/N runs, merged by --from-json
# ---------------------------------------------------------------------------


def strip_arms(header: str) -> str:
    return header.split(" | arms ")[0]


@pytest.mark.slow
def test_shards_merged_by_from_json_print_the_tables_of_one_unsharded_run(
        capfd, cache_dir, tmp_path_factory):
    shards = [once(capfd, tmp_path_factory, cache_dir, n) for n in ("shard1", "shard2")]
    for (code, _, err, _, saved), key in zip(shards, ("smol", "qwen")):
        assert code == EXIT_OK, err
        assert [r["model_key"] for r in saved["rows"]] == [key]  # grid index K-1 modulo 2
    code, whole, err, _, _ = once(capfd, tmp_path_factory, cache_dir, "both")
    assert code == EXIT_OK, err

    code, merged, err = main(capfd, ["--from-json", shards[0][3], shards[1][3]])
    assert code == EXIT_OK, err
    assert err == ""
    assert merged.splitlines()[1:] == whole.splitlines()[1:]
    assert strip_arms(merged.splitlines()[0]) == strip_arms(whole.splitlines()[0])
    assert [line for line in merged.splitlines() if line.startswith("stack:")] == \
        [merged.splitlines()[0]]  # exactly one header
    assert len(table_rows(merged, 64)) == 2


@pytest.mark.parametrize("key", ["torch", "soup_cli"])
def test_merging_results_of_different_stacks_exits_2_with_one_line(
        capfd, cache_dir, tmp_path_factory, tmp_path, key):
    first = once(capfd, tmp_path_factory, cache_dir, "shard1")[3]
    other = once(capfd, tmp_path_factory, cache_dir, "shard2")[4]
    other = json.loads(json.dumps(other))
    other["environment"][key] = "0.0.0-another-stack"
    path = tmp_path / "other-stack.json"
    path.write_text(json.dumps(other))
    code, out, err = main(capfd, ["--from-json", first, path])
    one_error_line(code, out, err, "different stacks", key, "0.0.0-another-stack")


def test_merging_overlapping_shards_exits_2_with_one_line(capfd, cache_dir, tmp_path_factory):
    shard = once(capfd, tmp_path_factory, cache_dir, "shard1")[3]
    whole = once(capfd, tmp_path_factory, cache_dir, "both")[3]  # holds shard 1's arm too
    code, out, err = main(capfd, ["--from-json", shard, whole])
    one_error_line(code, out, err, "same arm", "overlapping")
    code, out, err = main(capfd, ["--from-json", shard, shard])
    one_error_line(code, out, err, "overlapping")


# ---------------------------------------------------------------------------
# CUDA required; an unknown option (a fresh process: what a terminal sees)
# ---------------------------------------------------------------------------


def test_real_run_without_cuda_exits_2_with_one_line_naming_cuda_and_dry_run(
        capfd, tmp_path, monkeypatch):
    """CUDA is hidden from the harness, so this holds on a GPU box too; nothing is built,
    nothing printed to stdout, nothing left behind."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    code, out, err = main(capfd, ["--models", "smol", "--seq", "64"])
    one_error_line(code, out, err, "CUDA", "--dry-run")
    assert list(tmp_path.iterdir()) == []


def test_unknown_option_exits_2_with_one_line_in_a_fresh_process(run_cli, tmp_path):
    proc = run_cli(["--frobnicate"], cwd=tmp_path, timeout=60)
    one_error_line(proc.returncode, proc.stdout, proc.stderr, "--frobnicate")
    assert "usage:" not in proc.stderr


# ---------------------------------------------------------------------------
# Bad input: exit 2, one line naming the problem, nothing on stdout, no traceback
# ---------------------------------------------------------------------------


def _gpt2_folder(root: Path) -> Path:
    """A config of an architecture Soup cannot stream, with a (dummy) safetensors file and
    a tokenizer file, so only the architecture is wrong."""
    import torch
    from safetensors.torch import save_file
    from transformers import GPT2Config

    folder = root / "gpt2-tiny"
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=256,
               bos_token_id=0, eos_token_id=0).save_pretrained(folder)
    save_file({"wte.weight": torch.zeros(128, 32)}, str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_text("{}")
    return folder


def _no_config_folder(root: Path) -> Path:
    folder = root / "no-config"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def _unwritable_folder(root: Path) -> str:
    """A folder this process cannot write into (root writes through mode bits, not /proc/1)."""
    folder = root / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    if not os.access(folder, os.W_OK):
        return str(folder)
    if os.path.isdir("/proc/1") and not os.access("/proc/1", os.W_OK):
        return "/proc/1"
    pytest.skip("no folder here that this process cannot write into")


BAD_INPUT = [
    # id, argv ({tmp}: the test's folder), words the error line must hold
    ("seq-zero", ["--dry-run", "--seq", "0"], ["--seq", "0", "at least 64"]),
    ("seq-under-soups-64", ["--dry-run", "--seq", "32"], ["--seq", "32", "at least 64"]),
    ("seq-negative", ["--dry-run", "--seq", "-5"], ["--seq", "-5", "at least 64"]),
    ("seq-word", ["--dry-run", "--seq", "abc"], ["--seq", "'abc'", "whole number"]),
    ("seq-beyond-max-positions", ["--dry-run", "--seq", "9000", "--models", "smol"],
     ["--seq 9000", "SmolLM2-135M", "8192"]),
    ("seq-float", ["--dry-run", "--seq", "1e3"], ["--seq", "'1e3'", "whole number"]),
    ("seq-non-ascii-digit", ["--dry-run", "--seq", "\u00b2"], ["--seq", "whole number"]),
    ("seq-empty", ["--dry-run", "--seq", ""], ["--seq", "empty"]),
    ("seq-empty-item", ["--dry-run", "--seq", "2048,,4096"], ["--seq", "empty"]),
    ("seq-named-twice", ["--dry-run", "--seq", "64,64"], ["--seq", "64", "twice"]),
    ("models-unknown", ["--dry-run", "--models", "foo"], ["--models", "'foo'", "smol,qwen"]),
    ("models-empty", ["--dry-run", "--models", ""], ["--models", "empty", "smol,qwen"]),
    ("models-named-twice", ["--dry-run", "--models", "smol,smol"], ["--models", "twice"]),
    ("model-with-models", ["--dry-run", "--model", "{tmp}", "--models", "smol", "--seq", "64"],
     ["--model", "--models", "exclusive"]),
    ("model-without-seq", ["--dry-run", "--model", "{tmp}"], ["--model", "--seq"]),
    ("model-no-config", ["--dry-run", "--model", "{noconfig}", "--seq", "64"],
     ["--model", "no config.json"]),
    ("batch-zero", ["--dry-run", "--batch", "0"], ["--batch", "0", "at least 1"]),
    ("batch-word", ["--dry-run", "--batch", "x"], ["--batch", "'x'", "whole number"]),
    ("gpus-negative", ["--dry-run", "--gpus", "-1"], ["--gpus", "-1", "at least 0"]),
    ("model-unstreamable-arch", ["--dry-run", "--model", "{gpt2}", "--seq", "64"],
     ["gpt2", "cannot be layer-streamed"]),
    ("determinism-one", ["--dry-run", "--determinism", "1"], ["--determinism", "1", "at least 2"]),
    ("shard-beyond", ["--dry-run", "--shard", "3/2"], ["--shard 3/2", "K/N"]),
    ("shard-zero", ["--dry-run", "--shard", "0/2"], ["--shard 0/2", "K/N"]),
    ("shard-word", ["--dry-run", "--shard", "x"], ["--shard x", "K/N"]),
    ("shard-with-gpus", ["--dry-run", "--shard", "1/2", "--gpus", "0"], ["--shard", "--gpus"]),
    ("plot-not-png", ["--dry-run", "--plot", "{tmp}/plot.txt"], ["--plot", ".png"]),
    ("plot-under-a-file", ["--dry-run", "--plot", "{tmp}/a-file/plot.png"],
     ["--plot", "a-file", "not a folder"]),
    ("json-to-a-folder", ["--dry-run", "--json", "{tmp}"], ["--json", "folder"]),
    ("json-under-unwritable-folder", ["--dry-run", "--json", "{ro}/sub/out.json"],
     ["--json", "{ro}", "cannot be written"]),
    ("json-and-markdown-same-path", ["--dry-run", "--json", "{tmp}/x", "--markdown", "{tmp}/x"],
     ["--json", "--markdown", "same file"]),
    ("snapshot-in-a-dry-run", ["--dry-run", "--snapshot"], ["--snapshot", "--dry-run"]),
    ("compare-without-from-json", ["--dry-run", "--compare", "{tmp}/a-file"],
     ["--compare", "--from-json"]),
]


@pytest.mark.parametrize("argv, words", [pytest.param(a, w, id=i) for i, a, w in BAD_INPUT])
def test_bad_input_exits_2_with_one_line_naming_the_problem(capfd, tmp_path, argv, words):
    (tmp_path / "a-file").write_text("not a folder\n")
    subs = {"{tmp}": str(tmp_path)}
    if any("{gpt2}" in a for a in argv):
        subs["{gpt2}"] = str(_gpt2_folder(tmp_path))
    if any("{noconfig}" in a for a in argv):
        subs["{noconfig}"] = str(_no_config_folder(tmp_path))
    if any("{ro}" in a for a in argv):
        subs["{ro}"] = _unwritable_folder(tmp_path)
    for key, value in subs.items():
        argv = [a.replace(key, value) for a in argv]
        words = [w.replace(key, value) for w in words]
    capfd.readouterr()
    code, out, err = main(capfd, argv)
    one_error_line(code, out, err, *words)
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.rows.jsonl").exists()


def test_cache_dir_outside_home_cwd_and_temp_dir_is_refused_and_not_created(
        capfd, tmp_path, monkeypatch):
    """Soup would silently ignore such a folder and shard into ~/.soup: refused before
    anything runs, in one line, and the refused folder is not created."""
    for name in ("home", "tmp", "cwd"):
        (tmp_path / name).mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.chdir(tmp_path / "cwd")
    target = tmp_path / "elsewhere" / "cache"
    code, out, err = main(capfd, ["--dry-run", "--models", "smol", "--seq", "64",
                                  "--cache-dir", target])
    one_error_line(code, out, err, "--cache-dir", str(target), "~/.soup")
    assert not (tmp_path / "elsewhere").exists()


# ---------------------------------------------------------------------------
# --help; a modes-only header
# ---------------------------------------------------------------------------


def test_help_states_the_defaults_and_exit_codes_0_1_2_130(capsys):
    with pytest.raises(SystemExit) as stop:
        h.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert "seq 2048,3072,4096,4352,5120,6144" in flat  # SmolLM2's grid
    assert "seq 2048,4096,5120,6144" in flat  # Qwen's grid
    assert "weights synthetic:" in flat and "synthetic (default)" in flat
    assert "--cache-dir must lie under $HOME, the working directory or the temp dir" in flat
    section = out[out.index("exit codes:"):]
    codes = [line.split()[0] for line in section.splitlines()[1:]
             if line.startswith("  ") and line.split()[0].isdigit()]
    assert codes == ["0", "1", "2", "130"]
    for word in ("VOID", "OOM", "FAILED", "UNDER", "usage error", "interrupted"):
        assert word in section


def test_measure_only_dry_run_header_names_no_arms_sensibly(capfd):
    code, out, err = main(capfd, ["--measure", "--dry-run"])
    assert code == EXIT_OK, err
    header = out.splitlines()[0]
    assert header.startswith("stack: ")
    assert "arms no arms" not in header
    assert header.endswith("| arms none (modes only)")
    assert "--measure: bytes per logit element" in out and "n/a (dry run)" in out
    assert "realised" not in out  # no sweep table
    assert err == ""


# ---------------------------------------------------------------------------
# The checkpoint cache, and batch 2
# ---------------------------------------------------------------------------


def _file_stamps(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
@pytest.mark.release
def test_second_run_with_the_same_cache_dir_reuses_checkpoint_and_shards(
        capfd, cache_dir, tmp_path_factory):
    code, _, err, _, _ = once(capfd, tmp_path_factory, cache_dir, "both")  # the first run
    assert code == EXIT_OK, err
    checkpoint = cache_dir / "checkpoints" / f"smol-{checkpoint_fingerprint(SMOL)}"
    assert (checkpoint / ".complete").is_file() and (checkpoint / "model.safetensors").is_file()
    from soup_cli.utils.layer_shard import model_slug

    shards = cache_dir / "layer-stream" / model_slug(str(checkpoint))
    assert (shards / "index.json").is_file() and any(shards.glob("layer_*.safetensors")), \
        "Soup's shards are not in --cache-dir"
    before = _file_stamps(cache_dir)

    # The second run (batch-2 arms of the same models; the batch test reads it too).
    code, _, err, _, result = once(capfd, tmp_path_factory, cache_dir, "batch2", fresh=True)
    assert code == EXIT_OK, err
    assert "damaged" not in err and "rebuilding" not in err
    assert result["rows"][0]["ran"]["base"] == str(checkpoint)
    # No build time is reported: both checkpoints were cached (the second model's figure
    # must not be the first model's arm, timed while its cached checkpoint sat ready).
    build_s = result["timings"]["build_s"]
    assert all(seconds == 0 for seconds in build_s.values()), build_s
    after = _file_stamps(cache_dir)
    changed = [k for k in before if after.get(k) != before[k]]
    assert changed == [], f"cache files rewritten on a cache hit: {changed[:5]}"


def test_batch_2_dry_run_realises_requested_seq_in_every_row_of_the_batch(
        capfd, cache_dir, tmp_path_factory):
    code, out, err, _, result = once(capfd, tmp_path_factory, cache_dir, "batch2")
    assert code == EXIT_OK, err
    assert [r["model_key"] for r in result["rows"]] == ["smol", "qwen"]
    for row in result["rows"]:
        assert row["batch"] == 2
        assert row["realised_width"] == 64 and row["realised_rows"] == [64, 64]
        assert row["derived"]["realised"] == 64 and row["derived"]["status"] == "dry-run"
    assert [line.split()[:3] for line in table_rows(out, 64)] == [["64", "64", "2"]] * 2


# ---------------------------------------------------------------------------
# --isolate and --determinism run arms in fresh processes
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_isolate_runs_each_arm_in_its_own_fresh_process(capfd, cache_dir, tmp_path_factory):
    code, out, err, _, result = once(capfd, tmp_path_factory, cache_dir, "isolate")
    assert code == EXIT_OK, err
    assert result["environment"]["arms"].startswith("isolated")
    rows = result["rows"]
    assert [(r["seq"], r["realised_width"], r["repeat"]) for r in rows] == [(64, 64, None), (96, 96, None)]
    pids = {r["ran"]["pid"] for r in rows}
    assert len(pids) == 2 and os.getpid() not in pids
    assert [line.split()[:2] for line in table_rows(out, 64) + table_rows(out, 96)] == \
        [["64", "64"], ["96", "96"]]


@pytest.mark.slow
def test_determinism_repeats_an_arm_in_distinct_fresh_processes(capfd, cache_dir, tmp_path_factory):
    code, out, err, _, result = once(capfd, tmp_path_factory, cache_dir, "determinism")
    assert code == EXIT_OK, err
    rows = result["rows"]
    assert [(r["seq"], r["repeat"], r["realised_width"]) for r in rows] == [(64, 1, 64), (64, 2, 64)]
    pids = [r["ran"]["pid"] for r in rows]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    line = next(x for x in out.splitlines() if x.startswith("  SmolLM2-135M seq 64 batch 1: peaks"))
    assert f"pids {pids[0]},{pids[1]}" in line
    assert "--determinism: the same arm in fresh processes" in out
    assert "realised" not in out  # --determinism alone runs no sweep


# ---------------------------------------------------------------------------
# --model: any streamable checkpoint, with figures derived from its config
# ---------------------------------------------------------------------------


def test_model_option_on_a_local_checkpoint_runs_without_record_columns(
        capfd, cache_dir, tmp_path):
    """A small llama checkpoint through --model: Soup's real setup on CPU, realised ==
    requested, the prediction from the figures derived from its config, and no record
    column, since the record never measured a model brought by the user."""
    tiny = replace(SMOL, key="tiny", name="tiny", hidden=64, intermediate=128, n_layers=2,
                   vocab=512, max_positions=1024,
                   arch=dict(SMOL.arch, num_attention_heads=4, num_key_value_heads=2))
    ckpt = tmp_path / "tiny-llama"
    prepare_checkpoint(tiny, ckpt)()
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--dry-run", "--model", ckpt, "--seq", "64",
                                  "--cache-dir", cache_dir, "--json", out_json])
    assert code == EXIT_OK, err
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["model"] == str(ckpt) and row["model_key"] == "custom"
    assert row["realised_width"] == 64 and row["realised_rows"] == [64]
    assert row["predicted"] == predicted_bytes(load_custom_shape(str(ckpt)), 64)
    assert row["record_peak"] is None and row["derived"]["vs_record"] is None
    assert "weights local" in out.splitlines()[0]
    (line,) = table_rows(out, 64)
    cells = line.split()  # seq realised batch predicted n/a (dry run) pred/real A10G vs ...
    assert cells[:3] == ["64", "64", "1"] and cells[4:7] == ["n/a", "(dry", "run)"]
    assert cells[7] == "-" and cells[9] == "-"  # no ratio, nothing to compare to the A10G record
    assert float(cells[8]) > 0  # the corrected estimate, from the checkpoint's own config.json (issue 36 item 11)
