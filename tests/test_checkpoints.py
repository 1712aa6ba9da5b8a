"""Checkpoint builds and a stop (issue 22, defect 10): a Ctrl-C during a build stops the writer
between tensors and leaves no half-built folder. CPU, a tiny many-layered shape."""

from __future__ import annotations

import time

import pytest

from issue395 import builder
from issue395.builder import BuildStopped

from issue395.checkpoints import Checkpoints
from issue395.console import Stop
from issue395.options import Run
from issue395.record import Shape
from issue395.scratch import Scratch

TINY = Shape(key="tiny", name="tiny", hub_id="tiny", model_type="llama", pool=0, extras=0, adapter=0,
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
        checkpoints = Checkpoints(["tiny"], {"tiny": TINY}, Run(models=("tiny",), weights="synthetic"), scratch)
        started = time.perf_counter()
        with pytest.raises(BuildStopped):
            checkpoints.get("tiny")
        checkpoints.close()
        assert time.perf_counter() - started < 10
        assert len(made) <= 4, f"{len(made)} tensors made after the stop was asked at the third"
        assert list(root.iterdir()) == [], "a half-built checkpoint was left behind"


def test_a_checkpoint_built_with_no_stop_is_whole_and_verifies():
    from issue395.checkpoints import checkpoint_problem

    with Scratch() as scratch:
        checkpoints = Checkpoints(["tiny"], {"tiny": TINY}, Run(models=("tiny",), weights="synthetic"), scratch)
        path = checkpoints.get("tiny")
        checkpoints.close()
        assert checkpoint_problem(__import__("pathlib").Path(path)) is None
