"""issue395.estimator.terms and the terms it declares: every term an estimate emits is declared once
and charged by the anatomy where it is live; the preference losses' blocks and the reference adapter
against the bytes the H200's allocator held (the committed task anatomy arms); the optimizer's states
against the tensors torch's AdamW and bitsandbytes' 8-bit AdamW really make on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from issue395.errors import UsageError
from issue395.estimator import estimate as E
from issue395.estimator import steady as S
from issue395.estimator.anatomy import CLASSES, class_breakdown
from issue395.estimator.arch import arch_from_config
from issue395.estimator.terms import BY_KEY, Kind, Phase, Term, phase_sum
from issue395.model.registry import config_json

ROOT = Path(__file__).resolve().parents[2]
ANATOMY = sorted(ROOT.glob("results/task-anatomy-*/anatomy-*.json"))

#: arms across the estimator's branches: dense, softcap, sliding window, phi NF4, MoE and hybrid
#: kinds, each streaming mode, the five tasks, the steady state
ARMS = [("smol", dict(seq=2048)), ("mistral-7b", dict(quant="nf4", seq=512)),
        ("gemma2-2b", dict(seq=4096, batch=2)), ("phi-2", dict(quant="nf4", seq=512, batch=4)),
        ("moonlight", dict(quant="nf4", seq=1024)), ("deepseek-v3+per_expert", dict(quant="nf4", seq=512)),
        ("qwen3.5", dict(seq=1024)), ("smol+chunk512", dict(seq=2048)), ("smol+recompute-off", dict(seq=1024)),
        ("moonlight+recompute-off", dict(quant="nf4", seq=512)), ("qwen", dict(seq=2048, steps=3)),
        ("mistral-7b", dict(quant="nf4", seq=512, steps=2, lora_r=256))] + [
        (f, dict(seq=s, batch=2, task=t, quant=q)) for t in ("dpo", "orpo", "simpo", "kto")
        for f, q, s in (("qwen", "none", 2048), ("mistral-7b", "nf4", 512), ("gemma2-2b", "none", 4096))]


def _estimate(key, kw):
    return E.estimate_key(key, release="0.77.0", soup=False, **kw)


@pytest.mark.parametrize("key,kw", ARMS)
def test_every_term_an_estimate_emits_is_declared_once_in_the_table_and_in_its_order(key, kw):
    e = _estimate(key, kw)
    assert set(e.terms) <= set(BY_KEY)
    order = [t.key for t in Term]
    assert list(e.terms) == sorted(e.terms, key=order.index)
    assert len(order) == len(set(order))


def test_every_class_is_one_torch_mem_tracker_documents():
    from torch.distributed._tools.mem_tracker import _MemRefType
    assert {k.value for k in Kind} == {m.value for m in _MemRefType}
    assert {t.kind for t in Term} <= set(Kind)


@pytest.mark.parametrize("key,kw", ARMS)
def test_the_anatomy_charges_every_byte_of_the_binding_phase_but_the_allocator_rounding_and_rests(key, kw):
    """Before the table, the anatomy's own lists lacked chunked_loss, retained_activations and
    expert_in_flight, so a streaming mode's charged bytes fell short of the estimate's phase."""
    e = _estimate(key, kw)
    if e.phase == Phase.OPTIMIZER.value:
        return  # nothing of the step is live then: the anatomy names a step's blocks
    from issue395.model.streaming import family_of
    assert _charged(e, family_of(key)) == _held(e)


def _charged(e, family: str) -> int:
    rows = class_breakdown({c: 0 for c in CLASSES}, e, seq=e.seq, batch=e.batch, config=config_json(family))
    return sum(r["charged"] for r in rows)


def _held(e) -> int:
    """The binding phase's bytes less its rests (segment tails, unsplit remainders: no block of their own)."""
    phase = Phase(e.phase)
    rests = {Phase.LOSS: ("allocator_rounding", "retained_remainders", "loss_remainders"),
             Phase.REFERENCE: ("retained_remainders", "reference_remainders")}
    return phase_sum(e.terms, phase) - sum(e.terms.get(k, 0) for k in rests.get(phase, ()))


