"""Faults during a sweep: the guard, OOM, a failing Soup setup, Ctrl-C, teardown errors,
UNDER, a crash mid-sweep, and what a run leaves behind.

Every arm is a real Soup setup (``SFTTrainerWrapper(config).setup``) on CPU. Where a
test needs a measured peak, only the CUDA step is faked, through the harness's seams:
``h.cuda_available`` -> True, ``h.arm_device`` -> "cpu" (Soup builds on CPU) and
``h.real_peak`` -> a fake that returns a peak without running the step. Each such
test says so.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import issue395_second_stack_vram as h  # noqa: E402

SMOL = h.SHAPES["smol"]
GIB = 2 ** 30


def main(capfd, argv):
    code = h.main([str(a) for a in argv])
    out, err = capfd.readouterr()
    return code, out, err


def table_rows(out: str, seq: int) -> list[str]:
    return [line for line in out.splitlines() if line.split()[:1] == [str(seq)]]


def safe_peak(seq: int) -> int:
    """A fake peak the prediction covers (pred/real 1.25x)."""
    return int(h.predicted_bytes(SMOL, seq) / 1.25)


class FakeStep:
    """Stands in for h.real_peak (the CUDA step): records which seq each call was for and
    returns ``peaks[seq]``, or raises ``raises[seq]``, or runs ``actions[seq]`` first."""

    def __init__(self, peaks=None, raises=None, actions=None):
        self.calls: list[int] = []
        self.peaks = peaks or {}
        self.raises = raises or {}
        self.actions = actions or {}

    def __call__(self, trainer, snapshot=False):
        seq = int(trainer.args.max_length)
        self.calls.append(seq)
        if seq in self.actions:
            self.actions[seq]()
        if seq in self.raises:
            raise self.raises[seq]
        peak = self.peaks.get(seq, safe_peak(seq))
        return {"peak": peak, "resident": 1234, "reserved": peak, "step_s": 0.01,
                "snapshot": None}


@pytest.fixture
def fake_cuda(monkeypatch):
    """Fakes the CUDA step only: a CUDA box is reported, Soup builds on CPU, the step is
    FakeStep. Returns a function that installs a FakeStep built from its arguments."""
    monkeypatch.setattr(h, "cuda_available", lambda: True)
    monkeypatch.setattr(h, "arm_device", lambda opts: "cpu")

    def install(**kw) -> FakeStep:
        step = FakeStep(**kw)
        monkeypatch.setattr(h, "real_peak", step)
        return step

    return install


def send_ctrl_c() -> None:
    """One Ctrl-C to this process, and wait until the harness's handler has seen it."""
    already = h.Stop.requested
    os.kill(os.getpid(), signal.SIGINT)
    deadline = time.monotonic() + 5
    while not already and not h.Stop.requested and time.monotonic() < deadline:
        time.sleep(0.01)


