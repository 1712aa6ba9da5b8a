"""A hostile environment: outputs that are links, FIFOs or devices, a disk that fills up at the
last write, a cache damaged between runs, --model folders that are not what they claim, and
runs killed with SIGKILL. Each test pins behaviour the harness before the redesign (146e63c)
lacked, but for the two --model cases it already refused (invalid JSON, a gpt2 config), kept
here with their kin, and the two GPU tests, which pin the measurement itself.

Everything runs on CPU, through the real Soup setup (--dry-run) where a run is needed; the
only fakes are the faults themselves (a full disk, a damaged file). The two tests marked
``cuda`` run only on a GPU box.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import SCRIPT, SMOL, cuda, main, table_rows, dead_pid

from issue395.measure.builder import build_tokenizer, checkpoint_fingerprint, hf_config, safetensors_problem
from issue395.host.checkpoints import checkpoint_problem, synthetic_checkpoint
from issue395.errors import EXIT_OK, EXIT_USAGE
from issue395.model.registry import SHAPES
from issue395.host.scratch import SCRATCH_PREFIX, Scratch

#: A tiny streamable llama (2 layers, vocab 512): a real --model folder in a fraction of a second.
TINY = dataclasses.replace(SMOL, key="tiny", name="tiny", n_layers=2, vocab=512, hidden=64,
                           intermediate=128, max_positions=256, record=False,
                           arch=dict(SMOL.arch, num_attention_heads=4, num_key_value_heads=2))
ENOSPC = (28, "No space left on device")


def listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


@pytest.fixture
def fresh_places(tmp_path, monkeypatch):
    """Call it to make $HOME, the temp dir ($TMPDIR and tempfile.tempdir) and the working
    directory each a fresh empty folder: whatever a run leaves behind then shows up in them.
    (Called after a test's own set-up: a process's first transformers config import leaves
    torch's inductor folder in whatever temp dir is current, harness or not.)"""
    def enter() -> dict[str, Path]:
        places = {name: tmp_path / name for name in ("home", "tmp", "cwd")}
        for p in places.values():
            p.mkdir()
        monkeypatch.setenv("HOME", str(places["home"]))
        monkeypatch.setenv("TMPDIR", str(places["tmp"]))
        monkeypatch.setattr(tempfile, "tempdir", str(places["tmp"]))
        monkeypatch.chdir(places["cwd"])
        return places
    return enter


@pytest.fixture(scope="module")
def smol_built(cache_dir):
    """The session cache's SmolLM2 checkpoint (built once, in this process, by the harness's
    own builder); tests that damage a cache copy it into a private one."""
    return synthetic_checkpoint(SMOL, cache_dir / "checkpoints")[0]


def private_cache(tmp_path: Path, smol_built: Path) -> tuple[Path, Path]:
    """A --cache-dir of this test's own, holding a copy of the built SmolLM2 checkpoint."""
    cache = tmp_path / "cache"
    dest = cache / "checkpoints" / smol_built.name
    shutil.copytree(smol_built, dest)
    return cache, dest


# ---------------------------------------------------------------------------
# write_output never replaces what is not a regular file, and never leaves a temp file
# ---------------------------------------------------------------------------


def test_a_json_output_that_cannot_be_written_exits_2_naming_it_and_where_the_rows_are(
        capfd, cache_dir, tmp_path, monkeypatch, smol_built):
    """The disk fills at the very last write (the final --json): exit 2, one error line that
    names the --json output and the file the rows are kept in, the old --json intact, and no
    temp file left beside it."""
    folder = tmp_path / "outputs"
    folder.mkdir()
    out_json = folder / "out.json"
    out_json.write_text('{"tool": "issue395_second_stack_vram", "old": true}\n')  # an earlier run's
    real_replace = os.replace

    def replace(src, dst, *a, **kw):
        if os.path.realpath(dst) == str(out_json):
            raise OSError(*ENOSPC)
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", replace)
    code, out, err = main(capfd, ["--dry-run", "--models", "smol", "--seq", "64",
                                  "--cache-dir", cache_dir, "--json", out_json])
    assert code == EXIT_USAGE, err
    rows_file = Path(str(out_json) + ".rows.jsonl")
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1, err
    assert f"--json {out_json}" in errors[0] and "No space left on device" in errors[0]
    assert f"the rows are kept in {rows_file}" in errors[0]
    header, row = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert header["row_file"] == 1 and header["environment"]["command"].endswith(f"--json {out_json}")
    assert (row["seq"], row["derived"]["status"]) == (64, "dry-run")
    assert out_json.read_text() == '{"tool": "issue395_second_stack_vram", "old": true}\n'
    assert sorted(p.name for p in folder.iterdir()) == ["out.json", "out.json.rows.jsonl"]
    assert len(table_rows(out, 64)) == 1  # the table was printed before the write


# ---------------------------------------------------------------------------
# A damaged cache is repaired on the next run
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_truncated_cached_checkpoint_is_rebuilt_by_the_next_run(capfd, tmp_path, smol_built):
    cache, dest = private_cache(tmp_path, smol_built)
    weights = dest / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    code, out, err = main(capfd, ["--dry-run", "--models", "smol", "--seq", "64",
                                  "--cache-dir", cache])
    assert code == EXIT_OK, err
    assert table_rows(out, 64)[0].split()[-1] == "dry-run"
    assert checkpoint_problem(dest) is None
    assert weights.stat().st_size == (smol_built / "model.safetensors").stat().st_size
    assert sorted(p.name for p in dest.parent.iterdir()) == [dest.name]
    # The user is told what was damaged and that it was rebuilt.
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert any(str(dest) in line and "model.safetensors" in line for line in notes), err


@pytest.mark.slow
@pytest.mark.release
def test_damaged_soup_shards_are_removed_and_sharded_again(capfd, tmp_path, smol_built):
    """Soup checks only that its shard files exist; a truncated one would fail the arm."""
    cache, dest = private_cache(tmp_path, smol_built)
    argv = ["--dry-run", "--models", "smol", "--seq", "64", "--cache-dir", cache]
    code, out, first_err = main(capfd, argv)  # a fresh cache: Soup shards the checkpoint
    assert code == EXIT_OK, first_err
    (shards,) = [p for p in (cache / "layer-stream").iterdir() if p.is_dir()]
    layer = shards / "layer_001.safetensors"
    os.truncate(layer, layer.stat().st_size // 2)
    assert safetensors_problem(layer) is not None

    code, out, err = main(capfd, argv)
    assert code == EXIT_OK, err
    assert table_rows(out, 64)[0].split()[-1] == "dry-run"
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and str(shards) in notes[0] and "layer_001.safetensors" in notes[0]
    assert all(safetensors_problem(f) is None for f in shards.glob("*.safetensors"))
    assert (shards / "index.json").is_file()
    # A fresh cache is not damaged: its first run must not say so.
    assert "damaged" not in first_err, first_err


@pytest.mark.slow
def test_a_half_built_checkpoint_left_by_a_killed_run_is_removed_by_the_next_run(
        capfd, tmp_path, smol_built):
    """A run killed while building leaves ``.<model>-<fp>.partial-<pid>`` in --cache-dir
    (SIGKILL runs no clean-up); the next run removes it, and leaves one whose builder still
    runs."""
    cache, dest = private_cache(tmp_path, smol_built)
    qwen = f"qwen-{checkpoint_fingerprint(SHAPES['qwen'])}"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        dead_partial = dest.parent / f".{qwen}.partial-{dead_pid()}"
        live_partial = dest.parent / f".{qwen}.partial-{live.pid}"
        for partial in (dead_partial, live_partial):
            partial.mkdir()
            (partial / "config.json").write_text("{}")
        code, out, err = main(capfd, ["--dry-run", "--models", "smol", "--seq", "64",
                                      "--cache-dir", cache])
        assert code == EXIT_OK, err
        assert live_partial.is_dir()
        assert sorted(p.name for p in dest.parent.iterdir()) == sorted([dest.name, live_partial.name])
    finally:
        live.kill()
        live.wait()


# ---------------------------------------------------------------------------
# --model: a folder that is not what it claims is refused in one line, leaving nothing
# ---------------------------------------------------------------------------


def _model_folder(dest: Path, config_change=None, config_text=None, tokenizer=True) -> Path:
    """config.json of TINY, one tiny safetensors file and the harness's own tokenizer; then
    one thing made wrong."""
    import torch
    from safetensors.torch import save_file

    dest.mkdir(parents=True)
    ids = build_tokenizer(dest) if tokenizer else {"<|im_end|>": 1, "<|endoftext|>": 0}
    hf_config(TINY, eos_id=ids["<|im_end|>"], pad_id=ids["<|endoftext|>"]).save_pretrained(str(dest))
    config = json.loads((dest / "config.json").read_text())
    if config_change:
        config_change(config)
    (dest / "config.json").write_text(config_text if config_text is not None else json.dumps(config))
    save_file({"model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}, str(dest / "model.safetensors"))
    return dest


BAD_MODELS = {
    "vocab-negative": (dict(config_change=lambda c: c.update(vocab_size=-1)), "vocab_size"),
    "vocab-zero": (dict(config_change=lambda c: c.update(vocab_size=0)), "vocab_size"),
    "no-layers": (dict(config_change=lambda c: c.update(num_hidden_layers=0)), "num_hidden_layers"),
    "vocab-missing": (dict(config_change=lambda c: c.pop("vocab_size")), "vocab_size"),
    "hidden-missing": (dict(config_change=lambda c: c.pop("hidden_size")), "hidden_size"),
    "invalid-json": (dict(config_text='{"model_type": "llama", '), "config.json"),
    "nested-too-deep": (dict(config_text="[" * 100_000 + "]" * 100_000), "config.json"),
    "vocab-too-large": (dict(config_change=lambda c: c.update(vocab_size=10 ** 30)), "vocab_size"),
    "gpt2": (dict(config_change=lambda c: c.update(model_type="gpt2")), "cannot be layer-streamed"),
    "no-tokenizer": (dict(tokenizer=False), "no tokenizer"),
}


@pytest.mark.parametrize("case", list(BAD_MODELS))
def test_a_bad_model_folder_exits_2_in_one_line_and_leaves_nothing(capfd, tmp_path, fresh_places, case):
    build, fragment = BAD_MODELS[case]
    folder = _model_folder(tmp_path / "model" / case, **build)
    assert safetensors_problem(folder / "model.safetensors") is None
    places = fresh_places()
    code, out, err = main(capfd, ["--dry-run", "--model", folder, "--seq", "64"])
    assert code == EXIT_USAGE, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0] and str(folder) in lines[0]
    assert "Traceback" not in out + err
    for name, place in places.items():
        assert listing(place) == set(), f"left behind in {name}"


# ---------------------------------------------------------------------------
# A killed run's scratch is reaped by the next run; a running run's is not touched
# ---------------------------------------------------------------------------


def test_a_sigkilled_run_leaves_scratch_that_the_next_run_removes(tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--dry-run", "--models", "smol", "--seq", "64"],
                            env=dict(os.environ, TMPDIR=str(tmp)), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        folders: list[Path] = []
        while time.monotonic() < deadline and proc.poll() is None:
            folders = [p for p in tmp.glob(f"{SCRATCH_PREFIX}{proc.pid}-*")
                       if len((p / "owner").read_text().split() if (p / "owner").is_file() else []) == 2]
            if folders:
                break
            time.sleep(0.02)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the run and anything it started: no clean-up
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    (left,) = folders
    assert left.is_dir()  # SIGKILL ran no clean-up

    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with Scratch() as s:
        assert not left.exists()
    assert list(tmp.iterdir()) == []
    assert not s.root.exists()


# ---------------------------------------------------------------------------
# On the GPU box: the real step
# ---------------------------------------------------------------------------


@cuda
def test_smollm2_at_2048_is_realised_2048_and_predicted_at_or_above_its_real_peak(
        capfd, cache_dir, tmp_path):
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--models", "smol", "--seq", "2048", "--cache-dir", cache_dir,
                                  "--json", out_json])
    assert code == EXIT_OK, err
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["realised_width"] == 2048 and row["realised_rows"] == [2048]
    assert row["real_peak"] > 0 and row["predicted"] >= row["real_peak"]
    assert row["derived"]["status"] == "ok" and row["derived"]["pred_over_real"] >= 1.0


@cuda
def test_a_second_in_process_arm_peaks_as_the_same_arm_in_a_fresh_process(capfd, cache_dir, tmp_path):
    """Nothing the first arm leaves in the process (allocator blocks, cuBLAS workspaces) may
    show in the second arm's peak: it equals the same arm run alone, to the byte."""
    in_process, isolated = tmp_path / "in-process.json", tmp_path / "isolated.json"
    code, out, err = main(capfd, ["--models", "smol", "--seq", "2048,3072", "--cache-dir", cache_dir,
                                  "--json", in_process])
    assert code == EXIT_OK, err
    code, out, err = main(capfd, ["--isolate", "--models", "smol", "--seq", "3072",
                                  "--cache-dir", cache_dir, "--json", isolated])
    assert code == EXIT_OK, err
    second = [r for r in json.loads(in_process.read_text())["rows"] if r["seq"] == 3072]
    alone = [r for r in json.loads(isolated.read_text())["rows"] if r["seq"] == 3072]
    assert len(second) == len(alone) == 1
    assert second[0]["pid"] == os.getpid() and alone[0]["pid"] != os.getpid()
    assert second[0]["real_peak"] == alone[0]["real_peak"]
