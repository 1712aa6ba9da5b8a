"""Shared fixtures for the CLI tests: the harness module, one checkpoint cache per session,
and a clean process state (environment, SIGINT handler, Ctrl-C flag) around every test.

Everything runs on CPU: the real Soup setup goes through the harness's --dry-run path.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "issue395_second_stack_vram.py"
sys.path.insert(0, str(ROOT))
import issue395_second_stack_vram as h  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_process_state():
    """h.main in-process sets CUDA_VISIBLE_DEVICES and installs its own SIGINT handler and
    Ctrl-C flag; none of that may leak from one test into the next."""
    saved_env = dict(os.environ)
    saved_handler = signal.getsignal(signal.SIGINT)
    saved_tempdir = tempfile.tempdir
    h.Stop.requested = False
    yield
    h.Stop.requested = False
    signal.signal(signal.SIGINT,
                  signal.default_int_handler if saved_handler is None else saved_handler)
    tempfile.tempdir = saved_tempdir
    os.environ.clear()
    os.environ.update(saved_env)


@pytest.fixture(scope="session")
def cache_dir():
    """One --cache-dir for the whole session, under the temp dir (where Soup honours it):
    checkpoints are built and Soup's shards written once, then every later run reuses them.
    Removed at the end of the session (it holds ~4 GB)."""
    path = Path(tempfile.mkdtemp(prefix="issue395-test-cache-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def run_cli():
    """The harness as a fresh process, the way a terminal runs it (stdout, stderr captured)."""
    def run(args, *, cwd=None, env=None, timeout=300):
        return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)
    return run
