"""issue395.estimator.arch: a config.json read as transformers reads it (every absent field takes the value
transformers gives that architecture, checked against transformers itself on a meta model), and
a value no config can mean refused in one line naming the field (issue 22, defects 1 and 2)."""

from __future__ import annotations

import copy
import json

import pytest
from conftest import main, one_error_line

from issue395.estimator import arch as A
from issue395.estimator import estimate as E
from issue395.estimator import soup_number
from issue395.errors import UsageError
from issue395.model.registry import config_json

FAMILY_KEYS = ("smol", "qwen", "llama32-1b", "qwen3-0.6b", "mistral-7b", "gemma-2b", "gemma2-2b",
               "gemma3-1b", "phi-2", "phi3-mini", "llama31-8b")


# -- The config read as transformers reads it (issue 22, defect 1) --

#: What the model itself reads off the config for its attention mask and logits (modeling_*.py):
#: mistral and phi3 build a sliding mask from config.sliding_window for every layer; the classes
#: that keep layer_types slide where it says so; gemma2/gemma3 soft-cap the logits.
WHOLE_MODEL_WINDOW, SOFTCAPPED = ("mistral", "phi3"), ("gemma2", "gemma3_text")


def arch_by_transformers(fields: dict) -> A.Arch:
    """The Arch as transformers resolves the config: its config class (AutoConfig.for_model) and a
    one-layer model on the meta device (its linears, head_dim, rotary table, tied head, norms)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from issue395.measure.console import quiet_libraries

    # a deep copy: transformers standardises a rope_scaling dict in place, and FAMILIES shares it
    mt, kw = fields["model_type"], copy.deepcopy({k: v for k, v in fields.items() if k != "model_type"})
    with quiet_libraries():
        c = AutoConfig.for_model(mt, **kw)
        one = AutoConfig.for_model(mt, **{**kw, "num_hidden_layers": 1})
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(one)
    layer = model.model.layers[0]
    mods = {n.split(".")[-1]: (m.in_features, m.out_features, m.bias is not None)
            for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    hd, nh = layer.self_attn.head_dim, c.num_attention_heads
    kv = (mods["qkv_proj"][1] - nh * hd) // (2 * hd) if "qkv_proj" in mods else mods["k_proj"][1] // hd
    rotary = next(b for n, b in model.model.named_buffers() if n.endswith("inv_freq") and "original" not in n)
    types = getattr(c, "layer_types", None)
    slides = "sliding_attention" in types if types is not None else mt in WHOLE_MODEL_WINDOW
    norms = [m for n, m in layer.named_children() if "norm" in n]
    return A.Arch(mt, c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size, nh, kv, hd,
                  model.lm_head.weight is model.model.embed_tokens.weight, c.max_position_embeddings,
                  2 * rotary.numel(), c.sliding_window if slides else None,
                  mt in SOFTCAPPED and c.final_logit_softcapping is not None, mods, norms=len(norms),
                  norm_bias=any(getattr(m, "bias", None) is not None for m in norms),
                  qk_norm=hasattr(layer.self_attn, "q_norm"), qk_layernorm=hasattr(layer.self_attn, "q_layernorm"),
                  dropouts=frozenset(n for n, p in (("resid_pdrop", getattr(layer, "resid_dropout", None)),
                                                    ("embd_pdrop", getattr(model.model, "embed_dropout", None)))
                                     if p is not None and 0 < p.p < 1)
                  | ({"attention_dropout"} if mt == "phi" and 0 < (layer.self_attn.attention_dropout or 0) < 1
                     else set()))


def _variants(key: str):
    """The family's config, with each field the estimator defaults removed, and with all removed."""
    full = config_json(key)
    optional = [k for k in full if k in A.CONFIG_DEFAULTS[full["model_type"]] or k == "partial_rotary_factor"]
    yield "as published", full
    for k in optional:
        yield f"without {k}", {n: v for n, v in full.items() if n != k}
    yield "without " + ",".join(optional), {n: v for n, v in full.items() if n not in optional}


def test_traits_cover_every_architecture_soup_streams_but_qwen4_exp_which_is_refused():
    # the dense ones read here, deepseek_v3 and Qwen3.5's text decoders by issue395.estimator.moe; qwen4_exp
    # (transformers' own defaults do not build it) is refused in one line, never read as another
    assert set(A.CONFIG_DEFAULTS) == {t for t, layout in A.TRAITS.items() if layout in ("gqa", "phi", "phi3")}
    streamed = set(soup_number.supported_archs()) | set(soup_number.stream_aliases())
    assert streamed - set(A.TRAITS) - set(A.TEXT_DECODER) <= {"qwen4_exp", "qwen4_exp_text"}
    with pytest.raises(UsageError, match="not one this estimator reads"):
        A.arch_from_config({**config_json("mistral-7b"), "model_type": "qwen4_exp"})


