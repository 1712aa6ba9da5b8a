"""issue395.shapes: shapes derived from a config, and the configs no real model has."""

from __future__ import annotations
import pytest


def test_derive_shape_refuses_a_config_larger_than_any_real_model():
    from transformers import AutoConfig

    from issue395.errors import UsageError
    from issue395.shapes import derive_shape

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=2**23)
    with pytest.raises(UsageError, match="vocab_size"):
        derive_shape(config, "huge")
