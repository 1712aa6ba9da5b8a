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
    + gate, up, down 4096x14336) = 2 x 218,103,808 = 436,207,616 B, written out here. The peak is the
    recomputed forward's end, down_proj being dequantised: its nested absmax expanded to fp32 is live
    beside the weights, 14336 x 4096 / 64 x 4 = 3,670,016 B (one block at ops.py:337 in
    results/map4-full-lanes-layer-phase-*/call-3/layer-sft-mistral-nf4-512x1-r8.json; docs/PEAK.md,
    "The NF4 layer phase, read per phase"), charged with the weights."""
    c = cfg("mistral-7b")
    est = E.estimate(c, quant="nf4", seq=512, release="0.73.3", soup=False)
    assert est.phase == "layer"
    classify = A.physical_classifier(c, quant="nf4", seq=512, batch=1)
    rows = {r["class"]: r for r in A.class_breakdown(
        A.classify_blocks(mistral_nf4_512_blocks(), classify), est, seq=512, batch=1, config=c)}
    w = rows[A.DEQUANTISED]
    assert w["charged"] == 436_207_616 + 3_670_016 and w["per"] == (1, "layer")
    # live: 3 x 117,440,512 + 3 x 33,554,432 = 452,984,832 (PEAK's older history, no absmax temp listed)
    assert w["missed"] == 452_984_832 - 439_877_632
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
    # 2 x (2 x 4096 x 4096 + 2 x 4096 x 1024 + 3 x 4096 x 14336) = 436,207,616 B, and down_proj's nested
    # absmax in fp32 as the forward's end dequantises it, 14336 x 4096 / 64 x 4 = 3,670,016 B (live at
    # the peak: test_layer_phase_breakdown_charges_weights_per_layer_and_the_autograd_workspace)
    assert line.split()[4] == "439.878"


def test_a_pre_hopper_workspace_is_named_by_the_block_torch_requests_not_8_mib():
    """torch's ':4096:2:16:8' default is one caching-allocator request of the summed 8,519,680 B
    (CublasHandlePool.cpp); a bare 8 MiB block on an arm where no class has that size is unnamed."""
    classify = A.physical_classifier(cfg("smol"), quant="none", seq=512, batch=1)
    assert classify(8 * MiB + 128 * 1024) == A.WORKSPACES
    assert classify(8 * MiB) == A.REST
    assert classify(32 * MiB) == A.WORKSPACES


# --- a preference task's row: its rows, its loss's blocks, the head's private copy -------------

#: Committed GPU rows (H200, soup-cli 0.77.0): the map of Mistral-7B NF4 512 under SFT, DPO and KTO,
#: whose margins carry the classes its blocks were named by when it ran (at SFT's sizes), and the
#: task anatomy arms, whose allocator histories keep every live block's size at the peak.
MISTRAL_MAP = ROOT / "results/tasks-rest-h200-soup0.77.0-and-0.73.3-7e1f9a6/mistral-nf4-512-dpo-kto.json"
TASK_ANATOMY = sorted(ROOT.glob("results/*/anatomy-*.json"))
#: Mistral-7B NF4 512x1 DPO's blocks live at its peak, (size, count): the groups of the H200's
#: allocator history of that arm (bench/task_peak_anatomy.py). The first test holds them to the
#: committed map row of the same arm: named at SFT's sizes they give its classes to the byte.
MISTRAL_DPO_ANATOMY = ROOT / ("results/findmax-kimi-anatomy-h200-soup0.77.0-f6c944f/"
                              "anatomy-077-dpo-mistral-nf4-512x1-phases.json")
MISTRAL_DPO_512 = [(g["size"], g["count"]) for g in json.loads(MISTRAL_DPO_ANATOMY.read_text())["groups"]]


def _expand(pairs) -> list[int]:
    return [s for s, n in pairs for _ in range(n)]


def _margin(path: Path, task, quant: str, seq: int, batch: int) -> dict:
    return next(m for m in json.loads(path.read_text())["margins"]
                if (m.get("task"), m["quant"], m["seq"], m["batch"]) == (task, quant, seq, batch))


def test_the_mistral_dpo_blocks_are_the_committed_map_rows_blocks_as_sfts_sizes_named_them():
    m = _margin(MISTRAL_MAP, "dpo", "nf4", 512, 1)
    sft_sized = A.classify_blocks(_expand(MISTRAL_DPO_512), A.physical_classifier(cfg("mistral-7b"), quant="nf4",
                                                                                  seq=512, batch=1))
    assert sft_sized == {k: v for k, v in m["physical"].items() if k != "resident weights"}
    # the defect, as the row shows it: its 32 inputs as k/v weights, its loss and head copy in the rest
    assert sft_sized == {A.DEQUANTISED: 268_435_456, A.REST: 888_880_128}


def test_a_dpo_row_names_its_loss_blocks_its_head_copy_and_its_2b_row_inputs_leaving_under_2pc_in_the_rest():
    c, m = cfg("mistral-7b"), _margin(MISTRAL_MAP, "dpo", "nf4", 512, 1)
    classify = A.physical_classifier(c, quant="nf4", seq=512, batch=1, task="dpo", release="0.77.0")
    live = A.classify_blocks(_expand(MISTRAL_DPO_512), classify)
    est = E.estimate_key("mistral-7b", quant="nf4", seq=512, batch=1, task="dpo", release="0.77.0", soup=False)
    # the loss's blocks as the estimator lists them: 2 x 134,217,728 + 2 x 133,955,584 + 66,977,792
    assert live[A.LOGITS_FP32] == sum(E.task_loss_blocks(arch_of(c), "dpo", 512, 1)) == 603_324_416
    assert live[A.HEAD_COPY] == est.terms["head_copy"] == 268_435_456  # the untied head, 32768 x 4096 bf16
    assert live[A.CHECKPOINTED] == 32 * 8_388_608  # 32 layers' inputs, 2 rows x 512 x 4096 x 2 B each
    assert live[A.FP32_RESIDUAL] == 16_777_216  # the final norm's fp32 copy of 2 rows
    assert A.DEQUANTISED not in live  # no recompute at the peak: nothing of 8 MiB is a k/v weight
    assert live[A.REST] == 343_040 and live[A.REST] < 0.02 * m["real_peak"]
    rows = {r["class"]: r for r in A.class_breakdown(live, est, seq=512, batch=1, config=c)}
    assert (rows[A.HEAD_COPY]["charged"], rows[A.HEAD_COPY]["missed"], rows[A.HEAD_COPY]["per"]) == (
        268_435_456, 0, None)
    assert rows[A.CHECKPOINTED]["missed"] == 0 and rows[A.CHECKPOINTED]["per"] == (1024, "token")
    assert rows[A.LOGITS_FP32]["per"] == (1024 * 32768, "logits element")


@pytest.mark.parametrize("path", [p.name for p in TASK_ANATOMY if not json.loads(p.read_text()).get("step_error")])
def test_each_task_anatomy_peak_is_named_class_by_class_as_the_estimate_charges_it(path):
    """The committed anatomy arms (H200: DPO, KTO, ORPO, SimPO and SFT; SmolLM2, Qwen2.5 and
    Mistral-7B, bf16 and NF4): at each loss peak the fp32 blocks are the loss's, the saved inputs and the final
    norm's copy are what the estimate charges at the task's rows, and under 2% is left unnamed."""
    d = json.loads(next(p for p in TASK_ANATOMY if p.name == path).read_text())
    family, release = {"mistral": "mistral-7b"}.get(path.split("-")[3], path.split("-")[3]), \
        "0.77.0" if "-077-" in path else "0.73.3"
    c = cfg(family)
    classify = A.physical_classifier(c, quant=d["quant"], seq=d["seq"], batch=d["batch"], task=d["task"],
                                     release=release)
    live = A.classify_blocks([g["size"] for g in d["groups"] for _ in range(g["count"])], classify)
    est = E.estimate_key(family, quant=d["quant"], seq=d["seq"], batch=d["batch"], task=d["task"],
                         release=release, soup=False)
    assert est.phase == "loss"
    rows = {r["class"]: r for r in A.class_breakdown(live, est, seq=d["seq"], batch=d["batch"], config=c)}
    assert {k: rows[k]["missed"] for k in (A.LOGITS_FP32, A.CHECKPOINTED, A.FP32_RESIDUAL)} == {
        A.LOGITS_FP32: 0, A.CHECKPOINTED: 0, A.FP32_RESIDUAL: 0}
    assert 0 < live[A.REST] < 0.02 * d["real_peak"]


def test_a_task_rows_fp32_logits_are_charged_in_the_phase_the_estimate_binds():
    """The loss phase charges the loss's blocks; the reference forward the policy's, which it holds
    (reference_held); the head's copy is live in both."""
    import dataclasses

    c = cfg("mistral-7b")
    est = E.estimate_key("mistral-7b", quant="nf4", seq=512, batch=1, task="dpo", release="0.77.0", soup=False)
    a = arch_of(c)
    for phase, fp32 in (("loss", sum(E.task_loss_blocks(a, "dpo", 512, 1))),
                        ("reference", sum(E.reference_held_blocks(a, "dpo", 512, 1)))):
        rows = {r["class"]: r for r in A.class_breakdown({}, dataclasses.replace(est, phase=phase), seq=512,
                                                         batch=1, config=c)}
        assert (rows[A.LOGITS_FP32]["charged"], rows[A.HEAD_COPY]["charged"]) == (fp32, 2 * 32768 * 4096)
    rows = [r["class"] for r in A.class_breakdown({}, dataclasses.replace(est, phase="layer"), seq=512, batch=1,
                                                  config=c)]
    assert A.HEAD_COPY not in rows  # not live in the layer phase, and none live: no row


