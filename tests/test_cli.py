"""The command line end to end: real Soup setups on CPU through --dry-run, bad input,
the CUDA-required exit, fresh-process modes, the checkpoint cache and --help.

Every arm here is a real ``SFTTrainerWrapper(config).setup`` with transformers, TRL,
PEFT and torch on CPU; nothing is faked in this file. Most runs call ``h.main`` in
process (the imports are paid once); the few that must prove what a real terminal
sees run as fresh processes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import issue395_second_stack_vram as h  # noqa: E402

SOUP_CONSOLE_TEXT = ("Layer streaming", "LoRA applied", "Preparing layer shards",
                     "Loading tokenizer", "chat_template override", "Map:", "Truncating",
                     "\u256d", "\u2502", "\u2570")


def main(capfd, argv):
    """h.main in process; returns (exit code, stdout, stderr) as the fds saw them."""
    code = h.main([str(a) for a in argv])
    out, err = capfd.readouterr()
    return code, out, err


def err_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def table_rows(out: str, seq: int) -> list[str]:
    return [line for line in out.splitlines() if line.split()[:1] == [str(seq)]]


# ---------------------------------------------------------------------------
# 1. A real dry run of both models
# ---------------------------------------------------------------------------


def test_dry_run_both_models_realises_requested_seq_and_keeps_soup_text_off_stdout(
        capfd, cache_dir, tmp_path):
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--dry-run", "--seq", "128", "--cache-dir", cache_dir,
                                  "--json", out_json])
    assert code == h.EXIT_OK, err
    result = json.loads(out_json.read_text())
    rows = result["rows"]
    assert [r["model_key"] for r in rows] == ["smol", "qwen"]
    for r in rows:
        assert r["realised"] == r["seq"] == 128
        assert r["realised_rows"] == [128]
        assert r["status"] == "dry-run" and r["real_peak"] is None and r["error"] is None

    # One row per model, under that model's heading, realised 128, no peak.
    lines = out.splitlines()
    smol_at = next(i for i, l in enumerate(lines) if l.startswith("SmolLM2-135M  (predicted"))
    qwen_at = next(i for i, l in enumerate(lines) if l.startswith("Qwen2.5-0.5B  (predicted"))
    printed = table_rows(out, 128)
    assert len(printed) == 2
    for line in printed:
        assert line.split()[:3] == ["128", "128", "1"]
        assert "n/a (dry run)" in line
    assert smol_at < lines.index(printed[0]) < qwen_at < lines.index(printed[1])

    # Soup's panels, bars and banners went to the per-arm log, not the console.
    for text in SOUP_CONSOLE_TEXT:
        assert text not in out, f"Soup console text {text!r} reached stdout"
        assert text not in err, f"Soup console text {text!r} reached stderr"
    assert all(line.startswith("[arm ") for line in err_lines(err)), err

    header = lines[0]
    assert header.startswith("stack: ")
    for label, dist in (("torch", "torch"), ("transformers", "transformers"), ("trl", "trl"),
                        ("peft", "peft"), ("soup-cli", "soup-cli")):
        assert f"{label} {metadata.version(dist)}" in header
    assert "weights synthetic" in header


# ---------------------------------------------------------------------------
# 3. CUDA required (a fresh process: what a terminal sees)
# ---------------------------------------------------------------------------


def test_real_run_without_cuda_exits_2_with_one_line_naming_cuda_and_dry_run(run_cli, tmp_path):
    """CUDA_VISIBLE_DEVICES='' hides any GPU, so this holds on a GPU box too."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = run_cli(["--models", "smol", "--seq", "64"], cwd=tmp_path, env=env)
    assert proc.returncode == h.EXIT_USAGE
    lines = err_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert "CUDA" in lines[0] and "--dry-run" in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_unknown_option_exits_2_with_one_line_in_a_fresh_process(run_cli, tmp_path):
    proc = run_cli(["--frobnicate"], cwd=tmp_path, timeout=60)
    assert proc.returncode == h.EXIT_USAGE
    lines = err_lines(proc.stderr)
    assert len(lines) == 1 and "--frobnicate" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "usage:" not in proc.stderr