def short_chat_rows(short_seqs):
    """h.chat_rows, but rows for ``short_seqs`` carry half a seq of words: they tokenize short."""
    real = h.chat_rows

    def rows(seq, n=h.DATA_ROWS):
        if seq not in short_seqs:
            return real(seq, n)
        content = "word " * (seq // 2)
        return [{"messages": [{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": content}]} for _ in range(n)]

    return rows


# ---------------------------------------------------------------------------
# 2. The guard: a row that tokenizes short is VOID
# ---------------------------------------------------------------------------


def test_row_that_tokenizes_short_is_void_in_a_dry_run_and_exits_1(
        capfd, cache_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(h, "chat_rows", short_chat_rows({128}))
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--dry-run", "--models", "smol", "--seq", "128",
                                  "--cache-dir", cache_dir, "--json", out_json])
    assert code == h.EXIT_FINDING
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["status"] == "VOID"
    assert 64 <= row["realised"] < 128  # Soup really ran it at its own, shorter length
    (line,) = table_rows(out, 128)
    assert line.split()[1] == str(row["realised"])
    assert line.count("VOID") == 4  # pred/real, vs A10G, over-est: no ratio; and the status
    assert "VOID - realised" in out


def test_void_row_is_never_measured_and_gets_no_ratio(capfd, cache_dir, tmp_path, monkeypatch,
                                                      fake_cuda):
    """Fakes the CUDA peak only (h.real_peak): the good row's step runs, the void row's not."""
    monkeypatch.setattr(h, "chat_rows", short_chat_rows({128}))
    step = fake_cuda()
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--models", "smol", "--seq", "64,128", "--cache-dir", cache_dir,
                                  "--json", out_json])
    assert code == h.EXIT_FINDING
    assert step.calls == [64]  # the seam is live, and the void row was never stepped
    good, void = json.loads(out_json.read_text())["rows"]
    assert good["status"] == "ok" and good["real_peak"] == safe_peak(64)
    assert good["pred_over_real"] == pytest.approx(1.25, rel=1e-6)
    assert void["status"] == "VOID"
    for key in ("real_peak", "pred_over_real", "nonlogits_overestimate",
                "retained_copy_would_fit", "vs_record"):
        assert void[key] is None, key
    (line,) = table_rows(out, 128)
    assert line.split()[5] == "VOID"
    assert "1.250x" in table_rows(out, 64)[0]


# ---------------------------------------------------------------------------
# 6. Faults during a sweep
# ---------------------------------------------------------------------------


def test_oom_on_one_arm_is_recorded_with_its_request_and_the_sweep_goes_on(
        capfd, cache_dir, tmp_path, fake_cuda):
    """Fakes the CUDA step only: it raises torch's OOM on the 2nd of 3 arms."""
    import torch

    step = fake_cuda(raises={80: torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 4 GiB")})
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--models", "smol", "--seq", "64,80,96", "--cache-dir",
                                  cache_dir, "--json", out_json])
    assert code == h.EXIT_FINDING
    assert step.calls == [64, 80, 96]
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["seq"] for r in rows] == [64, 80, 96]
    first, oom, last = rows
    assert oom["status"] == "OOM" and oom["real_peak"] is None
    assert oom["oom_request_bytes"] == int(1.5 * GIB)
    assert oom["error"].startswith("OutOfMemoryError: CUDA out of memory")
    for r in (first, last):
        assert r["status"] == "ok" and r["real_peak"] == safe_peak(r["seq"])
    assert table_rows(out, 80)[0].split()[4] == "OOM"
    assert f"(asked for {1.5 * GIB / 1e9:.2f} GB)" in out


def test_soup_setup_failure_is_a_failed_row_with_its_last_line_and_the_sweep_goes_on(
        capfd, cache_dir, tmp_path, monkeypatch):
    from soup_cli.trainer.sft import SFTTrainerWrapper

    real_setup = SFTTrainerWrapper.setup

    def setup(self, *a, **kw):
        if self.config.data.max_length == 80:
            raise RuntimeError("shard store broke\nno space left on the pinned pool")
        return real_setup(self, *a, **kw)

    monkeypatch.setattr(SFTTrainerWrapper, "setup", setup)
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--dry-run", "--models", "smol", "--seq", "64,80,96",
                                  "--cache-dir", cache_dir, "--json", out_json])
    assert code == h.EXIT_FINDING
    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["seq"], r["status"]) for r in rows] == [(64, "dry-run"), (80, "FAILED"),
                                                      (96, "dry-run")]
    assert rows[1]["error"] == "RuntimeError: no space left on the pinned pool"
    assert [r["realised"] for r in rows] == [64, None, 96]
    assert "FAILED - RuntimeError: no space left on the pinned pool" in out


def test_ctrl_c_stops_after_the_arm_in_flight_saves_rows_and_exits_130(
        capfd, cache_dir, tmp_path, fake_cuda):
    """Fakes the CUDA step only: the step of arm 1 delivers a real SIGINT to this process."""
    step = fake_cuda(actions={64: send_ctrl_c})
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--models", "smol", "--seq", "64,96", "--cache-dir", cache_dir,
                                  "--json", out_json])
    assert code == h.EXIT_INTERRUPTED
    assert step.calls == [64]  # arm 2 never started
    result = json.loads(out_json.read_text())
    assert result["interrupted"] is True and result["exit_code"] == 130
    (row,) = result["rows"]
    assert row["seq"] == 64 and row["status"] == "ok" and row["real_peak"] == safe_peak(64)
    assert len(table_rows(out, 64)) == 1 and table_rows(out, 96) == []
    assert "interrupted: 1 row(s) measured before the stop" in out
    assert not Path(str(out_json) + ".rows.jsonl").exists()


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
    assert code == h.EXIT_OK
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["status"] == "ok" and row["error"] is None
    assert row["real_peak"] == safe_peak(64)
    assert row["teardown_error"] == "OSError: pinned store still mapped"
    assert "teardown error (measurement kept): OSError: pinned store still mapped" in out


