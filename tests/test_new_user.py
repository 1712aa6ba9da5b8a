"""What a hostile new user hits first: a many-layered tiny model's build memory, configs no real
model has, a closed terminal and an early Ctrl-C, and saved results edited by hand. CPU only,
tiny models only."""

from __future__ import annotations

import copy
import json
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import ROOT, main, one_error_line

from issue395.console import Stop
from issue395.record import Shape

MAP = ROOT / "results/h200x2-2026-11-30-map-2gpu/map-2gpu.json"
SWEEP = ROOT / "results/h200-2026-11-30-margin-map/full-cold.json"
SCHEMA1 = ROOT / "results/h200-2026-11-30/h200-2026-11-30-full-cold.json"


# 1. the builder: each tensor owns exactly its bytes --------------------------------------------

def _tiny_llama(layers: int, vocab: int = 512, hidden: int = 64, intermediate: int = 128) -> Shape:
    return Shape(key="custom", name="tiny", hub_id="tiny", model_type="llama", pool=0, extras=0,
                 adapter=0, vocab=vocab, hidden=hidden, intermediate=intermediate, n_layers=layers,
                 max_positions=256, arch={"num_attention_heads": 4, "num_key_value_heads": 2},
                 record=False)


def _written_tensors(shape, dest, monkeypatch):
    """The tensors write_weights hands safetensors, caught before anything is written."""
    import safetensors.torch

    from issue395.builder import prepare_checkpoint

    caught = {}
    monkeypatch.setattr(safetensors.torch, "save_file",
                        lambda tensors, path, metadata=None: caught.update(tensors))
    Path(dest).mkdir(parents=True, exist_ok=True)
    (Path(dest) / "model.safetensors").write_bytes(b"")  # the manifest stats the file
    prepare_checkpoint(shape, Path(dest))()
    return caught


def test_every_built_weight_owns_exactly_its_own_bytes_not_the_tiled_pool(tmp_path, monkeypatch):
    tensors = _written_tensors(_tiny_llama(layers=40), tmp_path / "ckpt", monkeypatch)
    assert len(tensors) > 40 * 9
    for name, t in tensors.items():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name
    total = sum(t.untyped_storage().nbytes() for t in tensors.values())
    assert total < 8 * 2**20  # the pool tiled once per tensor held 2 MiB each: ~750 MiB


def test_built_weights_keep_the_values_of_the_tiled_pool(tmp_path, monkeypatch):
    """The committed results used these weights: small tensors are the pool from a moving offset,
    tensors larger than the tile repeat it."""
    import torch

    tensors = _written_tensors(_tiny_llama(layers=2, vocab=20000, hidden=64), tmp_path / "ckpt",
                               monkeypatch)
    gen = torch.Generator().manual_seed(395)
    size = 1 << 20
    pool = (torch.randn(2 * size, generator=gen, dtype=torch.float32) * 0.02).to(torch.bfloat16)
    big = 0
    for i, (name, t) in enumerate(tensors.items()):
        if "norm" in name:
            assert bool((t == 1.0).all()), name
            continue
        offset = (i * 7919) % size
        n = t.numel()
        expected = pool[offset:offset + size].repeat(-(-n // size))[:n].view(t.shape)
        assert torch.equal(t, expected), name
        big += n > size
    assert big, "no tensor larger than the tile was checked"


# 2. configs no real model has ------------------------------------------------------------------

@pytest.mark.parametrize("field, value, limit", [
    ("num_hidden_layers", 1_000_000, "1024"),
    ("vocab_size", 2**31 - 1, "4194304"),
    ("hidden_size", 2**20, "65536"),
    ("intermediate_size", 2**24, "262144"),
], ids=["layers", "vocab", "hidden", "intermediate"])
def test_a_config_larger_than_any_real_model_is_one_line_naming_the_limit(capfd, tmp_path, field,
                                                                          value, limit):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 512, "max_position_embeddings": 256, field: value}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    t = time.perf_counter()
    line = one_error_line(*main(capfd, ["--dry-run", "--model", path, "--seq", "64"]), field, limit)
    assert time.perf_counter() - t < 30, line


def test_derive_shape_refuses_a_config_larger_than_any_real_model():
    from transformers import AutoConfig

    from issue395.errors import UsageError
    from issue395.shapes import derive_shape

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=2**23)
    with pytest.raises(UsageError, match="vocab_size"):
        derive_shape(config, "huge")


# 3. signals ------------------------------------------------------------------------------------

