"""issue395.estimator.layer: the layer phase's counts, here the LoRA dropout masks a streamed step keeps or not
by its task (layer.mask_bytes, the rule resident.py's estimate takes too), held to a committed anatomy's saved
blocks and to Soup's own streamed layer on CPU."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT

from issue395.estimator.arch import arch_from_config
from issue395.estimator.estimate import estimate, no_grad_layer_per_token
from issue395.estimator.layer import layer_blocks, layer_peak, mask_bytes
from issue395.model.registry import config_json
from issue395.tasks import task

ANATOMY = ROOT / "results" / "resident-anatomy-h200-soup0.77.0-2400c0d" / "call-1"
#: the same 2048 tokens in each task's own shape: SFT 2048x1, the paired losses 1024x1 (2 rows), KTO 1024x2
TARGETS = ("q_proj", "v_proj")  # the protocol's, which the anatomies ran
SHAPES = {"sft": (2048, 1), "dpo": (1024, 1), "orpo": (1024, 1), "simpo": (1024, 1), "kto": (1024, 2)}


def _peak_blocks(name: str) -> dict:
    """The requested sizes live at an anatomy's peak, by size (the allocator's history)."""
    return {g["size"]: g["count"] for g in json.loads((ANATOMY / f"{name}.json").read_text())["groups"]}


def test_a_preference_tasks_streamed_layer_phase_charges_no_dropout_mask_and_sfts_charges_the_measured_ones():
    """Issue 52 (fidelity): TRL's DPO, ORPO, CPO (SimPO) and KTO set LoRA's dropout p to 0, so no mask is saved.
    Measured on the same peft layers (Llama-3.2-1B, q_proj and v_proj, 2048 tokens, no checkpoint): SFT keeps 30
    mask blocks (layers 1-15, two targets), DPO none. The streamed estimate of SFT charges exactly those bytes
    more than each preference task's: in the layer phase's walk (the binding layer's own share of them, one
    block each target, listed among its blocks), with stream_recompute off through the loss (all 30), and in
    the reference forward's no-grad layer (one block); the rest of each count is alike."""
    sft_blocks, dpo_blocks = _peak_blocks("res-sft-llama1b-bf16-2048x1"), _peak_blocks("res-dpo-llama1b-bf16-1024x1")
    (size, count), = [(s, n) for s, n in sft_blocks.items() if s not in dpo_blocks and s < 2 ** 24]
    c = config_json("llama32-1b")
    a = arch_from_config(c)
    per_layer = count // (a.L - 1)  # layer 0's input carries no gradient: its dropouts keep no mask
    assert (size, count, per_layer) == (4194304, 30, 2)

    def terms(name, **kw):
        seq, batch = SHAPES[name]
        return estimate(c, seq=seq, batch=batch, task=name, soup=False, **kw).terms

    sft, sft_off = terms("sft"), terms("sft", stream={"stream_recompute": "off"})
    for name in ("dpo", "orpo", "simpo", "kto"):
        t, off = terms(name), terms(name, stream={"stream_recompute": "off"})
        assert sft["layer_per_token"] - t["layer_per_token"] == per_layer * size, name
        assert sft_off["retained_activations"] - off["retained_activations"] == count * size, name
        if task(name).reference:  # the no-grad layer's widest target: its mask, one block, is not made
            assert 2048 * no_grad_layer_per_token(a, "none", TARGETS, 8) - t["reference_layer"] == size, name
    for name, kept in (("sft", per_layer), ("dpo", 0)):
        lp = layer_peak(a, "none", TARGETS, 8, 2048, per=4, held=False, per_expert=False,
                        mask=mask_bytes(task(name)))
        assert layer_blocks(a, "none", TARGETS, 8, 2048, lp).count(size) == kept, name