def test_peak_above_the_prediction_is_under_and_exits_1(capfd, cache_dir, tmp_path, fake_cuda):
    """Fakes the CUDA peak only: 1.25x the prediction."""
    predicted = h.predicted_bytes(SMOL, 64)
    fake_cuda(peaks={64: int(predicted * 1.25)})
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--models", "smol", "--seq", "64", "--cache-dir", cache_dir,
                                  "--json", out_json])
    assert code == h.EXIT_FINDING
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["status"] == "UNDER"
    assert row["pred_over_real"] == pytest.approx(0.8, rel=1e-6)
    (line,) = table_rows(out, 64)
    assert line.split()[-1] == "UNDER" and "0.800x" in line


def test_crash_mid_sweep_prints_and_saves_the_rows_finished_before_it(
        capfd, cache_dir, tmp_path, monkeypatch, fake_cuda):
    """Fakes the CUDA step only. An unexpected error escapes the arm loop as arm 2 of 3
    starts: exit 1, one error line, no traceback on the console, and --json holds the
    finished row, the error and the traceback."""
    fake_cuda()
    real_measured_row = h.measured_row

    def measured_row(arm, *a, **kw):
        if arm.seq == 80:
            raise RuntimeError("harness bug mid-sweep")
        return real_measured_row(arm, *a, **kw)

    monkeypatch.setattr(h, "measured_row", measured_row)
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--models", "smol", "--seq", "64,80,96", "--cache-dir",
                                  cache_dir, "--json", out_json])
    assert code == h.EXIT_FINDING
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == ["error: the harness failed after 1 row(s): "
                      "RuntimeError: harness bug mid-sweep"]
    assert "Traceback" not in out + err
    result = json.loads(out_json.read_text())
    assert result["error"] == "RuntimeError: harness bug mid-sweep"
    assert "Traceback" in result["traceback"]
    assert [(r["seq"], r["status"], r["real_peak"]) for r in result["rows"]] == [
        (64, "ok", safe_peak(64))]
    assert len(table_rows(out, 64)) == 1 and table_rows(out, 80) == []


def test_a_row_whose_progress_line_crashes_is_still_in_the_saved_json(
        capfd, cache_dir, tmp_path, monkeypatch, fake_cuda):
    """Fakes the CUDA step only. Arm 2 of 3 finishes (it is already in <json>.rows.jsonl)
    and then its progress line crashes: the saved --json must not lose that row."""
    fake_cuda()
    real_arm = h.Progress.arm

    def arm(self, row):
        real_arm(self, row)
        if self.done == 2:
            raise RuntimeError("progress crashed")

    monkeypatch.setattr(h.Progress, "arm", arm)
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--models", "smol", "--seq", "64,80,96", "--cache-dir",
                                  cache_dir, "--json", out_json])
    assert code == h.EXIT_FINDING
    result = json.loads(out_json.read_text())
    assert result["error"] == "RuntimeError: progress crashed"
    assert [r["seq"] for r in result["rows"]] == [64, 80]


# ---------------------------------------------------------------------------
# 4. A run leaves nothing behind
# ---------------------------------------------------------------------------


def _listing(root: Path, recursive: bool) -> set[tuple[str, int]]:
    if not root.exists():
        return set()
    items = root.rglob("*") if recursive else root.iterdir()
    return {(str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1) for p in items}