@pytest.fixture
def sighup_restored(monkeypatch):
    """SIGHUP's handler restored after; the streams of a pytest run with -s left alone."""
    from issue395 import console

    gone = []
    monkeypatch.setattr(console, "terminal_gone", lambda: gone.append(True))
    saved = signal.getsignal(signal.SIGHUP)
    yield gone
    signal.signal(signal.SIGHUP, saved if saved is not None else signal.SIG_DFL)


def _signal_self(sig) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(2)  # the handler raises KeyboardInterrupt before this returns


def test_a_closed_terminal_sighup_stops_at_once_like_sigterm(sighup_restored):
    Stop.install(quiet=True)
    with pytest.raises(KeyboardInterrupt):
        _signal_self(signal.SIGHUP)
    assert Stop.requested and sighup_restored == [True]


def test_after_a_hang_up_a_terminal_stdout_writes_to_dev_null_and_a_pipe_is_kept():
    """In a fresh process whose stdout is a terminal (a pty) and stderr a pipe: writing to a
    hung-up terminal fails with EIO, so it is pointed at /dev/null; the pipe still gets text."""
    import pty
    import subprocess
    import sys

    master, slave = pty.openpty()
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); from issue395.console import terminal_gone; "
            "terminal_gone(); null = os.stat(os.devnull).st_rdev; "
            "sys.stderr.write(f'{os.fstat(1).st_rdev == null} {os.fstat(2).st_rdev == null}')")
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(ROOT)], stdout=slave,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(slave)
        os.close(master)
    assert proc.stderr == "True False", proc.stderr


def test_a_closed_terminal_stops_at_once_even_with_an_arm_in_flight(sighup_restored):
    Stop.install(quiet=True, track_arms=True)
    with pytest.raises(KeyboardInterrupt), Stop.arm():
        _signal_self(signal.SIGHUP)
    assert Stop.requested and not Stop.in_flight


def test_first_ctrl_c_with_no_arm_in_flight_stops_at_once_and_says_so(capfd):
    Stop.install(track_arms=True)
    with pytest.raises(KeyboardInterrupt):
        _signal_self(signal.SIGINT)
    assert Stop.requested
    err = capfd.readouterr().err
    assert "no arm in flight" in err and "stopping now" in err
    assert "after the arm in flight" not in err


def test_first_ctrl_c_with_an_arm_in_flight_waits_for_it_and_a_second_stops_now(capfd):
    Stop.install(track_arms=True)
    with Stop.arm():
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 5
        while not Stop.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert Stop.requested  # no KeyboardInterrupt: the arm finishes
        assert "stopping after the arm in flight" in capfd.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            _signal_self(signal.SIGINT)
    assert not Stop.in_flight


def test_a_ctrl_c_between_arms_stops_at_once_once_arms_are_tracked(capfd):
    Stop.install(quiet=True, track_arms=True)
    with Stop.arm():
        pass
    with pytest.raises(KeyboardInterrupt):
        _signal_self(signal.SIGINT)


# 4 and 5. saved results edited by hand ---------------------------------------------------------

def _corrupt(tmp_path, source, edit):
    data = json.loads(Path(source).read_text())
    edit(data)
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(data))
    return path


def _dup_first_row(d):
    d["rows"].append(copy.deepcopy(d["rows"][0]))


def _margin(**kw):
    return lambda d: d["margins"][0].update(kw)


