"""Faults during a sweep: the guard, OOM, a failing Soup setup, Ctrl-C, teardown errors,
UNDER, a crash mid-sweep, a child process that dies, a usage error after rows, and what a
run leaves behind.

Every arm is a real Soup setup (``SFTTrainerWrapper(config).setup``) on CPU. Where a test
needs a measured peak, only the CUDA step is faked (``fake_cuda``: Soup builds the arm on
CPU through ``h.STEP_DEVICE`` and ``h.real_peak`` is a ``FakeStep``); each such test says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
from conftest import SMOL, h, main, safe_peak, send_ctrl_c, short_chat_rows, table_rows

from issue395.host import checkpoints, spread
from issue395.measure.builder import checkpoint_fingerprint
from issue395.host.checkpoints import synthetic_checkpoint
from issue395.measure.console import Progress
from issue395.errors import EXIT_FINDING, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError
from issue395.model.arm import predicted_bytes

GIB = 2 ** 30
#: A tiny streamable llama (2 layers, vocab 512) for runs that need no protocol shape.
TINY = dataclasses.replace(SMOL, key="tiny", name="tiny", n_layers=2, vocab=512, hidden=64,
                           intermediate=128, max_positions=256, record=False,
                           arch=dict(SMOL.arch, num_attention_heads=4, num_key_value_heads=2))


@pytest.fixture(scope="module", autouse=True)
def smol_built(cache_dir):
    """The session cache's SmolLM2 checkpoint, built once in this process by the harness's own
    builder (the same call its --_build child makes), so no test here waits on a fresh
    builder process. Returns its folder."""
    return synthetic_checkpoint(SMOL, cache_dir / "checkpoints")[0]


def rows_of(path: Path) -> list[dict]:
    return json.loads(path.read_text())["rows"]


def status(row: dict) -> str:
    return row["derived"]["status"]


# ---------------------------------------------------------------------------
# The guard: a row that tokenizes short is VOID
# ---------------------------------------------------------------------------


def test_row_that_tokenizes_short_is_void_in_a_dry_run_and_exits_1(
        capfd, cache_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(h, "chat_rows", short_chat_rows({128}))
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--dry-run", "--models", "smol", "--seq", "128",
                                  "--cache-dir", cache_dir, "--json", out_json])
    assert code == EXIT_FINDING, err
    (row,) = rows_of(out_json)
    assert status(row) == "VOID"
    assert 64 <= row["derived"]["realised"] < 128  # Soup really ran it at its own, shorter length
    assert row["realised_width"] == row["derived"]["realised"]
    (line,) = table_rows(out, 128)
    assert line.split()[1] == str(row["derived"]["realised"])
    assert line.count("VOID") == 5  # pred/real, corr/real, vs A10G, over-est: no ratio; and the status
    assert "VOID - realised" in out


def test_void_row_is_never_measured_and_gets_no_ratio(capfd, cache_dir, tmp_path, monkeypatch,
                                                      fake_cuda):
    """Fakes the CUDA step only: the good row's step runs, the void row's never does."""
    monkeypatch.setattr(h, "chat_rows", short_chat_rows({128}))
    step = fake_cuda()
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--models", "smol", "--seq", "64,128", "--cache-dir", cache_dir,
                                  "--json", out_json])
    assert code == EXIT_FINDING, err
    assert step.calls == [64]  # the seam is live, and the void row was never stepped
    good, void = rows_of(out_json)
    assert status(good) == "ok" and good["real_peak"] == safe_peak(64)
    assert good["derived"]["pred_over_real"] == pytest.approx(1.25, rel=1e-6)
    assert status(void) == "VOID"
    assert void["real_peak"] is None and void["resident"] is None
    for key in ("pred_over_real", "nonlogits_overestimate", "retained_copy_would_fit", "vs_record"):
        assert void["derived"][key] is None, key
    (line,) = table_rows(out, 128)
    assert line.split()[5] == "VOID"
    assert "1.250x" in table_rows(out, 64)[0]


# ---------------------------------------------------------------------------
# Faults during a sweep
# ---------------------------------------------------------------------------


def test_oom_on_one_arm_is_recorded_with_its_request_and_the_sweep_goes_on(
        capfd, cache_dir, tmp_path, fake_cuda):
    """Fakes the CUDA step only: it raises torch's own OOM on the first of two arms."""
    import torch

    step = fake_cuda(raises={64: torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 4 GiB")})
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--models", "smol", "--seq", "64,80", "--cache-dir", cache_dir,
                                  "--json", out_json])
    assert code == EXIT_FINDING, err
    assert step.calls == [64, 80]
    oom, last = rows_of(out_json)
    assert (oom["seq"], status(oom), oom["failure"]) == (64, "OOM", "OOM")
    assert oom["real_peak"] is None and oom["derived"]["pred_over_real"] is None
    assert oom["oom_request"] == int(1.5 * GIB)
    assert oom["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert oom["ran"]["teardown_error"] is None  # the arm was torn down and the next one ran
    assert status(last) == "ok" and last["real_peak"] == safe_peak(80)
    assert table_rows(out, 64)[0].split()[4] == "OOM"
    assert f"(asked for {1.5 * GIB / 1e9:.2f} GB)" in out


def test_soup_setup_failure_is_a_failed_row_with_its_last_line_and_the_sweep_goes_on(
        capfd, cache_dir, tmp_path, monkeypatch):
    from soup_cli.trainer.sft import SFTTrainerWrapper

    real_setup = SFTTrainerWrapper.setup

    def setup(self, *a, **kw):
        if self.config.data.max_length == 64:
            raise RuntimeError("shard store broke\nno space left on the pinned pool")
        return real_setup(self, *a, **kw)

    monkeypatch.setattr(SFTTrainerWrapper, "setup", setup)
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--dry-run", "--models", "smol", "--seq", "64,80",
                                  "--cache-dir", cache_dir, "--json", out_json])
    assert code == EXIT_FINDING, err
    rows = rows_of(out_json)
    assert [(r["seq"], status(r)) for r in rows] == [(64, "FAILED"), (80, "dry-run")]
    assert rows[0]["error"] == "RuntimeError: no space left on the pinned pool"
    assert [r["derived"]["realised"] for r in rows] == [None, 80]
    assert "FAILED - RuntimeError: no space left on the pinned pool" in out


