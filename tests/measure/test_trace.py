"""issue395.measure.trace: a saved device history (bench/task_peak_anatomy.py's save_trace) replayed through
estimator.allocator (issue 52 item 1, issue 51 item 3). The hand-written histories are torch's actions as
CUDACachingAllocator.cpp records them; the committed one is a real H100 run's. Nothing is faked."""

import gzip
import json
from pathlib import Path

import pytest

from issue395.measure.trace import held_at, replay_trace, replaying_trace

MiB = 2**20
BASE = 1 << 40
PHI2_NF4 = Path(__file__).resolve().parents[2] / "results/anatomy-and-segments52-h100-soup0.77.0-96b7b97/" \
    "res-sft-phi2-nf4-512x1"
PHI3_GC = PHI2_NF4.parents[1] / "resident-traces-qwen-nf4-phi3-gc-h100-soup0.77.0-1a0b582/" \
    "res-sft-phi3-bf16-gc-2048x1-exp"


def start(*blocks):
    """One 20 MiB segment at BASE holding ``blocks`` (size, request, state) in address order."""
    out, addr = [], BASE
    for size, req, state in blocks:
        out.append({"address": addr, "size": size, "requested_size": req, "state": state})
        addr += size
    return [{"address": BASE, "total_size": addr - BASE, "stream": 0, "blocks": out}]


def test_a_history_seeded_from_its_start_replays_to_torch_s_addresses_and_peak():
    """A resident 6 MiB block, a 5 MiB request cut from the free rest of its segment, a deferred free that keeps
    the block out of the pool (the next request, 10 MiB, which the 14 MiB the two would merge into would hold, gets a
fresh segment at torch's cudaMalloc address), then
    the resident block freed: the allocated peak counts whole blocks, and the model agrees at every event."""
    seg2 = BASE + 100 * MiB
    trace = {"start_segments": start((6 * MiB, 6 * MiB - 10, "active_allocated"), (14 * MiB, 0, "inactive")),
             "events": [["alloc", BASE + 6 * MiB, 5 * MiB - 3, 0],
                        ["free_requested", BASE + 6 * MiB, 5 * MiB - 3, 0],
                        ["segment_alloc", seg2, 10 * MiB, 0],
                        ["alloc", seg2, 10 * MiB, 0],
                        ["free_completed", BASE + 6 * MiB, 5 * MiB - 3, 0],
                        ["alloc", BASE + 6 * MiB, 13 * MiB, 0],  # 13 MiB of the 14 MiB free: not split
                        ["free_requested", BASE, 6 * MiB - 10, 0], ["free_completed", BASE, 6 * MiB - 10, 0],
                        ["snapshot", 0, 0, 0]]}
    r = replay_trace(trace)
    assert r.divergences == [] and r.peak == 6 * MiB + 10 * MiB + 14 * MiB and r.rests_at_peak == MiB
    assert r.alloc.allocated == 24 * MiB


def test_a_departure_from_torch_is_named_at_its_event_and_the_replay_goes_on():
    """Torch cudaMalloc'd where the model finds a cached block (a second stream in torch the trace's row does not
    carry, say): the departure is named at that event, and a later free of torch's address still finds its block."""
    trace = {"start_segments": start((6 * MiB, 6 * MiB, "active_allocated"), (14 * MiB, 0, "inactive")),
             "events": [["segment_alloc", BASE + 100 * MiB, 20 * MiB, 0], ["alloc", BASE + 100 * MiB, 5 * MiB, 0],
                        ["free_requested", BASE + 100 * MiB, 5 * MiB, 0],
                        ["free_completed", BASE + 100 * MiB, 5 * MiB, 0]]}
    events = list(replaying_trace(trace))
    assert "cudaMalloc'd" in events[1].diverged and events[1].block.addr == BASE + 6 * MiB
    assert events[-1].alloc.allocated == 6 * MiB
    assert replay_trace(trace).first[0] == 1


def test_a_wholly_free_start_segment_is_left_out_as_the_window_s_empty_cache_released_it():
    """peak_window empties the cache after save_trace's start was read: torch then cudaMallocs again at that
    address, which the model must too."""
    trace = {"start_segments": start((20 * MiB, 0, "inactive")),
             "events": [["segment_alloc", BASE, 20 * MiB, 0], ["alloc", BASE, 8 * MiB, 0]]}
    r = replay_trace(trace)
    assert r.divergences == [] and r.alloc.reserved == 20 * MiB


@pytest.mark.parametrize("row", [["free_requested", BASE + 7, 512, 0], ["segment_unmap", BASE, 2 * MiB, 0]])
def test_a_free_never_allocated_or_an_unmapping_torch_did_not_do_is_refused_or_named(row):
    """A free of an address never allocated is an error; an unmapping of pages the model holds no free block over
    is a departure named at its event."""
    if row[0] == "free_requested":
        with pytest.raises(ValueError):
            replay_trace({"start_segments": [], "events": [row]})
    else:
        assert "unmapped" in replay_trace({"start_segments": [], "events": [row]}).first[2]


