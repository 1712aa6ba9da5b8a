"""--min-free and --emulate-card's cores (issue 20): the lowest cap
an arm completes under, by bisection over fresh capped processes, and a ballast held outside
this process's caching allocator so a card of another size is what Soup's own gate measures.
Neither imports torch at module level; the CUDA calls are the only thing the CPU tests fake."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..constants import MiB
from ..text import gb, ratio, table
from ..results.extras import MinFreeFound
from ..results.row import Row
from .constraint import Constraint, arm_name

#: The bisection stops when the bracket is narrower than this: 0.25% of the allocated peak or
#: 4 MiB, whichever is larger (a cap finer than the allocator's 2 MiB pages means nothing).
RESOLUTION_FRACTION, RESOLUTION_FLOOR = 0.0025, 4 * MiB
DRIVER_PAGE = 2 * MiB  # cudaMalloc maps whole pages of this size


def resolution(peak: int) -> int:
    return max(RESOLUTION_FLOOR, math.ceil(RESOLUTION_FRACTION * peak))


@dataclass
class MinFree:
    """The lowest cap that completed, the highest that did not, and every probe in order."""

    completes: Optional[int]
    fails: int
    resolution: int
    probes: list = field(default_factory=list)  # (cap bytes, True: completed / False: OOM)

    def to_json(self) -> dict:
        return {"min_free": self.completes, "min_free_oom_at": self.fails,
                "min_free_resolution": self.resolution, "min_free_probes": [list(p) for p in self.probes]}


def bisect_min_free(completes_at: Callable[[int], bool], peak: int, start: int, ceiling: int) -> MinFree:
    """``completes_at(cap)`` runs the arm in a fresh process capped at ``cap`` bytes (expandable
    segments on) and says whether it completed (False: it raised OOM). The allocated ``peak`` is
    a floor no cap below can pass; ``start`` (e.g. the needs-free estimate) the first guess; the
    bracket doubles upward from it until a run completes, at most to ``ceiling`` (the card)."""
    step = resolution(peak)
    found = MinFree(None, peak, step)

    def probe(cap: int) -> bool:
        ok = completes_at(cap)
        found.probes.append((cap, ok))
        return ok

    high = max(start, peak + step)
    while not probe(high):
        found.fails = high
        if high >= ceiling:
            return found  # not even the whole card: min_free stays None
        high = min(ceiling, high + max(step, high - peak))
    low = found.fails
    while high - low > step:
        mid = (low + high) // 2
        if probe(mid):
            high = mid
        else:
            low = mid
    found.completes, found.fails = high, low
    return found


# -- --emulate-card: a ballast outside the caching allocator --
def _loaded_cudart() -> list:
    """libcudart files this process has mapped (torch's own runtime: a wheel ships it as
    libcudart.so.12 under nvidia/cuda_runtime, a name no plain lookup finds)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as fh:
            return list(dict.fromkeys(line.split()[-1] for line in fh if "libcudart.so" in line))
    except OSError:
        return []


class _Driver:
    """The driver API under the runtime's two names: libcuda is always there where a card is,
    and torch's primary context is current once mem_get_info has run."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def cudaMalloc(self, ref, size):  # noqa: N802 - the runtime's name
        return self.lib.cuMemAlloc_v2(ref, size)

    def cudaFree(self, ptr):  # noqa: N802
        return self.lib.cuMemFree_v2(ptr)


def _cudart():
    """libcudart as torch loaded it (the process's own runtime), else the system's, else the driver."""
    import torch  # noqa: F401  (loads its libcudart into the process)

    for name in (*_loaded_cudart(), "libcudart.so.12", "libcudart.so", ctypes.util.find_library("cudart")):
        if name:
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
    try:
        return _Driver()
    except OSError:
        raise OSError("neither libcudart nor libcuda can be loaded") from None


@dataclass
class Ballast:
    """cudaMalloc'd bytes the caching allocator never sees and mem_get_info does (device-wide):
    what leaves the free memory a smaller card would show after its context."""

    pointer: Optional[ctypes.c_void_p]
    size: int
    free_after: int  # measured: mem_get_info's free once the ballast is held
    lib: Any = None  # the runtime that allocated it frees it


def hold_ballast(target_free: int, lib: Optional[ctypes.CDLL] = None,
                 mem_get_info: Optional[Callable[[], tuple]] = None) -> Ballast:
    """Allocate ``free - target_free`` bytes with cudaMalloc so that mem_get_info reports
    ``target_free``; nothing when the card has less free. The driver maps whole 2 MiB pages, so
    the size is rounded down to one: the emulated card is never smaller than the card named
    (free_after lies in [target_free, target_free + 2 MiB))."""
    if mem_get_info is None:
        import torch

        mem_get_info = torch.cuda.mem_get_info
    lib = lib or _cudart()
    free, _ = mem_get_info()
    size = (int(free) - int(target_free)) // DRIVER_PAGE * DRIVER_PAGE
    if size <= 0:
        return Ballast(None, 0, int(free))
    ptr = ctypes.c_void_p()
    err = lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(size))
    if err != 0:
        raise RuntimeError(f"cudaMalloc of {size} B for the ballast failed (cudaError {err})")
    return Ballast(ptr, size, int(mem_get_info()[0]), lib)


def release_ballast(ballast: Ballast, lib: Optional[ctypes.CDLL] = None) -> None:
    if ballast.pointer is not None:
        (lib or ballast.lib or _cudart()).cudaFree(ballast.pointer)
        ballast.pointer = None


class MinFreeBisection(Constraint):
    """--min-free: each arm's lowest completing cap, by bisection over fresh capped processes. It
    constrains no arm in-process (each probe is a --cap child, issue395.host.probes drives them); its
    record is the bisection's outcome, set on the control's row."""

    FLAG, RECORD, PROBES = "--min-free", MinFreeFound, True

    @classmethod
    def for_arm(cls, asked: bool, context: Optional[int] = None) -> None:
        return None  # each probe runs under --cap

    @classmethod
    def how(cls, asked: bool) -> str:
        return "--min-free: a bisection over capped fresh processes (expandable segments)"

    @staticmethod
    def table(rows: list[Row]) -> str:
        """--min-free: the lowest cap each arm's step completes under, found by bisection over fresh
        capped processes, beside this tool's needs-free and their ratio."""
        cells = []
        for r in rows:
            f = r.constraint
            over = f.needs_free / f.completes if f.needs_free and f.completes else None
            cells.append([arm_name(r), gb(r.soup_predicted), gb(f.needs_free), gb(f.completes), gb(f.oom),
                          f"{(f.resolution or 0) / MiB:.1f}", ratio(over), str(len(f.probes))])
        return "\n".join(["--min-free: the lowest allocator cap the step completes under (measured: a bisection over "
                          "fresh processes, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, to the resolution shown); "
                          "needs free: this tool's estimator; Soup's own: computed by Soup"] + table(
            [("arm", -34), ("Soup's own GB", 13), ("needs free GB", 13), ("min free GB", 11), ("OOM at GB", 9),
             ("res. MiB", 8), ("needs/min", 9), ("probes", 6)], cells))
