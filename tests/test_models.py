"""The record's two synthetic checkpoints (SmolLM2 and Qwen2.5) against docs/PROTOCOL.md's shape
table: tests of SHAPES (issue395.registry) and of the builder on them, still to move to test_registry
and test_builder (issue 21).

The record's byte figures are pinned on the two real builds (made by the harness's own builder once
per session into the session's --cache-dir, which the CLI tests then reuse), read through the
safetensors header without loading a tensor; their configs, derived shapes and tokenizers. The
builder's fingerprint and cache moved to test_builder and test_checkpoints, derive_shape's refusals
to test_shapes. Nothing is faked.
"""

from __future__ import annotations

import json

import pytest
from conftest import QWEN, SMOL

from issue395.builder import checkpoint_fingerprint, hf_config
from issue395.arm import predicted_bytes
from issue395.checkpoints import synthetic_checkpoint
from issue395.registry import SHAPES
from issue395.shapes import derive_shape

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