@pytest.mark.parametrize("key", FAMILY_KEYS)
def test_the_stdlib_reading_equals_transformers_field_by_field(key):
    for label, fields in _variants(key):
        try:
            got = A.arch_from_config(fields)
        except UsageError as exc:  # refused: transformers' own reading must be unusable too
            want = arch_by_transformers(fields)
            assert want.heads % want.kv, (key, label, str(exc))
            continue
        want = arch_by_transformers(fields)
        for name in A.Arch.__dataclass_fields__:
            assert getattr(got, name) == getattr(want, name), (key, label, name)


def test_an_absent_tie_word_embeddings_is_untied_on_llama_as_transformers_reads_it():
    c = config_json("llama31-8b")
    absent = {k: v for k, v in c.items() if k != "tie_word_embeddings"}
    e = lambda cfg: E.estimate(cfg, quant="nf4", seq=512)  # noqa: E731
    assert e(absent) == e(c) != e({**c, "tie_word_embeddings": True})
    assert A.arch_from_config({**absent, "model_type": "mistral"}).tied is False
    gemma = {k: v for k, v in config_json("gemma-2b").items() if k != "tie_word_embeddings"}
    assert A.arch_from_config(gemma).tied is True  # GemmaConfig ties by default


def test_an_absent_head_dim_is_the_classes_own_not_hidden_over_heads():
    gemma = {k: v for k, v in config_json("gemma-2b").items() if k != "head_dim"}
    qwen3 = {**{k: v for k, v in config_json("qwen3-0.6b").items() if k != "head_dim"}, "hidden_size": 2048}
    assert A.arch_from_config({**gemma, "hidden_size": 4096}).head_dim == 256  # not 4096 / 8
    assert A.arch_from_config(qwen3).head_dim == 128  # not 2048 / 16


# -- A value no config can mean: one line naming the field, exit 2 (defect 2) --
@pytest.mark.parametrize("key, field, value", [
    ("mistral-7b", "num_key_value_heads", 0), ("mistral-7b", "num_key_value_heads", -8),
    ("mistral-7b", "head_dim", 10**12), ("phi-2", "partial_rotary_factor", 1e300),
    ("phi-2", "partial_rotary_factor", -1), ("llama31-8b", "partial_rotary_factor", 2),
    ("mistral-7b", "sliding_window", "4096"), ("mistral-7b", "sliding_window", 4096.0),
    ("mistral-7b", "sliding_window", -1), ("llama31-8b", "sliding_window", -1),
    ("llama31-8b", "tie_word_embeddings", "false"), ("llama31-8b", "attention_bias", "false"),
    ("llama31-8b", "mlp_bias", "false"), ("mistral-7b", "attention_bias", "false"),
    ("gemma2-2b", "final_logit_softcapping", "false"), ("gemma2-2b", "attn_logit_softcapping", "30"),
    ("gemma2-2b", "final_logit_softcapping", -30.0), ("qwen", "use_sliding_window", "false"),
    ("gemma3-1b", "sliding_window_pattern", 0), ("qwen", "max_window_layers", -1),
    ("llama31-8b", "max_position_embeddings", 0),
], ids=lambda v: str(v)[:20])
def test_a_value_no_config_can_mean_is_one_line_naming_the_field(capfd, tmp_path, key, field, value):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config_json(key), field: value}))
    one_error_line(*main(capfd, ["--estimate", "--model", path, "--seq", "512"]), field)


def test_a_rope_dicts_partial_rotary_factor_is_checked_too():
    c = {**config_json("phi-2"), "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 7}}
    with pytest.raises(UsageError, match="partial_rotary_factor"):
        A.arch_from_config(c)
    c["rope_parameters"]["partial_rotary_factor"] = 0.25
    assert A.arch_from_config(c).rotary_dim == 20  # rope_parameters' own value first, as transformers


# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


def test_a_gemma2_config_saved_by_transformers_is_estimated(capfd, tmp_path):
    """Issue 29 item 5: a config.json transformers writes itself for gemma2 (use_bidirectional_attention null)
    is read as an architecture and estimated, not refused."""
    from transformers import AutoConfig

    AutoConfig.for_model("gemma2").save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["use_bidirectional_attention"] is None
    code, out, err = main(capfd, ["--estimate", "--model", tmp_path, "--seq", "512"])
    assert code == 0 and "needs free" in out, err
