"""Children and signals (issue 22, defect 9): a first Ctrl-C to a --gpus parent reaches its
children, each stopping after its own arm in flight; a SIGKILLed parent leaves no orphan.

Real child processes on CPU; each child stands in for the harness's (it reads its job file as the
harness's does, installs the same Stop, and "measures" an arm by sleeping: no Soup, no GPU).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from conftest import ROOT

from issue395.console import Stop
from issue395.options import Run
from issue395.record import Arm
from issue395.scratch import Scratch
from issue395.spread import spread

SLEEPY_CHILD = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    from issue395.console import Stop
    from issue395.result import RowFile
    from issue395.spread import CHILD_JOB, die_with_parent, lost_row, read_job

    die_with_parent()
    run, job = read_job(os.environ[CHILD_JOB])
    Stop.install(quiet=True)
    rows = RowFile(run.json)
    try:
        for arm in job.arms:
            if Stop.requested:
                break
            with Stop.arm():
                with open({started!r}, "a") as fh:
                    fh.write(f"{{os.getpid()}}\\n")
                time.sleep({arm_s})
            rows.add(lost_row(arm, run, None, 0))
    except KeyboardInterrupt:
        pass
""")


def sleepy_child(tmp_path: Path, arm_s: float) -> tuple[Path, Path]:
    started = tmp_path / "started"
    script = tmp_path / "child.py"
    script.write_text(SLEEPY_CHILD.format(root=str(ROOT), started=str(started), arm_s=arm_s))
    return script, started


def wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_one_ctrl_c_to_a_gpus_parent_stops_each_child_after_its_arm_in_flight(tmp_path):
    script, started = sleepy_child(tmp_path, arm_s=1.5)
    arms = [Arm("smol", 64, 1, i) for i in range(4)]
    run = Run(models=("smol",), seqs=(64,), gpus=(0, 1), dry_run=True)
    rows = []

    def ctrl_c_once_both_children_measure():
        if wait_for(lambda: started.exists() and len(started.read_text().split()) >= 2):
            os.kill(os.getpid(), signal.SIGINT)

    Stop.install(quiet=True)
    threading.Thread(target=ctrl_c_once_both_children_measure, daemon=True).start()
    with Scratch() as scratch, Stop.arm():
        spread(run, arms, scratch, rows.append, str(script))
    assert Stop.requested
    # Two children, two arms each: each finished the arm it had in flight and began no other.
    assert len(started.read_text().split()) == 2, started.read_text()
    assert len(rows) == 2 and all(r.failure == "FAILED" for r in rows)


PARENT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from issue395.options import Run
    from issue395.record import Arm
    from issue395.scratch import Scratch
    from issue395.spread import spread

    with Scratch() as scratch:
        spread(Run(models=("smol",), seqs=(64,), gpus=(0,), dry_run=True), [Arm("smol", 64, 1, 0)],
               scratch, print, {script!r})
""")


def test_a_sigkilled_gpus_parent_leaves_no_child_running(tmp_path):
    script, started = sleepy_child(tmp_path, arm_s=120)
    parent = tmp_path / "parent.py"
    parent.write_text(PARENT.format(root=str(ROOT), script=str(script)))
    proc = subprocess.Popen([sys.executable, str(parent)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: started.exists() and started.read_text().strip())
        child = int(started.read_text().split()[0])
        proc.kill()
        proc.wait()

        def gone() -> bool:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return True
            # a zombie the init process has not yet reaped counts as gone
            stat = Path(f"/proc/{child}/stat")
            return stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z"

        assert wait_for(gone, timeout=15), "the child outlived its SIGKILLed parent"
    finally:
        proc.kill()
        if started.exists():
            for pid in started.read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
