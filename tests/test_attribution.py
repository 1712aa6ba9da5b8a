"""Peak attribution from an allocator history, the positive control, and shards and merging.

A CUDA allocator snapshot cannot be taken on a CPU-only machine, so every history here
is hand-built in torch.cuda.memory._snapshot()'s plain-dict format:
{"device_traces": [[{"action", "addr", "size"}, ...]], "segments": []}, sizes being the
REQUESTED sizes (the allocator counts each block rounded up to 512). The replay, the
attribution and the control are the harness's real code; the one real control step runs
on a CUDA box only (marker ``cuda``).
"""

from __future__ import annotations

import json
import random

import pytest
from conftest import cuda, make_row, safe_peak

from issue395.cuda import attribute_peak, block_bytes, control_step, logits_kind, positive_control
from issue395.errors import EXIT_FINDING, EXIT_INTERRUPTED, EXIT_OK, UsageError
from issue395.grid import plan_arms, shard_of
from issue395.arm import Arm, predicted_bytes
from issue395.registry import SHAPES
from issue395.merge import merge
from issue395.result import Result
from issue395.row import Row

E = 1001  # logits elements; odd, so 2E and 4E are not multiples of 512
BF16, FP32 = 2 * E, 4 * E  # requested sizes: 2002, 4004
BF16_BLOCK, FP32_BLOCK = 2048, 4096  # what the allocator counts
R = 10_000_000  # resident when recording began


def alloc(addr, size):
    return {"action": "alloc", "addr": addr, "size": size}


def free(addr, size, completed=True):
    """A free as recent torch records it: free_requested, then free_completed."""
    events = [{"action": "free_requested", "addr": addr, "size": size}]
    if completed:
        events.append({"action": "free_completed", "addr": addr, "size": size})
    return events


def snapshot(*events):
    trace = []
    for e in events:
        trace.extend(e if isinstance(e, list) else [e])
    return {"device_traces": [trace], "segments": []}


def loss_step_history():
    """resident R; a bf16 logits; two fp32 logits; one freed; another fp32 and a small
    block (the peak); then frees, a fresh bf16 copy and a large pre-existing block freed
    after the peak. A block freed but never allocated in the trace was resident before."""
    return snapshot(
        free(900, 3000),             # pre-existing block, freed before the peak: -3072
        alloc(1, BF16),              # +2048
        alloc(2, FP32),              # +4096
        alloc(3, FP32),              # +4096  (two fp32 + bf16: 10240, not yet the peak)
        free(2, FP32),               # -4096
        alloc(4, FP32),              # +4096
        alloc(5, 100),               # +512 -> the peak: R - 3072 + 10752
        free(3, FP32),               # -4096
        free(1, BF16),               # -2048
        alloc(6, BF16),              # +2048
        free(901, 600_000),          # pre-existing block freed after the peak
    )


PEAK = R - 3072 + BF16_BLOCK + 2 * FP32_BLOCK + 512


# --- the allocator's rounding and the logits shapes ---------------------------------

def test_the_mistral_nf4_peak_is_named_by_physical_class_dequantised_weights_not_activations():
    """docs/PEAK.md's history of Mistral-7B NF4 512x1, in miniature: three 4096x14336 and three
    4096x4096 bf16 blocks live at the peak are the dequantised layer, set apart from the rest,
    and the bytes resident before the step are the resident weights."""
    from issue395.anatomy import physical_classifier
    from issue395.registry import config_json

    classify = physical_classifier(config_json("mistral-7b"), quant="nf4", seq=512, batch=1,
                                   targets=("q_proj", "v_proj"))
    mlp, attn = 4096 * 14336 * 2, 4096 * 4096 * 2
    snap = snapshot(*[alloc(i, mlp) for i in range(3)], *[alloc(10 + i, attn) for i in range(3)],
                    alloc(20, 1000))
    a = attribute_peak(snap, R, 512 * 32768, R + 3 * mlp + 3 * attn + 1024, physical=classify)
    assert a["physical"] == {"dequantised layer weights": 3 * mlp + 3 * attn, "the rest": 1024,
                             "resident weights": R}
    assert "physical" not in attribute_peak(snap, R, 512 * 32768)


def test_block_bytes_rounds_up_to_512():
    assert block_bytes(1) == 512
    assert block_bytes(0) == 512
    assert block_bytes(512) == 512
    assert block_bytes(513) == 1024
    assert block_bytes(BF16) == BF16_BLOCK
    assert block_bytes(FP32) == FP32_BLOCK


