"""Peak attribution from an allocator history, the positive control, and scheduling.

A CUDA allocator snapshot cannot be taken on this CPU-only machine, so every
history here is hand-built in torch.cuda.memory._snapshot()'s plain-dict format:
{"device_traces": [[{"action", "addr", "size"}, ...]], "segments": []}, sizes
being the REQUESTED sizes (the allocator counts each block rounded up to 512).
The replay, the attribution and the control are the harness's real code.
"""

from __future__ import annotations

import pickle
import random
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import issue395_second_stack_vram as h  # noqa: E402

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
    """resident R; a bf16 logits; two fp32 logits; one freed; another fp32 and a
    small block (the peak); then frees, a fresh bf16 copy and a large pre-existing block freed after
    the peak. A block freed before the peak was resident before recording."""
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


def test_block_bytes_rounds_up_to_512():
    assert h.block_bytes(1) == 512
    assert h.block_bytes(0) == 512
    assert h.block_bytes(512) == 512
    assert h.block_bytes(513) == 1024
    assert h.block_bytes(BF16) == BF16_BLOCK
    assert h.block_bytes(FP32) == FP32_BLOCK


def test_replayed_peak_is_the_maximum_not_the_final_state():
    a = h.attribute_peak(loss_step_history(), R, E, measured_peak=PEAK)
    assert a["replayed_peak"] == PEAK
    # At the peak: one bf16 and two fp32 logits live (the final state has one fp32).
    assert a["logits_bf16"] == {"count": 1, "bytes": BF16_BLOCK}
    assert a["logits_fp32"] == {"count": 2, "bytes": 2 * FP32_BLOCK}
    assert a["other_groups"] == {"< 1 MB": {"count": 1, "bytes": 512}}
    assert a["elements"] == E
    assert a["events"] == len(loss_step_history()["device_traces"][0])


def test_pre_existing_frees_before_the_peak_reduce_resident_at_peak():
    a = h.attribute_peak(loss_step_history(), R, E, measured_peak=PEAK)
    # The 3000-byte free before the peak counts (rounded to 3072); the 600 kB one after
    # the peak does not.
    assert a["resident_at_peak"] == R - 3072


def test_small_allocation_counts_as_a_512_byte_block():
    a = h.attribute_peak(snapshot(alloc(7, 1)), 0, E)
    assert a["replayed_peak"] == 512
    assert a["other_groups"] == {"< 1 MB": {"count": 1, "bytes": 512}}


def test_blocks_are_grouped_by_size():
    a = h.attribute_peak(snapshot(alloc(1, 150_000_000), alloc(2, 20_000_000),
                                  alloc(3, 2_000_000), alloc(4, 10)), 0, E)
    assert list(a["other_groups"]) == [">= 100 MB", "10-100 MB", "1-10 MB", "< 1 MB"]
    assert all(g["count"] == 1 for g in a["other_groups"].values())
    assert a["logits_bf16"]["count"] == a["logits_fp32"]["count"] == 0


def test_complete_when_measured_peak_matches():
    assert h.attribute_peak(loss_step_history(), R, E, PEAK)["complete"] is True
    # Within an allocator remainder (under 1 MiB) it is still complete.
    assert h.attribute_peak(loss_step_history(), R, E, PEAK + 512 * 1024)["complete"] is True
    # Without a measurement there is nothing to disagree with.
    assert h.attribute_peak(loss_step_history(), R, E, None)["complete"] is True


@pytest.mark.parametrize("off", [+4 * 2**20, -4 * 2**20, +100_000_000])
def test_incomplete_when_measured_peak_is_far_off(off):
    a = h.attribute_peak(loss_step_history(), R, E, PEAK + off)
    assert a["complete"] is False
    assert a["measured_peak"] == PEAK + off
    assert a["replayed_peak"] == PEAK


def test_empty_history_is_never_complete():
    a = h.attribute_peak({"device_traces": [], "segments": []}, R, E, R)
    assert a["complete"] is False
    assert a["replayed_peak"] == R
    assert a["resident_at_peak"] == R


def test_history_that_only_frees_peaks_at_resident():
    a = h.attribute_peak(snapshot(free(900, 5000)), R, E, R)
    assert a["replayed_peak"] == R
    assert a["logits_bf16"]["count"] == 0
    assert a["complete"] is True


def test_history_without_free_requested_replays_on_free_completed():
    """Older histories record only the completed free; the replay uses it then."""
    trace = [e for e in loss_step_history()["device_traces"][0]
             if e["action"] != "free_requested"]
    a = h.attribute_peak({"device_traces": [trace], "segments": []}, R, E, PEAK)
    assert a["replayed_peak"] == PEAK
    assert a["logits_fp32"]["count"] == 2


def test_free_completed_is_not_counted_twice_when_free_requested_exists():
    a = h.attribute_peak(loss_step_history(), R, E)
    assert a["replayed_peak"] == PEAK  # a double count would lower it


