"""The CUDA side of a measurement: the one peak window, the allocator's history and what is live
at the peak, the positive control's loss step, and how an OOM reads.
"""

from __future__ import annotations

import contextlib
import gc
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from ..constants import EXPANDABLE_PAGE_BYTES, SIZE_UNITS, MiB, block_bytes
from ..estimator.anatomy import classify_blocks, live_blocks


@dataclass
class Window:
    """What one peak window read: allocated when it opened, and the peaks while it was open."""

    before: int = 0
    peak: int = 0
    reserved: int = 0


@contextlib.contextmanager
def peak_window() -> Iterator[Window]:
    """The measurement, defined once: collect, synchronise, empty the cache and reset the peak
    stats; on a clean exit, synchronise and read ``max_memory_allocated`` (and reserved). The
    measured step, the sdpa probe and the positive control's step all run inside one."""
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    window = Window(before=int(torch.cuda.memory_allocated()))
    yield window
    torch.cuda.synchronize()
    window.peak = int(torch.cuda.max_memory_allocated())
    window.reserved = int(torch.cuda.max_memory_reserved())


def oom_request(exc: BaseException) -> Optional[int]:
    """The size an OOM asked for, off torch's message ("Tried to allocate 1.20 GiB")."""
    m = re.search(r"Tried to allocate ([0-9.]+) ([KMGT]i?B)", str(exc))
    return int(float(m.group(1)) * SIZE_UNITS[m.group(2)]) if m else None


def is_oom(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")
    return (torch is not None and isinstance(exc, torch.OutOfMemoryError)) or \
        "out of memory" in str(exc).lower()


SIZE_GROUPS = ((100_000_000, ">= 100 MB"), (10_000_000, "10-100 MB"), (1_000_000, "1-10 MB"),
               (0, "< 1 MB"))


@contextlib.contextmanager
def allocator_history(max_entries: int, stacks: Optional[str] = None) -> Iterator[dict[str, Any]]:
    """Record the caching allocator's history; the snapshot lands in the yielded dict. Sizes only by
    default (the harness reads no frames); ``stacks`` "python" or "all" (C++ frames too: a block
    allocated off the Python thread, the autograd engine's, has no Python frame) records each
    allocation's traceback."""
    import torch

    torch.cuda.memory._record_memory_history(enabled="all", context="alloc" if stacks else None,
                                             stacks=stacks or "python",
                                             max_entries=max_entries)
    taken: dict[str, Any] = {}
    try:
        yield taken
    finally:
        taken["snapshot"] = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)


def device_history(snapshot: dict[str, Any]) -> tuple[list, set]:
    """The device's allocator trace (the longest, one GPU) and the actions that end a block there: a
    history with free_requested frees a block when it is requested (allocated_bytes drops then), an
    older one at free or free_completed."""
    traces = snapshot.get("device_traces") or []
    trace = max(traces, key=len) if traces else []
    frees = ({"free_requested"} if any(e.get("action") == "free_requested" for e in trace)
             else {"free", "free_completed"})
    return trace, frees




@dataclass(frozen=True)
class PageNeed:
    """An expandable-segments history at its replayed peak (measured): ``allocated`` (block bytes
    live), ``mapped`` (the segments' mapped bytes then: the reserved memory; None where the history
    holds no mapping events) and ``pages`` (the bytes of the pages live blocks touch). ``pages -
    allocated`` is the allocator's reserve a card must hold at that peak once every wholly free page
    is released, as the allocator releases them before it raises OOM."""

    allocated: int
    mapped: Optional[int]
    pages: int

    @property
    def reserve(self) -> int:
        return self.pages - self.allocated


