"""issue395.run.request and the mode table (issue395.run.options.MODES, issue395.run.runner.EXECUTE): each
command line settles once into its mode's own request type, which is what decides how it runs; a soup.yaml
is read once whatever the mode. Soup's own loader reads the real file; nothing is faked (the loader is
wrapped to count its calls, and still runs)."""

from __future__ import annotations

import json

import pytest
from conftest import BASE_YAML

from issue395.model.registry import config_json
from issue395.run import configarm, estimate_mode, find_max_mode, measure_mode, userconfig
from issue395.run.options import CARD_LIST, MODES, SOUP_PATCH, settle
from issue395.run.parser import build_parser
from issue395.host.measured import MeasureRequest, measure_from_json
from issue395.run.request import CardListRequest, EstimateRequest, FindMaxRequest, RerenderRequest
from issue395.run.runner import EXECUTE



@pytest.fixture
def soup_yaml(tmp_path):
    base = tmp_path / "qwen"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(config_json("qwen")))
    path = tmp_path / "soup.yaml"
    path.write_text(BASE_YAML.format(base=base))
    return path


def settled(*argv):
    argv = [str(a) for a in argv]
    return settle(build_parser().parse_args(argv), argv)


def test_each_mode_is_its_own_request_and_every_request_has_its_execution():
    saved = next(p for p in __import__("pathlib").Path("results").rglob("*.json"))
    assert type(settled("--dry-run")) is MeasureRequest
    assert type(settled("--map", "--families", "smol", "--dry-run")) is MeasureRequest
    assert type(settled("--estimate", "--model", "smol", "--seq", "512")) is EstimateRequest
    assert type(settled("--card", "list")) is CardListRequest
    assert type(settled("--from-json", saved)) is RerenderRequest
    assert set(EXECUTE) == {m.request for m in (CARD_LIST, SOUP_PATCH, *MODES)} and len(EXECUTE) == len(MODES) + 2


def test_a_child_reads_back_the_measure_request_its_parent_settled():
    from dataclasses import asdict

    run = settled("--models", "smol", "--seq", "512", "--cap", "soup", "--gpus", "0")
    assert measure_from_json(json.loads(json.dumps(asdict(run)))) == run


@pytest.mark.parametrize("argv, request_type", [
    (["--estimate", "--card", "T4"], EstimateRequest),
    (["--dry-run"], MeasureRequest),
    (["--find-max", "seq", "--card", "12GB", "--dry-run"], FindMaxRequest),
])
def test_the_soup_yaml_is_read_once_in_every_mode(monkeypatch, soup_yaml, argv, request_type):
    reads = []
    real = userconfig.read_soup_config

    def counted(path, *rest):
        reads.append(path)
        return real(path, *rest)

    for module in (userconfig, configarm, estimate_mode, find_max_mode, measure_mode):
        if hasattr(module, "read_soup_config"):
            monkeypatch.setattr(module, "read_soup_config", counted)
    request = settled("--config", soup_yaml, *argv)
    assert type(request) is request_type and reads == [str(soup_yaml)]


def test_find_max_settles_its_estimate_as_estimate_settles_the_same_file_and_card(soup_yaml):
    found = settled("--find-max", "seq", "--config", soup_yaml, "--emulate-card", "12GB", "--dry-run")
    estimated = settled("--estimate", "--config", soup_yaml, "--card", "12GB")
    assert found.estimate == estimated.__class__(**{**vars(estimated), "argv": ()})
    assert (found.flag, found.axis, found.arm.checkpoint) == ("--emulate-card", "seq", str(soup_yaml.parent / "qwen"))


def test_find_max_carries_the_files_arm_the_run_estimate_answers_at_the_steps_settled(soup_yaml):
    """Issue 50 item 2 (house5c): --find-max's request carries the file's Arm (config_arm's: its base resolved, the
    probes' checkpoint folder absolute) and reads the run from it: it is the Arm --estimate answers for the same
    file, at the steps settled (the run's steady state, or --steps)."""
    from dataclasses import replace

    found = settled("--find-max", "batch", "--config", soup_yaml, "--card", "12GB", "--dry-run")
    (estimated,) = settled("--estimate", "--config", soup_yaml, "--card", "12GB").arms()
    assert found.arm == replace(estimated, checkpoint=str(soup_yaml.parent / "qwen")) and found.arm.steps == 2
    assert settled("--find-max", "seq", "--config", soup_yaml, "--card", "12GB", "--dry-run", "--steps", "1").arm.steps == 1
