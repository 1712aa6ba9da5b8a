"""A device history of torch's caching allocator, as bench/task_peak_anatomy.py's ``save_trace`` keeps it
(``{"start_segments": [...], "end_segments": [...], "events": [[action, addr, size, stream], ...]}``,
frames left out), replayed through estimator.allocator: the real request sequence in, the model's blocks,
splits, addresses and allocated-bytes stat out, each checked against what torch recorded (issue 52 item 1,
issue 51 item 3). Stdlib only.

Torch's actions (CUDACachingAllocator.cpp ``record_trace``): ``alloc`` carries the request (``orig_size``,
what ``requested_size`` keeps), ``free_requested`` and ``free_completed`` the block's ``requested_size``
(the two halves of a free: the allocated stat drops at the first, the block rejoins its pool at the
second), ``segment_alloc`` the cudaMalloc'd segment (recorded in ``alloc_block``, before the ``alloc``
it serves), ``segment_free`` a segment released; ``snapshot`` and ``oom`` change nothing. Under expandable
segments (a history with ``segment_map`` or ``segment_unmap``, or a start segment marked ``is_expandable``):
``segment_map`` the pages ``map_block`` mapped for the ``alloc`` after it (recorded before it, as
``segment_alloc`` is), ``segment_unmap`` the whole pages ``unmap_block`` gave back from a free block
(``release_cached_blocks``: empty_cache, or an OOM's retry); the model maps and unmaps by torch's rules
(estimator.allocator) and each of its mappings is checked against torch's.

The state before the history: ``save_trace``'s ``start_segments`` is read before the measured window's
``empty_cache`` (issue395.measure.cuda.peak_window), which releases every wholly free segment with no
event recorded, so those are left out; every other block is seeded as it stood (allocated with its
request, free in its stream's pool, or waiting on its free). Under expandable segments each start segment is
one mapped range of its pool's address space (a snapshot reports each so), the whole pages of its free blocks
unmapped by that empty_cache (no event recorded either); a range is the small pool's where its snapshot says
so (``segment_type``) or, unsaid, where no block in use in it is over 1 MiB (a large-pool block is its request,
over 1 MiB, under expandable segments).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from ..constants import K_SMALL_SIZE, block_bytes
from ..estimator.allocator import Block, CachingAllocator, allocation_size

#: what a snapshot's block state means to the model
_STATES = {"active_allocated": "allocated", "active_pending_free": "pending", "inactive": "free"}
_QUIET = {"snapshot", "oom"}
_MAPPING = {"segment_map", "segment_unmap"}


def is_expandable(trace: dict[str, Any]) -> bool:
    """Whether ``trace`` ran on expandable segments: a mapping event in it, or a start segment so marked."""
    return (any(row[0] in _MAPPING for row in trace.get("events") or [])
            or any(s.get("is_expandable") for s in trace.get("start_segments") or []))


def seeded(start_segments: list[dict], expandable: bool = False) -> tuple[CachingAllocator, dict[int, Block]]:
    """The allocator as the history found it: every segment of ``start_segments`` that holds a block still in
    use, at its address, on its stream (``expandable``: every mapped range, then the window's empty_cache's
    unmapping); the blocks in use by address (what the history's frees name)."""
    alloc = CachingAllocator(expandable)
    held: dict[int, Block] = {}
    for seg in sorted(start_segments, key=lambda s: int(s["address"])):
        blocks = sorted(seg.get("blocks") or [], key=lambda b: int(b["address"]))
        if not expandable and all(b.get("state") == "inactive" for b in blocks):
            continue  # released by the window's empty_cache before recording began
        states = [_STATES.get(b.get("state"), "free") for b in blocks]
        made = alloc.seed(int(seg["address"]), [(int(b["size"]), int(b.get("requested_size") or 0), st)
                                                for b, st in zip(blocks, states)], int(seg.get("stream") or 0),
                          _small(seg, blocks, states) if expandable else None)
        held.update((b.addr, b) for b, st in zip(made, states) if st != "free")
    if expandable:
        alloc.empty_cache()
        alloc.mappings.clear()
    return alloc, held


def _small(seg: dict, blocks: list[dict], states: list[str]) -> bool:
    """Whether an expandable start segment is the small pool's (its snapshot's segment_type, else its blocks)."""
    if seg.get("segment_type"):
        return seg["segment_type"] == "small"
    return all(int(b["size"]) <= K_SMALL_SIZE for b, st in zip(blocks, states) if st != "free")


@dataclass
class Event:
    """One event of the history replayed: its index, its row, the allocator after it, the model's block it
    touched (None for a segment's or a quiet event), and where the model departs from torch there (None where
    it agrees: the same address, a segment cudaMalloc'd where and only where torch did)."""

    index: int
    row: list
    alloc: CachingAllocator
    block: Optional[Block]
    diverged: Optional[str]


def replaying_trace(trace: dict[str, Any]) -> Iterator[Event]:
    """The model after each event of ``trace`` (save_trace's dict) in turn. An alloc takes the address torch's
    cudaMalloc returned where both cudaMalloc a segment; a free names the block torch allocated at that address
    (so the replay goes on past a departure). A free of an address never allocated, or an action the model does
    not know, is an error (ValueError); a mapping event is modelled (it makes the history expandable: is_expandable)."""
    alloc, held = seeded(trace.get("start_segments") or [], is_expandable(trace))
    segment: Optional[tuple[int, int]] = None  # the cudaMalloc torch recorded for the next alloc
    mapped: list[tuple] = []  # the pages torch mapped for the next alloc
    for i, row in enumerate(trace.get("events") or []):
        action, addr, size = row[0], int(row[1] or 0), int(row[2] or 0)
        stream = int(row[3] or 0) if len(row) > 3 else 0
        block, why = None, None
        if action == "segment_alloc":
            segment = (addr, size)
        elif action == "segment_map" and alloc.expandable:
            mapped.append(("segment_map", addr, size))
        elif action == "alloc" and alloc.expandable:
            block, why = _alloc_expandable(alloc, size, stream, addr, mapped)
            held[addr], mapped = block, []
        elif action == "alloc":
            block, why = _alloc(alloc, size, stream, addr, segment)
            held[addr], segment = block, None
        elif action == "segment_unmap" and alloc.expandable:
            got = alloc.unmap_at(addr)
            if got != (addr, size):
                why = f"torch unmapped {size:,} B at {addr:#x}, the model {got}"
        elif action in ("free_requested", "free", "free_completed"):
            block = held.get(addr)
            if block is None:
                raise ValueError(f"event {i}: {action} of {addr:#x}, never allocated in this history")
            if action != "free_completed":
                alloc.free_requested(block)
            if action != "free_requested":
                alloc.free_completed(held.pop(addr))
        elif action == "segment_free":
            why = _release(alloc, addr, size)
        elif action not in _QUIET:
            raise ValueError(f"event {i}: {action!r} is not modelled")
        yield Event(i, row, alloc, block, why)


def _alloc(alloc: CachingAllocator, size: int, stream: int, addr: int,
           segment: Optional[tuple[int, int]]) -> tuple[Block, Optional[str]]:
    """One alloc replayed, and where the model departs from torch on it."""
    cached = alloc.fits(size, stream)
    block = alloc.malloc(size, stream, at=segment[0] if segment and not cached else None)
    why = None
    if cached and segment:
        why = f"torch cudaMalloc'd {segment[1]:,} B for {size:,} B where the model reused a cached block"
    elif not cached and not segment:
        why = f"the model cudaMalloc'd for {size:,} B where torch reused a cached block"
    elif segment and allocation_size(block_bytes(size)) != segment[1]:
        why = f"segment of {segment[1]:,} B in torch, {allocation_size(block_bytes(size)):,} B in the model"
    elif block.addr != addr:
        why = f"{size:,} B at {addr:#x} in torch, at {block.addr:#x} in the model"
    return block, why


def _alloc_expandable(alloc: CachingAllocator, size: int, stream: int, addr: int,
                      mapped: list[tuple]) -> tuple[Block, Optional[str]]:
    """One alloc replayed under expandable segments, and where the model departs from torch on it: the pages
    it mapped for it, or the block's address."""
    before = len(alloc.mappings)
    block = alloc.malloc(size, stream)
    made = alloc.mappings[before:]
    if made != mapped:
        return block, f"for {size:,} B torch mapped {mapped}, the model {made}"
    if block.addr != addr:
        return block, f"{size:,} B at {addr:#x} in torch, at {block.addr:#x} in the model"
    return block, None


def _release(alloc: CachingAllocator, addr: int, size: int) -> Optional[str]:
    head = next((s for s in alloc.segments if s.addr == addr), None)
    if head is None or not alloc.wholly_free(head) or head.size != size:
        return f"torch released the segment at {addr:#x} ({size:,} B), not wholly free in the model"
    alloc.release(head)
    return None


@dataclass
class TraceReplay:
    """A whole history replayed: the model at its end, its peak (the allocated stat's maximum, from the
    seeded state) with its event and the rests past the rounded requests then, the requests' peak, each
    departure (index, action, why) and the end's blocks where the model's and torch's differ; under expandable
    segments the bytes of the whole pages the live blocks touch at the peak (measure.cuda.page_need's
    ``pages``), else None."""

    alloc: CachingAllocator
    peak: int
    peak_at: int
    rests_at_peak: int
    requested_at_peak: int
    divergences: list[tuple[int, str, str]] = field(default_factory=list)
    end_differs: list[str] = field(default_factory=list)
    pages_at_peak: Optional[int] = None

    @property
    def first(self) -> Optional[tuple[int, str, str]]:
        return self.divergences[0] if self.divergences else None


def replay_trace(trace: dict[str, Any]) -> TraceReplay:
    """``trace`` replayed to its end (replaying_trace), its peak and every departure from torch."""
    alloc = None
    best, at, rests, requested, diverged, pages = -1, -1, 0, 0, [], None
    for ev in replaying_trace(trace):
        alloc = ev.alloc
        if ev.diverged:
            diverged.append((ev.index, ev.row[0], ev.diverged))
        if alloc.allocated > best:
            best, at = alloc.allocated, ev.index
            rests, requested = alloc.allocated - alloc.requested, alloc.requested
            pages = alloc.touched_pages() if alloc.expandable else None
    if alloc is None:
        alloc, _ = seeded(trace.get("start_segments") or [], is_expandable(trace))
    if best < alloc.peak:  # no event rose above the seeded state
        best, rests, requested = alloc.peak, alloc.allocated - alloc.requested, alloc.requested
    return TraceReplay(alloc, best, at, rests, requested, diverged, end_differs(alloc, trace.get("end_segments")),
                       pages)


def end_differs(alloc: CachingAllocator, end_segments: Optional[list[dict]]) -> list[str]:
    """Each block (address, size, in use or free) where the model's end and torch's differ; [] where no end
    was recorded."""
    if not end_segments:
        return []
    real = {(int(b["address"]), int(b["size"]), b.get("state") != "inactive")
            for s in end_segments for b in s.get("blocks") or []}
    model = {(b.addr, b.size, b.allocated or b.pending) for b in alloc.blocks() if b.mapped}
    return [f"{'torch' if k in real else 'model'} only: {k[1]:,} B at {k[0]:#x} "
            f"{'in use' if k[2] else 'free'}" for k in sorted(real ^ model)]


@dataclass(frozen=True)
class Held:
    """One block live at a moment of a replayed history: the event that allocated it (-1: it stood before the
    history began), its request and its size (their difference its rest past the request, with the 512 B
    rounding), and the request last freed at its address before it was allocated (0: none in the history, a
    new segment's or a tail's), which names what a block with a rest was carved from."""

    born: int
    requested: int
    size: int
    previous: int

    @property
    def rest(self) -> int:
        return self.size - block_bytes(self.requested)


def held_at(trace: dict[str, Any], at: int) -> list[Held]:
    """Every block live after event ``at`` of ``trace`` (replay_trace's ``peak_at`` for the allocated peak),
    with when it was allocated and what its address held before (issue 52 item 1: which blocks keep the
    rests at a peak, and what they were cut from)."""
    born: dict[int, int] = {}
    freed: dict[int, int] = {}  # address -> the request last freed there
    before: dict[int, int] = {}  # id(block) -> freed[addr] when it was allocated
    for ev in replaying_trace(trace):
        if ev.row[0] == "alloc":
            born[id(ev.block)] = ev.index
            before[id(ev.block)] = freed.get(ev.block.addr, 0)
        elif ev.row[0] in ("free_requested", "free"):
            freed[ev.block.addr] = int(ev.row[2] or 0)
        if ev.index == at:
            return [Held(born.get(id(b), -1), b.requested, b.size, before.get(id(b), 0)) for b in ev.alloc.live()]
    raise ValueError(f"event {at} is past the history's {len(trace.get('events') or [])} events")
