"""issue395.estimator.anatomy: naming the blocks live at a step's peak by physical class, from their sizes,
and setting each class against the estimator term meant to charge it, as --from-json prints it.
Synthetic block lists built from the real family configs (the registry, issue395/model/registry.py), and
one committed map whose margin is given its physical classes by hand where a GPU's allocator history
would have (none can be taken here); CPU only, nothing else faked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from issue395.model.registry import config_json
from issue395.estimator import anatomy as A  # noqa: E402
from issue395.estimator import estimate as E  # noqa: E402
from issue395.errors import UsageError  # noqa: E402
from issue395.estimator.soup_number import arch_of  # noqa: E402

MiB = 2**20


def cfg(key: str) -> dict:
    return config_json(key)


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
    assert classify(2 * 4096 * 1024) == A.DEQUANTISED  # k/v 8 MiB, also T h 4
    live = A.classify_blocks(mistral_nf4_512_blocks(), classify)
    assert live[A.DEQUANTISED] == 3 * 117_440_512 + 3 * 33_554_432
    assert live[A.CHECKPOINTED] == 32 * 2 * 512 * 4096
    assert live[A.ROTARY] == 4 * 128 * 512 and live[A.REST] == 5 * 4096
    assert not {A.LOGITS_BF16, A.LOGITS_FP32, A.WORKSPACES} & set(live)  # nothing of theirs is live


def test_same_sizes_on_a_bf16_arm_are_not_weights():
    classify = A.physical_classifier(cfg("mistral-7b"), quant="none", seq=512, batch=1)
    assert classify(117_440_512) == A.REST
    assert classify(33_554_432) == A.LOGITS_BF16  # no dequantised weights without NF4
    assert classify(4 * 512 * 32768) == A.LOGITS_FP32
    assert classify(4 * 512 * 4096) == A.FP32_RESIDUAL  # 8 MiB: the residual outranks Ampere's


@pytest.mark.parametrize("key", ["smol", "qwen", "gemma3-1b", "phi3-mini", "llama31-8b"])
def test_each_class_size_is_named_and_requested_or_512_rounded_sizes_match(key):
    c = cfg(key)
    a = arch_of(c)
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
    """Phi-2 (public config: 32 layers, hidden 2560) NF4 2048x1: its residual is fp32 after layer
    0, so the live inputs are 1 bf16 (2 T h) + 31 fp32 (4 T h), and the final norm's input is
    one more fp32 T h 4. The charge is written out from the shape, not read from the estimator."""
    c = cfg("phi-2")
    T, h = 2048, 2560
    classify = A.physical_classifier(c, quant="nf4", seq=2048, batch=1, targets=("q_proj", "v_proj"))
    assert classify(4 * T * h) == A.CHECKPOINTED and classify(2 * T * h) == A.CHECKPOINTED
    est = E.estimate(c, quant="nf4", seq=2048, release="0.73.3", soup=False)
    blocks = [2 * T * h] + [4 * T * h] * 31 + [4 * T * h] + [3 * 4 * T * 51200 // 3] * 3
    live = A.classify_blocks(blocks, classify)
    rows = {r["class"]: r for r in A.class_breakdown(live, est, seq=2048, batch=1, config=c)}
    # (2 + 31 x 4 + 4) x 2048 x 2560 = 130 x 5,242,880 = 681,574,400 B
    assert rows[A.CHECKPOINTED]["live"] == 681_574_400
    assert rows[A.CHECKPOINTED]["charged"] == 681_574_400 and rows[A.CHECKPOINTED]["missed"] == 0
    assert rows[A.FP32_RESIDUAL]["charged"] == 0
    # three fp32 logits, 4 x 2048 x 51,200 = 419,430,400 B each, the loss phase's three copies
    assert rows[A.LOGITS_FP32]["live"] == 3 * 419_430_400 and rows[A.LOGITS_FP32]["missed"] == 0


#: A real allocator history: results/record-h200x2-soup0.73.3-e7c26f7's batch-snapshot row for
#: Qwen2.5-0.5B 4096x1 (--snapshot, H200), blocks live at the measured peak grouped by size.
QWEN_4096 = ROOT / "results" / "record-h200x2-soup0.73.3-e7c26f7" / "h200-2026-11-30-batch-snapshot.json"


def test_breakdown_of_qwen_4096x1_committed_loss_peak_misses_only_small_blocks():
    """The live blocks come from a measured history, not from the estimator's terms. Qwen2.5-0.5B's
    public shape (24 layers, hidden 896, vocab 151,936, head_dim 64) splits its groups exactly:
    3 fp32 logits of 4 x 4096 x 151,936 = 2,489,319,424 B; in 10-100 MB one fp32 residual,
    4 x 4096 x 896 = 14,680,064; in 1-10 MB 24 saved inputs of 2 x 4096 x 896 = 7,340,032 and one
    rotary table of 4 x 64 x 4096 = 1,048,576 (25 blocks, 177,209,344 B); and 12 blocks under
    1 MB, 1,198,592 B in all (their sizes are not kept, so they stand here as one block)."""
    row = next(r for r in json.loads(QWEN_4096.read_text())["rows"]
               if (r["model_key"], r["seq"], r["batch"]) == ("qwen", 4096, 1))
    hist = row["attribution"]
    assert hist["complete"] and hist["replayed_peak"] == hist["measured_peak"] == row["real_peak"]
    logits, residual, saved, rotary, small = 2_489_319_424, 14_680_064, 7_340_032, 1_048_576, 1_198_592
    assert hist["logits_fp32"] == {"count": 3, "bytes": 3 * logits}
    assert hist["other_groups"] == {"10-100 MB": {"count": 1, "bytes": residual},
                                    "1-10 MB": {"count": 25, "bytes": 24 * saved + rotary},
                                    "< 1 MB": {"count": 12, "bytes": small}}
    blocks = [logits] * 3 + [residual] + [saved] * 24 + [rotary] + [small]
    assert hist["resident_at_peak"] + sum(blocks) == row["real_peak"]  # nothing measured is left out
    c = cfg("qwen")
    est = E.estimate(c, seq=4096, batch=1, release="0.73.3", soup=False)
    assert est.phase == "loss"
    classify = A.physical_classifier(c, quant="none", seq=4096, batch=1)
    rows = A.class_breakdown(A.classify_blocks(blocks, classify), est, seq=4096, batch=1, config=c)
    by = {r["class"]: r for r in rows}
    assert [r["class"] for r in rows] == list(A.CLASSES)
    assert {k: (by[k]["live"], by[k]["missed"]) for k in (A.LOGITS_FP32, A.CHECKPOINTED, A.FP32_RESIDUAL,
                                                           A.ROTARY)} == {
        A.LOGITS_FP32: (3 * logits, 0), A.CHECKPOINTED: (24 * saved, 0), A.FP32_RESIDUAL: (residual, 0),
        A.ROTARY: (rotary, 0)}
    # the small blocks: ids and labels (32 B/token) and position ids (8 B/position) are charged,
    # 1,198,592 - 40 x 4096 = 1,034,752 B of them are not (the allowance's share)
    assert (by[A.REST]["live"], by[A.REST]["missed"]) == (small, 1_034_752)
    assert by[A.REST]["missed_per"] == 1_034_752 / 4096
    assert by[A.LOGITS_FP32]["per"] == (4096 * 151_936, "logits element")
    assert by[A.CHECKPOINTED]["per"] == (4096, "token") and by[A.ROTARY]["per"] == (4096, "position")
    assert by[A.MASKS]["per"] == (4096 * 4096, "seq^2")
    assert by[A.WORKSPACES]["per"] is None and by[A.WORKSPACES]["charged"] == 0  # loss phase
    assert by[A.DEQUANTISED]["charged"] == 0  # bf16 arm
    assert "B per token" in A.render(rows)


def test_layer_phase_breakdown_charges_weights_per_layer_and_the_autograd_workspace():
    """Mistral-7B (public config: hidden 4096, 8 KV heads of 128, intermediate 14336) NF4 512x1:
    one layer's linears dequantised to bf16 are 2 x (q 4096x4096 + k, v 4096x1024 + o 4096x4096
    + gate, up, down 4096x14336) = 2 x 218,103,808 = 436,207,616 B, written out here."""
    c = cfg("mistral-7b")
    est = E.estimate(c, quant="nf4", seq=512, release="0.73.3", soup=False)
    assert est.phase == "layer"
    classify = A.physical_classifier(c, quant="nf4", seq=512, batch=1)
    rows = {r["class"]: r for r in A.class_breakdown(
        A.classify_blocks(mistral_nf4_512_blocks(), classify), est, seq=512, batch=1, config=c)}
    w = rows[A.DEQUANTISED]
    assert w["charged"] == 436_207_616 and w["per"] == (1, "layer")
    # live: 3 x 117,440,512 + 3 x 33,554,432 = 452,984,832; 16 MiB more than one layer's weights
    assert w["missed"] == 16_777_216
    assert rows[A.WORKSPACES]["charged"] == 33_554_432 and rows[A.WORKSPACES]["per"] is None
    assert rows[A.LOGITS_FP32]["charged"] == 0  # the loss phase's terms do not bind here


def test_bad_input():
    classify = A.physical_classifier(cfg("smol"), quant="none", seq=512, batch=1)
    for junk in (-1, 2.5, "8", True):
        with pytest.raises(UsageError):
            classify(junk)
    with pytest.raises(UsageError):
        A.physical_classifier(cfg("smol"), quant="int8", seq=512, batch=1)
    est = E.estimate(cfg("smol"), seq=512, release="0.73.3", soup=False)
    with pytest.raises(UsageError):
        A.class_breakdown({"activations": 1}, est, seq=512, batch=1, config=cfg("smol"))


def test_an_attribution_that_cannot_name_classes_never_costs_the_measurement(monkeypatch):
    from issue395.estimator import anatomy

    def broken(*a, **kw):
        raise TypeError("an estimator signature this tool cannot read")

    assert anatomy.classifier_for("smol", quant="none", seq=2048, batch=1) is not None
    assert anatomy.classifier_for("custom", quant="none", seq=2048, batch=1) is None
    monkeypatch.setattr(anatomy, "physical_classifier", broken)
    assert anatomy.classifier_for("smol", quant="none", seq=2048, batch=1) is None


def test_a_margin_of_a_release_the_estimator_does_not_know_is_left_out_of_the_anatomy():
    from issue395.estimator.anatomy import margin_anatomy

    m = {"model": "x", "model_key": "custom", "quant": "none", "seq": 64, "batch": 1, "physical": {"the rest": 1}}
    assert margin_anatomy([m], "9.9.9") == ""


def test_a_map_margin_named_by_physical_class_is_set_against_the_corrected_terms(capfd, tmp_path):
    """A saved map whose Mistral-7B NF4 512x1 margin carries its live blocks by physical class
    (as run_arm records them with a history): the text sets each class against the corrected
    estimate's term, the dequantised layer against its W16 term, resident weights first."""
    from conftest import main

    data = json.loads((ROOT / "results/cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37/map-512-1024.json").read_text())
    margin = next(m for m in data["margins"] if (m["model_key"], m["quant"], m["seq"], m["batch"])
                  == ("mistral-7b", "nf4", 512, 1))
    w16 = 3 * 4096 * 14336 * 2 + 3 * 4096 * 4096 * 2
    margin["physical"] = {"dequantised layer weights": w16, "the rest": 1024, "resident weights": 800_000_000}
    path = tmp_path / "map.json"
    path.write_text(json.dumps(data))
    code, out, err = main(capfd, ["--from-json", path])
    assert "Traceback" not in err
    section = out.split("the peak by physical class")[1]
    assert section.index("resident weights") < section.index("dequantised layer weights")
    line = next(x for x in section.splitlines() if "dequantised layer weights" in x)
    assert f"{w16 / 1e6:.3f}" in line  # live, measured
    # charged: the corrected W16 term, one layer's linears in bf16 from Mistral-7B's public shape:
    # 2 x (2 x 4096 x 4096 + 2 x 4096 x 1024 + 3 x 4096 x 14336) = 436,207,616 B
    assert line.split()[4] == "436.208"


def test_a_pre_hopper_workspace_is_named_by_the_block_torch_requests_not_8_mib():
    """torch's ':4096:2:16:8' default is one caching-allocator request of the summed 8,519,680 B
    (CublasHandlePool.cpp); a bare 8 MiB block on an arm where no class has that size is unnamed."""
    classify = A.physical_classifier(cfg("smol"), quant="none", seq=512, batch=1)
    assert classify(8 * MiB + 128 * 1024) == A.WORKSPACES
    assert classify(8 * MiB) == A.REST
    assert classify(32 * MiB) == A.WORKSPACES
