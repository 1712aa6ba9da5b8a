"""issue395.measure.shapes: shapes derived from any config on a meta skeleton (nothing allocated), and the
configs refused (an architecture Soup cannot stream, a size that is not a whole number or that no
real model has). Each family's shape is pinned against docs/FAMILIES.md's public parameter
counts (typed in here independently of the harness) and against the estimator's closed formula; the
record's two models in the map are the registry's own shapes.
Nothing is faked: real transformers on the meta device."""

from __future__ import annotations

import pytest
from conftest import TINY

from issue395.estimator import estimate
from issue395.measure.builder import hf_config
from issue395.errors import UsageError
from issue395.model.registry import FAMILIES, SHAPES, config_json
from issue395.measure.shapes import derive_shape, family_shape, registry_shape
from issue395.estimator.soup_number import arch_of

def test_derive_shape_refuses_a_config_larger_than_any_real_model():
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=2**23)
    with pytest.raises(UsageError, match="vocab_size"):
        derive_shape(config, "huge")


#: docs/FAMILIES.md: the public parameter count of one checkpoint per family.
PUBLIC_PARAMS = {
    "llama32-1b": 1_235_814_400, "qwen3-0.6b": 596_049_920, "mistral-7b": 7_248_023_552,
    "gemma-2b": 2_506_172_416, "gemma2-2b": 2_614_341_888, "gemma3-1b": 999_885_952,
    "phi-2": 2_779_683_840, "phi3-mini": 3_821_079_552, "llama31-8b": 8_030_261_248,
}
UNTIED = {"mistral-7b", "phi-2", "phi3-mini", "llama31-8b"}


def meta_model(key):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = FAMILIES[key].model_type, FAMILIES[key].config
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields),
                                                dtype=torch.bfloat16)


@pytest.mark.parametrize("key", sorted(PUBLIC_PARAMS))
def test_each_family_config_builds_its_public_parameter_count(key):
    assert sum(p.numel() for p in meta_model(key).parameters()) == PUBLIC_PARAMS[key]


@pytest.mark.parametrize("key", sorted(PUBLIC_PARAMS))
def test_family_shape_charges_an_untied_head_in_the_extras(key):
    shape = family_shape(key)
    model = meta_model(key)
    embed = model.get_input_embeddings().weight.numel() * 2
    assert (shape.extras >= 2 * embed) == (key in UNTIED)
    # the meta skeleton's layer and the estimator's closed formula are two derivations: they agree
    assert shape.pool == estimate.pool(arch_of(config_json(key)), "none")


def test_lora_targets_are_q_and_v_except_phi3s_fused_qkv_and_the_adapter_follows_them():
    phi3 = family_shape("phi3-mini")
    assert phi3.targets == ("qkv_proj",)
    # qkv_proj: 3072 -> 3 x 3072; the grid's count is twice LoRA's A + B on every layer.
    assert phi3.grid_adapter == 2 * 32 * 8 * (3072 + 3 * 3072)
    llama = family_shape("llama32-1b")
    assert llama.targets == ("q_proj", "v_proj")
    assert llama.grid_adapter == 2 * 16 * 8 * ((2048 + 2048) + (2048 + 8 * 64))


def test_a_config_files_adapter_sets_the_adapter_count_and_never_the_checkpoint():
    """--config's own targets, r and alpha: the grid's count follows them (q_proj alone at r 4),
    the checkpoint stays the family's (its fingerprint: a cached family checkpoint serves it)."""
    from issue395.measure.builder import checkpoint_fingerprint

    llama = family_shape("llama32-1b")
    assert registry_shape("llama32-1b") == llama and (llama.lora_r, llama.lora_alpha) == (8, 16)
    own = registry_shape("llama32-1b", targets=("q_proj",), lora_r=4, lora_alpha=8)
    assert (own.targets, own.lora_r, own.lora_alpha) == (("q_proj",), 4, 8)
    assert own.grid_adapter == 2 * 16 * 4 * (2048 + 2048)
    assert checkpoint_fingerprint(own) == checkpoint_fingerprint(llama)
    smol = registry_shape("smol", lora_r=16)  # the record's two: derived from their public config
    assert (smol.pool, smol.extras, smol.grid_adapter) == (SHAPES["smol"].pool, SHAPES["smol"].extras,
                                                           2 * SHAPES["smol"].grid_adapter)
    assert smol.record is False  # a config's arm is not the record's: no A10G figure beside it


