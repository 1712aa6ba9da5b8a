"""issue395.checkpoints: the checkpoint cache, its damage named and repaired, NF4 aliases."""

from __future__ import annotations
import dataclasses
import json
import os
import shutil
import pytest
from conftest import SMOL
from issue395.checkpoints import checkpoint_problem, synthetic_checkpoint
import socket
from issue395.checkpoints import quant_base, reap_dead_partials
from issue395.scratch import Scratch


TINY = dataclasses.replace(SMOL, key="tiny", name="tiny", n_layers=2, vocab=512, hidden=64,
                           intermediate=128, max_positions=256, record=False,
                           arch=dict(SMOL.arch, num_attention_heads=4, num_key_value_heads=2))


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
        assert __import__("pathlib").Path(nf4).resolve() == base.resolve()
        assert quant_base(scratch, str(base), "nf4") == nf4  # the same alias again


def test_a_half_built_checkpoint_of_another_host_is_left_alone(tmp_path):
    other = tmp_path / ".smol-abc.partial-elsewhere-1"
    mine_dead = tmp_path / f".smol-abc.partial-{socket.gethostname()}-999999"
    for folder in (other, mine_dead):
        folder.mkdir()
    reap_dead_partials(tmp_path)
    assert other.exists() and not mine_dead.exists()