def test_ctrl_c_stops_after_the_arm_in_flight_saves_rows_and_exits_130(
        capfd, cache_dir, tmp_path, fake_cuda):
    """Fakes the CUDA step only: arm 1's step delivers a real SIGINT to this process."""
    step = fake_cuda(actions={64: send_ctrl_c})
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--models", "smol", "--seq", "64,96", "--cache-dir", cache_dir,
                                  "--json", out_json])
    assert code == EXIT_INTERRUPTED, err
    assert step.calls == [64]  # arm 2 never started
    result = json.loads(out_json.read_text())
    assert result["interrupted"] is True and result["exit_code"] == 130
    (row,) = result["rows"]
    assert row["seq"] == 64 and status(row) == "ok" and row["real_peak"] == safe_peak(64)
    assert len(table_rows(out, 64)) == 1 and table_rows(out, 96) == []
    assert "interrupted: 1 row(s) measured before the stop" in out
    assert not Path(str(out_json) + ".rows.jsonl").exists()  # the final JSON holds the row


def test_teardown_error_is_recorded_and_never_replaces_the_measurement(
        capfd, cache_dir, tmp_path, monkeypatch, fake_cuda):
    """Fakes the CUDA step only; Soup's real _close_stream_runtime runs, then raises."""
    from soup_cli.trainer.sft import SFTTrainerWrapper

    real_close = SFTTrainerWrapper._close_stream_runtime

    def close(self, *a, **kw):
        real_close(self, *a, **kw)
        raise OSError("pinned store still mapped")

    monkeypatch.setattr(SFTTrainerWrapper, "_close_stream_runtime", close)
    fake_cuda()
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--models", "smol", "--seq", "64", "--cache-dir", cache_dir,
                                  "--json", out_json])
    assert code == EXIT_OK, err
    (row,) = rows_of(out_json)
    assert status(row) == "ok" and row["error"] is None and row["failure"] is None
    assert row["real_peak"] == safe_peak(64)
    assert row["ran"]["teardown_error"] == "OSError: pinned store still mapped"
    assert "teardown error (measurement kept): OSError: pinned store still mapped" in out