def test_the_anatomy_charges_every_byte_of_a_resident_reference_phase_but_its_rests():
    """A resident run whose reference forward binds (Mistral-7B NF4 KTO 512x2: the policy's retained graph, its
    rests and the no-grad forward's layer or head beside it): the anatomy's classes charge the phase's every byte
    but the retained blocks' and the reference's rests."""
    from issue395.estimator.resident import estimate_resident

    e = estimate_resident(config_json("mistral-7b"), quant="nf4", seq=512, batch=2, task="kto", release="0.77.0")
    assert e.phase == Phase.REFERENCE.value and e.terms["retained_activations"]
    assert _charged(e, "mistral-7b") == _held(e)


def _anatomy(name: str) -> dict:
    return json.loads(next(p for p in ANATOMY if p.name == name).read_text())


@pytest.mark.parametrize("path", [p.name for p in ANATOMY if not json.loads(p.read_text()).get("step_error")])
def test_each_loss_holds_the_vocab_sized_fp32_blocks_the_h200_allocator_held_at_its_peak(path):
    """The blocks task_loss_blocks lists are the ones live at the measured peak, size for size
    (every block of at least one shifted row of fp32 logits)."""
    d = _anatomy(path)
    a = arch_from_config(config_json(path.split("-")[3]))
    if d["task"] == "sft":
        blocks = [4 * d["seq"] * d["batch"] * a.V] * 3
    else:
        blocks = E.task_loss_blocks(a, d["task"], d["seq"], d["batch"])
    row = 4 * (d["seq"] - 1) * a.V
    live = [g["size"] for g in d["groups"] for _ in range(g["count"]) if g["size"] >= row]
    assert sorted(blocks) == sorted(live)


@pytest.mark.parametrize("family", ["qwen", "smol"])
def test_dpos_reference_adapter_is_the_resident_bytes_dpo_holds_over_orpo_on_0770(family):
    dpo, orpo = _anatomy(f"anatomy-077-dpo-{family}-2048x1.json"), _anatomy(f"anatomy-077-orpo-{family}-2048x1.json")
    d, o = (E.estimate_key(family, seq=2048, task=t, release="0.77.0", soup=False) for t in ("dpo", "orpo"))
    resident = lambda e: phase_sum(e.terms, Phase.RESIDENT)  # noqa: E731
    assert resident(d) - resident(o) == dpo["resident_before"] - orpo["resident_before"] > 0


def test_a_task_the_estimator_cannot_model_is_refused_in_one_line():
    with pytest.raises(UsageError, match="refuses a kto batch under 2"):
        E.estimate_key("smol", seq=512, batch=1, task="kto", soup=False)
    with pytest.raises(UsageError, match="stream_loss_chunk with task dpo"):
        E.estimate_key("smol+chunk512", seq=2048, task="dpo", release="0.77.0", soup=False)
    with pytest.raises(UsageError, match="not one Soup streams"):
        E.estimate_key("smol", seq=512, task="grpo", soup=False)



def test_an_optimizer_the_estimator_does_not_model_is_charged_as_an_upper_bound_not_refused():
    """Issue 53 item 14: adafactor, adamw_hf (any name the optimizer table lacks) was refused; it is charged as
    two fp32 states and two fp32 step copies per LoRA parameter, at least what any modelled optimizer costs."""
    from issue395.estimator.steady import OPTIMIZERS

    bound = {o: E.estimate_key("smol", seq=512, steps=2, optimizer=o, soup=False).terms
             for o in ("adafactor", "adamw_hf")}
    assert bound["adafactor"] == bound["adamw_hf"]
    for name in OPTIMIZERS:
        modelled = E.estimate_key("smol", seq=512, steps=2, optimizer=name, soup=False).terms
        for key in ("adam_moments", "optimizer_transients"):  # the states term keeps its first name
            assert bound["adafactor"][key] >= modelled[key], (name, key)