# ---------------------------------------------------------------------------
# 5. Bad input: exit 2, one line naming the problem, no traceback
# ---------------------------------------------------------------------------


def _gpt2_folder(root: Path) -> Path:
    """A config of an architecture Soup cannot stream, with a (dummy) safetensors file."""
    from safetensors.torch import save_file
    import torch
    from transformers import GPT2Config

    folder = root / "gpt2-tiny"
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=256,
               bos_token_id=0, eos_token_id=0).save_pretrained(folder)
    save_file({"wte.weight": torch.zeros(128, 32)}, str(folder / "model.safetensors"))
    return folder


def _no_config_folder(root: Path) -> Path:
    folder = root / "no-config"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    return folder


BAD_INPUT = [
    # id, argv (with {tmp} for the test's folder), words the error line must hold
    ("seq-zero", ["--dry-run", "--seq", "0"], ["--seq", "0", "at least 1"]),
    ("seq-negative", ["--dry-run", "--seq", "-5"], ["--seq", "-5", "at least 1"]),
    ("seq-word", ["--dry-run", "--seq", "abc"], ["--seq", "'abc'", "whole number"]),
    ("seq-float", ["--dry-run", "--seq", "1e3"], ["--seq", "'1e3'", "whole number"]),
    ("seq-empty", ["--dry-run", "--seq", ""], ["--seq", "empty"]),
    ("seq-empty-item", ["--dry-run", "--seq", "2048,,4096"], ["--seq", "empty"]),
    ("seq-beyond-max-positions", ["--dry-run", "--seq", "40000", "--models", "smol"],
     ["40000", "SmolLM2-135M", "8192"]),
    ("models-unknown", ["--dry-run", "--models", "foo"], ["--models", "'foo'", "smol,qwen"]),
    ("models-empty", ["--dry-run", "--models", ""], ["--models", "empty", "smol,qwen"]),
    ("batch-zero", ["--dry-run", "--batch", "0"], ["--batch", "0", "at least 1"]),
    ("batch-word", ["--dry-run", "--batch", "x"], ["--batch", "'x'", "whole number"]),
    ("gpus-absent", ["--gpus", "7", "--dry-run"], ["--gpus", "GPU 7", "not there"]),
    ("json-missing-folder", ["--dry-run", "--json", "/nonexistent/dir/out.json"],
     ["--json", "/nonexistent/dir", "does not exist"]),
    ("markdown-missing-folder", ["--dry-run", "--markdown", "{tmp}/missing/out.md"],
     ["--markdown", "missing", "does not exist"]),
    ("plot-under-a-file", ["--dry-run", "--plot", "{tmp}/a-file/plot.png"],
     ["--plot", "a-file", "does not exist"]),
    ("weights-hub-offline", ["--weights", "hub", "--dry-run", "--models", "smol", "--seq", "64"],
     ["HuggingFaceTB/SmolLM2-135M", "--weights synthetic", "no network"]),
    ("model-missing-path", ["--dry-run", "--model", "/nonexistent/path", "--seq", "64"],
     ["--model", "/nonexistent/path"]),
    ("model-unstreamable-arch", ["--dry-run", "--model", "{gpt2}", "--seq", "64"],
     ["gpt2", "cannot be layer-streamed"]),
    ("model-no-config", ["--dry-run", "--model", "{noconfig}", "--seq", "64"],
     ["--model", "no config.json"]),
    ("plot-not-png", ["--dry-run", "--plot", "{tmp}/plot.txt"], ["--plot", ".png"]),
    ("seq-named-twice", ["--dry-run", "--seq", "64,64"], ["--seq", "64", "twice"]),
    ("models-named-twice", ["--dry-run", "--models", "smol,smol"], ["--models", "twice"]),
    ("compare-missing", ["--from-json", "{tmp}/a-file", "--compare", "{tmp}/nope.json"],
     ["--"]),
    ("model-hub-id-offline", ["--dry-run", "--model", "nobody-here/no-such-model", "--seq", "64"],
     ["--model", "nobody-here/no-such-model"]),
]