def test_trls_disable_dropout_reaches_every_lora_dropout_inside_soups_streamed_layers():
    """Issue 52 (fidelity), on the real stack (CPU): Soup's StreamedDecoderLayer (the installed soup-cli's own
    class, which install_streaming puts in place of every decoder layer) holds the peft layer as its child
    ``inner``, so TRL's own disable_dropout_in_model, which DPO, ORPO, CPO and KTO run at their init on the
    model Soup hands them, sets every LoRA dropout inside it to p 0; the streamed forward, its checkpoint's
    recompute and a retained body all run that same module, so no mask is written there (mask_bytes' rule).
    SFT runs no such step: its dropouts keep Soup's 0.05."""
    import torch
    import peft
    import transformers
    from soup_cli.utils.layer_stream_runtime import _streamed_layer_class
    from trl.trainer.utils import disable_dropout_in_model

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    m = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), peft.LoraConfig(
        r=8, target_modules=list(TARGETS), lora_dropout=0.05))
    layers = m.base_model.model.model.layers
    streamed = _streamed_layer_class()
    for i in range(len(layers)):
        layers[i] = streamed(layers[i], i, None, None)

    def dropouts():
        return [d.p for layer in layers for d in layer.inner.modules() if isinstance(d, torch.nn.Dropout)]

    assert dropouts() == [0.05] * (len(TARGETS) * cfg.num_hidden_layers)
    assert mask_bytes(task("sft")) == 1
    disable_dropout_in_model(m)
    assert dropouts() == [0] * (len(TARGETS) * cfg.num_hidden_layers)
    assert all(mask_bytes(task(name)) == 0 for name in ("dpo", "orpo", "simpo", "kto"))


def test_a_lora_dropout_of_0_builds_no_dropout_in_peft_so_no_task_keeps_a_mask():
    """Issue 50 item 1, on the real stack (CPU): peft builds nn.Identity for a LoRA dropout of 0 (Soup's
    training.lora.dropout 0), no nn.Dropout, so no mask is written whatever the task (mask_bytes at p 0: none,
    SFT's too); at Soup's default or another p in (0, 1) an nn.Dropout of that p, whose mask SFT keeps."""
    import torch
    import peft
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)
    for p, kept in ((0.0, 0), (0.05, 1), (0.3, 1)):
        m = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), peft.LoraConfig(
            r=8, target_modules=list(TARGETS), lora_dropout=p))
        kinds = {type(d).__name__ for name, d in m.named_modules() if name.endswith("lora_dropout.default")}
        assert kinds == ({"Identity"} if p == 0 else {"Dropout"}), (p, kinds)
        assert mask_bytes(task("sft"), p) == kept, p
        assert all(mask_bytes(task(name), p) == 0 for name in ("dpo", "orpo", "simpo", "kto"))


def test_a_resident_deepseek_v3_layer_keeps_what_the_cpu_measurement_found_not_the_kinds_bound():
    """Issue 51 item 3: without recompute a bf16 Moonlight layer keeps, per token, what the CPU measurement under
    CUDA's autocast lists found alive beside the loss (transformers 5.16.1, peft 0.20, full widths, q_proj and
    kv_b_proj at r 8; layer.latent_retained's docstring): 105,572 B in dense layer 0, 143,310 in each MoE layer,
    where the kinds' count charged 109,536 and 169,440 (the routed experts' gathered input beside their output,
    the router's fp32 logits, the latent at 6 B a width). The committed streamed recompute-off live set agrees:
    one top_k x 2h block (50,331,648 B at 2048) a MoE layer, not two. Under NF4 (not measured) the bound stays."""
    from issue395.estimator.layer import retained_by_layer

    a = arch_from_config(config_json("moonlight"))
    assert retained_by_layer(a, "none", ("q_proj", "kv_b_proj"), 8) == [105_572, 143_310, 143_310, 143_310]
    # the kinds' count, its norms' fp32 rstd (layer.RMS_RSTD_BYTES) charged since review item 3: 4 B more in
    # layer 0 (its one recorded norm), 8 in each other
    assert retained_by_layer(a, "nf4", ("q_proj", "kv_b_proj"), 8) == [109_540, 169_448, 169_448, 169_448]
    walk = json.loads((ROOT / "results" / "layer-walk-modes-h200-soup0.77.0-2798321" / "call-1"
                       / "walk-sft-moonlight-bf16-2048x1-recompute-off.json").read_text())
    expert_out = next(g for g in walk["groups"] if g["size"] == 6 * 2 * a.h * 2048)
    assert expert_out["count"] == 3 and set(expert_out["frames"]) == {"moe.py:332 _grouped_mm <- ??:0 PyMethod_New"}