def test_steps_runs_that_many_optimizer_steps_on_enough_rows_and_says_so(capfd, cache_dir, tmp_path, fake_cuda):
    """--steps 3 (fakes the CUDA peak only): the step is asked for 3, Soup's dataloader has rows for
    3 batches in its one epoch, and the header names the steps (the protocol's 1 is implied)."""
    step = fake_cuda()
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--models", "smol", "--seq", "64", "--batch", "2", "--steps", "3",
                                  "--cache-dir", cache_dir, "--json", out_json])
    assert code == 0, err
    assert step.steps == [3]
    assert "3 optimizer steps per arm" in out.splitlines()[0]
    assert json.loads(out_json.read_text())["environment"]["steps"] == 3
    assert h.rows_for_batch(2, 3) * 0.9 >= 6 > h.rows_for_batch(2, 1) * 0.9


def test_peak_above_the_prediction_is_under_and_exits_1(capfd, cache_dir, tmp_path, fake_cuda):
    """Fakes the CUDA peak only: 1.25x the prediction."""
    predicted = predicted_bytes(SMOL, 64)
    fake_cuda(peaks={64: int(predicted * 1.25)})
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--models", "smol", "--seq", "64", "--cache-dir", cache_dir,
                                  "--json", out_json])
    assert code == EXIT_FINDING, err
    (row,) = rows_of(out_json)
    assert status(row) == "UNDER"
    assert row["derived"]["pred_over_real"] == pytest.approx(0.8, rel=1e-6)
    (line,) = table_rows(out, 64)
    assert line.split()[-1] == "UNDER" and "0.800x" in line


def test_crash_mid_sweep_prints_and_saves_the_rows_finished_before_it(
        capfd, cache_dir, tmp_path, monkeypatch, fake_cuda):
    """Fakes the CUDA step only. A harness error escapes the arm loop as arm 2 of 3 starts:
    exit 1, one error line and no traceback on the console, and --json holds the finished
    row and the error."""
    fake_cuda()
    real_measure_arm = h.measure_arm

    def measure_arm(arm, *a, **kw):
        if arm.seq == 80:
            raise RuntimeError("harness bug mid-sweep")
        return real_measure_arm(arm, *a, **kw)

    monkeypatch.setattr(h, "measure_arm", measure_arm)
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--models", "smol", "--seq", "64,80,96", "--cache-dir",
                                  cache_dir, "--json", out_json])
    assert code == EXIT_FINDING
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == ["error: the harness failed after 1 row(s): RuntimeError: harness bug mid-sweep"]
    assert "Traceback" not in out + err
    result = json.loads(out_json.read_text())
    assert result["error"] == "RuntimeError: harness bug mid-sweep"
    assert result["exit_code"] == EXIT_FINDING
    assert [(r["seq"], status(r), r["real_peak"]) for r in result["rows"]] == [
        (64, "ok", safe_peak(64))]
    assert len(table_rows(out, 64)) == 1 and table_rows(out, 80) == table_rows(out, 96) == []


def test_a_row_whose_progress_line_crashes_is_still_in_the_saved_json(
        capfd, cache_dir, tmp_path, monkeypatch, fake_cuda):
    """Fakes the CUDA step only. Arm 1 of 2 finishes (it is already kept) and then its
    progress line crashes: the saved --json must not lose that row."""
    step = fake_cuda()
    real_arm = Progress.arm

    def arm(self, row):
        real_arm(self, row)
        raise RuntimeError("progress crashed")

    monkeypatch.setattr(Progress, "arm", arm)
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--models", "smol", "--seq", "64,80", "--cache-dir", cache_dir,
                                  "--json", out_json])
    assert code == EXIT_FINDING
    assert step.calls == [64]
    result = json.loads(out_json.read_text())
    assert result["error"] == "RuntimeError: progress crashed"
    assert [(r["seq"], status(r)) for r in result["rows"]] == [(64, "ok")]
    assert len(table_rows(out, 64)) == 1


# ---------------------------------------------------------------------------
# A child process that dies is never a silent gap
# ---------------------------------------------------------------------------