def test_logits_kind_names_exactly_one_logits_tensor():
    assert logits_kind(2 * E, E) == "bf16"
    assert logits_kind(4 * E, E) == "fp32"
    assert logits_kind(2 * E + 1, E) is None
    assert logits_kind(8 * E, E) is None  # two tensors' worth is not one logits tensor
    assert logits_kind(E, E) is None


# --- the replay ------------------------------------------------------------------------

def test_replayed_peak_is_the_maximum_not_the_final_state():
    a = attribute_peak(loss_step_history(), R, E, measured_peak=PEAK)
    assert a["replayed_peak"] == PEAK
    # At the peak: one bf16 and two fp32 logits live (the final state has one of each).
    assert a["logits_bf16"] == {"count": 1, "bytes": BF16_BLOCK}
    assert a["logits_fp32"] == {"count": 2, "bytes": 2 * FP32_BLOCK}
    assert a["other_groups"] == {"< 1 MB": {"count": 1, "bytes": 512}}
    assert a["elements"] == E
    assert a["measured_peak"] == PEAK
    assert a["events"] == len(loss_step_history()["device_traces"][0])


def test_pre_existing_frees_before_the_peak_reduce_resident_at_peak():
    a = attribute_peak(loss_step_history(), R, E, measured_peak=PEAK)
    # The 3000-byte free before the peak counts (rounded to 3072); the 600 kB one after
    # the peak does not.
    assert a["resident_at_peak"] == R - 3072


def test_small_allocation_counts_as_a_512_byte_block():
    a = attribute_peak(snapshot(alloc(7, 1)), 0, E)
    assert a["replayed_peak"] == 512
    assert a["other_groups"] == {"< 1 MB": {"count": 1, "bytes": 512}}


def test_blocks_are_grouped_by_size_largest_first():
    a = attribute_peak(snapshot(alloc(4, 10), alloc(3, 2_000_000), alloc(1, 150_000_000),
                                  alloc(2, 20_000_000)), 0, E)
    assert a["other_groups"] == {">= 100 MB": {"count": 1, "bytes": 150_000_128},
                                 "10-100 MB": {"count": 1, "bytes": 20_000_256},
                                 "1-10 MB": {"count": 1, "bytes": 2_000_384},
                                 "< 1 MB": {"count": 1, "bytes": 512}}
    assert list(a["other_groups"]) == [">= 100 MB", "10-100 MB", "1-10 MB", "< 1 MB"]
    assert a["logits_bf16"]["count"] == a["logits_fp32"]["count"] == 0


def test_complete_when_the_measured_peak_matches():
    assert attribute_peak(loss_step_history(), R, E, PEAK)["complete"] is True
    # Within an allocator remainder (under 1 MiB) it is still complete.
    assert attribute_peak(loss_step_history(), R, E, PEAK + 512 * 1024)["complete"] is True
    # Without a measurement there is nothing to disagree with.
    assert attribute_peak(loss_step_history(), R, E, None)["complete"] is True


@pytest.mark.parametrize("off", [+4 * 2**20, -4 * 2**20, +100_000_000])
def test_incomplete_when_the_measured_peak_is_far_off(off):
    a = attribute_peak(loss_step_history(), R, E, PEAK + off)
    assert a["complete"] is False
    assert a["measured_peak"] == PEAK + off
    assert a["replayed_peak"] == PEAK


@pytest.mark.parametrize("snap", [{"device_traces": [], "segments": []},
                                  {"device_traces": [[]], "segments": []}, {}],
                         ids=["no-traces", "empty-trace", "no-key"])
def test_empty_history_is_never_complete(snap):
    a = attribute_peak(snap, R, E, R)
    assert a["complete"] is False
    assert a["events"] == 0
    assert a["replayed_peak"] == R
    assert a["resident_at_peak"] == R


def test_history_that_only_frees_peaks_at_resident():
    a = attribute_peak(snapshot(free(900, 5000)), R, E, R)
    assert a["replayed_peak"] == R
    assert a["logits_bf16"]["count"] == 0
    assert a["complete"] is True


@pytest.mark.parametrize("kept", ["free_completed", "free"])
def test_history_without_free_requested_replays_on_its_other_free(kept):
    """Older histories record only the completed free (or a plain free); the replay uses it."""
    trace = [dict(e, action=kept) if e["action"] == "free_completed" else e
             for e in loss_step_history()["device_traces"][0] if e["action"] != "free_requested"]
    a = attribute_peak({"device_traces": [trace], "segments": []}, R, E, PEAK)
    assert a["replayed_peak"] == PEAK
    assert a["logits_fp32"]["count"] == 2
    assert a["resident_at_peak"] == R - 3072