def page_need(snapshot: dict[str, Any]) -> Optional[PageNeed]:
    """The pages live blocks touch at the replayed peak of ``snapshot`` (torch.cuda.memory._snapshot()
    with the history on). The blocks live when the history began are those the end state still
    holds that the history never touches, and those whose first event is a free. None where the
    snapshot has no expandable segment."""
    import bisect

    segments = sorted((s for s in snapshot.get("segments") or [] if s.get("is_expandable")),
                      key=lambda s: s["address"])
    if not segments:
        return None
    bases = [s["address"] for s in segments]
    trace, frees = device_history(snapshot)
    touched: set[int] = set()  # each address the history allocates or frees
    live: dict[int, int] = {}
    for e in trace:
        act, addr = e.get("action"), int(e.get("addr", 0))
        if (act == "alloc" or act in frees) and addr not in touched:
            touched.add(addr)
            if act in frees:  # first seen freed: allocated before the history began
                live[addr] = block_bytes(int(e.get("size", 0)))
    for seg in segments:
        for b in seg.get("blocks") or []:
            if b.get("state") in ("active_allocated", "active_pending_free") and int(b["address"]) not in touched:
                live[int(b["address"])] = int(b["size"])
    # Copying the live blocks at every new high is quadratic while memory climbs: find the peak's
    # event first (the state before any event counts too), then replay up to it once.
    sizes, total, net_map, mapped_seen = dict(live), sum(live.values()), 0, False
    best, at, best_map = total, -1, 0
    for i, e in enumerate(trace):
        act, addr, size = e.get("action"), int(e.get("addr", 0)), int(e.get("size", 0))
        if act in ("segment_map", "segment_unmap"):
            net_map += size if act == "segment_map" else -size
            mapped_seen = True
        elif act == "alloc":
            sizes[addr] = block_bytes(size)
            total += sizes[addr]
        elif act in frees and addr in sizes:
            total -= sizes.pop(addr)
        if total > best:
            best, at, best_map = total, i, net_map
    best_live = live
    for e in trace[:at + 1]:
        act, addr = e.get("action"), int(e.get("addr", 0))
        if act == "alloc":
            best_live[addr] = block_bytes(int(e.get("size", 0)))
        elif act in frees:
            best_live.pop(addr, None)
    pages: set[tuple[int, int, int]] = set()  # (segment base, page index, page size)
    for addr, size in best_live.items():
        k = bisect.bisect_right(bases, addr) - 1
        base, kind = (segments[k]["address"], segments[k].get("segment_type")) if k >= 0 else (0, "large")
        page = EXPANDABLE_PAGE_BYTES.get(kind, EXPANDABLE_PAGE_BYTES["large"])
        pages.update((base, i, page) for i in range((addr - base) // page, (addr - base + size - 1) // page + 1))
    page_bytes = sum(page for *_, page in pages)
    mapped_end = sum(int(seg.get("total_size", 0)) for seg in segments)
    return PageNeed(allocated=best, mapped=mapped_end - net_map + best_map if mapped_seen else None, pages=page_bytes)


def save_snapshot(snapshot: dict[str, Any], path: Path) -> str:
    """A raw allocator snapshot, pickled as torch's own viewer reads it (--snapshot-dir)."""
    import pickle

    path.write_bytes(pickle.dumps(snapshot))
    return str(path)


def logits_kind(size: int, elements: int) -> Optional[str]:
    """'bf16' or 'fp32' when a block is exactly one logits tensor (seq x vocab x batch)."""
    return {elements * 2: "bf16", elements * 4: "fp32"}.get(size)


def attribute_peak(snapshot: dict[str, Any], resident: int, elements: int,
                   measured_peak: Optional[int] = None,
                   classify: Optional[Callable[[int], str]] = None,
                   physical: Optional[Callable[[int], str]] = None) -> dict[str, Any]:
    """Replay the allocator's history and name what is live at the peak: by ``classify`` (the
    estimator term meant to charge it) and by ``physical`` (its physical class, issue395.estimator.anatomy),
    whose bytes land in "classes" and "physical" (with the live blocks' sizes, "live_blocks", so a
    saved row's classes can be named again when it is rendered). ``resident`` was
    allocated before recording began (a block freed but never seen allocated comes out of it).
    A replayed peak off the measured one means the history was incomplete, and it says so."""
    trace, frees = device_history(snapshot)

    def replay(events: list) -> Iterator[tuple[int, int, int, dict[int, int]]]:
        live: dict[int, int] = {}
        base, total = resident, 0
        for i, event in enumerate(events):
            action, addr, size = event.get("action"), int(event.get("addr", 0)), int(event.get("size", 0))
            if action == "alloc":
                live[addr] = size
                total += block_bytes(size)
            elif action in frees:
                if addr in live:
                    total -= block_bytes(live.pop(addr))
                else:
                    base -= block_bytes(size)
            else:
                continue
            yield i, base, total, live

    # Copying the live blocks at every new high is quadratic while memory climbs: find the
    # peak's event first, then replay up to it once.
    best, best_base, at = resident, resident, -1
    for i, base, total, _ in replay(trace):
        if base + total > best:
            best, best_base, at = base + total, base, i
    best_live: dict[int, int] = {}
    for _, _, _, best_live in replay(trace[:at + 1]):
        pass
    groups: dict[str, dict[str, int]] = {}
    logits = {"bf16": {"count": 0, "bytes": 0}, "fp32": {"count": 0, "bytes": 0}}
    classes = classify_blocks(best_live.values(), classify) if classify is not None else {}
    named = classify_blocks(best_live.values(), physical) if physical is not None else {}
    for size in best_live.values():
        kind = logits_kind(size, elements)
        label = next(lbl for floor, lbl in SIZE_GROUPS if size >= floor)
        g = logits[kind] if kind else groups.setdefault(label, {"count": 0, "bytes": 0})
        g["count"] += 1
        g["bytes"] += block_bytes(size)
    # A split block keeps an unseen remainder under 1 MiB; a lost event shows far beyond that.
    complete = measured_peak is None or abs(best - measured_peak) <= (1 << 20) + measured_peak * 1e-3
    return {"elements": elements, "replayed_peak": best, "measured_peak": measured_peak,
            "complete": bool(trace) and complete, "events": len(trace),
            "resident_at_peak": best_base, "logits_bf16": logits["bf16"],
            "logits_fp32": logits["fp32"], "classes": classes,
            **({"physical": dict(named, **{"resident weights": best_base}),
                "live_blocks": live_blocks(best_live.values())} if physical is not None else {}),
            "other_groups": {k: groups[k] for _, k in SIZE_GROUPS if k in groups}}


def control_step(hold_copy: bool, tokens: int = 2048, vocab: int = 32768,
                 hidden: int = 256) -> dict[str, Any]:
    """The positive control's loss step; with ``hold_copy`` one extra bf16 copy of the logits is held
    across backward (the retention the record found absent): the attribution must see it."""
    import torch
    from transformers.loss.loss_utils import ForCausalLMLoss

    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen,
                    requires_grad=True)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, generator=gen,
                    requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens), device="cuda", generator=gen)
    with peak_window() as window, allocator_history(200_000) as taken:
        logits = h @ w.t()
        held = logits.detach().clone() if hold_copy else None
        ForCausalLMLoss(logits, labels, vocab).backward()
    del held, logits, h, w, labels
    torch.cuda.empty_cache()
    return attribute_peak(taken["snapshot"], window.before, tokens * vocab, window.peak)


def positive_control(without: dict[str, Any], with_copy: dict[str, Any]) -> dict[str, Any]:
    """Passes only if holding one extra bf16 copy shows exactly one more bf16 logits block."""
    extra = with_copy["logits_bf16"]["count"] - without["logits_bf16"]["count"]
    return {"without_copy": without, "with_copy": with_copy, "extra_bf16_blocks": extra,
            "passed": extra == 1 and without["complete"] and with_copy["complete"]}