def _killed_at_start(monkeypatch, tmp_path):
    """Every child dies at start-up, before it can report (exit 139, as a segfault would):
    a sitecustomize on the children's PYTHONPATH. Nothing in the harness is faked."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nif 'ISSUE395_CHILD_JOB' in os.environ:\n    os._exit(139)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    return 139


def _unreadable_job(monkeypatch, tmp_path):
    """Every child is handed a job file it cannot read: it exits 2 without a row."""
    monkeypatch.setattr(spread, "write_job", lambda path, run, job: path.write_text("{not json"))
    return 2


@pytest.mark.slow
@pytest.mark.parametrize("death", [_killed_at_start, _unreadable_job], ids=["killed", "refused"])
def test_a_child_that_dies_leaves_a_failed_row_for_each_arm_and_exits_1(
        capfd, cache_dir, tmp_path, monkeypatch, death):
    code_of_child = death(monkeypatch, tmp_path)
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--dry-run", "--isolate", "--models", "smol", "--seq", "64,96",
                                  "--cache-dir", cache_dir, "--json", out_json])
    assert code == EXIT_FINDING, err
    rows = rows_of(out_json)
    assert [(r["seq"], status(r)) for r in rows] == [(64, "FAILED"), (96, "FAILED")]
    for r in rows:
        assert f"exited with code {code_of_child}" in r["error"]
        assert r["real_peak"] is None and r["derived"]["pred_over_real"] is None
    assert out.count(f"exited with code {code_of_child}") == 2
    assert [line.split()[-1] for line in table_rows(out, 64) + table_rows(out, 96)] == ["FAILED"] * 2


# ---------------------------------------------------------------------------
# A usage error after rows keeps them
# ---------------------------------------------------------------------------


def _hub_reaches_smol_only(monkeypatch, smol_built):
    """--weights hub where the hub serves SmolLM2 (the harness's own synthetic checkpoint
    stands in for the download) and is unreachable for Qwen: the harness's own refusal."""
    def hub_snapshot(repo_id, scratch):
        if repo_id == SMOL.hub_id:
            return smol_built
        raise UsageError(f"cannot fetch {repo_id} from the hub (ConnectionError: offline); "
                           "--weights synthetic builds the same shapes with no network")

    monkeypatch.setattr(checkpoints, "hub_snapshot", hub_snapshot)


def test_a_usage_error_after_rows_keeps_them_and_exits_2(
        capfd, cache_dir, tmp_path, monkeypatch, smol_built):
    _hub_reaches_smol_only(monkeypatch, smol_built)
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--dry-run", "--weights", "hub", "--models", "smol,qwen",
                                  "--seq", "64", "--cache-dir", cache_dir, "--json", out_json])
    assert code == EXIT_USAGE, err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "cannot fetch Qwen/Qwen2.5-0.5B from the hub" in errors[0]
    assert [(r["model_key"], r["seq"], status(r)) for r in rows_of(out_json)] == [
        ("smol", 64, "dry-run")]
    assert len(table_rows(out, 64)) == 1
    assert not Path(str(out_json) + ".rows.jsonl").exists()


def test_a_usage_error_after_rows_is_recorded_in_the_saved_json(
        capfd, cache_dir, tmp_path, monkeypatch, smol_built):
    """The saved result must not pass for a complete run: it says why it stopped short (the
    previous version stored the error and exit code 2)."""
    _hub_reaches_smol_only(monkeypatch, smol_built)
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--dry-run", "--weights", "hub", "--models", "smol,qwen",
                                  "--seq", "64", "--cache-dir", cache_dir, "--json", out_json])
    assert code == EXIT_USAGE, err
    result = json.loads(out_json.read_text())
    assert "cannot fetch Qwen/Qwen2.5-0.5B" in (result["error"] or ""), result["error"]
    assert result["exit_code"] != EXIT_OK


# ---------------------------------------------------------------------------
# A run leaves nothing behind
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny streamable checkpoint folder (the harness's builder at TINY's shape), outside
    every folder a leftover test watches."""
    return synthetic_checkpoint(TINY, tmp_path_factory.mktemp("tiny-model"))[0]


def _listing(root: Path) -> set[tuple[str, int]]:
    if not root.exists():
        return set()
    return {(str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1)
            for p in root.rglob("*")}


def _fail_after_setup(monkeypatch):
    """Soup's real setup runs (data written, shards made), then the arm fails."""
    from soup_cli.trainer.sft import SFTTrainerWrapper

    real_setup = SFTTrainerWrapper.setup

    def setup(self, *a, **kw):
        real_setup(self, *a, **kw)
        raise RuntimeError("arm failed after setup")

    monkeypatch.setattr(SFTTrainerWrapper, "setup", setup)
    return EXIT_FINDING