@pytest.mark.parametrize("config_name", ["GPT2Config", "BertConfig"])
def test_derive_shape_refuses_an_architecture_soup_cannot_stream(config_name):
    import transformers

    config = getattr(transformers, config_name)(n_layer=1, num_hidden_layers=1)
    with pytest.raises(UsageError, match="cannot be layer-streamed"):
        derive_shape(config, name="tiny")


@pytest.mark.parametrize("field, value", [("vocab_size", 0), ("num_hidden_layers", 0),
                                          ("hidden_size", -1), ("num_attention_heads", 0)])
def test_derive_shape_refuses_a_figure_that_is_not_a_whole_number(field, value):
    config = hf_config(TINY)
    setattr(config, field, value)
    with pytest.raises(UsageError, match=f"config {field} is {value!r}"):
        derive_shape(config, name="tiny")


def test_the_record_models_in_the_map_are_the_records_shapes():
    assert family_shape("smol") is SHAPES["smol"] and family_shape("qwen") is SHAPES["qwen"]


@pytest.mark.parametrize("key", ["llama32-1b", "phi3-mini", "moonlight"])
def test_the_measurements_default_targets_are_the_estimators_on_the_same_config(key):
    """With no targets named, the meta skeleton's adapter goes where the estimator's does: both read
    the protocol's targets off the layer's modules (latent attention has no v_proj: its own pair)."""
    from transformers import AutoConfig

    from issue395.estimator.arch import arch_from_config, protocol_targets
    from issue395.estimator.soup_number import supported_archs

    fields_ = config_json(key)
    if fields_["model_type"] not in supported_archs():
        pytest.skip(f"the installed soup-cli does not stream {fields_['model_type']} (0.77.0's venv runs it)")
    config = AutoConfig.for_model(fields_["model_type"], **{k: v for k, v in fields_.items() if k != "model_type"})
    got = derive_shape(config, key, key=key).targets
    assert got == protocol_targets(arch_from_config(fields_))
    assert got == {"llama32-1b": ("q_proj", "v_proj"), "phi3-mini": ("qkv_proj",),
                   "moonlight": ("q_proj", "kv_b_proj")}[key]


@pytest.mark.parametrize("key", ["moonlight", "qwen3.5-moe"])
def test_a_registry_models_shape_is_built_whatever_the_installed_soup_streams(key):
    """A registry family's shape is the model's, not a run's: it builds on the meta device whether or not the installed
    Soup streams its model type (soup-cli 0.73.3 streams neither DeepSeek-V3 nor Qwen3.5-MoE), so a resident run of it
    and its checkpoint have one; a streamed run of it is refused where the run is settled (require_streamed)."""
    shape = registry_shape(key)
    assert (shape.key, shape.model_type, shape.n_layers) == (key, FAMILIES[key].model_type,
                                                             FAMILIES[key].config["num_hidden_layers"])
    assert shape.pool > 0 and shape.grid_adapter > 0


def test_only_a_streamed_runs_shape_asks_whether_soup_streams_its_architecture():
    """derive_shape refuses an architecture no Soup streams (Mixtral, an MoE) for a streamed run, and builds it for a
    resident one (``streamed=False``)."""
    from transformers import MixtralConfig

    config = MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, vocab_size=512)
    with pytest.raises(UsageError, match="'mixtral' cannot be layer-streamed"):
        derive_shape(config, name="tiny-mixtral")
    shape = derive_shape(config, name="tiny-mixtral", streamed=False, targets=("q_proj", "v_proj"))
    assert (shape.model_type, shape.n_layers, shape.vocab) == ("mixtral", 2, 512)