@pytest.mark.parametrize("source, edit, words", [
    (SCHEMA1, lambda d: d.update(determinism=[1]), ["determinism"]),
    (SCHEMA1, lambda d: d.update(determinism={"arms": {"a": 1}}), ["determinism"]),
    (SCHEMA1, lambda d: d.update(determinism={"arms": [1]}), ["determinism"]),
    (SCHEMA1, lambda d: d.update(determinism={"arms": [{"rows": 3}]}), ["determinism"]),
    (SCHEMA1, lambda d: d.update(determinism={"arms": [{"rows": [dict(d["rows"][0], repeat="x")]}]}),
     ["repeat"]),
    (SCHEMA1, lambda d: d["rows"][0].update(elements="x"), ["elements"]),
    (SCHEMA1, _dup_first_row, ["twice"]),
    (MAP, lambda d: d.update(margins=[{}]), ["margin"]),
    (MAP, lambda d: d.update(margins={"a": 1}), ["margins"]),
    (MAP, lambda d: d.update(margins=[1]), ["margin"]),
    (MAP, _margin(ratio="x"), ["ratio"]),
    (MAP, _margin(ratio=float("nan")), ["ratio"]),
    (MAP, _margin(model_key=["smol"]), ["model_key"]),
    (MAP, _margin(complete="yes"), ["complete"]),
    (MAP, _margin(terms=3), ["terms"]),
    (MAP, _margin(terms=[{}]), ["terms"]),
    (MAP, _margin(terms=[{"term": "x", "charged": 1, "measured": 1, "missed": 0, "per": [0, "x"]}]),
     ["per"]),
    (MAP, _margin(note=3), ["note"]),
    (MAP, lambda d: d["rows"][0].update(model_key=["smol"]), ["model_key"]),
    (MAP, lambda d: d["rows"][0].update(model=["x"]), ["model"]),
    (MAP, _dup_first_row, ["twice"]),
    (SWEEP, _dup_first_row, ["twice"]),
    (SWEEP, lambda d: d.update(timings=[1]), ["timings"]),
    (SWEEP, lambda d: d["environment"].update(torch=["2.9"]), ["torch"]),
    (SWEEP, lambda d: d["environment"].update(date={"x": 1}), ["date"]),
    (SWEEP, lambda d: d.update(kind=["map"]), ["kind"]),
    (SWEEP, lambda d: d.update(kind="bogus"), ["kind"]),
    (SWEEP, lambda d: d.update(interrupted="no"), ["interrupted"]),
    (SWEEP, lambda d: d.update(error=["x"]), ["error"]),
    (SWEEP, lambda d: d.update(control=[1]), ["control"]),
    (SWEEP, lambda d: d.update(measure=[1]), ["measure"]),
    (SWEEP, lambda d: d.update(sdpa="x"), ["sdpa"]),
    (SWEEP, lambda d: d.update(schema=True), ["schema"]),
    (SWEEP, lambda d: d["rows"][0].update(timings=[1]), ["timings"]),
    (SWEEP, lambda d: d["rows"][0].update(error=["x"]), ["error"]),
    (SWEEP, lambda d: d["rows"][0].update(gpu=["x"]), ["gpu"]),
    (SWEEP, lambda d: d["rows"][0].update(log=5), ["log"]),
    (SWEEP, lambda d: d["rows"][0].update(dry_run="yes"), ["dry_run"]),
    (SWEEP, lambda d: d["rows"][0].update(soup_terms=[1]), ["soup_terms"]),
    (SWEEP, lambda d: d["rows"][0].update(targets=3), ["targets"]),
], ids=["s1-determinism-list", "s1-determinism-arms-object", "s1-determinism-arm-number",
        "s1-determinism-rows-number", "s1-determinism-repeat-string", "s1-elements-string",
        "s1-duplicate-arm", "map-margin-empty", "map-margins-object", "map-margin-number",
        "map-margin-ratio-string", "map-margin-ratio-nan", "map-margin-model-key-list",
        "map-margin-complete-string", "map-margin-terms-number", "map-margin-term-empty",
        "map-margin-per-zero", "map-margin-note-number", "map-row-model-key-list",
        "map-row-model-list", "map-duplicate-arm", "sweep-duplicate-arm", "timings-list",
        "environment-value-list", "environment-value-object", "kind-list", "kind-unknown",
        "interrupted-string", "error-list", "control-list", "measure-list", "sdpa-string",
        "schema-true", "row-timings-list", "row-error-list", "row-gpu-list", "row-log-number",
        "row-dry-run-string", "row-soup-terms-list", "row-targets-number"])
def test_a_hand_edited_saved_result_is_one_line_and_exit_2(capfd, tmp_path, source, edit, words):
    path = _corrupt(tmp_path, source, edit)
    one_error_line(*main(capfd, ["--from-json", path]), "--from-json", *words)


def test_two_maps_whose_row_model_key_is_a_list_are_one_line_not_a_traceback(capfd, tmp_path):
    bad = _corrupt(tmp_path, MAP, lambda d: d["rows"][0].update(model_key=["smol"]))
    good = tmp_path / "good.json"
    good.write_text(MAP.read_text())
    one_error_line(*main(capfd, ["--from-json", bad, good]), "model_key")


def test_the_committed_results_still_load(capfd):
    for path in (MAP, SWEEP, SCHEMA1):
        code, out, err = main(capfd, ["--from-json", path])
        assert code in (0, 1) and out and "error" not in err, (path, err)
