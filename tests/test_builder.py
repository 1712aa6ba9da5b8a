"""issue395.builder: architecture-exact synthetic checkpoints. Building one says nothing of
transformers' own (issue 22, defect 17: a stray "Unrecognized keys in `rope_parameters`" leaked to
stderr in the map's dry run: Gemma 3's per-layer-type rope, as transformers 5 validates it while the
builder made and saved its config); each weight owns its own bytes; an untied head is kept and
Gemma's norms are their neutral zero; a safetensors file is whole or says why not; a checkpoint's
fingerprint changes with every field that shapes it and with nothing else. CPU, tiny shapes
of the real families; nothing faked. Soup's own read of the config inside an arm goes to the arm's
Soup log."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from conftest import TINY

from issue395 import builder
from issue395.builder import checkpoint_fingerprint, prepare_checkpoint, safetensors_problem
from issue395.registry import FAMILIES, Shape
from issue395.shapes import family_shape, load_custom_shape


def test_a_gemma3_checkpoint_is_built_and_its_shape_read_with_no_rope_warning_on_stderr(capfd, tmp_path):
    gemma3 = family_shape("gemma3-1b")
    tiny = dataclasses.replace(gemma3, key="g3", vocab=512, hidden=64, intermediate=128, n_layers=2,
                               arch=dict(gemma3.arch, num_attention_heads=2, num_key_value_heads=1, head_dim=32))
    prepare_checkpoint(tiny, tmp_path)
    load_custom_shape(str(tmp_path))
    _, err = capfd.readouterr()
    assert "Unrecognized keys" not in err, err

def _tiny_llama(layers: int, vocab: int = 512, hidden: int = 64, intermediate: int = 128) -> Shape:
    return Shape(key="custom", name="tiny", hub_id="tiny", model_type="llama", pool=0, extras=0,
                 grid_adapter=0, vocab=vocab, hidden=hidden, intermediate=intermediate, n_layers=layers,
                 max_positions=256, arch={"num_attention_heads": 4, "num_key_value_heads": 2},
                 record=False)


def _written_tensors(shape, dest, monkeypatch):
    """The tensors write_weights wrote, read back with safetensors in the order they were written."""
    from safetensors.torch import load_file

    prepare_checkpoint(shape, Path(dest))()
    path = Path(dest) / "model.safetensors"
    tensors = load_file(str(path))
    with open(path, "rb") as fh:
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    header.pop("__metadata__")
    return {k: tensors[k] for k in sorted(header, key=lambda k: header[k]["data_offsets"][0])}


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


def test_safetensors_problem_detects_truncation_and_a_missing_file(tmp_path):
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(64, 64, dtype=torch.bfloat16)}, str(path))
    assert safetensors_problem(path) is None
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(size - 100)
    assert "bytes, its header describes" in safetensors_problem(path)
    with open(path, "r+b") as fh:
        fh.truncate(4)
    assert safetensors_problem(path) == "w.safetensors: truncated header"
    path.write_bytes(b"")
    assert safetensors_problem(path) == "w.safetensors: truncated header"
    path.unlink()
    assert safetensors_problem(path) == "w.safetensors: FileNotFoundError"


def test_builder_keeps_an_untied_head_and_sets_gemma_norms_to_their_neutral_zero(tmp_path):
    from safetensors import safe_open

    tiny = dict(n_layers=1, vocab=512, hidden=64, intermediate=128, max_positions=256, record=False)
    gemma = dataclasses.replace(family_shape("gemma-2b"), key="g", **tiny,
                                arch=dict(FAMILIES["gemma-2b"].config, num_attention_heads=2, head_dim=32))
    mistral = dataclasses.replace(family_shape("mistral-7b"), key="m", **tiny,
                                  arch=dict(FAMILIES["mistral-7b"].config, num_attention_heads=2,
                                            num_key_value_heads=1, head_dim=32))
    for shape in (gemma, mistral):
        prepare_checkpoint(shape, tmp_path / shape.key)()
    with safe_open(str(tmp_path / "g" / "model.safetensors"), framework="pt") as f:
        norms = [f.get_tensor(k) for k in f.keys() if "norm" in k]
        assert norms and all(float(t.abs().max()) == 0.0 for t in norms)
        assert "lm_head.weight" not in f.keys()
    with safe_open(str(tmp_path / "m" / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" in f.keys()
        assert all(float(f.get_tensor(k).min()) == 1.0 for k in f.keys() if "norm" in k)


#: Fields that name a model but do not shape its checkpoint (record does: a --model shape
#: keeps its own config fields, the record's are tied with silu).
#: A streaming mode changes how Soup shards a checkpoint, never the checkpoint: its modes share it.
NOT_SHAPING = {"name", "hub_id", "stream"}


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, tuple):
        return value + ("x",)
    raise TypeError(value)


def test_fingerprint_changes_with_every_shaping_field(monkeypatch):
    base = checkpoint_fingerprint(TINY)
    assert checkpoint_fingerprint(dataclasses.replace(TINY)) == base
    fields = {f.name for f in dataclasses.fields(Shape)}
    assert NOT_SHAPING < fields
    for name in sorted(fields - NOT_SHAPING - {"arch"}):  # every field, a new one included
        changed = dataclasses.replace(TINY, **{name: _changed(getattr(TINY, name))})
        assert checkpoint_fingerprint(changed) != base, name
    for key, value in TINY.arch.items():
        changed = dataclasses.replace(TINY, arch=dict(TINY.arch, **{key: _changed(value)}))
        assert checkpoint_fingerprint(changed) != base, key
    assert checkpoint_fingerprint(dataclasses.replace(
        TINY, arch=dict(TINY.arch, use_sliding_window=False))) != base  # a new arch field
    for name in sorted(NOT_SHAPING):
        value = getattr(TINY, name)
        changed = dataclasses.replace(TINY, **{name: _changed(value)})
        assert checkpoint_fingerprint(changed) == base, name
    # The builder and the tokenizer's words shape the checkpoint too.
    monkeypatch.setattr(builder, "BUILDER_VERSION", builder.BUILDER_VERSION + 1)
    assert checkpoint_fingerprint(TINY) != base
    monkeypatch.undo()
    monkeypatch.setattr(builder, "TOKEN_WORDS", builder.TOKEN_WORDS + ("extra",))
    assert checkpoint_fingerprint(TINY) != base
