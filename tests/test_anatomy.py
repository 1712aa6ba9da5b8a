"""issue395.anatomy: naming the blocks live at a step's peak by physical class, from their sizes,
and setting each class against the estimator term meant to charge it. Synthetic block lists
built from the real family configs (tests/data/family-configs.json); CPU only, no torch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from issue395 import anatomy as A  # noqa: E402
from issue395 import estimate as E  # noqa: E402
from issue395.errors import UsageError  # noqa: E402

MiB = 2**20


def cfg(key: str) -> dict:
    return dict(json.loads((ROOT / "tests" / "data" / "family-configs.json").read_text())[key])


def mistral_nf4_512_blocks() -> list[int]:
    """Mistral-7B NF4 512x1 at its layer-phase peak, as PEAK's allocator history lists it: three
    4096x14336 bf16 MLP weights, three 32 MiB blocks, 32 checkpointed inputs, rotary tables."""
    T, h = 512, 4096
    return [117_440_512] * 3 + [33_554_432] * 3 + [2 * T * h] * 32 + [4 * 128 * 512] + [4096] * 5


def test_mistral_nf4_512x1_weight_blocks_are_dequantised_layer_weights_not_activations():
    c = cfg("mistral-7b")
    classify = A.physical_classifier(c, quant="nf4", seq=512, batch=1, targets=("q_proj", "v_proj"),
                                     lora_r=8)
    assert classify(117_440_512) == A.DEQUANTISED  # 4096 x 14336 x 2
    # 4096 x 4096 x 2 = 32 MiB is also its bf16 logits (512 x 32768 x 2) and a Hopper workspace
    assert classify(33_554_432) == A.DEQUANTISED
    assert classify(2 * 4096 * 1024) == A.DEQUANTISED  # k/v 8 MiB, also T h 4 and Ampere's
    live = A.classify_blocks(mistral_nf4_512_blocks(), classify)
    assert live[A.DEQUANTISED] == 3 * 117_440_512 + 3 * 33_554_432
    assert live[A.CHECKPOINTED] == 32 * 2 * 512 * 4096
    assert live[A.ROTARY] == 4 * 128 * 512 and live[A.REST] == 5 * 4096
    assert live[A.LOGITS_BF16] == live[A.LOGITS_FP32] == live[A.WORKSPACES] == 0


def test_same_sizes_on_a_bf16_arm_are_not_weights():
    classify = A.physical_classifier(cfg("mistral-7b"), quant="none", seq=512, batch=1)
    assert classify(117_440_512) == A.REST
    assert classify(33_554_432) == A.LOGITS_BF16  # no dequantised weights without NF4
    assert classify(4 * 512 * 32768) == A.LOGITS_FP32
    assert classify(4 * 512 * 4096) == A.FP32_RESIDUAL  # 8 MiB: the residual outranks Ampere's


@pytest.mark.parametrize("key", ["smol", "qwen", "gemma3-1b", "phi3-mini", "llama31-8b"])
def test_each_class_size_is_named_and_requested_or_512_rounded_sizes_match(key):
    c = cfg(key)
    a = E.arch_of(c)
    seq, batch = 1536, 2  # no two classes share a size here (2048 x 2: seq^2 x 2 = 8 MiB)
    T = seq * batch
    classify = A.physical_classifier(c, quant="none", seq=seq, batch=batch)
    assert classify(4 * T * a.V) == A.LOGITS_FP32
    assert classify(2 * T * a.V) == A.LOGITS_BF16
    assert classify(2 * T * a.h) == A.CHECKPOINTED
    assert classify(4 * T * a.h) == A.FP32_RESIDUAL
    assert classify(4 * a.rotary_dim * seq) == A.ROTARY
    assert classify(seq * seq * batch) == A.MASKS and classify(2 * seq * seq * batch) == A.MASKS
    assert classify(33_554_432) in (A.WORKSPACES, A.CHECKPOINTED, A.FP32_RESIDUAL)
    assert classify(777) == A.REST
    odd = 2 * T * a.h + 100  # not a 512 multiple: the 512-rounded class size names it too
    assert classify(-(-odd // 512) * 512) in (A.CHECKPOINTED, A.REST)


def test_phi2_nf4_fp32_inputs_are_checkpointed_and_charged_with_the_final_norm():
    c = cfg("phi-2")
    T, h = 2048, 2560
    classify = A.physical_classifier(c, quant="nf4", seq=2048, batch=1, targets=("q_proj", "v_proj"))
    assert classify(4 * T * h) == A.CHECKPOINTED and classify(2 * T * h) == A.CHECKPOINTED
    est = E.estimate(c, quant="nf4", seq=2048, release="0.73.3")
    blocks = [2 * T * h] + [4 * T * h] * 31 + [4 * T * h] + [3 * 4 * T * 51200 // 3] * 3
    live = A.classify_blocks(blocks, classify)
    rows = {r["class"]: r for r in A.class_breakdown(live, est, seq=2048, batch=1, config=c)}
    assert rows[A.CHECKPOINTED]["charged"] == est.terms["checkpointed_inputs"] + est.terms["final_norm"]
    assert rows[A.CHECKPOINTED]["missed"] == 0  # (4L-2) T h + 4 T h: 1 bf16 + 31 fp32 + 1 fp32
    assert rows[A.FP32_RESIDUAL]["charged"] == 0
    assert rows[A.LOGITS_FP32]["missed"] == 0


def test_breakdown_of_a_loss_peak_in_units():
    c = cfg("qwen")
    seq, batch = 2048, 1
    a = E.arch_of(c)
    T, el = seq * batch, seq * batch * a.V
    est = E.estimate(c, seq=seq, batch=batch, release="0.73.3")
    assert est.phase == "loss"
    blocks = [4 * el] * 3 + [2 * T * a.h] * a.L + [4 * T * a.h] + [4 * a.rotary_dim * seq] + [8 * T] * 4
    classify = A.physical_classifier(c, quant="none", seq=seq, batch=batch)
    rows = A.class_breakdown(A.classify_blocks(blocks, classify), est, seq=seq, batch=batch, config=c)
    by = {r["class"]: r for r in rows}
    assert [r["class"] for r in rows] == list(A.CLASSES)
    for r in rows:
        assert set(r) >= {"class", "live", "charged", "missed", "per"}
        assert r["missed"] == r["live"] - r["charged"]
    assert by[A.LOGITS_FP32]["missed"] == 0 and by[A.LOGITS_FP32]["per"] == (el, "logits element")
    assert by[A.CHECKPOINTED]["missed"] == 0 and by[A.CHECKPOINTED]["per"] == (T, "token")
    assert by[A.FP32_RESIDUAL]["missed"] == 0
    assert by[A.ROTARY]["missed"] == 0 and by[A.ROTARY]["per"] == (seq, "position")
    assert by[A.MASKS]["per"] == (seq * seq * batch, "seq^2")
    assert by[A.WORKSPACES]["per"] is None and by[A.WORKSPACES]["charged"] == 0  # loss phase
    assert by[A.DEQUANTISED]["charged"] == 0  # bf16 arm
    # the rest: 32 B/token of ids and labels charged, 8 B/position; 4 x 8 B/token live
    assert by[A.REST]["missed"] == 4 * 8 * T - 32 * T - 8 * seq
    assert by[A.REST]["missed_per"] == by[A.REST]["missed"] / T
    assert "B per token" in A.render(rows)


def test_layer_phase_breakdown_charges_weights_per_layer_and_the_autograd_workspace():
    c = cfg("mistral-7b")
    est = E.estimate(c, quant="nf4", seq=512, release="0.73.3")
    assert est.phase == "layer"
    classify = A.physical_classifier(c, quant="nf4", seq=512, batch=1)
    rows = {r["class"]: r for r in A.class_breakdown(
        A.classify_blocks(mistral_nf4_512_blocks(), classify), est, seq=512, batch=1, config=c)}
    w = rows[A.DEQUANTISED]
    assert w["charged"] == E.dequantised_layer(E.arch_of(c), "nf4") and w["per"] == (1, "layer")
    assert w["missed"] == 3 * 117_440_512 + 3 * 33_554_432 - w["charged"]
    assert rows[A.WORKSPACES]["charged"] == E.CUBLAS_WORKSPACE and rows[A.WORKSPACES]["per"] is None
    assert rows[A.LOGITS_FP32]["charged"] == 0  # the loss phase's terms do not bind here


def test_bad_input():
    classify = A.physical_classifier(cfg("smol"), quant="none", seq=512, batch=1)
    for junk in (-1, 2.5, "8", True):
        with pytest.raises(UsageError):
            classify(junk)
    with pytest.raises(UsageError):
        A.physical_classifier(cfg("smol"), quant="int8", seq=512, batch=1)
    est = E.estimate(cfg("smol"), seq=512, release="0.73.3")
    with pytest.raises(UsageError):
        A.class_breakdown({"activations": 1}, est, seq=512, batch=1, config=cfg("smol"))


def test_modules_stay_small_and_torch_free():
    for name in ("anatomy.py", "estimate.py"):
        text = (ROOT / "issue395" / name).read_text()
        assert len(text.splitlines()) < 450
        assert "import torch" not in text
