"""torch's CUDA caching allocator (one device, one stream, no capacity limit) replayed in pure Python: a
sequence of requests and frees in, the blocks it hands out and its allocated-bytes stat (what
``torch.cuda.max_memory_allocated`` reads) out. Stdlib only. Issue 52 item 1: the rests a block keeps past
its request are history, block by block; this module is that history's rules (estimator/sequence.py replays a
resident step through it).

The rules, as c10/cuda/CUDACachingAllocator.cpp states them (torch 2.11-2.15; the constants are
issue395.constants'):

- ``malloc``: ``size_t size = round_size(orig_size); auto& pool = get_pool(size, stream); const size_t
  alloc_size = get_allocation_size(size);`` then ``get_free_block(params)``, else ``alloc_block`` (a new
  segment of ``alloc_size``), then ``bool split_remainder = should_split(params.block, params.size());``.
- ``round_size``: ``kMinBlockSize * ((size + kMinBlockSize - 1) / kMinBlockSize)`` (512 B; under 512 B,
  512 B), with the default ``roundup_power2_divisions`` (none).
- ``get_pool``: ``if (size <= kSmallSize) return small_blocks; else return large_blocks;``
- ``get_allocation_size``: ``if (size <= kSmallSize) return kSmallBuffer; else if (size < kMinLargeAlloc)
  return kLargeBuffer; else return kRoundLarge * ((size + kRoundLarge - 1) / kRoundLarge);``
- ``get_free_block``: ``auto it = pool.blocks.lower_bound(&p.search_key);`` over ``BlockComparatorSize``
  (stream, then size, then address): the smallest free block at least the request, the lowest address among
  equals. The oversize rules (``p.size() < max_split_size() && (*it)->size >= max_split_size()``, and
  ``(*it)->size >= p.size() + kLargeBuffer``) never fire at the default ``max_split_size`` (SIZE_MAX).
- ``should_split``: ``size_t remaining = block->size - size; if (block->pool->is_small ||
  CUDAAllocatorConfig::expandable_segments()) return remaining >= kMinBlockSize; else return (size <
  max_split_size()) && (remaining > kSmallSize);`` A large-pool block whose rest would be 1 MiB or less is
  handed out whole.
- ``alloc_found_block``: a split block keeps the request at the free block's address (``block = new
  Block(device, stream, size, pool, block->ptr)``) and the rest after it goes back to the pool;
  ``increase_stat(stats.allocated_bytes[stat_type], block->size)`` counts the whole block.
- ``free``: ``block->allocated = false;`` and ``stats.allocated_bytes[stat_type].decrease(block->size);``
  at once (the history's ``free_requested``), then, where ``!block->stream_uses.empty()``, ``insert_events``:
  the block waits for its streams' events and ``process_events`` hands it to ``free_block`` later (the
  history's ``free_completed``); else ``free_block`` now. ``free_block``: ``try_merge_blocks`` with
  ``block->prev`` and ``block->next`` (a neighbour is absorbed only where ``!src->allocated &&
  src->event_count == 0 && src->stream_uses.empty()``: a block still waiting is not), and the block back in
  its pool. ``free_requested`` and ``free_completed`` split the two for a history's deferred frees.
- Streams: a block belongs to the stream it was allocated on (``Block(device, stream, size, pool, ptr)``, a
  split keeps it) and ``BlockComparatorSize`` orders a pool ``if (a->stream != b->stream) return
  (uintptr_t)a->stream < (uintptr_t)b->stream;`` before size and address; ``get_free_block`` gives up where
  ``(*it)->stream != p.stream()``: a freed block serves only requests on its own stream (a pool per stream
  here). Segments are returned only by a history's ``segment_free`` or the caller's ``empty_cache``
  (``release_block``, of a wholly free segment: ``empty_cache`` or an OOM's retry, never decided here).

Expandable segments (``expandable=True``), torch's rules: every pool splits at 512 B, so a block is its rounded
request and the allocated stat is exact whatever the layout. Each pool and stream has a segment of address space
(``ExpandableSegment``; far larger here than torch's 9/8 of the card, so it never runs out) mapped in pages, 20
MiB large and 2 MiB small (constants.EXPANDABLE_PAGE_BYTES); unmapped space is a block of its own
(``mapped = false``).
- ``get_free_block``: ``auto expandable_size = [](Block* b) { return b->size + (b->next && !b->next->mapped ?
  b->next->size : 0); };`` and from the best fit ``while (... expandable_size(*next) < expandable_size(*it)) it =
  next++;``: a free block before unmapped space is passed over for the next one that fits.
- ``alloc_block``: ``try_allocate_expandable_block(..., p.size(), ...)``: ``find_expandable_block`` takes the
  stream's unmapped blocks by address (``pool->unmapped``, BlockComparatorAddress) and for each ``if
  (allocatable(c->prev)) c = c->prev;`` and the first whose run of free blocks holds the request
  (``has_available_address_space``); ``map_block`` maps whole pages from an unmapped block's start (``segmentLeft``,
  ``segmentRight``), splits the unmapped rest off and ``try_merge_blocks`` with both neighbours (``dst->mapped !=
  src->mapped`` never merges), recording ``SEGMENT_MAP``.
- ``release_blocks`` (empty_cache): every free block of an expandable segment ``unmap_block``: its whole pages
  unmapped (the partial pages at its ends stay mapped, free blocks of their own), recording ``SEGMENT_UNMAP``.
The pages live blocks touch at a history's peak (``touched_pages``) are what a card cannot do without then. Checked:
a committed expandable history (Phi-3-mini bf16 with checkpointing, H100) replays through it with every mapping at
torch's address and its touched pages the measured page need to the byte (tests/measure/test_trace.py); three runs'
requests recorded on the default allocator reach their measured page need to the byte on two and one page under on
the third (tests/estimator/test_allocator.py).

What it does not model: when a deferred free completes (the caller says: ``free_completed``), CUDA graphs'
private pools,
``max_split_size_mb``, ``roundup_power2_divisions``, garbage collection, when ``empty_cache`` runs and the frees an
OOM triggers, and cudaMalloc's addresses (a new segment is placed after every earlier one, so among free blocks
of one size the older segment's wins, where the card's addresses may order them otherwise; ``descending`` places
each below every earlier one instead, as the driver placed the streamed H100 histories' segments, where the newest
wins: with it the streamed step's replay is their block sizes to the end of step 1's optimizer step, without it
Qwen2.5 DPO's departs at its first backward's first gradient).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

from ..constants import (EXPANDABLE_PAGE_BYTES, K_LARGE_BUFFER, K_MIN_BLOCK_SIZE, K_MIN_LARGE_ALLOC,
                         K_ROUND_LARGE, K_SMALL_SIZE, block_bytes)

K_SMALL_BUFFER = 2 * K_SMALL_SIZE  # the small pool's segment (kSmallBuffer)
#: The address space one expandable segment reserves: torch's is 9/8 of the card's memory (ExpandableSegment's
#: max_handles_); the card unknown, one far larger, so a segment never runs out of room here.
EXPANDABLE_ADDRESS_SPACE = 1 << 44


#: Where a descending allocator's first new segment ends (any address above every seeded one).
DESCENDING_TOP = 1 << 48


def _allocatable(b: Optional["Block"]) -> bool:
    """find_expandable_block's ``allocatable``: free (mapped or not) and waiting on no free."""
    return b is not None and not b.allocated and not b.pending