def _fail_after_setup(monkeypatch):
    """Soup's real setup runs (checkpoint built, shards written), then the arm fails."""
    from soup_cli.trainer.sft import SFTTrainerWrapper

    real_setup = SFTTrainerWrapper.setup

    def setup(self, *a, **kw):
        real_setup(self, *a, **kw)
        raise RuntimeError("arm failed after setup")

    monkeypatch.setattr(SFTTrainerWrapper, "setup", setup)
    return h.EXIT_FINDING


def _hard_ctrl_c_after_setup(monkeypatch):
    """Two Ctrl-Cs right after Soup's real setup: the second stops the run at once."""
    real = h.realised_lengths

    def lengths(trainer):
        out = real(trainer)
        send_ctrl_c()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the handler raises KeyboardInterrupt before this returns
        return out

    monkeypatch.setattr(h, "realised_lengths", lengths)
    return h.EXIT_INTERRUPTED


@pytest.mark.parametrize("fault", [None, _fail_after_setup, _hard_ctrl_c_after_setup],
                         ids=["clean", "failed-arm", "interrupted"])
def test_dry_run_without_cache_dir_leaves_no_files_behind(capfd, tmp_path, monkeypatch, fault):
    """No fakes but the fault itself. The temp dir is a private one (tempfile.tempdir and
    $TMPDIR, which both the harness and Soup consult) so other processes on the box cannot
    disturb the listing; $HOME/.soup is the real one."""
    tmp, cwd = tmp_path / "tmp", tmp_path / "cwd"
    tmp.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.chdir(cwd)
    home_soup = Path.home() / ".soup"
    before = (_listing(home_soup, True), _listing(tmp, False), _listing(cwd, True))
    expected = fault(monkeypatch) if fault else h.EXIT_OK

    code, out, err = main(capfd, ["--dry-run", "--models", "smol", "--seq", "64"])

    assert code == expected, err
    assert _listing(home_soup, True) == before[0], "new files under ~/.soup"
    assert _listing(tmp, False) == before[1], "left behind in the temp dir"
    assert _listing(cwd, True) == before[2], "left behind in the working directory"


# ---------------------------------------------------------------------------
# 7. A worker process that dies is never a silent gap
# ---------------------------------------------------------------------------


def test_a_worker_that_dies_leaves_a_failed_row_for_each_arm_and_exits_1(
        capfd, cache_dir, tmp_path, monkeypatch):
    """Nothing is faked in the harness: every fresh worker process is killed at start-up by
    a sitecustomize on its PYTHONPATH (exit code 139, as a segfault would). The parent must
    report each lost arm as FAILED with the worker's exit code, save them, and exit 1."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, sys\nif '--_worker' in sys.argv:\n    os._exit(139)\n")
    monkeypatch.setenv("PYTHONPATH", str(site) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--dry-run", "--isolate", "--models", "smol", "--seq", "64,96",
                                  "--cache-dir", cache_dir, "--json", out_json])
    assert code == h.EXIT_FINDING, err
    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["seq"], r["status"]) for r in rows] == [(64, "FAILED"), (96, "FAILED")]
    assert all("exited with code 139" in r["error"] for r in rows)
    assert "exited with code 139" in out


def test_a_usage_error_after_the_sweep_keeps_the_rows_it_measured(
        capfd, cache_dir, tmp_path, monkeypatch):
    """A later mode refusing its input (here --determinism, made to raise the harness's own
    usage error, as an unreachable --model would) must not lose the sweep's finished rows."""
    def refuse(*args, **kwargs):
        raise h.UsageError("--model x: cannot reach the hub")

    monkeypatch.setattr(h, "determinism_mode", refuse)
    out_json = tmp_path / "out.json"
    code, out, err = main(capfd, ["--dry-run", "--sweep", "--determinism", "--models", "smol",
                                  "--seq", "64", "--cache-dir", cache_dir, "--json", out_json])
    assert code == h.EXIT_USAGE
    assert [line for line in err.splitlines() if line.startswith("error")] == [
        "error: --model x: cannot reach the hub"]
    result = json.loads(out_json.read_text())
    assert [(r["seq"], r["status"]) for r in result["rows"]] == [(64, "dry-run")]
    assert result["exit_code"] == h.EXIT_USAGE