def test_the_untied_head_keeps_a_private_copy_only_where_a_second_forward_refills_its_slot():
    """0.77.0's _needs_a_private_weight: a reference forward (DPO, KTO), an untied head; the
    copy is the head's bf16 weight."""
    a = arch_from_config(config_json("mistral-7b"))
    assert not a.tied
    got = {t: E.estimate_key("mistral-7b", seq=512, batch=2, task=t, release=r, soup=False).terms.get("head_copy", 0)
           for t in ("dpo", "kto", "orpo", "simpo") for r in ("0.77.0",)}
    assert got == {"dpo": 2 * a.V * a.h, "kto": 2 * a.V * a.h, "orpo": 0, "simpo": 0}
    assert E.estimate_key("qwen", seq=512, task="dpo", release="0.77.0", soup=False).terms["head_copy"] == 0


def _lora_like(a, targets, r):
    """fp32 parameters of the LoRA tensors' shapes, each with a gradient, as PEFT makes them."""
    params = []
    for _ in range(a.L):
        for t in targets:
            fan_in, fan_out, _ = a.modules[t]
            params += [torch.nn.Parameter(torch.zeros(r, fan_in)), torch.nn.Parameter(torch.zeros(fan_out, r))]
    for p in params:
        p.grad = torch.ones_like(p)
    return params


def _state_bytes(opt) -> int:
    seen, out = set(), 0
    for state in opt.state.values():
        for k, v in state.items():
            if torch.is_tensor(v) and v.dim() and k not in ("qmap1", "qmap2"):  # qmaps: one map per process
                if v.data_ptr() not in seen:
                    seen.add(v.data_ptr())
                    out += v.numel() * v.element_size()
    return out


@pytest.mark.parametrize("name", ["adamw_torch", "adamw_8bit"])
def test_the_optimizer_states_are_the_bytes_the_real_optimizer_makes_on_cpu(name):
    """SmolLM2's LoRA tensors at r 8 (lora_B below bitsandbytes' 4,096-element floor stays fp32)
    and at r 64, stepped once by the optimizer the name builds."""
    a = arch_from_config(config_json("smol"))
    for r in (8, 64):
        params = _lora_like(a, ("q_proj", "v_proj"), r)
        if name == "adamw_torch":
            opt = torch.optim.AdamW(params)
        else:
            bnb = pytest.importorskip("bitsandbytes")
            opt = bnb.optim.AdamW8bit(params)
        opt.step()
        sizes = S.lora_tensors(a, ("q_proj", "v_proj"), r)
        assert sorted(sizes) == sorted(p.numel() for p in params)
        assert S.optimizer_state_bytes(sizes, name) == _state_bytes(opt)


def test_the_steady_state_adds_the_states_and_binds_at_the_optimizer_step_for_a_huge_adapter():
    small = E.estimate_key("smol", seq=2048, soup=False)
    eight_one = E.estimate_key("smol", seq=2048, steps=1, optimizer="adamw_8bit", soup=False)
    # one step: its optimizer step makes the states (8-bit ones smaller), but a small adapter's loss binds
    assert (eight_one.corrected_predicted, eight_one.phase) == (small.corrected_predicted, small.phase) == (
        small.corrected_predicted, "loss")
    assert 0 < eight_one.terms["adam_moments"] < small.terms["adam_moments"]
    eight, full = (E.estimate_key("mistral-7b", quant="nf4", seq=16, steps=2, lora_r=1024, optimizer=o,
                                  targets=("q_proj", "k_proj", "v_proj", "o_proj"), soup=False)
                   for o in ("adamw_8bit", "adamw_torch"))
    assert full.phase == "optimizer"
    assert eight.corrected_predicted < full.corrected_predicted
