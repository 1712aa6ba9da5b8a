"""issue395.measure.cuda.page_need: under expandable segments, the pages live blocks touch at the
replayed peak are what a card must hold; pages - allocated is the allocator's reserve there. FAKED:
the allocator snapshot (a CUDA history cannot be taken on CPU), built here in the shape
torch.cuda.memory._snapshot() gives (segments with their end-state blocks, one device trace)."""

from __future__ import annotations

from issue395.constants import EXPANDABLE_PAGE_BYTES
from issue395.measure.cuda import page_need

MiB = 2**20
P = EXPANDABLE_PAGE_BYTES["large"]
BASE = 1 << 40


def snapshot(trace, end_blocks, *, expandable=True, total=None, kind="large", base=BASE):
    return {"segments": [{"address": base, "total_size": total if total is not None else 4 * P,
                          "segment_type": kind, "is_expandable": expandable,
                          "blocks": [{"address": a, "size": s, "state": "active_allocated"} for a, s in end_blocks]}],
            "device_traces": [trace]}


def ev(action, addr, size):
    return {"action": action, "addr": addr, "size": size}


def test_blocks_sharing_a_page_hold_it_and_a_free_page_between_them_does_not_count():
    # A (live before the history, 30 MiB) shares page 1 with C; D spans pages 2 and 3; C is freed after the peak
    a, c, d = BASE, BASE + 30 * MiB, BASE + 40 * MiB
    trace = [ev("alloc", c, 5 * MiB), ev("alloc", d, 25 * MiB), ev("free_requested", c, 5 * MiB),
             ev("free_completed", c, 5 * MiB)]
    need = page_need(snapshot(trace, [(a, 30 * MiB), (d, 25 * MiB)]))
    assert need.allocated == 60 * MiB
    assert need.pages == 4 * P and need.reserve == 4 * P - 60 * MiB
    # the same blocks with a whole page free between A and D: that page is released, not charged
    far = BASE + 3 * P
    need = page_need(snapshot([ev("alloc", far, 25 * MiB)], [(a, 30 * MiB), (far, 25 * MiB)], total=6 * P))
    assert need.pages == 2 * P + 2 * P and need.allocated == 55 * MiB


def test_a_block_freed_before_the_peak_was_live_from_the_start_if_its_first_event_is_a_free():
    a, b = BASE, BASE + P
    trace = [ev("free_requested", a, 10 * MiB), ev("alloc", b, 30 * MiB)]
    need = page_need(snapshot(trace, [(b, 30 * MiB)]))
    assert need.allocated == 30 * MiB, "the peak is after the free: A is gone, B alone"
    trace = [ev("alloc", b, 30 * MiB), ev("free_requested", a, 10 * MiB)]
    need = page_need(snapshot(trace, [(b, 30 * MiB)]))
    assert need.allocated == 40 * MiB and need.pages == 3 * P, "A (page 0) and B (pages 1, 2) at the peak"


def test_the_small_pool_maps_in_2_mib_pages():
    s = EXPANDABLE_PAGE_BYTES["small"]
    trace = [ev("alloc", BASE + 100, 512 * 1024)]
    need = page_need(snapshot(trace, [(BASE + 100, 512 * 1024)], kind="small", total=4 * s))
    assert need.pages == s and need.reserve == s - 512 * 1024


def test_the_mapped_bytes_at_the_peak_come_from_the_mapping_events():
    d = BASE
    trace = [ev("segment_map", BASE, 2 * P), ev("alloc", d, 30 * MiB), ev("free_requested", d, 30 * MiB),
             ev("segment_unmap", BASE, P)]
    need = page_need(snapshot(trace, [], total=P))
    assert need.mapped == 2 * P and need.allocated == 30 * MiB and need.pages == 2 * P


def test_a_history_without_expandable_segments_has_no_page_need():
    assert page_need(snapshot([ev("alloc", BASE, MiB)], [(BASE, MiB)], expandable=False)) is None