def _marks(case_id):
    if case_id == "gpus-absent":
        import torch

        return [pytest.mark.skipif(torch.cuda.device_count() > 7, reason="GPU 7 exists here")]
    return []


@pytest.mark.parametrize("argv, words",
                         [pytest.param(a, w, id=i, marks=_marks(i)) for i, a, w in BAD_INPUT])
def test_bad_input_exits_2_with_one_line_naming_the_problem(capfd, tmp_path, argv, words):
    (tmp_path / "a-file").write_text("not a folder\n")
    subs = {"{tmp}": str(tmp_path)}
    if "{gpt2}" in argv:
        subs["{gpt2}"] = str(_gpt2_folder(tmp_path))
    if "{noconfig}" in argv:
        subs["{noconfig}"] = str(_no_config_folder(tmp_path))
    for key, value in subs.items():
        argv = [a.replace(key, value) for a in argv]
    capfd.readouterr()
    started = time.perf_counter()
    code, out, err = main(capfd, argv)
    assert time.perf_counter() - started < 60  # the hub case must fail fast, not hang
    assert code == h.EXIT_USAGE
    lines = err_lines(err)
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert "Traceback" not in out + err


def test_seq_with_a_non_ascii_digit_is_a_usage_error_not_a_traceback(capfd):
    """'\u00b2'.isdigit() is True but int() rejects it: it must still be one usage line."""
    code, out, err = main(capfd, ["--dry-run", "--seq", "\u00b2"])
    assert code == h.EXIT_USAGE
    lines = err_lines(err)
    assert len(lines) == 1 and "whole number" in lines[0], err
    assert "Traceback" not in out + err


# ---------------------------------------------------------------------------
# 7. Batch 2: every row of the batch realises the requested seq
# ---------------------------------------------------------------------------


def test_batch_2_dry_run_realises_requested_seq_in_every_row_of_the_batch(
        capfd, cache_dir, tmp_path):
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--batch", "2", "--dry-run", "--models", "smol", "--seq", "128",
                                  "--cache-dir", cache_dir, "--json", out_json])
    assert code == h.EXIT_OK, err
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["batch"] == 2
    assert row["realised_rows"] == [128, 128]
    assert row["realised"] == 128 and row["status"] == "dry-run"
    assert table_rows(out, 128)[0].split()[:3] == ["128", "128", "2"]


# ---------------------------------------------------------------------------
# 8. --isolate and --determinism run arms in fresh processes
# ---------------------------------------------------------------------------


def test_isolate_runs_each_arm_in_its_own_fresh_process(capfd, cache_dir, tmp_path):
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--dry-run", "--isolate", "--models", "smol", "--seq", "64,96",
                                  "--cache-dir", cache_dir, "--json", out_json])
    assert code == h.EXIT_OK, err
    result = json.loads(out_json.read_text())
    rows = result["rows"]
    assert [(r["seq"], r["realised"]) for r in rows] == [(64, 64), (96, 96)]
    pids = {r["pid"] for r in rows}
    assert len(pids) == 2 and os.getpid() not in pids
    assert result["environment"]["isolation"].startswith("isolated")


def test_determinism_repeats_an_arm_in_distinct_fresh_processes(capfd, cache_dir, tmp_path):
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--dry-run", "--determinism", "2", "--models", "smol",
                                  "--seq", "64", "--cache-dir", cache_dir, "--json", out_json])
    assert code == h.EXIT_OK, err
    det = json.loads(out_json.read_text())["determinism"]
    assert det["repeats"] == 2
    (arm,) = det["arms"]
    assert arm["seq"] == 64
    assert len(arm["pids"]) == 2 and len(set(arm["pids"])) == 2
    assert os.getpid() not in arm["pids"]
    assert [r["realised"] for r in arm["rows"]] == [64, 64]
    assert "--determinism" in out