def test_one_head_copy_takes_one_block_where_a_logits_block_has_its_size():
    """Mistral-7B DPO 1024x1: the policy's and the reference's logits are 2 x 1024 x 32768 x 4 B =
    2^28 B each, the head's bf16 copy 32768 x 4096 x 2 = 2^28 B too."""
    classify = A.physical_classifier(cfg("mistral-7b"), quant="none", seq=1024, batch=1, task="dpo",
                                     release="0.77.0")
    live = A.classify_blocks([2**28] * 3, classify)
    assert live == {A.HEAD_COPY: 2**28, A.LOGITS_FP32: 2 * 2**28}
    assert "head's" not in str(A.classify_blocks([2**28] * 2, A.physical_classifier(
        cfg("mistral-7b"), quant="none", seq=1024, batch=1, task="dpo", release="0.73.3")))  # no copy before 0.77.0


def test_a_task_rows_layer_phase_names_a_weight_sized_block_a_weight_as_many_times_as_a_layer_has_it():
    """No loss block live (the recompute): of Mistral-7B NF4 512x1 DPO's 8 MiB blocks two are the
    layer's dequantised k and v (4096 x 1024 x 2 B), the other 30 saved inputs; its MLP weights are
    weights. With a loss block live the same 8 MiB blocks are all inputs."""
    classify = A.physical_classifier(cfg("mistral-7b"), quant="nf4", seq=512, batch=1, task="dpo", release="0.77.0")
    layer = [117_440_512] * 3 + [8_388_608] * 32
    assert A.classify_blocks(layer, classify) == {A.DEQUANTISED: 3 * 117_440_512 + 2 * 8_388_608,
                                                  A.CHECKPOINTED: 30 * 8_388_608}
    assert A.classify_blocks([134_217_728] + [8_388_608] * 32, classify) == {A.LOGITS_FP32: 134_217_728,
                                                                             A.CHECKPOINTED: 32 * 8_388_608}