def test_an_expandable_history_replays_torch_s_mappings_best_fit_and_touched_pages():
    """Issue 51 item 4, torch's expandable segments (CUDACachingAllocator.cpp, derived by hand): a mapped range of 3
    pages (60 MiB) holding X 10 MiB, a free 12 MiB, Y 8 MiB, a free 30 MiB; the window's empty_cache unmaps the last
    page (wholly free; no event). A 10 MiB request then takes the 12 MiB block, not the 10 MiB one before the
    unmapped page (get_free_block's expandable_size: that one can grow); 25 MiB fits no free block, so map_block maps
    one page after the free 10 MiB it merges with (segment_map) and the request sits at 30 MiB: the peak, 53 MiB
    live over all three pages. Every block but it freed, the first page is wholly free: empty_cache unmaps it
    (segment_unmap), and a 15 MiB request maps it again (find_expandable_block: the lowest unmapped space with
    the free block after it) rather than grow the segment's end."""
    seg = start((10 * MiB, 10 * MiB, "active_allocated"), (12 * MiB, 0, "inactive"),
                (8 * MiB, 8 * MiB, "active_allocated"), (30 * MiB, 0, "inactive"))
    trace = {"start_segments": [{**seg[0], "is_expandable": True}],
             "events": [["alloc", BASE + 10 * MiB, 10 * MiB, 0],
                        ["segment_map", BASE + 40 * MiB, 20 * MiB, 0], ["alloc", BASE + 30 * MiB, 25 * MiB, 0],
                        *[[a, x, n, 0] for x, n in ((BASE + 22 * MiB, 8 * MiB), (BASE, 10 * MiB),
                                                    (BASE + 10 * MiB, 10 * MiB))
                          for a in ("free_requested", "free_completed")],
                        ["segment_unmap", BASE, 20 * MiB, 0],
                        ["segment_map", BASE, 20 * MiB, 0], ["alloc", BASE, 15 * MiB, 0]]}
    r = replay_trace(trace)
    assert r.divergences == [] and r.peak == 53 * MiB and r.pages_at_peak == 60 * MiB
    assert r.alloc.reserved == 60 * MiB and r.alloc.allocated == 40 * MiB
    wrong = {**trace, "events": trace["events"][:1] + [["segment_map", BASE + 40 * MiB, 40 * MiB, 0]]
             + trace["events"][2:3]}
    assert "mapped" in replay_trace(wrong).first[2]


def test_the_committed_expandable_phi_3_checkpointed_history_replays_to_its_measured_page_need():
    """Issue 51 item 4: the H100 run of Phi-3-mini bf16 SFT with gradient checkpointing, 2048x1, 2 steps, on
    expandable segments (48,306 events, 104 segment_map) replayed from its real requests: every alloc and every
    mapping at torch's address, the end's blocks torch's, the allocated peak max_memory_allocated exactly, and the
    whole pages the live blocks touch there the page need measure.cuda.page_need read off the same history
    (9,139,388,416 B: 95,991,296 B over the allocated peak, in step 2's loss)."""
    path = PHI3_GC
    trace = json.loads(gzip.open(f"{path}.trace.json.gz", "rt").read())
    row = json.loads(Path(f"{path}.json").read_text())
    r = replay_trace(trace)
    assert r.divergences == [] and r.end_differs == []
    assert r.peak == row["real_peak"] == row["page_need"]["allocated"]
    assert r.pages_at_peak == row["page_need"]["pages"] and r.pages_at_peak - r.peak == row["page_need"]["reserve"]


def test_the_committed_phi_2_nf4_history_replays_to_its_real_peak_block_for_block():
    """Issue 51 item 3: the H100 run of phi-2 NF4 resident 512x1 (torch 2.11) replayed from its real requests: the
    model's allocated peak is max_memory_allocated exactly, every alloc at torch's address, the end's blocks
    torch's. The rests at that peak are allocated less the rounded requests then, which are no more than the
    history's own requests' peak (replayed_peak, a maximum perhaps at another event)."""
    trace = json.loads(gzip.open(f"{PHI2_NF4}.trace.json.gz", "rt").read())
    row = json.loads(Path(f"{PHI2_NF4}.json").read_text())
    r = replay_trace(trace)
    assert r.divergences == [] and r.end_differs == []
    assert r.peak == row["real_peak"] and r.rests_at_peak == r.peak - r.requested_at_peak
    assert r.requested_at_peak <= row["replayed_peak"]


def test_the_blocks_held_at_an_event_carry_when_they_were_made_and_what_their_address_held_before():
    """Issue 52 item 1 (which blocks keep the rests, and what they were cut from): a resident block from before the
    history; an 8 MiB request between two live blocks, freed; a 7 MiB request that takes that 8 MiB block whole (its
    1 MiB rest is not split off: the large pool splits only a rest over 1 MiB); a 5 MiB request in a new segment:
    each held block says the event that made it (-1: before the history), its request, its size and the request
    last freed at its address (0: none), and their rests are the replay's at its peak."""
    trace = {"start_segments": start((6 * MiB, 6 * MiB, "active_allocated"), (14 * MiB, 0, "inactive")),
             "events": [["alloc", BASE + 6 * MiB, 8 * MiB, 0], ["alloc", BASE + 14 * MiB, 6 * MiB, 0],
                        ["free_requested", BASE + 6 * MiB, 8 * MiB, 0], ["free_completed", BASE + 6 * MiB, 8 * MiB, 0],
                        ["alloc", BASE + 6 * MiB, 7 * MiB, 0],
                        ["segment_alloc", BASE + 100 * MiB, 20 * MiB, 0], ["alloc", BASE + 100 * MiB, 5 * MiB, 0]]}
    r = replay_trace(trace)
    assert r.divergences == [] and r.peak_at == 6
    held = held_at(trace, r.peak_at)
    assert {(h.born, h.requested, h.size, h.previous, h.rest) for h in held} == {
        (-1, 6 * MiB, 6 * MiB, 0, 0), (1, 6 * MiB, 6 * MiB, 0, 0), (4, 7 * MiB, 8 * MiB, 8 * MiB, MiB),
        (6, 5 * MiB, 5 * MiB, 0, 0)}
    assert sum(h.rest for h in held) == r.rests_at_peak == MiB
    with pytest.raises(ValueError):
        held_at(trace, 7)
