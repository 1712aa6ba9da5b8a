"""issue395.measure.cuda: what is live at a step's peak, replayed from the caching allocator's history; the
positive control that proves the replay sees a held bf16 logits copy; how an OOM reads.

A CUDA allocator snapshot cannot be taken on a CPU-only machine, so every history here is FAKED:
hand-built in torch.cuda.memory._snapshot()'s plain-dict format
{"device_traces": [[{"action", "addr", "size"}, ...]], "segments": []}, sizes being the REQUESTED
sizes (the allocator counts each block rounded up to 512). The replay, the attribution, the control
and the OOM parsing are the harness's real code; the one real control step runs on a CUDA box only
(marker ``cuda``).
"""

from __future__ import annotations

import pytest
import torch
from conftest import alloc, attributed, BF16, BF16_BLOCK, cuda, E, FP32, FP32_BLOCK, free, R, snapshot

from issue395.measure.cuda import attribute_peak, control_step, is_oom, logits_kind, oom_request, positive_control


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


# --- the logits shapes and the physical classes --------------------------------------

def test_the_mistral_nf4_peak_is_named_by_physical_class_dequantised_weights_not_activations():
    """docs/PEAK.md's history of Mistral-7B NF4 512x1, in miniature: three 4096x14336 and three
    4096x4096 bf16 blocks live at the peak are the dequantised layer, set apart from the rest,
    and the bytes resident before the step are the resident weights."""
    from issue395.estimator.anatomy import physical_classifier
    from issue395.model.registry import config_json

    classify = physical_classifier(config_json("mistral-7b"), quant="nf4", seq=512, batch=1,
                                   targets=("q_proj", "v_proj"))
    mlp, attn = 4096 * 14336 * 2, 4096 * 4096 * 2
    snap = snapshot(*[alloc(i, mlp) for i in range(3)], *[alloc(10 + i, attn) for i in range(3)],
                    alloc(20, 1000))
    a = attribute_peak(snap, R, 512 * 32768, R + 3 * mlp + 3 * attn + 1024, physical=classify)
    assert a["physical"] == {"dequantised layer weights": 3 * mlp + 3 * attn, "the rest": 1024,
                             "resident weights": R}
    assert "physical" not in attribute_peak(snap, R, 512 * 32768)
    assert a["live_blocks"] == [[mlp, 3], [attn, 3], [1000, 1]]  # kept, to be named again when rendered


def test_a_dpo_arms_peak_is_named_at_its_task_and_its_blocks_sizes_are_kept():
    """Mistral-7B NF4 512x1 DPO in miniature (FAKED history): the policy's fp32 logits (2 rows x 512
    x 32768 x 4 B) and 32 saved inputs of 2 rows x 512 x 4096 x 2 B; the capture's classifier reads
    the arm's task and the attribution keeps the blocks' sizes."""
    from issue395.estimator.anatomy import classifier_for

    classify = classifier_for("mistral-7b", quant="nf4", seq=512, batch=1, task="dpo", release="0.77.0")
    logits, inputs = 2 * 512 * 32768 * 4, 2 * 512 * 4096 * 2
    snap = snapshot(alloc(1, logits), *[alloc(10 + i, inputs) for i in range(32)])
    a = attribute_peak(snap, R, 512 * 32768, R + logits + 32 * inputs, physical=classify)
    assert a["physical"] == {"logits fp32": logits, "checkpointed layer inputs": 32 * inputs, "resident weights": R}
    assert a["live_blocks"] == [[logits, 1], [inputs, 32]]


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


@cuda
def test_real_control_step_sees_the_held_bf16_copy():
    """On a CUDA box: the real loss step, without and with one held bf16 logits copy."""
    c = positive_control(control_step(False), control_step(True))
    assert c["without_copy"]["complete"] and c["with_copy"]["complete"]
    assert c["extra_bf16_blocks"] == 1
    assert c["passed"] is True


# --- an OOM --------------------------------------------------------------------------------

@pytest.mark.parametrize("message, size", [
    ("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 79.19 GiB", int(1.5 * 2**30)),
    ("CUDA out of memory. Tried to allocate 64.00 MiB", 64 * 2**20),
    ("Tried to allocate 512 KiB", 512 * 2**10),
    ("out of memory: Tried to allocate 2.5 GB", int(2.5e9)),
    ("CUDA out of memory.", None),
    ("Tried to allocate lots", None),
])
def test_an_ooms_request_is_read_off_torchs_message_in_its_own_unit(message, size):
    assert oom_request(torch.OutOfMemoryError(message)) == size


def test_an_oom_is_torchs_out_of_memory_error_or_a_message_that_says_so():
    assert is_oom(torch.OutOfMemoryError("CUDA error"))  # its type, whatever it says
    assert is_oom(RuntimeError("CUDA error: out of memory"))  # an older or wrapped OOM says so
    assert not is_oom(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_oom(ValueError("Tried to allocate 1.00 GiB"))