def test_free_completed_is_not_counted_twice_when_free_requested_exists():
    a = attribute_peak(loss_step_history(), R, E)
    assert a["replayed_peak"] == PEAK  # a double count would lower it
    assert a["resident_at_peak"] == R - 3072


def test_longest_device_trace_is_replayed():
    snap = loss_step_history()
    snap["device_traces"] = [[alloc(1, 10)], snap["device_traces"][0], []]
    a = attribute_peak(snap, R, E, PEAK)
    assert a["replayed_peak"] == PEAK
    assert a["events"] == len(loss_step_history()["device_traces"][0])


# --- the positive control: hand-made histories through attribute_peak -----------------

def control_history(bf16_copies: int, fp32_copies: int = 0):
    """A loss step: bf16 logits, fp32 upcast, grad; plus held copies across it."""
    events = [alloc(1, BF16), alloc(2, FP32)]
    events += [alloc(100 + i, BF16) for i in range(bf16_copies)]
    events += [alloc(200 + i, FP32) for i in range(fp32_copies)]
    events += [alloc(3, FP32), free(2, FP32), free(3, FP32), free(1, BF16)]
    events += [free(100 + i, BF16) for i in range(bf16_copies)]
    events += [free(200 + i, FP32) for i in range(fp32_copies)]
    return snapshot(*events)


def control_peak(bf16_copies: int, fp32_copies: int = 0) -> int:
    return R + BF16_BLOCK * (1 + bf16_copies) + FP32_BLOCK * (2 + fp32_copies)


def attributed(copies: int, measured_off: int = 0, fp32_copies: int = 0):
    return attribute_peak(control_history(copies, fp32_copies), R, E,
                            control_peak(copies, fp32_copies) + measured_off)


def test_positive_control_passes_with_exactly_one_extra_bf16_block():
    without, with_copy = attributed(0), attributed(1)
    assert without["complete"] and with_copy["complete"]
    assert without["logits_bf16"]["count"] == 1
    assert with_copy["logits_bf16"]["count"] == 2
    c = positive_control(without, with_copy)
    assert c["extra_bf16_blocks"] == 1
    assert c["passed"] is True
    assert c["without_copy"] is without and c["with_copy"] is with_copy


@pytest.mark.parametrize("copies,fp32,extra", [(0, 0, 0), (2, 0, 2), (0, 1, 0)],
                         ids=["no-copy-seen", "two-copies", "fp32-copy"])
def test_positive_control_fails_unless_exactly_one_more_bf16_block(copies, fp32, extra):
    c = positive_control(attributed(0), attributed(copies, fp32_copies=fp32))
    assert c["extra_bf16_blocks"] == extra
    assert c["passed"] is False


def test_positive_control_fails_when_a_history_is_incomplete():
    far = 50 * 2**20
    assert positive_control(attributed(0, far), attributed(1))["passed"] is False
    assert positive_control(attributed(0), attributed(1, far))["passed"] is False
    empty = attribute_peak({"device_traces": []}, R, E, R)
    assert positive_control(empty, attributed(1))["passed"] is False


def test_a_failed_positive_control_is_a_finding():
    passed = positive_control(attributed(0), attributed(1))
    failed = positive_control(attributed(0), attributed(0))
    row = make_row("smol", 2048, real_peak=safe_peak(2048))
    assert Result(environment=ENV, rows=[row], control=passed).exit_code == EXIT_OK
    assert Result(environment=ENV, rows=[row], control=failed).exit_code == EXIT_FINDING


@cuda
def test_real_control_step_sees_the_held_bf16_copy():
    """On a CUDA box: the real loss step, without and with one held bf16 logits copy."""
    c = positive_control(control_step(False), control_step(True))
    assert c["without_copy"]["complete"] and c["with_copy"]["complete"]
    assert c["extra_bf16_blocks"] == 1
    assert c["passed"] is True


# --- shards and merging ------------------------------------------------------------------

ENV = {"gpu": "NVIDIA H200", "driver": "570.1", "cuda": "13.0", "torch": "2.13.0+cu130",
       "transformers": "5.16.1", "trl": "0.29.1", "peft": "0.20.0", "soup_cli": "0.73.3",
       "python": "3.11.9", "weights": "synthetic", "dry_run": False, "arms": "shard 1/3 in one process",
       "cuda_visible_devices": "0", "date": "2025-01-01T00:00:00+00:00", "command": "x --shard 1/3"}


def grid():
    return plan_arms(["smol", "qwen"], None, [1])