def _growable(b: "Block") -> int:
    """get_free_block's ``expandable_size``: a free block and the unmapped space right after it."""
    return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)


def allocation_size(size: int) -> int:
    """The segment a rounded request of ``size`` bytes gets when nothing cached fits (get_allocation_size)."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


@dataclass(eq=False)
class Block:
    """One block of a segment: its address, its size, the request it holds (0 while free), its stream;
    ``pending`` while a free waits for its stream's events (out of the allocated stat, not yet in the pool)."""

    addr: int
    size: int
    small: bool
    requested: int = 0
    allocated: bool = False
    stream: int = 0
    pending: bool = False
    mapped: bool = True  # expandable: whether pages back it (an unmapped block is a segment's free address space)
    prev: Optional["Block"] = field(default=None, repr=False)
    next: Optional["Block"] = field(default=None, repr=False)

    @property
    def rest(self) -> int:
        """What an allocated block holds past its rounded request (0 where it was split to it)."""
        return self.size - block_bytes(self.requested) if self.allocated else 0


class CachingAllocator:
    """The default caching allocator's pools, one per stream; ``allocated`` and ``peak`` are its allocated-bytes
    stat (block sizes) and that stat's maximum since the last ``reset_peak``; ``requested`` sums the rounded
    requests live (what an allocator history replays: a block leaves both at its free's request)."""

    def __init__(self, expandable: bool = False, address_space: int = EXPANDABLE_ADDRESS_SPACE,
                 descending: bool = False):
        self.expandable = expandable
        self.address_space = address_space  # expandable: the bytes of address space one segment reserves
        # a new segment below every earlier one, as the driver placed each of the streamed H100 histories' (issue 52
        # item 1): among free blocks of one size the newest segment's then wins
        self.descending = descending
        self._low = DESCENDING_TOP
        self._free: dict = {}  # per pool (small?, stream): sorted (size, addr, id, block), mapped blocks only
        self._end = 0  # the next segment's address
        self.segments: list[Block] = []  # each segment's first block (expandable: its address space's first)
        self.mappings: list[tuple] = []  # expandable: ("segment_map" | "segment_unmap", addr, bytes), in order
        self.allocated = self.peak = self.requested = self.requested_peak = self.reserved = 0

    # -- the free lists (BlockComparatorSize: stream, then size, then address) --
    def _insert(self, b: Block) -> None:
        bisect.insort(self._free.setdefault((b.small, b.stream), []), (b.size, b.addr, id(b), b))

    def _remove(self, b: Block) -> None:
        lst = self._free[b.small, b.stream]
        i = bisect.bisect_left(lst, (b.size, b.addr, id(b)))
        assert lst[i][3] is b
        del lst[i]

    def _fit(self, size: int, small: bool, stream: int) -> tuple[list, int]:
        """The stream's pool and where in it the smallest free block of at least ``size`` bytes is (the pool's
        length where none is: get_free_block's lower_bound)."""
        lst = self._free.get((small, stream), [])
        return lst, bisect.bisect_left(lst, (size, -1))

    def _best_fit(self, size: int, small: bool, stream: int) -> Optional[Block]:
        """get_free_block; under expandable segments a free block is as large as it can grow (itself and the
        unmapped space after it), so one before a segment's unmapped end is passed over for the next that fits."""
        lst, i = self._fit(size, small, stream)
        if i >= len(lst):
            return None
        while self.expandable and i + 1 < len(lst) and _growable(lst[i + 1][3]) < _growable(lst[i][3]):
            i += 1
        return lst.pop(i)[3]

    def _new_segment(self, size: int, small: bool, stream: int, at: Optional[int]) -> Block:
        """cudaMalloc of ``allocation_size`` at ``at`` (a history's address) or after every segment so far (or,
        expandable, pages mapped into the stream's segment: try_allocate_expandable_block)."""
        if self.expandable:
            return self._expand(size, small, stream)
        seg = allocation_size(size)
        if at is None and self.descending:
            at = self._low = min([self._low] + [h.addr for h in self.segments]) - seg
        b = Block(self._end if at is None else at, seg, small, stream=stream)
        self._end = max(self._end, b.addr + seg)
        self.reserved += seg
        self.segments.append(b)
        return b

    # -- expandable segments (try_allocate_expandable_block, find_expandable_block, map_block, unmap_block) --
    def _expand(self, size: int, small: bool, stream: int) -> Block:
        """The lowest unmapped space with the free block before it that holds ``size`` bytes, mapped in whole
        pages from the unmapped block's start (the free block before it merged in), out of the pool."""
        c = self._expandable_at(size, small, stream)
        if not c.mapped:
            self._map(c, min(c.size, size))
        while c.size < size:
            nxt = c.next
            self._map(nxt, min(size - c.size, nxt.size))
            c = nxt
        self._remove(c)
        return c

    def _expandable_at(self, size: int, small: bool, stream: int) -> Block:
        """find_expandable_block: each unmapped block of the stream's pool by address, taken with the free block
        before it, the first whose run of free blocks holds ``size``; else a new segment's address space."""
        for head in self._heads(small, stream):
            b = head
            while b is not None:
                if not b.mapped:
                    c = b.prev if _allocatable(b.prev) else b
                    run, x = 0, c
                    while run < size and _allocatable(x):
                        run, x = run + x.size, x.next
                    if run >= size:
                        return c
                b = b.next
        # each pool's segments stand in their own address range, far past any other
        base = ((1 << 60) if small else (1 << 59)) + (stream << 50)
        base += sum(h.small == small and h.stream == stream for h in self.segments) * self.address_space
        b = Block(base, self.address_space, small, stream=stream, mapped=False)
        self.segments.append(b)
        return b

    def _heads(self, small: bool, stream: int) -> list[Block]:
        return sorted((h for h in self.segments if h.small == small and h.stream == stream), key=lambda h: h.addr)

    def _head_of(self, b: Block) -> Block:
        while b.prev is not None:
            b = b.prev
        return b

    def _map(self, b: Block, size: int) -> None:
        """map_block: whole pages from an unmapped block's start (page-aligned) covering ``size`` bytes, the
        unmapped rest split off after them, merged with a free neighbour, into the pool."""
        page = EXPANDABLE_PAGE_BYTES["small" if b.small else "large"]
        n = -(-size // page) * page
        b.mapped = True
        if n < b.size:
            self._link(Block(b.addr + n, b.size - n, b.small, stream=b.stream, mapped=False), b, b.next)
            b.size = n
        self.reserved += n
        self.mappings.append(("segment_map", b.addr, n))
        self._merge(b)
        self._insert(b)

    def _unmap(self, b: Block) -> Optional[tuple[int, int]]:
        """unmap_block: the whole pages inside a free mapped block unmapped (the partial pages at either end
        stay mapped, free blocks of their own), merged with unmapped neighbours; the range, or None where it
        holds no whole page."""
        page = EXPANDABLE_PAGE_BYTES["small" if b.small else "large"]
        base = self._head_of(b).addr
        lo = base + -(-(b.addr - base) // page) * page
        hi = base + (b.addr + b.size - base) // page * page
        if lo >= hi:
            return None
        self._remove(b)
        end = b.addr + b.size
        if lo > b.addr:
            before = Block(b.addr, lo - b.addr, b.small, stream=b.stream)
            self._link(before, b.prev, b)
            self._insert(before)
        if hi < end:
            after = Block(hi, end - hi, b.small, stream=b.stream)
            self._link(after, b, b.next)
            self._insert(after)
        b.addr, b.size, b.mapped = lo, hi - lo, False
        self._merge(b)
        self.reserved -= hi - lo
        self.mappings.append(("segment_unmap", lo, hi - lo))
        return lo, hi - lo

    def unmap_at(self, addr: int) -> Optional[tuple[int, int]]:
        """The free mapped block holding ``addr`` unmapped (a history's segment_unmap); its range, or None."""
        b = next((x for x in self.blocks() if x.mapped and not x.allocated and not x.pending
                  and x.addr <= addr < x.addr + x.size), None)
        return None if b is None else self._unmap(b)

    def _link(self, b: Block, prev: Optional[Block], nxt: Optional[Block]) -> None:
        """``b`` spliced between ``prev`` and ``nxt`` (Block::splice), the segment's head where it has no prev."""
        b.prev, b.next = prev, nxt
        if prev is not None:
            prev.next = b
        if nxt is not None:
            if nxt.prev is None:
                self.segments[self.segments.index(nxt)] = b
            nxt.prev = b

    def _should_split(self, b: Block, size: int) -> bool:
        remaining = b.size - size
        if b.small or self.expandable:
            return remaining >= K_MIN_BLOCK_SIZE
        return remaining > K_SMALL_SIZE

    def fits(self, requested: int, stream: int = 0) -> bool:
        """Whether a cached free block would serve the request (else malloc cudaMallocs a segment)."""
        size = block_bytes(requested)
        lst, i = self._fit(size, size <= K_SMALL_SIZE, stream)
        return i < len(lst)

    def malloc(self, requested: int, stream: int = 0, at: Optional[int] = None) -> Block:
        """A request of ``requested`` bytes on ``stream``: the block it gets (best fit in that stream's pool,
        else a new segment, at ``at`` where given), split where should_split says so."""
        size = block_bytes(requested)
        small = size <= K_SMALL_SIZE
        b = self._best_fit(size, small, stream) or self._new_segment(size, small, stream, at)
        if self._should_split(b, size):
            rest = Block(b.addr + size, b.size - size, small, stream=stream, prev=b, next=b.next)
            if b.next is not None:
                b.next.prev = rest
            b.next, b.size = rest, size
            self._insert(rest)
        b.allocated, b.requested = True, requested
        self.allocated += b.size
        self.requested += size
        self.peak = max(self.peak, self.allocated)
        self.requested_peak = max(self.requested_peak, self.requested)
        return b

    def free(self, b: Block) -> None:
        """``b`` freed with no stream's events to wait for: requested and completed at once."""
        self.free_requested(b)
        self.free_completed(b)

    def free_requested(self, b: Block) -> None:
        """The free's first half: out of the allocated stat now, kept from its pool and its neighbours' merges
        until ``free_completed``."""
        assert b.allocated, "a block freed twice"
        self.allocated -= b.size
        self.requested -= block_bytes(b.requested)
        b.allocated, b.pending, b.requested = False, True, 0

    def free_completed(self, b: Block) -> None:
        """``b`` back to its pool, merged with a free neighbour on either side (free_block, try_merge_blocks)."""
        assert b.pending, "a free completed that was never requested"
        b.pending = False
        self._merge(b)
        self._insert(b)

    def _merge(self, b: Block) -> None:
        """try_merge_blocks with ``b``'s prev and next: a neighbour free, waiting on no free, and mapped as
        ``b`` is (a free mapped block never absorbs unmapped space) is absorbed."""
        for other in (b.prev, b.next):
            if other is not None and not other.allocated and not other.pending and other.mapped == b.mapped:
                if other.mapped:
                    self._remove(other)
                if other is b.prev:
                    b.addr, b.prev = other.addr, other.prev
                    if b.prev is not None:
                        b.prev.next = b
                    else:
                        self.segments[self.segments.index(other)] = b
                else:
                    b.next = other.next
                    if b.next is not None:
                        b.next.prev = b
                b.size += other.size

    @staticmethod
    def wholly_free(head: Block) -> bool:
        """Whether ``head`` is a whole segment, free and waiting on no free (release_block's condition)."""
        return head.prev is None and head.next is None and not head.allocated and not head.pending

    def release(self, head: Block) -> None:
        """A wholly free segment given back to the driver (release_block: a history's ``segment_free``)."""
        assert self.wholly_free(head), "only a wholly free segment is released"
        self._remove(head)
        self.segments.remove(head)
        self.reserved -= head.size

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache: every wholly free segment released (release_cached_blocks), both pools; under
        expandable segments every free block's whole pages unmapped (release_blocks, unmap_block), and a segment
        left wholly unmapped given up."""
        if not self.expandable:
            for head in [h for h in self.segments if self.wholly_free(h)]:
                self.release(head)
            return
        for small in (False, True):  # release_cached_blocks: the large pool, then the small
            for key in sorted(k for k in self._free if k[0] == small):
                for *_, b in list(self._free[key]):
                    self._unmap(b)
        self.segments = [h for h in self.segments if h.mapped or h.next is not None]

    def seed(self, addr: int, blocks: list[tuple], stream: int = 0, small: Optional[bool] = None) -> list[Block]:
        """A segment already there when a history began, at ``addr``: its ``blocks`` in address order as (size,
        request, state: "allocated", "pending" (its free requested, not completed) or "free"), counted in the
        stats (the peak from there); its blocks returned. ``small`` None: only the small pool's segments are
        kSmallBuffer (a large one is kLargeBuffer, or 10 MiB and more). Under expandable segments a segment is a
        mapped range of its pool's address space (torch's snapshot reports each so), laid into the unmapped
        space of the pool's segment holding it, or the first range of a new one."""
        out: list[Block] = []
        small = sum(size for size, *_ in blocks) == K_SMALL_BUFFER if small is None else small
        for size, requested, state in blocks:
            live = state == "allocated"
            b = Block(addr, size, small, requested if live else 0, live, stream, state == "pending",
                      prev=out[-1] if out else None)
            if out:
                out[-1].next = b
            out.append(b)
            addr += size
            if live:
                self.allocated += size
                self.requested += block_bytes(requested)
            elif state == "free":
                self._insert(b)
        if self.expandable:
            self._lay(out, small, stream)
        else:
            self.segments.append(out[0])
        self._end = max(self._end, addr)
        self.reserved += addr - out[0].addr
        self.reset_peak()
        return out

    def _lay(self, run: list[Block], small: bool, stream: int) -> None:
        """A seeded mapped range spliced into the unmapped block of its pool's segment that holds it (the
        unmapped space before and after it kept), or made the first range of a new segment."""
        start, end = run[0].addr, run[-1].addr + run[-1].size
        u = next((b for h in self._heads(small, stream) for b in _chain(h)
                  if not b.mapped and b.addr <= start and end <= b.addr + b.size), None)
        if u is None:
            self.segments.append(run[0])
            self._link(Block(end, self.address_space - (end - start), small, stream=stream, mapped=False),
                       run[-1], None)
            return
        prev, nxt = u.prev, u.next
        if end < u.addr + u.size:
            nxt = Block(end, u.addr + u.size - end, small, stream=stream, mapped=False, next=nxt)
            if u.next is not None:
                u.next.prev = nxt
        run[-1].next = nxt
        if nxt is not None:
            nxt.prev = run[-1]
        if start > u.addr:  # the unmapped space before the range stays, shortened
            u.size, u.next, run[0].prev = start - u.addr, run[0], u
            return
        run[0].prev = prev
        if prev is not None:
            prev.next = run[0]
        else:
            self.segments[self.segments.index(u)] = run[0]

    def reset_peak(self) -> None:
        """torch.cuda.reset_peak_memory_stats: each peak from what is live now."""
        self.peak, self.requested_peak = self.allocated, self.requested

    def touched_pages(self) -> int:
        """Under expandable segments, the bytes of the whole pages the live blocks touch now (20 MiB in the large pool,
        2 MiB in the small: constants.EXPANDABLE_PAGE_BYTES), each pool's segment from its first page: what a card
        cannot do without at this moment, since at an OOM the allocator unmaps every wholly free page before it
        retries (docs/PEAK.md, "EXPANDABLE_RESERVE_PAGES"; measure.cuda.page_need reads the same of a real history)."""
        pages = set()
        for head in self.segments:
            page = EXPANDABLE_PAGE_BYTES["small" if head.small else "large"]
            b = head
            while b is not None:
                if b.allocated:
                    first, last = (b.addr - head.addr) // page, (b.addr - head.addr + b.size - 1) // page
                    pages.update((head.addr, page, i) for i in range(first, last + 1))
                b = b.next
        return sum(page for _, page, _ in pages)

    def live(self) -> list[Block]:
        """Every allocated block, segment by segment, in address order."""
        return [b for b in self.blocks() if b.allocated]

    def blocks(self) -> list[Block]:
        """Every block, segment by segment, in address order (expandable: unmapped space too)."""
        return [b for head in self.segments for b in _chain(head)]


def _chain(head: Block) -> Iterator[Block]:
    """A segment's blocks from ``head``, in address order."""
    b: Optional[Block] = head
    while b is not None:
        yield b
        b = b.next


def replaying(events: Iterable[tuple], alloc: Optional[CachingAllocator] = None) -> Iterator[tuple]:
    """The allocator after each of ``events`` in turn, as (index, event, allocator, held): ("alloc", key, bytes,
    ...), ("free", key), ("reset_peak",) or ("empty_cache",), a key naming one request until it is freed; ``held``
    maps each live key to (the index that allocated it, its block). A free of a key never allocated is an error."""
    alloc = CachingAllocator() if alloc is None else alloc
    held: dict = {}
    for j, event in enumerate(events):
        if event[0] == "alloc":
            held[event[1]] = (j, alloc.malloc(event[2]))
        elif event[0] == "free":
            alloc.free(held.pop(event[1])[1])
        elif event[0] == "reset_peak":
            alloc.reset_peak()
        elif event[0] == "empty_cache":
            alloc.empty_cache()
        else:
            raise ValueError(f"unknown allocator event {event[0]!r}")
        yield j, event, alloc, held


def replay(events: Iterable[tuple], expandable: bool = False) -> CachingAllocator:
    """The allocator after every one of ``events`` (replaying's)."""
    alloc = CachingAllocator(expandable)
    for _ in replaying(events, alloc):
        pass
    return alloc
