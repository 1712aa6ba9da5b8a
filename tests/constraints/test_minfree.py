"""issue395.constraints.minfree: --min-free's bisection and --emulate-card's ballast (issue 20). The GPU paths
run here with only the CUDA calls faked, and the tests say so: the child process's outcome
(completed or OOM at a cap) is a function of the cap, cudaMalloc/cudaFree/mem_get_info are a fake
device."""

from __future__ import annotations

import pytest
from conftest import FakeDevice

from issue395.constraints import minfree as M

MiB = 2**20


@pytest.mark.parametrize("true_min", [1_500_000_000, 1_500_000_001, 2_900_000_000, 1_000_000_000 + 4 * MiB])
def test_bisection_finds_the_lowest_completing_cap_to_its_resolution(true_min):
    peak = 1_000_000_000
    seen = []

    def child(cap):  # FAKE: the fresh capped child's outcome, completed iff cap >= its real need
        seen.append(cap)
        return cap >= true_min

    got = M.bisect_min_free(child, peak=peak, start=1_200_000_000, ceiling=24 * 10**9)
    step = M.resolution(peak)
    assert step == max(4 * MiB, 2_500_000)
    assert got.completes >= true_min > got.fails and got.completes - got.fails <= step
    assert [c for c, _ in got.probes] == seen and all(ok == (c >= true_min) for c, ok in got.probes)
    assert set(got.to_json()) == {"min_free", "min_free_oom_at", "min_free_resolution", "min_free_probes"}


def test_an_arm_that_never_completes_below_the_card_has_no_min_free():
    got = M.bisect_min_free(lambda cap: False, peak=10**9, start=2 * 10**9, ceiling=4 * 10**9)
    assert got.completes is None and got.fails == 4 * 10**9


def test_the_ballast_leaves_exactly_the_emulated_cards_free_memory_and_goes_back():
    dev = FakeDevice(free=140 * 10**9, total=150 * 10**9)
    from issue395.estimator.cards import budget, parse_card

    target = budget(parse_card("A10G")).free_bytes
    b = M.hold_ballast(target, lib=dev, mem_get_info=dev.mem_get_info)
    # the size rounds down to the driver's 2 MiB page: never a smaller card than the one named
    assert b.free_after == dev.free and target <= b.free_after < target + 2 * 2**20
    assert b.size % (2 * 2**20) == 0
    M.release_ballast(b, lib=dev)
    assert dev.free == 140 * 10**9 and b.pointer is None


def test_no_ballast_when_the_card_already_has_less_free_and_a_failed_malloc_says_so():
    dev = FakeDevice(free=10**9, total=2 * 10**9)
    assert M.hold_ballast(2 * 10**9, lib=dev, mem_get_info=dev.mem_get_info).size == 0
    dev.cudaMalloc = lambda ref, size: 2
    with pytest.raises(RuntimeError, match="cudaMalloc"):
        M.hold_ballast(10**8, lib=dev, mem_get_info=dev.mem_get_info)