def test_the_capture_names_a_task_arms_blocks_at_its_task():
    sft = A.classifier_for("mistral-7b", quant="nf4", seq=512, batch=1)
    dpo = A.classifier_for("mistral-7b", quant="nf4", seq=512, batch=1, task="dpo", release="0.77.0")
    assert (sft(8_388_608), dpo(8_388_608)) == (A.DEQUANTISED, A.CHECKPOINTED)
    assert (sft(134_217_728), dpo(134_217_728)) == (A.REST, A.LOGITS_FP32)
    assert A.classifier_for("smol", quant="none", seq=512, batch=1, task="kto") is None  # KTO needs batch 2


def _physical_section(text: str) -> list[str]:
    return text.split("the peak by physical class")[1].split("\n\n")[0].splitlines()


def test_an_sft_rows_classes_are_the_ones_its_gpu_run_printed(capfd):
    """The SFT rows of the committed Mistral map: the live column and the classes' order, as the
    tool printed them on the H200 (the charged column is the estimator's, which moves with it)."""
    from conftest import main

    code, out, err = main(capfd, ["--from-json", MISTRAL_MAP])
    printed = _physical_section(MISTRAL_MAP.with_suffix(".txt").read_text())
    now = _physical_section(out)

    def sft_tables(lines):
        tables, keep = [], False
        for line in lines:
            if line.startswith("  ") and not line.startswith("    "):
                keep = " dpo " not in line and " kto " not in line
                tables.append([]) if keep else None
            elif keep:
                tables[-1].append(line[:40])  # class and live MB
        return tables

    assert len(sft_tables(printed)) == 2 and sft_tables(now) == sft_tables(printed)


