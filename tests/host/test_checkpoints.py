"""issue395.host.checkpoints: the checkpoint cache (built once, then served; an unfinished or damaged
folder rebuilt, each kind of damage named), a Ctrl-C during a build (issue 22, defect 10: the writer
stops between tensors and leaves no half-built folder), NF4 shard aliases, and another host's partial
builds left alone. CPU, tiny shapes built by the harness's own builder; nothing faked but the
builder's tensor maker where the stop test counts what it made."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import time
from pathlib import Path

import pytest
from conftest import TINY

from issue395.measure import builder
from issue395.measure.builder import BuildStopped, checkpoint_fingerprint
from issue395.host.checkpoints import (Checkpoints, checkpoint_problem, quant_base, reap_dead_partials,
                                  synthetic_checkpoint)
from issue395.measure.console import Stop
from issue395.host.measured import MeasureRequest
from issue395.model.registry import Shape
from issue395.host.scratch import Scratch

#: Many layers of toy size: a build long enough in tensors for a stop to land in the middle of it.
MANY_LAYERS = Shape(key="tiny", name="tiny", hub_id="tiny", model_type="llama", pool=0, extras=0, grid_adapter=0,
                    vocab=512, hidden=64, intermediate=128, n_layers=40, max_positions=256,
                    arch={"num_attention_heads": 4, "num_key_value_heads": 2}, record=False)


def test_a_stop_mid_build_ends_the_writer_between_tensors_and_removes_the_partial_folder(monkeypatch):
    made = []
    real_tiled = builder.tiled

    def tiled(tile, n):
        made.append(n)
        if len(made) == 3:
            Stop.requested = True  # as the first Ctrl-C with no arm in flight sets it
        return real_tiled(tile, n)

    monkeypatch.setattr(builder, "tiled", tiled)
    with Scratch() as scratch:
        root = scratch.checkpoint_root()
        checkpoints = Checkpoints(["tiny"], {"tiny": MANY_LAYERS}, MeasureRequest(models=("tiny",), weights="synthetic"),
                                  scratch)
        started = time.perf_counter()
        with pytest.raises(BuildStopped):
            checkpoints.get("tiny")
        checkpoints.close()
        assert time.perf_counter() - started < 10
        assert len(made) <= 4, f"{len(made)} tensors made after the stop was asked at the third"
        assert list(root.iterdir()) == [], "a half-built checkpoint was left behind"


def test_a_checkpoint_built_with_no_stop_is_whole_and_verifies():
    with Scratch() as scratch:
        checkpoints = Checkpoints(["tiny"], {"tiny": MANY_LAYERS}, MeasureRequest(models=("tiny",), weights="synthetic"),
                                  scratch)
        path = checkpoints.get("tiny")
        checkpoints.close()
        assert checkpoint_problem(Path(path)) is None


@pytest.fixture(scope="module")
def tiny_built(tmp_path_factory):
    return synthetic_checkpoint(TINY, tmp_path_factory.mktemp("tiny"))[0]


@pytest.mark.parametrize("damage, problem", [
    (lambda d: (d / ".complete").unlink(), "no completion marker"),
    (lambda d: (d / "config.json").unlink(), "config.json is missing"),
    (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    (lambda d: (d / "model.safetensors").unlink(), "model.safetensors: FileNotFoundError"),
    (lambda d: os.truncate(d / "model.safetensors", (d / "model.safetensors").stat().st_size - 10),
     "bytes, its header describes"),
    (lambda d: (d / ".complete").write_text(json.dumps(dict(
        json.loads((d / ".complete").read_text()), file_bytes=1))),
     "tensors differ from the shape it was built for"),
], ids=["marker", "config", "tokenizer", "weights-deleted", "weights-truncated", "manifest"])
def test_checkpoint_problem_names_each_kind_of_damage(tmp_path, tiny_built, damage, problem):
    dest = tmp_path / tiny_built.name
    shutil.copytree(tiny_built, dest)
    assert checkpoint_problem(dest) is None
    damage(dest)
    assert problem in checkpoint_problem(dest)


def test_a_checkpoint_deleted_behind_its_marker_is_rebuilt_with_a_note(tmp_path, tiny_built, capsys):
    dest = tmp_path / tiny_built.name
    shutil.copytree(tiny_built, dest)
    (dest / "model.safetensors").unlink()
    path, build_s = synthetic_checkpoint(TINY, tmp_path)
    assert path == dest and build_s > 0.0
    assert checkpoint_problem(dest) is None
    err = capsys.readouterr().err
    assert f"note: cached checkpoint {dest} is damaged (model.safetensors: FileNotFoundError)" in err
    assert [p.name for p in tmp_path.iterdir()] == [dest.name]  # no partial build left


def test_nf4_arms_get_their_own_soup_shard_folder_and_bf16_arms_keep_theirs(tmp_path):
    from soup_cli.utils.layer_shard import resolve_shard_dir

    base = tmp_path / "model"
    base.mkdir()
    with Scratch(str(tmp_path / "cache")) as scratch:
        assert quant_base(scratch, str(base), "none") == str(base)
        nf4 = quant_base(scratch, str(base), "nf4")
        assert resolve_shard_dir(nf4) != resolve_shard_dir(str(base))
        assert Path(nf4).resolve() == base.resolve()
        assert quant_base(scratch, str(base), "nf4") == nf4  # the same alias again


def test_a_half_built_checkpoint_of_another_host_is_left_alone(tmp_path):
    other = tmp_path / ".smol-abc.partial-elsewhere-1"
    mine_dead = tmp_path / f".smol-abc.partial-{socket.gethostname()}-999999"
    for folder in (other, mine_dead):
        folder.mkdir()
    reap_dead_partials(tmp_path)
    assert other.exists() and not mine_dead.exists()


def test_synthetic_checkpoint_is_built_once_then_served_from_cache(tmp_path):
    first, build_s = synthetic_checkpoint(TINY, tmp_path)
    assert build_s > 0.0
    assert first.name == f"tiny-{checkpoint_fingerprint(TINY)}"
    assert checkpoint_problem(first) is None
    manifest = json.loads((first / ".complete").read_text())
    assert manifest["file_bytes"] == (first / "model.safetensors").stat().st_size
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again, again_s = synthetic_checkpoint(TINY, tmp_path)
    assert again == first
    assert again_s == 0.0
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no half-built folder left


def test_synthetic_checkpoint_rebuilds_an_unfinished_folder(tmp_path, capsys):
    """A folder without its .complete marker (a build cut off, a half-finished rm -r) is
    not trusted: it is replaced by a complete build."""
    dest = tmp_path / f"tiny-{checkpoint_fingerprint(TINY)}"
    dest.mkdir()
    (dest / "config.json").write_text("{}")
    path, build_s = synthetic_checkpoint(TINY, tmp_path)
    assert path == dest and build_s > 0.0
    assert checkpoint_problem(path) is None
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 2
    assert [p.name for p in tmp_path.iterdir()] == [dest.name]


def test_the_next_family_is_not_built_ahead_where_the_disk_cannot_hold_it_beside_this_one(tmp_path):
    """Issue 38: one family ahead only where the disk's budget holds both; the held bytes go with the
    release, and the next family is then built when its first arm asks for it."""
    from issue395.host.cardlock import DiskLedger

    other = dataclasses.replace(TINY, key="tiny2", name="tiny2")
    size = TINY.checkpoint_bytes
    assert size > 0
    with Scratch() as scratch:
        ledger = DiskLedger.create(str(tmp_path / "disk.json"), str(tmp_path), budget=size * 3)
        checkpoints = Checkpoints(["tiny", "tiny2"], {"tiny": TINY, "tiny2": other},
                                  MeasureRequest(models=("tiny", "tiny2"), weights="synthetic"), scratch, ledger)
        same = os.stat(scratch.shard_root).st_dev == os.stat(scratch.checkpoint_root()).st_dev
        charge = size * (2 if same else 1)
        checkpoints.get("tiny")
        held = ledger.snapshot()["held"]
        if same:  # 2 + 2 of a budget of 3: the ahead build waits
            assert "tiny2" not in checkpoints.pending and list(held.values()) == [charge]
        else:  # 1 + 1 of 3: it starts beside
            assert sorted(held.values()) == [charge, charge]
        checkpoints.release("tiny")
        assert all(not k.endswith(":tiny") for k in ledger.snapshot()["held"])
        assert checkpoint_problem(Path(checkpoints.get("tiny2"))) is None
        checkpoints.release("tiny2")
        checkpoints.close()
        assert ledger.snapshot()["held"] == {}


def test_the_next_family_is_built_ahead_where_the_disk_holds_both():
    """...and where the budget holds this family and the next, with their shards, the next one's build
    starts while this one's arms run."""
    import tempfile

    from issue395.host.cardlock import DiskLedger

    other = dataclasses.replace(TINY, key="tiny2", name="tiny2")
    with Scratch() as scratch, tempfile.TemporaryDirectory() as tmp:
        ledger = DiskLedger.create(str(Path(tmp) / "disk.json"), tmp, budget=TINY.checkpoint_bytes * 8)
        checkpoints = Checkpoints(["tiny", "tiny2"], {"tiny": TINY, "tiny2": other},
                                  MeasureRequest(models=("tiny", "tiny2"), weights="synthetic"), scratch, ledger)
        checkpoints.get("tiny")
        assert "tiny2" in checkpoints.pending and len(ledger.snapshot()["held"]) == 2
        checkpoints.close()


# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


def test_a_checkpoint_build_says_so_on_stderr_when_it_is_not_a_terminal(capfd):
    """Issue 29 item 13: building a synthetic checkpoint is said on stderr (building, built in) even when
    stderr is not a terminal."""
    from conftest import TINY

    from issue395.host.checkpoints import Checkpoints
    from issue395.host.measured import MeasureRequest
    from issue395.host.scratch import Scratch

    with Scratch() as scratch:
        checkpoints = Checkpoints(["tiny"], {"tiny": TINY}, MeasureRequest(models=("tiny",), weights="synthetic"), scratch)
        checkpoints.get("tiny")
        checkpoints.close()
    err = capfd.readouterr().err
    assert "building" in err and "synthetic checkpoint" in err and "built in" in err, err
