"""run/measure_mode.py: the measured modes (the sweep, the map, a soup.yaml's one arm, --determinism,
--measure and --sdpa): ``settle``'s checks, once, before any arm (every output folder, an empty shard,
NF4 without bitsandbytes), and ``execute``'s plan of processes, its row file and its outputs, on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import main, make_row, one_error_line, readme_yaml

from issue395.measure.shapes import default_map_families
from issue395.model.arm import Arm
from issue395.results.result import Result
from issue395.run import measure_mode
from issue395.host.spread import plan_jobs


# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


@pytest.mark.parametrize("folder", ["/proc/x", "/proc/x/y", "/proc"])
def test_a_log_dir_where_nothing_can_be_made_is_one_line_before_any_arm(capfd, tmp_path, folder):
    """Issue 29 item 8: a --log-dir in which no file can be made is one line naming it, before any arm runs."""
    argv = ["--dry-run", "--config", readme_yaml(tmp_path), "--log-dir", folder]
    one_error_line(*main(capfd, argv), "--log-dir", folder)


def test_sweep_alongside_determinism_spreads_the_sweep_once_and_the_repeats_once(
        capfd, monkeypatch):
    """--sweep --isolate --determinism 2: the sweep's arms one process each, then the
    repeats. What each spread would start is read off the harness's own plan (the
    processes themselves are test_cli.py's --isolate and --determinism tests); no process
    is started here."""
    planned = []

    def plan_only(run, arms, scratch, on_row, script):
        planned.append([(job.arms, job.repeat) for job in plan_jobs(run, arms)])
        return []

    monkeypatch.setattr(measure_mode, "spread", plan_only)
    code, out, err = main(capfd, ["--dry-run", "--sweep", "--isolate", "--determinism", "2",
                                  "--models", "smol", "--seq", "64"])
    arm = Arm("smol", 64, 1, 0)
    assert planned == [[((arm,), None)], [((arm,), 1), ((arm,), 2)]], \
        "the sweep was spread as determinism repeats: its rows collide with the repeats' rows"


def test_an_explicit_nf4_request_without_bitsandbytes_is_a_usage_error(capfd, monkeypatch):
    """--quant nf4 asked for by name where bitsandbytes is not installed is one line naming it (exit 2),
    before any arm."""
    monkeypatch.setattr(measure_mode, "bitsandbytes_present", lambda: False)
    code, stdout, err = main(capfd, ["--map", "--quant", "nf4", "--families", "smol"])
    assert code == 2 and "bitsandbytes" in err and len(err.strip().splitlines()) == 1


_N_MAP = len(default_map_families()) + 1


@pytest.mark.parametrize("argv, words", [
    (["--dry-run", "--shard", "11/11"], ["--shard 11/11", "10 arm"]),
    (["--dry-run", "--models", "smol", "--seq", "128", "--shard", "2/2"], ["--shard 2/2", "1 arm"]),
    # the default map's families follow the installed Soup (0.77.0 adds three), and Llama-3.1-8B
    (["--dry-run", "--map", "--shard", f"{_N_MAP + 1}/{_N_MAP + 1}"], [f"--shard {_N_MAP + 1}/{_N_MAP + 1}",
                                                                        f"{_N_MAP} famil"]),
], ids=["sweep-11-of-11", "one-arm-2-of-2", "map-one-more-than-its-families"])
def test_an_empty_shard_is_one_line_naming_it_before_anything_runs(capfd, argv, words):
    """A --shard K/N that holds no arm (the sweep's, one arm's, the map's families') is one line naming the
    shard and how many arms or families there are, before anything runs."""
    one_error_line(*main(capfd, argv), "empty", *words)


def test_a_ctrl_c_once_every_arm_is_measured_leaves_a_complete_run_said_alike_everywhere(
        capfd, tmp_path, monkeypatch):
    """Issue 22, defect 15: a Ctrl-C while the outputs of a finished run are written exited 130 with
    no word of it while the JSON said interrupted: false, exit_code: 0. The run is complete (every
    arm measured): the message says so, it exits 0, and the JSON agrees. The children are stood in
    for by one row (no process is started), the Ctrl-C is a real SIGINT to this process."""
    from conftest import make_row, send_ctrl_c

    from issue395.run import measure_mode
    from issue395.results.result import Result

    def one_child(run, arms, scratch, on_row, script):
        on_row(make_row("smol", 64, index=0, real_peak=None, dry_run=True))
        return []

    real_write = measure_mode.write_outputs

    def ctrl_c_then_write(*args, **kw):
        send_ctrl_c()
        return real_write(*args, **kw)

    monkeypatch.setattr(measure_mode, "spread", one_child)
    monkeypatch.setattr(measure_mode, "write_outputs", ctrl_c_then_write)
    out = tmp_path / "o.json"
    code, stdout, err = main(capfd, ["--dry-run", "--isolate", "--models", "smol", "--seq", "64", "--json", out])
    data = json.loads(out.read_text())
    assert code == 0 and data["exit_code"] == 0 and data["interrupted"] is False, err
    assert "every arm is measured" in err and "interrupted" not in stdout
    assert Result.from_json(data).exit_code == code


def test_a_ctrl_c_that_cuts_the_arms_short_is_interrupted_everywhere(capfd, tmp_path, monkeypatch):
    """Issue 22: a Ctrl-C that cuts the arms short exits 130, says it stops after the arm in flight, and the
    JSON and the table say interrupted."""
    from conftest import make_row, send_ctrl_c

    from issue395.run import measure_mode

    def ctrl_c_after_one_row(run, arms, scratch, on_row, script):
        on_row(make_row("smol", 64, index=0, real_peak=None, dry_run=True))
        send_ctrl_c()  # one arm in flight (the children's): the stop waits for it
        return []

    monkeypatch.setattr(measure_mode, "spread", ctrl_c_after_one_row)
    out = tmp_path / "o.json"
    code, stdout, err = main(capfd, ["--dry-run", "--isolate", "--models", "smol", "--seq", "64,128",
                                     "--json", out])
    data = json.loads(out.read_text())
    assert code == 130 and data["exit_code"] == 130 and data["interrupted"] is True, err
    assert "stopping after the arm in flight" in err and "interrupted: 1 row(s)" in stdout


def test_a_parent_of_children_with_steps_keeps_the_childrens_stack_and_writes_its_json(
        capfd, tmp_path, monkeypatch):
    """--isolate --steps 2: the parent has no stack of its own; naming the steps must not stand in
    for the children's (it did: the render raised KeyError 'torch' and no JSON was written). The
    children are stood in for by one saved child result (no process is started here)."""
    from issue395.run import measure_mode

    child = Result(environment=json.loads((ROOT_RESULT).read_text())["environment"],
                   rows=[make_row("smol", 64, index=0, real_peak=None, dry_run=True)])

    def one_child(run, arms, scratch, on_row, script):
        on_row(child.rows[0])
        return [child]

    monkeypatch.setattr(measure_mode, "spread", one_child)
    out = tmp_path / "o.json"
    code, stdout, err = main(capfd, ["--dry-run", "--isolate", "--steps", "2", "--models", "smol", "--seq", "64",
                                     "--json", out])
    assert "Traceback" not in err and code == 0, err
    env = json.loads(out.read_text())["environment"]
    assert env["steps"] == 2 and env["torch"] == child.environment["torch"]
    assert "2 optimizer steps per arm" in stdout.splitlines()[0]


ROOT_RESULT = Path(__file__).resolve().parents[2] / "results/split-check-h200x2-soup0.73.3-b5bee37/full-cold.json"


def test_a_resident_map_of_a_family_soup_does_not_stream_is_planned_and_a_streamed_one_refused(capfd):
    """`--map --families moonlight --stream-layers off` plans the resident arm alone (a resident run streams nothing);
    with a streamed arm asked (`on,off`, or Soup's default on) it is one line where the installed Soup does not
    stream deepseek_v3 (soup-cli 0.73.3)."""
    from issue395.estimator.soup_number import streamed_as
    from issue395.run.options import settle
    from issue395.run.parser import build_parser

    argv = ["--map", "--dry-run", "--families", "moonlight", "--stream-layers", "off"]
    assert {a.model for a in settle(build_parser().parse_args(argv), argv).arms()} == {"moonlight+resident"}
    if streamed_as("deepseek_v3") is None:
        for layers in (["--stream-layers", "on,off"], []):
            one_error_line(*main(capfd, ["--map", "--dry-run", "--families", "moonlight", *layers]),
                           "--families moonlight", "does not stream deepseek_v3")
