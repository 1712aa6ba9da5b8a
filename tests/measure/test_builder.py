"""issue395.measure.builder: architecture-exact synthetic checkpoints. Building one says nothing of
transformers' own (issue 22, defect 17: a stray "Unrecognized keys in `rope_parameters`" leaked to
stderr in the map's dry run: Gemma 3's per-layer-type rope, as transformers 5 validates it while the
builder made and saved its config); each weight owns its own bytes; an untied head is kept and
Gemma's norms are their neutral zero; a safetensors file is whole or says why not; a checkpoint's
fingerprint changes with every field that shapes it and with nothing else. CPU, tiny shapes
of the real families; nothing faked. Soup's own read of the config inside an arm goes to the arm's
Soup log.

The record's two checkpoints (SmolLM2 and Qwen2.5) against docs/PROTOCOL.md's shape table: built once
per session by the harness's own builder into the session's --cache-dir (which the CLI tests then
reuse), their byte figures read through the safetensors header without loading a tensor, their
configs, tokenizers and the shapes derived back from them; the registry's two shapes as the builder
configures them derive the protocol's figures too, and their fingerprints differ."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import QWEN, SMOL, TINY

from issue395.measure import builder
from issue395.model.arm import predicted_bytes
from issue395.measure.builder import checkpoint_fingerprint, hf_config, prepare_checkpoint, safetensors_problem
from issue395.host.checkpoints import synthetic_checkpoint
from issue395.model.registry import FAMILIES, SHAPES, Shape
from issue395.measure.shapes import derive_shape, family_shape, load_custom_shape


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
#: Nor does the LoRA adapter Soup puts on it (targets, r, alpha, the grid's adapter count): a
#: --config arm with its own adapter runs on its family's checkpoint.
NOT_SHAPING = {"name", "hub_id", "stream", "targets", "lora_r", "lora_alpha", "grid_adapter"}


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


MODELS = ["smol", "qwen"]
# docs/PROTOCOL.md's shape table, typed in independently of SHAPES.
PROTOCOL = {
    "smol": dict(pool=14160384, extras=56624256, grid_adapter=921600, vocab=49152, hidden=576,
                 intermediate=1536, n_layers=30, heads=9, kv_heads=3, max_positions=8192,
                 rope_theta=100000.0, rms_eps=1e-5, model_type="llama"),
    "qwen": dict(pool=59649536, extras=272271104, grid_adapter=1081344, vocab=151936, hidden=896,
                 intermediate=4864, n_layers=24, heads=14, kv_heads=2, max_positions=32768,
                 rope_theta=1000000.0, rms_eps=1e-6, model_type="qwen2"),
}


@pytest.fixture(scope="module")
def checkpoints(cache_dir):
    """Both record checkpoints, built once per session by the harness's own builder into the
    session cache (the folder the CLI tests' --cache-dir runs reuse)."""
    root = cache_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    return {k: synthetic_checkpoint(SHAPES[k], root)[0] for k in MODELS}


@pytest.fixture(scope="module")
def tensors(checkpoints):
    """name -> (dtype, shape, bytes) for every tensor in each model.safetensors, off its header."""
    from safetensors import safe_open

    out = {}
    for key, path in checkpoints.items():
        info = {}
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                shape = list(sl.get_shape())
                n = 1
                for d in shape:
                    n *= d
                info[name] = (sl.get_dtype(), shape, n * 2)
        out[key] = info
    return out


def layer_of(name: str) -> int:
    return int(name.split(".layers.")[1].split(".")[0])


@pytest.mark.parametrize("key", MODELS)
def test_every_tensor_is_bf16(key, tensors):
    assert tensors[key]
    assert {dtype for dtype, _, _ in tensors[key].values()} == {"BF16"}


@pytest.mark.parametrize("key", MODELS)
def test_decoder_layer_bytes_are_half_the_pool(key, tensors):
    layer0 = [b for name, (_, _, b) in tensors[key].items() if ".layers." in name and layer_of(name) == 0]
    assert sum(layer0) == PROTOCOL[key]["pool"] // 2
    if key == "smol":  # PROTOCOL: a SmolLM2 decoder layer is 3,540,096 parameters
        assert sum(layer0) // 2 == 3_540_096


@pytest.mark.parametrize("key", MODELS)
def test_non_layer_tensors_are_the_extras(key, tensors):
    rest = {n: b for n, (_, _, b) in tensors[key].items() if ".layers." not in n}
    assert sum(rest.values()) == PROTOCOL[key]["extras"]
    assert set(rest) == {"model.embed_tokens.weight", "model.norm.weight"}


@pytest.mark.parametrize("key", MODELS)
def test_layer_count_and_tied_head(key, tensors, checkpoints):
    names = tensors[key]
    assert {layer_of(n) for n in names if ".layers." in n} == set(range(PROTOCOL[key]["n_layers"]))
    assert not any("lm_head" in n for n in names)  # tied: the head is the embedding
    per_layer: dict[int, int] = {}
    for n, (_, _, b) in names.items():
        if ".layers." in n:
            per_layer[layer_of(n)] = per_layer.get(layer_of(n), 0) + b
    assert set(per_layer.values()) == {PROTOCOL[key]["pool"] // 2}
    config = json.loads((checkpoints[key] / "config.json").read_text())
    assert config["tie_word_embeddings"] is True


@pytest.mark.parametrize("key", MODELS)
def test_config_carries_the_public_architecture(key, checkpoints):
    from transformers import AutoConfig, AutoTokenizer

    c = AutoConfig.from_pretrained(str(checkpoints[key]))
    p = PROTOCOL[key]
    assert c.model_type == p["model_type"]
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (
        p["hidden"], p["intermediate"], p["n_layers"])
    assert (c.num_attention_heads, c.num_key_value_heads) == (p["heads"], p["kv_heads"])
    assert (c.vocab_size, c.max_position_embeddings) == (p["vocab"], p["max_positions"])
    rope = getattr(c, "rope_parameters", None)
    theta = rope["rope_theta"] if isinstance(rope, dict) else c.rope_theta
    assert theta == p["rope_theta"]
    assert c.rms_norm_eps == p["rms_eps"]
    assert c.tie_word_embeddings is True
    assert c.hidden_act == "silu"
    if key == "qwen":
        assert not getattr(c, "use_sliding_window", False)
    tok = AutoTokenizer.from_pretrained(str(checkpoints[key]))
    assert c.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert c.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")


@pytest.mark.parametrize("key", MODELS)
def test_derive_shape_reproduces_protocol_figures(key, checkpoints):
    """derive_shape (a meta skeleton, nothing allocated) on the built config gives the grid's
    figures, so a --model of the same architecture predicts exactly what the record's does."""
    from transformers import AutoConfig

    s = derive_shape(AutoConfig.from_pretrained(str(checkpoints[key])), name=f"built-{key}")
    p = PROTOCOL[key]
    for f in ("pool", "extras", "grid_adapter", "vocab", "hidden", "intermediate", "n_layers",
              "max_positions", "model_type"):
        assert getattr(s, f) == p[f], f
    assert s.grid_adapter == {"smol": 921600, "qwen": 1081344}[key]
    assert s.record is False
    for seq in (2048, 6144):
        assert predicted_bytes(s, seq) == predicted_bytes(SHAPES[key], seq)


@pytest.mark.parametrize("key", MODELS)
def test_the_grid_shapes_are_the_protocol(key):
    """SHAPES against the independently typed table, and its config on the meta device."""
    s, p = SHAPES[key], PROTOCOL[key]
    for f in ("pool", "extras", "grid_adapter", "vocab", "hidden", "intermediate", "n_layers",
              "max_positions", "model_type"):
        assert getattr(s, f) == p[f], f
    assert (s.arch["num_attention_heads"], s.arch["num_key_value_heads"]) == (p["heads"], p["kv_heads"])
    assert (s.arch["rope_theta"], s.arch["rms_norm_eps"]) == (p["rope_theta"], p["rms_eps"])
    derived = derive_shape(hf_config(s), name=s.name)
    assert (derived.pool, derived.extras, derived.grid_adapter) == (p["pool"], p["extras"], p["grid_adapter"])


@pytest.fixture(scope="module")
def tokenizers(checkpoints):
    from transformers import AutoTokenizer

    return {k: AutoTokenizer.from_pretrained(str(p)) for k, p in checkpoints.items()}


@pytest.mark.parametrize("key", MODELS)
@pytest.mark.parametrize("n", [1, 2, 50, 777])
def test_each_word_is_one_token(key, n, tokenizers):
    """N copies of "word " are N word tokens plus one token for the trailing space;
    the content without its trailing space is exactly N tokens."""
    tok = tokenizers[key]
    ids = tok("word " * n, add_special_tokens=False)["input_ids"]
    pieces = tok.convert_ids_to_tokens(ids)
    assert len(ids) == n + 1
    assert pieces[0] == "word"
    assert set(pieces[1:n]) <= {"\u0120word"}
    assert pieces[n] == "\u0120"
    assert len(tok(("word " * n).rstrip(), add_special_tokens=False)["input_ids"]) == n


@pytest.mark.parametrize("key", MODELS)
def test_chat_special_tokens_are_single_ids(key, tokenizers):
    tok = tokenizers[key]
    ids = {}
    for special in ("<|im_start|>", "<|im_end|>"):
        got = tok(special, add_special_tokens=False)["input_ids"]
        assert len(got) == 1, special
        assert got[0] == tok.convert_tokens_to_ids(special)
        assert special in tok.all_special_tokens
        ids[special] = got[0]
    assert ids["<|im_start|>"] != ids["<|im_end|>"]
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    # A whole chatml assistant turn: the words stay one token each around the specials.
    text = "<|im_start|>assistant\n" + "word " * 10 + "<|im_end|>\n"
    pieces = tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])
    assert pieces.count("<|im_start|>") == 1 and pieces.count("<|im_end|>") == 1
    assert sum(p in ("word", "\u0120word") for p in pieces) == 10


def test_the_two_record_shapes_have_different_fingerprints():
    assert checkpoint_fingerprint(SMOL) != checkpoint_fingerprint(QWEN)
