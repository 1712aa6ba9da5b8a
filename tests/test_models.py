"""The synthetic checkpoints: architecture-exact, loadable, and cached.

Both models are built once for this module with the harness's real builder
(torch + safetensors + transformers, on CPU) and inspected with the real
libraries. Nothing is faked.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import issue395_second_stack_vram as h  # noqa: E402

MODELS = ["smol", "qwen"]
# PROTOCOL.md's shape table, typed in independently of h.SHAPES.
PROTOCOL = {
    "smol": dict(pool=14160384, extras=56624256, adapter=921600, vocab=49152, hidden=576,
                 intermediate=1536, n_layers=30, heads=9, kv_heads=3, max_positions=8192,
                 rope_theta=100000.0, rms_eps=1e-5, model_type="llama"),
    "qwen": dict(pool=59649536, extras=272271104, adapter=1081344, vocab=151936, hidden=896,
                 intermediate=4864, n_layers=24, heads=14, kv_heads=2, max_positions=32768,
                 rope_theta=1000000.0, rms_eps=1e-6, model_type="qwen2"),
}


@pytest.fixture(scope="module")
def checkpoints(request, tmp_path_factory):
    """Both synthetic checkpoints, built by the harness's own builder at most once per
    session: when a session-wide ``cache_dir`` fixture exists (the CLI tests'
    --cache-dir), its checkpoints/ folder is shared through the harness's own cache
    (synthetic_checkpoint -> build_checkpoint); otherwise they are built here."""
    try:
        root = Path(request.getfixturevalue("cache_dir")) / "checkpoints"
    except pytest.FixtureLookupError:
        root = tmp_path_factory.mktemp("checkpoints")
    root.mkdir(parents=True, exist_ok=True)
    return {k: h.synthetic_checkpoint(h.SHAPES[k], root)[0] for k in MODELS}


@pytest.fixture(scope="module")
def tensors(checkpoints):
    """name -> (dtype, shape, bytes) for every tensor in each model.safetensors."""
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


@pytest.mark.parametrize("key", MODELS)
def test_every_tensor_is_bf16(key, tensors):
    assert {dtype for dtype, _, _ in tensors[key].values()} == {"BF16"}


@pytest.mark.parametrize("key", MODELS)
def test_decoder_layer_bytes_are_half_the_pool(key, tensors):
    layer0 = [b for name, (_, _, b) in tensors[key].items() if ".layers.0." in name]
    assert sum(layer0) == PROTOCOL[key]["pool"] // 2
    if key == "smol":  # PROTOCOL: a SmolLM2 decoder layer is 3,540,096 parameters
        assert sum(layer0) // 2 == 3_540_096


@pytest.mark.parametrize("key", MODELS)
def test_non_layer_tensors_are_the_extras(key, tensors):
    rest = {n: b for n, (_, _, b) in tensors[key].items() if ".layers." not in n}
    assert sum(rest.values()) == PROTOCOL[key]["extras"]
    assert set(rest) == {"model.embed_tokens.weight", "model.norm.weight"}


@pytest.mark.parametrize("key", MODELS)
def test_layer_count_and_tied_head(key, tensors):
    layers = {int(n.split(".layers.")[1].split(".")[0]) for n in tensors[key] if ".layers." in n}
    assert layers == set(range(PROTOCOL[key]["n_layers"]))
    assert not any("lm_head" in n for n in tensors[key])
    # every layer has the same byte count as layer 0
    per_layer = {}
    for n, (_, _, b) in tensors[key].items():
        if ".layers." in n:
            i = int(n.split(".layers.")[1].split(".")[0])
            per_layer[i] = per_layer.get(i, 0) + b
    assert set(per_layer.values()) == {PROTOCOL[key]["pool"] // 2}


@pytest.mark.parametrize("key", MODELS)
def test_qkv_bias_only_for_qwen(key, tensors):
    biases = {n.split(".")[-2] for n in tensors[key]
              if ".layers.0.self_attn." in n and n.endswith(".bias")}
    if key == "qwen":
        assert biases == {"q_proj", "k_proj", "v_proj"}
    else:
        assert biases == set()


@pytest.mark.parametrize("key", MODELS)
def test_config_carries_the_public_architecture(key, checkpoints):
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(checkpoints[key]))
    p = PROTOCOL[key]
    assert c.model_type == p["model_type"]
    assert c.hidden_size == p["hidden"]
    assert c.intermediate_size == p["intermediate"]
    assert c.num_hidden_layers == p["n_layers"]
    assert c.num_attention_heads == p["heads"]
    assert c.num_key_value_heads == p["kv_heads"]
    assert c.vocab_size == p["vocab"]
    assert c.max_position_embeddings == p["max_positions"]
    rope = getattr(c, "rope_parameters", None)
    theta = rope["rope_theta"] if isinstance(rope, dict) else c.rope_theta
    assert theta == p["rope_theta"]
    assert c.rms_norm_eps == p["rms_eps"]
    assert c.tie_word_embeddings is True
    assert c.hidden_act == "silu"
    if key == "qwen":
        assert not getattr(c, "use_sliding_window", False)


@pytest.mark.parametrize("key", MODELS)
def test_derive_shape_reproduces_protocol_figures(key, checkpoints):
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(checkpoints[key]))
    s = h.derive_shape(c, name=f"built-{key}")
    p = PROTOCOL[key]
    for f in ("pool", "extras", "adapter", "vocab", "hidden", "intermediate", "n_layers",
              "heads", "kv_heads", "max_positions", "rope_theta", "rms_eps", "model_type"):
        assert getattr(s, f) == p[f], f
    assert s.qkv_bias is (key == "qwen")
    assert s.record is False
    # A derived shape predicts exactly what the grid's shape predicts.
    assert h.predicted_bytes(s, 4096) == h.predicted_bytes(h.SHAPES[key], 4096)


@pytest.mark.parametrize("config_name", ["GPT2Config", "BertConfig"])
def test_derive_shape_refuses_an_architecture_soup_cannot_stream(config_name):
    import transformers

    config = getattr(transformers, config_name)(n_layer=1, num_hidden_layers=1)
    with pytest.raises(h.UsageError, match="cannot be layer-streamed"):
        h.derive_shape(config, name="tiny")


@pytest.fixture(scope="module")
def tokenizers(checkpoints):
    from transformers import AutoTokenizer

    return {k: AutoTokenizer.from_pretrained(str(p)) for k, p in checkpoints.items()}


def test_tokenizer_loads_per_model_type(tokenizers):
    """transformers picks the tokenizer class by model type: Qwen2Tokenizer for qwen2,
    a different (generic fast) class for llama."""
    assert type(tokenizers["qwen"]).__name__ == "Qwen2Tokenizer"
    assert type(tokenizers["smol"]).__name__ != type(tokenizers["qwen"]).__name__


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


# --- cache and fingerprint (a tiny shape keeps this fast) ------------------------

TINY = dataclasses.replace(h.SHAPES["smol"], key="tiny", name="tiny", n_layers=2, vocab=512,
                           hidden=64, intermediate=128, heads=4, kv_heads=2, max_positions=256)


def test_fingerprint_changes_with_every_shaping_field():
    base = h.checkpoint_fingerprint(TINY)
    assert h.checkpoint_fingerprint(TINY) == base
    for change in (dict(n_layers=3), dict(vocab=1024), dict(hidden=32), dict(rms_eps=1e-6),
                   dict(qkv_bias=True), dict(rope_theta=10000.0), dict(model_type="qwen2")):
        assert h.checkpoint_fingerprint(dataclasses.replace(TINY, **change)) != base, change
    # 'record' does not shape the weights, so it does not change the name.
    assert h.checkpoint_fingerprint(dataclasses.replace(TINY, record=False)) == base


def test_synthetic_checkpoint_is_built_once_then_served_from_cache(tmp_path):
    first, build_s = h.synthetic_checkpoint(TINY, tmp_path)
    assert build_s > 0.0
    assert (first / ".complete").is_file()
    assert (first / "model.safetensors").is_file()
    assert first.name == f"tiny-{h.checkpoint_fingerprint(TINY)}"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again, again_s = h.synthetic_checkpoint(TINY, tmp_path)
    assert again == first
    assert again_s == 0.0
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    # No half-built folder is left behind.
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_synthetic_checkpoint_rebuilds_an_unfinished_folder(tmp_path):
    """A folder without its .complete marker (e.g. a half-finished rm -r) is not
    trusted: it is replaced by a complete build."""
    dest = tmp_path / f"tiny-{h.checkpoint_fingerprint(TINY)}"
    dest.mkdir()
    (dest / "config.json").write_text("{}")
    path, build_s = h.synthetic_checkpoint(TINY, tmp_path)
    assert build_s > 0.0
    assert (path / ".complete").is_file()
    assert (path / "model.safetensors").is_file()