def test_an_sft_margin_that_kept_its_blocks_renders_as_its_stored_classes():
    """The Qwen2.5 4096x1 history (results/record-h200x2-*): its blocks named now, from the sizes a
    margin keeps, give the table its stored classes give."""
    c = cfg("qwen")
    blocks = [2_489_319_424] * 3 + [14_680_064] + [7_340_032] * 24 + [1_048_576] + [1_198_592]
    stored = dict(A.classify_blocks(blocks, A.physical_classifier(c, quant="none", seq=4096, batch=1)),
                  **{"resident weights": 372_000_000})
    m = {"model": "Qwen2.5-0.5B", "model_key": "qwen", "quant": "none", "seq": 4096, "batch": 1, "physical": stored}
    kept = dict(m, live_blocks=A.live_blocks(blocks))
    assert kept["live_blocks"][0] == [2_489_319_424, 3]
    assert A.margin_anatomy([kept], "0.73.3") == A.margin_anatomy([m], "0.73.3") != ""


def test_a_task_row_is_split_from_the_blocks_it_kept_and_one_that_kept_none_is_not_split(capfd, tmp_path):
    """The committed Mistral map re-rendered: its task rows ran before the classes read the task, so
    they are not split; given its blocks' sizes (as a run from here on keeps them), the DPO 512x1
    row is split at its task's sizes, its head copy a class of its own."""
    from conftest import main

    data = json.loads(MISTRAL_MAP.read_text())
    code, out, err = main(capfd, ["--from-json", MISTRAL_MAP])
    section = _physical_section(out)
    assert sum("not split by class" in line for line in section) == 3  # DPO 512x1, 512x2, KTO 512x2
    assert not any("the head's private copy" in line for line in section)
    margin = next(m for m in data["margins"] if (m.get("task"), m["batch"]) == ("dpo", 1))
    margin["live_blocks"] = [list(p) for p in MISTRAL_DPO_512]
    path = tmp_path / "map.json"
    path.write_text(json.dumps(data))
    code, out, err = main(capfd, ["--from-json", path])
    assert "Traceback" not in err
    section = _physical_section(out)
    table = section[section.index(next(x for x in section if x.startswith("  Mistral-7B-v0.3 dpo nf4 512x1"))):]
    lines = {x.split("  ")[2].strip(): x.split() for x in table[2:13] if x.startswith("    ")}
    assert lines["the head's private copy"][4:7] == ["268.435", "268.435", "0.000"]
    assert lines["logits fp32"][2] == "603.324" and lines["checkpointed layer inputs"][3] == "268.435"
    assert lines["the rest"][2] == "0.343"
    assert sum("not split by class" in line for line in section) == 2


def test_a_margins_live_blocks_that_are_not_sizes_and_counts_are_refused_in_one_line(capfd, tmp_path):
    from conftest import main, one_error_line

    data = json.loads(MISTRAL_MAP.read_text())
    data["margins"][1]["live_blocks"] = [[8_388_608, 0]]
    path = tmp_path / "map.json"
    path.write_text(json.dumps(data))
    one_error_line(*main(capfd, ["--from-json", path]), "live_blocks")
