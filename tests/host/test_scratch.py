"""issue395.host.scratch: the scratch folder, reaping what killed runs left, Soup's shard cache checked and repaired."""

from __future__ import annotations
import os
import tempfile
from pathlib import Path
from conftest import dead_pid
from issue395.host.scratch import SCRATCH_PREFIX, Scratch, process_start


def test_scratch_left_by_a_dead_run_is_reaped_and_a_live_ones_kept(tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    me, dead = os.getpid(), dead_pid()

    def scratch(name: str, owner: str) -> Path:
        folder = tmp / f"{SCRATCH_PREFIX}{name}"
        (folder / "arms" / "000").mkdir(parents=True)
        (folder / "arms" / "000" / "train.jsonl").write_text("{}\n")
        (folder / "owner").write_text(owner)
        return folder

    dead_one = scratch(f"{dead}-x", f"{dead} 12345\n")
    live_one = scratch(f"{me}-y", f"{me} {process_start(me)}\n")
    reused_pid = scratch(f"{me}-z", f"{me} 1\n")  # the pid lives on, but in another process
    being_made = scratch(f"{me}-w", "")  # its owner file not yet written: not judged
    foreign = scratch("not-a-pid", "")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    link = tmp / f"{SCRATCH_PREFIX}{dead}-link"
    link.symlink_to(outside, target_is_directory=True)

    with Scratch() as s:
        assert s.root.parent == tmp and s.root.name.startswith(f"{SCRATCH_PREFIX}{me}-")
        assert not dead_one.exists() and not reused_pid.exists()
        assert live_one.exists() and being_made.exists() and foreign.exists()
        assert link.is_symlink() and (outside / "keep.txt").read_text() == "mine"
    assert not s.root.exists()
    assert {p.name for p in tmp.iterdir()} == {live_one.name, being_made.name, foreign.name, link.name}


def test_repair_leaves_a_shard_folder_that_a_peer_is_still_writing(tmp_path):
    import torch
    from safetensors.torch import save_file
    from soup_cli.utils.layer_shard import layer_shard_path, resolve_shard_dir

    with Scratch(str(tmp_path / "cache")) as scratch:
        base = str(tmp_path / "model")
        folder = resolve_shard_dir(base)
        save_file({"w": torch.zeros(4)}, layer_shard_path(folder, 0))  # index.json comes last
        scratch.repair_shards(base)
        assert list(__import__("pathlib").Path(folder).glob("*.safetensors"))


def test_a_cold_cache_dir_is_not_reported_as_damaged_shards(capfd, tmp_path):
    """A first run's model has no shard folder yet; that is not damage. (Soup's
    resolve_shard_dir creates the folder it names, empty, before Soup shards into it.)"""
    with Scratch(str(tmp_path / "cache")) as scratch:
        scratch.repair_shards(str(tmp_path / "checkpoints" / "smol-0123456789ab"))
    _, err = capfd.readouterr()
    assert "damaged" not in err, err