# ---------------------------------------------------------------------------
# 9. --cache-dir
# ---------------------------------------------------------------------------


def _file_stamps(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_second_run_with_the_same_cache_dir_reuses_checkpoint_and_shards(
        capfd, cache_dir, tmp_path):
    argv = ["--dry-run", "--models", "smol", "--seq", "64", "--cache-dir", cache_dir, "--json"]
    code, _, err = main(capfd, argv + [tmp_path / "first.json"])
    assert code == h.EXIT_OK, err
    before = _file_stamps(cache_dir)
    checkpoint = cache_dir / "checkpoints" / f"smol-{h.checkpoint_fingerprint(h.SHAPES['smol'])}"
    assert (checkpoint / ".complete").is_file() and (checkpoint / "model.safetensors").is_file()
    assert any(k.startswith("layer-stream") for k in before), "Soup's shards not in --cache-dir"

    code, _, err = main(capfd, argv + [tmp_path / "second.json"])
    assert code == h.EXIT_OK, err
    (row,) = json.loads((tmp_path / "second.json").read_text())["rows"]
    assert row["timings"]["build_s"] == 0
    assert row["realised"] == row["seq"] == 64
    after = _file_stamps(cache_dir)
    changed = [k for k in before if after.get(k) != before[k]]
    assert changed == [], f"cache files rewritten on a cache hit: {changed[:5]}"


def test_cache_dir_outside_home_cwd_and_temp_dir_is_refused_and_not_created(capfd):
    """Soup would silently ignore it and shard into ~/.soup: refused before anything runs,
    and the refused folder is not left behind."""
    target = Path(f"/opt/issue395-cache-test-{os.getpid()}")
    if not os.access("/opt", os.W_OK):
        pytest.skip("/opt is not writable here")
    try:
        code, out, err = main(capfd, ["--dry-run", "--models", "smol", "--seq", "64",
                                      "--cache-dir", target])
        assert code == h.EXIT_USAGE
        lines = err_lines(err)
        assert len(lines) == 1 and "--cache-dir" in lines[0] and "~/.soup" in lines[0], err
        assert "Traceback" not in out + err
        assert not target.exists()
    finally:
        shutil.rmtree(target, ignore_errors=True)




# ---------------------------------------------------------------------------
# 10. --help
# ---------------------------------------------------------------------------


def test_help_documents_exit_codes_0_1_2_and_130(capsys):
    with pytest.raises(SystemExit) as stop:
        h.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    section = out[out.index("exit codes:"):]
    codes = [line.split()[0] for line in section.splitlines()[1:]
             if line.startswith("  ") and line.split()[0].isdigit()]
    assert codes == ["0", "1", "2", "130"]
    for word in ("VOID", "OOM", "FAILED", "UNDER", "usage error", "interrupted"):
        assert word in section


# ---------------------------------------------------------------------------
# 11. --model: any streamable checkpoint, with figures derived from its config
# ---------------------------------------------------------------------------


def test_model_option_derives_the_grid_figures_and_runs_the_protocol_without_a_record(
        capfd, cache_dir, tmp_path):
    """A local checkpoint through --model: Soup's real setup on CPU, realised == requested,
    the prediction from the derived figures (equal to the grid's for this shape), and no
    record column, since the record never measured a model brought by the user."""
    ckpt, _ = h.synthetic_checkpoint(h.SHAPES["smol"], Path(cache_dir) / "checkpoints")
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--dry-run", "--model", ckpt, "--seq", "64",
                                  "--cache-dir", cache_dir, "--json", out_json])
    assert code == h.EXIT_OK, err
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["model"] == str(ckpt) and row["model_key"] == "custom"
    assert row["realised"] == 64 and row["realised_rows"] == [64]
    assert row["predicted"] == h.predicted_bytes(h.SHAPES["smol"], 64)
    assert row["record_a10g_peak"] is None and row["vs_record"] is None
    assert "weights local" in out.splitlines()[0]