def test_longest_device_trace_is_replayed():
    snap = loss_step_history()
    snap["device_traces"] = [[alloc(1, 10)], snap["device_traces"][0], []]
    assert h.attribute_peak(snap, R, E, PEAK)["replayed_peak"] == PEAK


def test_snapshot_pickled_to_file_gives_the_same_attribution(tmp_path):
    """--snapshot-dir pickles the raw snapshot; loading it back re-attributes the same."""
    snap = loss_step_history()
    path = tmp_path / "snapshot-smol-2048-b1.pickle"
    with open(path, "wb") as fh:
        pickle.dump(snap, fh)
    with open(path, "rb") as fh:
        loaded = pickle.load(fh)
    assert h.attribute_peak(loaded, R, E, PEAK) == h.attribute_peak(snap, R, E, PEAK)


# --- positive control: hand-made histories through attribute_peak ---------------

def control_history(bf16_copies: int):
    """A loss step: bf16 logits, fp32 upcast, grad; plus N held bf16 copies."""
    events = [alloc(1, BF16), alloc(2, FP32)]
    events += [alloc(100 + i, BF16) for i in range(bf16_copies)]
    events += [alloc(3, FP32), free(2, FP32), free(3, FP32), free(1, BF16)]
    events += [free(100 + i, BF16) for i in range(bf16_copies)]
    return snapshot(*events)


def control_peak(bf16_copies: int) -> int:
    return R + BF16_BLOCK * (1 + bf16_copies) + 2 * FP32_BLOCK


def attributed(copies: int, measured_off: int = 0):
    return h.attribute_peak(control_history(copies), R, E, control_peak(copies) + measured_off)


def test_positive_control_passes_with_exactly_one_extra_bf16_block():
    without, with_copy = attributed(0), attributed(1)
    assert without["logits_bf16"]["count"] == 1
    assert with_copy["logits_bf16"]["count"] == 2
    c = h.positive_control(without, with_copy)
    assert c["extra_bf16_blocks"] == 1
    assert c["passed"] is True
    assert c["without_copy"] is without and c["with_copy"] is with_copy


@pytest.mark.parametrize("copies,extra", [(0, 0), (2, 2)])
def test_positive_control_fails_unless_exactly_one_more(copies, extra):
    c = h.positive_control(attributed(0), attributed(copies))
    assert c["extra_bf16_blocks"] == extra
    assert c["passed"] is False


def test_positive_control_fails_when_a_history_is_incomplete():
    far = 50 * 2**20
    assert h.positive_control(attributed(0, far), attributed(1))["passed"] is False
    assert h.positive_control(attributed(0), attributed(1, far))["passed"] is False


# --- scheduling and merging -------------------------------------------------------

def default_arms():
    return h.plan_arms(["smol", "qwen"], None, [1])


def test_plan_arms_is_the_record_grid_in_order():
    arms = default_arms()
    assert [(a.model, a.seq) for a in arms] == [(k, s) for k, ss in h.RECORD_GRID.items()
                                                for s in ss]
    assert [a.index for a in arms] == list(range(10))


def test_schedule_is_deterministic():
    first = h.schedule(default_arms(), [0, 1])
    second = h.schedule(default_arms(), [0, 1])
    as_dicts = lambda q: {g: [asdict(a) for a in arms] for g, arms in q.items()}  # noqa: E731
    assert as_dicts(first) == as_dicts(second)


@pytest.mark.parametrize("gpus", [[0], [0, 1], [1, 0], [0, 1, 2], [3, 5, 7, 9]])
def test_schedule_deals_every_arm_once_in_grid_order(gpus):
    arms = default_arms()
    q = h.schedule(arms, gpus)
    assert list(q) == gpus
    dealt = sorted(a.index for queue in q.values() for a in queue)
    assert dealt == list(range(len(arms)))
    for queue in q.values():
        assert [a.index for a in queue] == sorted(a.index for a in queue)


def test_schedule_balances_two_gpus():
    q = h.schedule(default_arms(), [0, 1])
    for queue in q.values():
        assert not all(a.model == "qwen" for a in queue)
        assert any(a.model == "qwen" for a in queue)
    load = {g: sum(h.predicted_bytes(h.SHAPES[a.model], a.seq, a.batch) for a in queue)
            for g, queue in q.items()}
    biggest = max(h.predicted_bytes(h.SHAPES[a.model], a.seq) for a in default_arms())
    assert abs(load[0] - load[1]) <= biggest  # greedy's guarantee
    assert abs(load[0] - load[1]) < 0.05 * sum(load.values())


def test_merge_rows_restores_grid_order():
    rows = [{"index": i, "repeat": r, "seq": 1000 + i} for i in range(10) for r in range(2)]
    shuffled = rows[:]
    random.Random(395).shuffle(shuffled)
    assert shuffled != rows
    assert h.merge_rows(shuffled) == rows
    # Rows without a repeat (in-process runs) sort by index alone.
    plain = [{"index": i} for i in (3, 0, 2, 1)]
    assert [r["index"] for r in h.merge_rows(plain)] == [0, 1, 2, 3]