def _hard_ctrl_c_after_setup(monkeypatch):
    """Two Ctrl-Cs right after Soup's real setup: the second stops the run at once."""
    real = h.realised_lengths

    def lengths(trainer, *guarded):
        out = real(trainer, *guarded)
        send_ctrl_c()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the handler raises KeyboardInterrupt before this returns
        return out

    monkeypatch.setattr(h, "realised_lengths", lengths)
    return EXIT_INTERRUPTED


@pytest.mark.parametrize("model, fault", [
    ("smol", None),  # the default path: the synthetic checkpoint is built in scratch
    ("tiny", _fail_after_setup),
    ("tiny", _hard_ctrl_c_after_setup),
], ids=["clean", "failed-arm", "interrupted"])
@pytest.mark.slow
@pytest.mark.release
def test_dry_run_without_cache_dir_leaves_no_files_behind(capfd, tmp_path, monkeypatch,
                                                          tiny_model, model, fault):
    """No fakes but the fault itself. $HOME, the temp dir ($TMPDIR and tempfile.tempdir, which
    the harness, its children and Soup consult) and the working directory are fresh folders;
    the real ~/.soup is watched too."""
    home, tmp, cwd = tmp_path / "home", tmp_path / "tmp", tmp_path / "cwd"
    for p in (home, tmp, cwd):
        p.mkdir()
    real_soup = Path.home() / ".soup"
    before = _listing(real_soup)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.chdir(cwd)
    expected = fault(monkeypatch) if fault else EXIT_OK
    arms = ["--models", "smol"] if model == "smol" else ["--model", tiny_model]

    code, out, err = main(capfd, ["--dry-run", *arms, "--seq", "64"])

    assert code == expected, err
    assert _listing(home) == set(), "left behind in $HOME"
    assert _listing(tmp) == set(), "left behind in the temp dir"
    assert _listing(cwd) == set(), "left behind in the working directory"
    assert _listing(real_soup) == before, "new files under the real ~/.soup"




def test_a_hard_stop_while_checkpoints_build_leaves_no_half_built_folder_in_the_cache_dir(
        capfd, tmp_path, monkeypatch):
    """Neither model is cached in this --cache-dir. SmolLM2's weights are being written when
    Qwen2.5's build is prepared and queued behind them; right then the run is stopped hard (a
    second Ctrl-C). Whatever it had started, the user's cache must hold no half-built folder
    afterwards: no later run removes another run's. The Ctrl-Cs are the only fake."""
    cache = tmp_path / "cache"
    smol_dest = cache / "checkpoints" / f"smol-{checkpoint_fingerprint(SMOL)}"
    real_start = checkpoints.start_checkpoint
    queued: list[bool] = []

    def start_checkpoint(shape, root, writer=None):
        started = real_start(shape, root, writer)
        if shape.key == "qwen":
            queued.append(not smol_dest.exists())  # SmolLM2 still writing: Qwen2.5 waits its turn
            send_ctrl_c()
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises KeyboardInterrupt here
        return started

    monkeypatch.setattr(checkpoints, "start_checkpoint", start_checkpoint)
    code, out, err = main(capfd, ["--dry-run", "--models", "smol,qwen", "--seq", "64",
                                  "--cache-dir", cache])
    assert code == EXIT_INTERRUPTED, err
    assert queued, "Qwen2.5's build never started"
    left = sorted(p.name for p in (cache / "checkpoints").iterdir())
    assert [name for name in left if name.startswith(".")] == [], left
    if not queued[0]:
        pytest.skip("SmolLM2's weights were written before Qwen2.5's build could queue behind them")


def test_teardown_drops_the_dynamic_map_bitsandbytes_caches_on_the_gpu_and_keeps_a_cpu_one(
        monkeypatch):
    """A CUDA tensor cannot be built here: the stand-in has only what teardown reads
    (is_cuda). On the H200 this map was the 1,024 bytes NF4 arms left to every later arm."""
    import torch
    from bitsandbytes import functional

    class CudaTensor:
        is_cuda = True

    monkeypatch.setattr(functional, "name2qmap", {"dynamic": CudaTensor()})
    assert h.teardown(None) is None
    assert "dynamic" not in functional.name2qmap
    cpu_map = torch.zeros(256)
    functional.name2qmap["dynamic"] = cpu_map
    h.teardown(None)
    assert functional.name2qmap["dynamic"] is cpu_map

