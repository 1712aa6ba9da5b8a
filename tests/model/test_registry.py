"""issue395.model.registry: the one model registry. Every model is here once, by key (the record's two
with their published shapes, every family Soup streams), and every lookup by key answers from
here, a streaming mode after the key included. Plain data and lookups: no torch, no Soup.
"""

from __future__ import annotations

import pytest

from issue395.errors import UsageError
from issue395.record import LORA_TARGETS
from issue395.model.registry import (ALL_FAMILIES, FAMILIES, MAP_FAMILIES, SHAPES, by_hub_id, config_json, known,
                                     max_positions, mode_key, stream_mode)
from issue395.model.streaming import family_of

# docs/PROTOCOL.md's shape table, typed in here independently of the harness's own copy.
PROTOCOL_SHAPES = {
    "smol": dict(pool=14160384, extras=56624256, grid_adapter=921600, vocab=49152, hidden=576,
                 intermediate=1536, n_layers=30),
    "qwen": dict(pool=59649536, extras=272271104, grid_adapter=1081344, vocab=151936, hidden=896,
                 intermediate=4864, n_layers=24),
}


def test_the_records_two_shapes_are_the_protocols():
    assert list(SHAPES) == ["smol", "qwen"]
    for key, figures in PROTOCOL_SHAPES.items():
        shape = SHAPES[key]
        assert {f: getattr(shape, f) for f in figures} == figures
        assert shape.key == key and shape.record is True
        assert shape.targets == LORA_TARGETS  # the protocol's q_proj/v_proj
        assert (shape.lora_r, shape.lora_alpha) == (8, 16)  # the protocol's LoRA r=8, alpha=16


def test_a_hub_id_names_its_registry_model_the_first_of_two_that_share_one_and_no_other():
    """A soup.yaml's base: the record's two and every family by hub id (Llama-3.2-1B is llama32-1b,
    never its reduced-depth twin); an unknown id, and an empty one (Qwen3.5 names none), are None."""
    assert by_hub_id("mistralai/Mistral-7B-v0.3") == "mistral-7b"
    assert by_hub_id("HuggingFaceTB/SmolLM2-135M") == "smol" and by_hub_id("Qwen/Qwen2.5-0.5B") == "qwen"
    assert by_hub_id("meta-llama/Llama-3.2-1B") == "llama32-1b"
    assert by_hub_id("someorg/other") is None and by_hub_id("") is None


def test_every_model_is_here_once_and_every_family_list_names_only_models_here():
    assert not set(SHAPES) & set(FAMILIES)
    assert len(ALL_FAMILIES) == len(set(ALL_FAMILIES))
    assert set(ALL_FAMILIES) == set(SHAPES) | set(FAMILIES)
    assert ALL_FAMILIES[:len(MAP_FAMILIES)] == MAP_FAMILIES and MAP_FAMILIES[:2] == ("smol", "qwen")


@pytest.mark.parametrize("key", ["smol", "qwen", "mistral-7b", "llama32-1b-d4", "qwen+chunk512",
                                 "moonlight+per_expert+chunk512+recompute-off"])
def test_known_names_the_records_models_and_every_family_under_any_streaming_mode(key):
    assert known(key)


@pytest.mark.parametrize("key", ["", "gpt2", "SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M", "smol+turbo",
                                 "smol+chunk0", "smol+chunk", "mistral-7b+chunk-1", "custom"])
def test_known_refuses_a_name_not_here_or_a_mode_soup_has_not(key):
    assert not known(key)


def test_a_map_key_is_its_family_and_the_soup_training_keys_its_modes_set():
    key = mode_key("moonlight", "per_expert", 512, "off")
    assert key == "moonlight+per_expert+chunk512+recompute-off"
    assert family_of(key) == "moonlight"
    assert stream_mode(key) == ("moonlight", {"stream_expert_layout": "per_expert",
                                              "stream_loss_chunk": 512, "stream_recompute": "off"})
    assert mode_key("smol") == "smol" and stream_mode("smol") == ("smol", {})  # Soup's defaults add nothing
    with pytest.raises(UsageError, match="unknown streaming mode 'turbo'"):
        stream_mode("smol+turbo")


def test_the_records_models_are_looked_up_from_their_shapes_under_any_mode():
    assert max_positions("smol") == max_positions("smol+chunk512") == 8192
    assert max_positions("qwen") == 32768
    assert max_positions("mistral-7b+chunk1024") == FAMILIES["mistral-7b"].max_positions == 32768
    smol = config_json("smol")
    assert (smol["model_type"], smol["hidden_size"], smol["num_hidden_layers"], smol["vocab_size"]) == \
        ("llama", 576, 30, 49152)
    assert (smol["num_attention_heads"], smol["num_key_value_heads"], smol["tie_word_embeddings"]) == (9, 3, True)
    assert config_json("qwen")["use_sliding_window"] is False
    assert config_json("gemma-2b") == {"model_type": "gemma", **FAMILIES["gemma-2b"].config}


def test_variant_of_maps_instruct_chat_and_base_names_onto_their_family_and_nothing_else():
    """Issue 53 item 12: a variant word (instruct, chat, it, pt, base) is all that may differ from a registry
    hub id; the org, size and version must match."""
    from issue395.model.registry import variant_of

    assert variant_of("google/gemma-3-1b-it") == "gemma3-1b"  # Gemma's it beside its pt
    assert variant_of("HuggingFaceTB/SmolLM2-135M-Instruct") == "smol"
    assert variant_of("Qwen/Qwen3-0.6B-Base") == "qwen3-0.6b"
    for other in ("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-1.5B-Instruct", "mistralai/Mistral-7B-Instruct-v0.2",
                  "someone/Qwen2.5-0.5B-Instruct", "Qwen2.5-0.5B-Instruct", ""):
        assert variant_of(other) is None, other
