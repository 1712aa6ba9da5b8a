"""issue395.host.schedule: the lanes' card packed by bytes. Pure rules, no process: the room the lanes
leave their arms, the admission of an arm beside others (its bytes and Soup's gate), first asked first
served with a later arm let through only where it fits beside the earlier ones, the families' order
and the threads per lane. The needs are the real estimator's where a test reads an arm."""

from __future__ import annotations

import pytest

from issue395.estimator.cards import CONTEXT_BOUND_BYTES, STEP_GROWTH_BYTES
from issue395.estimator.cards import CARDS
from issue395.host.schedule import (Ledger, Need, Room, card_total, claim_order, deal, lane_threads, may_build,
                                    needs_table)

GB = 10**9


def test_the_room_is_the_card_less_every_live_lanes_context_and_growth():
    room = Room(100 * GB, 4)
    assert room.arm_bytes == 100 * GB - 4 * (CONTEXT_BOUND_BYTES + STEP_GROWTH_BYTES)
    assert Room(100 * GB, 4, context=0).arm_bytes == 100 * GB - 4 * STEP_GROWTH_BYTES, "a measured context is used"


def test_an_arm_too_large_for_a_lanes_quarter_runs_beside_others_when_the_sum_fits():
    room = Room(100 * GB, 4)  # a quarter: 25 GB; the binary lock would have held the card alone
    ledger = Ledger(room)
    ledger.ask("small", Need(10 * GB))
    ledger.ask("large", Need(60 * GB))
    assert ledger.admit() == ["small", "large"]
    ledger.ask("third", Need(30 * GB))  # 10 + 60 + 30 > what the four lanes leave
    assert ledger.admit() == []
    ledger.done("small")
    assert ledger.admit() == ["third"]
    assert ledger.used == 90 * GB


def test_a_large_arm_waiting_is_not_starved_by_small_arms_asking_after_it():
    ledger = Ledger(Room(100 * GB, 2))
    ledger.ask("a", Need(50 * GB))
    assert ledger.admit() == ["a"]
    ledger.ask("whole", Need(90 * GB))  # waits for a
    ledger.ask("b", Need(30 * GB))  # would fit beside a, but not beside the waiting arm: it waits too
    assert ledger.admit() == []
    ledger.ask("tiny", Need(1 * GB))  # fits beside a and the waiting arm's 90 GB? 50 + 90 > room: no
    assert ledger.admit() == []
    ledger.done("a")
    assert ledger.admit() == ["whole"], "the arm that asked first got the card first"
    ledger.done("whole")
    assert ledger.admit() == ["b", "tiny"]


def test_a_later_arm_starts_first_while_the_earlier_one_has_waited_less_than_its_patience():
    ledger = Ledger(Room(100 * GB, 3), patience=10.0)
    ledger.ask("a", Need(40 * GB), now=0.0)
    ledger.admit(now=0.0)
    ledger.ask("big", Need(60 * GB), now=1.0)  # 40 + 60 > room: it waits
    ledger.ask("small", Need(5 * GB), now=2.0)
    assert ledger.admit(now=2.0) == ["small"], "a small arm waited behind a large one within its patience"
    ledger.ask("late", Need(5 * GB), now=11.0)  # big has waited 10 s: its bytes are kept from now on
    assert ledger.admit(now=11.0) == []
    ledger.done("a")
    ledger.done("small")
    assert ledger.admit(now=12.0) == ["big", "late"]


def test_soups_gate_decides_beside_neighbours_as_alone():
    room = Room(20 * GB, 2)
    ledger = Ledger(room)
    ledger.ask("n", Need(8 * GB))
    ledger.admit()
    # its bytes fit beside n, but Soup's own number does not fit the free memory its gate would read
    ledger.ask("gated", Need(2 * GB, soup=room.gate_free(8 * GB) + 1))
    assert ledger.admit() == []
    ledger.done("n")
    assert ledger.admit() == ["gated"]
    # an arm Soup refuses even alone is let through at once and counts for nothing: its row is the refusal
    refused = Need(50 * GB, soup=30 * GB)
    assert room.refused_alone(refused) and room.fits_beside_lanes(refused)
    ledger.ask("refused", refused)
    assert ledger.admit() == ["refused"] and ledger.running["refused"] == 0


def test_an_arm_that_cannot_fit_beside_the_idle_lanes_is_said_so():
    room = Room(100 * GB, 4)
    assert room.fits_beside_lanes(Need(room.arm_bytes))
    assert not room.fits_beside_lanes(Need(room.arm_bytes + 1))


def test_the_ledger_survives_its_json_and_refuses_an_arm_asked_twice():
    ledger = Ledger(Room(100 * GB, 2), patience=3.0)
    ledger.ask(11, Need(GB, 2 * GB), now=1.0)
    ledger.ask(12, Need(99 * GB), now=2.0)
    ledger.admit(now=2.0)
    again = Ledger.from_json(ledger.room, ledger.to_json())
    assert (again.patience, again.running, again.waiting) == (3.0, ledger.running, ledger.waiting)
    with pytest.raises(ValueError):
        again.ask(11, Need(GB))
    with pytest.raises(ValueError):
        needs_table([(1, Need(1)), (1, Need(2))])


def test_families_are_taken_costliest_first_and_dealt_to_the_lightest_lane():
    cost = {"smol": 10.0, "mistral-7b": 90.0, "qwen": 30.0, "gemma-2b": 30.0, "phi-2": 20.0}
    assert claim_order(cost) == ["mistral-7b", "gemma-2b", "qwen", "phi-2", "smol"]
    assert deal(cost, 2) == [["mistral-7b"], ["gemma-2b", "qwen", "phi-2", "smol"]]


def test_lanes_4_6_and_8_on_16_cores_are_the_three_layouts_to_measure():
    assert [(n, lane_threads(16, n)) for n in (4, 6, 8)] == [(4, 4), (6, 2), (8, 2)]
    assert lane_threads(2, 8) == 1


def test_a_checkpoint_waits_for_disk_room_unless_the_disk_holds_nothing():
    assert may_build(40 * GB, 20 * GB, 60 * GB) and not may_build(41 * GB, 20 * GB, 60 * GB)
    assert may_build(0, 90 * GB, 60 * GB), "the only way on was refused"
    assert may_build(10**15, GB, None)


def test_the_h200s_room_starts_from_what_cuda_hands_out_not_nvidia_smis_total():
    h200 = CARDS["h200"]
    assert card_total(h200.total_bytes) == h200.total_bytes - h200.hidden_bytes < h200.total_bytes
    assert card_total(12_345) == 12_345, "a card not named here keeps the driver's total"