def measured_row(arm: Arm, repeat=None) -> Row:
    return make_row(arm.model, arm.seq, arm.batch, arm.index, repeat=repeat,
                    real_peak=safe_peak(arm.seq, SHAPES[arm.model]))


def shard_result(k: int, n: int, **env) -> Result:
    """One shard's saved result, read back as --from-json reads it."""
    arms = shard_of(grid(), (k, n))
    res = Result(environment=dict(ENV, **env), rows=[measured_row(a) for a in arms])
    return Result.from_json(json.loads(json.dumps(res.to_json())))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 9, 10, 11])
def test_shards_cover_every_arm_exactly_once(n):
    arms = grid()
    shards = [shard_of(arms, (k, n)) for k in range(1, n + 1)]
    dealt = sorted(a.index for shard in shards for a in shard)
    assert dealt == list(range(len(arms)))
    for shard in shards:
        assert [a.index for a in shard] == sorted(a.index for a in shard)  # grid order kept


def test_shard_k_of_n_is_every_arm_whose_index_is_k_minus_1_mod_n():
    arms = grid()
    assert [a.index for a in shard_of(arms, (2, 4))] == [1, 5, 9]
    assert [a.index for a in shard_of(arms, (4, 4))] == [3, 7]
    assert [(a.model, a.seq) for a in shard_of(arms, (1, 3))] == [
        ("smol", 2048), ("smol", 4352), ("qwen", 2048), ("qwen", 6144)]
    assert shard_of(arms, (1, 1)) == arms


def test_merge_puts_rows_from_shards_back_in_grid_order():
    parts = [shard_result(k, 3, cuda_visible_devices=str(k), date=f"2025-01-0{k}",
                          arms=f"shard {k}/3", command=f"x --shard {k}/3") for k in (1, 2, 3)]
    random.Random(395).shuffle(parts)
    merged = merge(parts, "merged from 3 result(s)")
    assert [r.index for r in merged.rows] == list(range(10))
    assert merged.rows == [measured_row(a) for a in grid()]
    assert merged.environment["arms"] == "merged from 3 result(s)"
    assert merged.exit_code == EXIT_OK


def test_merge_orders_repeats_after_the_sweep_by_arm_then_repeat():
    arms = grid()
    sweep = Result(environment=ENV, rows=[measured_row(a) for a in arms[:3]])
    reps = [Result(environment=ENV, rows=[measured_row(arms[i], repeat=r)])
            for i, r in ((2, 2), (1, 1), (2, 1), (1, 2))]
    merged = merge(reps + [sweep])
    assert [(r.index, r.repeat) for r in merged.rows] == [
        (0, None), (1, None), (2, None), (1, 1), (1, 2), (2, 1), (2, 2)]


def test_merge_refuses_overlapping_shards():
    with pytest.raises(UsageError, match="same arm"):
        merge([shard_result(1, 2), shard_result(1, 3)])  # arm 0 (and 6) in both


@pytest.mark.parametrize("key,other", [("torch", "2.12.0+cu128"), ("soup_cli", "0.77.0"),
                                       ("dry_run", True), ("gpu", "NVIDIA A10G"),
                                       ("weights", "hub"), ("transformers", "5.0.0")])
def test_merge_refuses_two_different_stacks(key, other):
    with pytest.raises(UsageError, match=key):
        merge([shard_result(1, 2), shard_result(2, 2, **{key: other})])


def test_merge_keeps_a_finding_from_any_shard():
    arms = grid()
    under = make_row(arms[3].model, arms[3].seq, index=3,
                     real_peak=predicted_bytes(SHAPES[arms[3].model], arms[3].seq) + 1)
    ok = Result(environment=ENV, rows=[measured_row(arms[0])],
                  control=positive_control(attributed(0), attributed(1)))
    bad = Result(environment=ENV, rows=[under],
                   control=positive_control(attributed(0), attributed(0)))
    merged = merge([ok, bad])
    assert [r.status for r in merged.rows] == ["ok", "UNDER"]
    assert merged.control["passed"] is False  # a failed control is never hidden by a passed one
    assert merged.exit_code == EXIT_FINDING
    stopped = Result(environment=ENV, rows=[measured_row(arms[1])], interrupted=True)
    assert merge([ok, stopped]).exit_code == EXIT_INTERRUPTED


def test_a_map_margin_named_by_physical_class_is_set_against_the_corrected_terms(capfd, tmp_path):
    """A saved map whose Mistral-7B NF4 512x1 margin carries its live blocks by physical class
    (as run_arm records them with a history): the text sets each class against the corrected
    estimate's term, the dequantised layer against its W16 term, resident weights first."""
    import json

    from conftest import ROOT, main

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