def test_the_streamed_recompute_off_router_is_bf16_as_latent_retained_charges_it():
    """Review item 6: layer.latent_retained (measured on CPU under a resident run's autocast) also serves the
    streamed step's stream_recompute off, which runs no autocast; its router's logits and sigmoid scores are bf16
    there too (the model's bf16 weight on a bf16 input): Moonlight recompute-off 2048x1's live set holds them as
    2 B x 64 experts x 2,048 tokens in each of its 3 MoE layers (modeling_deepseek_v3.py:146-147; fp32 would be
    twice that, and no block of that size is from there), so the count's bf16 figures stand."""
    a = arch_from_config(config_json("moonlight"))
    routed = next(k for k in a.layers.kinds if k.routed).routed
    walk = json.loads((ROOT / "results" / "layer-walk-modes-h200-soup0.77.0-2798321" / "call-1"
                       / "walk-sft-moonlight-bf16-2048x1-recompute-off.json").read_text())
    router = lambda g: any(f.startswith(("modeling_deepseek_v3.py:146 ", "modeling_deepseek_v3.py:147 "))
                           for f in g["frames"])
    sizes = {g["size"] for g in walk["groups"] if router(g)}
    T = walk["realised"]["width"] * walk["realised"]["rows"]
    assert T == 2048 and sizes == {2 * routed * T}, sizes


def test_an_rmsnorm_saves_its_fp32_input_and_rstd_as_the_count_charges_each_norm():
    """Review item 3: transformers' RMSNorm (Qwen3's, run on CPU on a bf16 input, its weight frozen as under
    LoRA) saves for its input's gradient the fp32 copy of its input and the fp32 rstd, one a row normed: 4h + 4
    B a token for a layer norm, 4 x (heads x head_dim + heads) for the q norm and 4 x (kv x head_dim + kv) for
    the k norm. layer_per_token charges each norm that much (a third layer norm, or the q/k norms taken away,
    moves it by exactly the measured bytes); before the rstd was charged it was 4 B a row short."""
    import dataclasses

    torch = pytest.importorskip("torch")
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from issue395.estimator.layer import layer_per_token

    a = arch_from_config(config_json("qwen3-0.6b"))

    def saved_per_token(width: int, rows: int, T: int = 16) -> int:
        norm = Qwen3RMSNorm(width).to(torch.bfloat16).requires_grad_(False)
        x = torch.randn(T, rows, width, dtype=torch.bfloat16, requires_grad=True)
        seen = {}

        def pack(t):
            if t.untyped_storage().data_ptr() != norm.weight.untyped_storage().data_ptr():
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            norm(x)
        return sum(seen.values()) // T

    one_norm = saved_per_token(a.h, 1)
    qk = saved_per_token(a.head_dim, a.heads) + saved_per_token(a.head_dim, a.kv)
    assert one_norm == 4 * a.h + 4 and qk == 4 * (a.heads + a.kv) * (a.head_dim + 1)
    t = ("q_proj", "v_proj")
    assert layer_per_token(dataclasses.replace(a, norms=3), "none", t, 8) - layer_per_token(a, "none", t, 8) == one_norm
    assert layer_per_token(a, "none", t, 8) - layer_per_token(dataclasses.replace(a, qk_norm=False), "none", t, 8) == qk
