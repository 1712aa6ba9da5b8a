"""issue395.estimator.cards: named cards, plain sizes, the context bound and the cuBLAS workspace per handle
(issue 20). CPU only: nothing here touches CUDA."""

from __future__ import annotations

import pytest
from conftest import ROOT, main, one_error_line

from issue395.estimator import cards as C
from issue395.estimator import estimate as E
from issue395.errors import UsageError
from issue395.record import RECORD_A10G_PEAK
from issue395.model.registry import config_json
from issue395.estimator.releases import soup_dir as _soup_dir
from conftest import main, one_error_line
from issue395.estimator.cards import CARDS, parse_card, parse_cards

ASKED = ("A10G", "L4", "T4", "RTX3090", "RTX4090", "RTX5090", "A100-40GB", "A100-80GB", "L40S", "H100", "H200")


def test_every_card_the_issue_names_and_a_laptop_or_consumer_card_of_each_small_size():
    for name in ASKED:
        card = C.parse_card(name.lower())
        assert card.name == name and card.cc and card.source and card.total_bytes % 2**20 == 0
    small = {round(c.total_bytes / 2**30) for c in C.CARDS.values() if c.total_bytes < 17 * 2**30}
    assert {4, 6, 8, 12, 16} <= small
    assert C.parse_card("RTX3050-Laptop-4GB").total_bytes == 4096 * 2**20  # the record's first stack


def test_plain_sizes_are_as_before_and_carry_no_compute_capability():
    assert (C.parse_card("24GB").total_bytes, C.parse_card("24GiB").total_bytes) == (24 * 10**9, 24 * 2**30)
    assert C.parse_card("24GB").cc is None
    for junk in ("", "RTX9090", "24TB", "0GB", "A10G,a10g"):
        with pytest.raises(UsageError) as info:
            C.parse_cards(junk)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("cc, env, expected", [
    ((9, 0), None, 32 * 2**20), ((10, 0), None, 32 * 2**20), ((12, 0), None, 32 * 2**20),
    ((8, 6), None, 8_519_680), ((8, 0), None, 8_519_680), ((7, 5), None, 8_519_680),
    (None, None, 32 * 2**20),  # a plain size: the larger one
    ((8, 6), ":4096:8", 32 * 2**20), ((9, 0), ":4096:2:16:8", 8_519_680), ((9, 0), ":16:8", 131_072),
    ((8, 6), "garbage", 8_519_680),  # no ':SIZE:COUNT' pair: torch warns and keeps its default
])
def test_cublas_workspace_follows_pytorchs_rule(cc, env, expected):
    assert C.cublas_workspace(cc, env) == expected


def test_the_context_bound_is_the_figure_in_soups_own_source():
    src = (_soup_dir() / "utils" / "layer_stream.py").read_text(encoding="utf-8")
    assert C.CONTEXT_EVIDENCE in src and C.CONTEXT_BOUND_BYTES == 850_000_000


def test_the_h200s_hidden_bytes_come_from_committed_text():
    text = (ROOT / "results/cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37/cap-soup.json").read_text()
    assert "total capacity of 139.80 GiB" in text
    h200 = C.CARDS["h200"]
    assert 600 * 2**20 < h200.hidden_bytes < 630 * 2**20
    assert C.budget(h200).context_bytes == C.CONTEXT_BOUND_BYTES + h200.hidden_bytes


def test_the_verdict_is_needs_free_plus_context_plus_the_runtimes_growth_within_total():
    """The step's allocator gets the card's free memory less what the CUDA runtime adds by the
    step's end (242-250 MiB measured); Soup's gate reads it less the 90 MiB loaded before it asks."""
    b = C.budget(C.parse_card("24GB"), context=10**9)
    assert (b.free_bytes, b.context_source) == (23 * 10**9, "given")
    room = 23 * 10**9 - 262_144_000
    assert b.step_free_bytes == room and b.fits(room) and not b.fits(room + 1)
    assert b.harness_gate_free_bytes == 23 * 10**9 - 94_371_840
    assert b.gate_free_bytes == 23 * 10**9 - C.CLI_GATE_GROWTH_BYTES
    assert C.CLI_GATE_GROWTH_BYTES < C.GATE_GROWTH_BYTES < C.STEP_GROWTH_BYTES, \
        "the modules by the gate are part of the step's growth, and `soup train` loads fewer by then"


def test_a_measured_runtime_growth_replaces_the_bound_with_a_given_context_and_with_the_cards_bound_alike():
    """Issue 51 item 4: a search's probes' own runtime growth (findmax.measured_growth) takes STEP_GROWTH_BYTES'
    place in the step's free memory whether the context is given or the card's bound; none given, the bound."""
    card = C.parse_card("24GB")
    for context in (10**9, None):
        plain, grown = C.budget(card, context), C.budget(card, context, 100_000_000)
        assert plain.step_free_bytes == plain.free_bytes - C.STEP_GROWTH_BYTES
        assert grown.step_free_bytes == grown.free_bytes - 100_000_000 == plain.step_free_bytes + 162_144_000


@pytest.mark.parametrize("resident, cc, measured", [
    (True, (9, 0), True), (True, None, False), (True, (8, 6), False), (True, (12, 0), False), (False, (9, 0), False),
    (False, None, False)])
def test_the_measured_resident_growth_is_charged_only_for_a_resident_run_on_hopper(resident, cc, measured):
    """Issue 51: a resident run in `soup train`'s own process grew the runtime by 176.9 MB on an H100 (sm_90); a
    streamed run, a card of another architecture or one whose architecture is not known (a plain size) keeps the
    262.1 MB bound, and the budget says which it charges."""
    want = C.RESIDENT_STEP_GROWTH_BYTES if measured else C.STEP_GROWTH_BYTES
    assert C.step_growth(resident, cc) == want
    assert C.growth_source(resident, cc) == (C.GROWTH_RESIDENT if measured else C.GROWTH_BOUND)
    b = C.budget(C.Card("card", 20 * 10**9, cc), 10**9, resident=resident)
    assert b.step_free_bytes == 19 * 10**9 - want and b.growth_from == C.growth_source(resident, cc)
    assert C.budget(C.Card("card", 20 * 10**9, cc), 10**9, 5, resident=resident).step_free_bytes == 19 * 10**9 - 5, \
        "a search's probes' own growth, where given, stands for either"


def test_a_box_whose_compute_capability_is_given_answers_for_its_card_not_the_emulated_ones():
    """--find-max's probes run on the box's card: its compute capability, given, replaces the emulated card's (a
    plain size's unknown one), and an unknown one (None) the named card's."""
    plain, h100 = C.parse_card("24GB"), C.parse_card("H100")
    assert C.budget(plain, 0, resident=True, cc=(9, 0)).growth == C.RESIDENT_STEP_GROWTH_BYTES
    assert C.budget(h100, 0, resident=True).growth == C.RESIDENT_STEP_GROWTH_BYTES
    assert C.budget(h100, 0, resident=True, cc=None).growth == C.STEP_GROWTH_BYTES


def _probe(p: dict):
    """A committed probe's JSON (findmax.Probe.to_json) read back into the Probe the search held."""
    from issue395.constraints import findmax as F

    a, o = p.get("allocator"), p.get("oom")
    return F.Probe(p["value"], p["outcome"], allocator=F.ProbeAllocator(**a) if a else None,
                   oom=F.OomReading(**o) if o else None, free_held=p.get("free_held"))


def test_the_resident_growth_is_the_most_any_committed_resident_probe_read():
    """RESIDENT_STEP_GROWTH_BYTES is the most measured: every committed resident --find-max probe's runtime growth
    (findmax.runtime_growth: at its exit, to the byte, or where it read nothing there torch's OOM message in its
    process, to its rounding), all on sm_90 (H100, H200), is at most it, and the most exact reading is it. A probe
    that reads more fails here."""
    import json

    from issue395.constraints.findmax import runtime_growth

    exact, message = [], []
    for path in sorted(ROOT.glob("results/resident-findmax-*/find-max-*.json")):
        d = json.loads(path.read_text())
        for p in map(_probe, d["measured"]["probes"]):
            g, a = runtime_growth(p, d["box_context_bytes"]), p.allocator
            if g is not None:
                read_at_exit = a is not None and None not in (p.free_held, a.free_at_exit, a.reserved_at_exit)
                (exact if read_at_exit else message).append(g)
    assert len(exact) >= 30 and len(message) >= 4, "30 exit readings of 8 searches, 4 OOM messages of older ones"
    assert max(exact) == C.RESIDENT_STEP_GROWTH_BYTES and exact.count(C.RESIDENT_STEP_GROWTH_BYTES) >= 24
    # A message alone is torch's two decimals of GiB on two figures (+-2 x 5.4 MB): more than that is more growth.
    assert max(message) <= C.RESIDENT_STEP_GROWTH_BYTES + 2 * 0.005 * 2**30
    assert C.RESIDENT_STEP_GROWTH_BYTES < C.STEP_GROWTH_BYTES


def test_soups_gate_in_soup_train_reads_what_the_find_max_probes_saw_it_print():
    """The free memory Soup's gate printed on every committed --find-max probe (the real `soup train`,
    two decimals) is the card's total less the box's context less the CLI's growth, to Soup's rounding."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    seen = 0
    for path in sorted(root.glob("results/*/find-max-*.json")) + sorted(root.glob("results/*/*/find-max-*.json")):
        d = json.loads(path.read_text())
        if not d.get("box_context_bytes"):
            continue
        b = C.budget(C.parse_card(d["card"]["card"]), context=d["box_context_bytes"])
        for p in d["measured"]["probes"]:
            if p.get("driver_free_gb"):
                assert abs(b.gate_free_bytes / 1e9 - p["driver_free_gb"]) <= 0.005 + 0.0065, (path.name, p)
                seen += 1
    assert seen >= 30


def test_the_a10g_workspace_is_not_subtracted_because_the_record_would_be_under():
    """Why the corrected estimate keeps 32 MiB on an sm 8.6 card: with the per-card 8,519,680 B
    the A10G record's published peaks (record.py) sit above it on most arms."""
    cut = 32 * 2**20 - C.cublas_workspace((8, 6))
    under = [k for k, peak in RECORD_A10G_PEAK.items()
             if E.estimate(config_json(k[0]), seq=k[1]).corrected_predicted - cut < peak]
    assert len(under) >= 6
    for (model, seq), peak in RECORD_A10G_PEAK.items():
        kept = E.estimate(config_json(model), seq=seq, workspace=C.cublas_workspace((8, 6)))
        assert kept == E.estimate(config_json(model), seq=seq)  # the per-card term never lowers it
        assert kept.corrected_predicted >= peak


def test_a_larger_workspace_config_raises_the_estimate():
    c = config_json("smol")
    assert (E.estimate(c, seq=512, workspace=64 * 2**20).corrected_predicted
            - E.estimate(c, seq=512).corrected_predicted) == 32 * 2**20


@pytest.mark.parametrize("text, words", [
    ("24GB,24GB", ["24GB is named twice"]), ("24GB,24.0GB", ["named twice"]), ("a10g,A10G", ["A10G is named twice"]),
    ("２４GB", ["not a size like 24GB"]), ("24GB,２４GB", ["not a size like 24GB"]),
    ("-1GB", ["a card's size is positive"]),
])
def test_a_card_named_twice_full_width_digits_or_a_negative_size_are_refused(text, words):
    """Issue 22, defect 16: full-width digits were read as a size (２４GB, a second 24 GB card)."""
    with pytest.raises(UsageError) as exc:
        C.parse_cards(text)
    for word in words:
        assert word in str(exc.value)


@pytest.mark.parametrize("cc, spelled", [((8, 6), ":4096:2:16:8"), ((7, 5), ":4096:2:16:8"), ((9, 0), ":4096:8"),
                                         ((12, 0), ":4096:8")])
def test_each_default_workspace_is_what_torchs_own_spelling_of_it_sums_to(cc, spelled):
    """The defaults come from constants; torch's source spells them as configs, parsed here."""
    assert C.cublas_workspace(cc) == C.cublas_workspace(cc, spelled)


def test_the_emulated_outcomes_are_the_issues_words():
    assert [C.emulated_outcome(True, False), C.emulated_outcome(False, False), C.emulated_outcome(False, True)] == [
        "refused by Soup", "admitted and completed", "admitted and OOM"]


# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


def test_card_list_names_every_card_with_its_source(capfd):
    """Issue 29 item 14: --card list names every card with its source, and refuses other options beside it in
    one line."""
    from issue395.estimator.cards import CARDS

    code, out, err = main(capfd, ["--card", "list"])
    assert code == 0, err
    for card in CARDS.values():
        (line,) = [ln for ln in out.splitlines() if ln.split()[0] == card.name]
        assert card.source in line
    one_error_line(*main(capfd, ["--card", "list", "--seq", "512"]), "--card list", "--seq")
NEW_CARDS = {"V100-16GB": (16160, (7, 0)), "V100-32GB": (32510, (7, 0)), "RTX-A6000": (49140, (8, 6)),
             "RTX4080": (16376, (8, 9)), "RTX3080": (10240, (8, 6)), "A40": (46068, (8, 6)), "L40": (46068, (8, 9)),
             "RTX2080Ti": (11264, (7, 5))}


@pytest.mark.parametrize("name", sorted(NEW_CARDS))
def test_issue53_cards_are_named_with_their_total_compute_capability_and_source(capfd, name):
    """Issue 53 item 15: V100 16/32 GB, RTX A6000, RTX 4080, RTX 3080, A40, L40 and RTX 2080 Ti are named cards,
    each with nvidia-smi's total, its compute capability and where the total comes from, listed by --card list,
    and --estimate answers on it."""
    from conftest import main

    card = CARDS[name.lower()]
    assert (card.total_bytes, card.cc) == (NEW_CARDS[name][0] * 2**20, NEW_CARDS[name][1])
    assert f"{NEW_CARDS[name][0]}MiB" in card.source
    code, out, err = main(capfd, ["--card", "list"])
    (line,) = [ln for ln in out.splitlines() if ln.split()[0] == name]
    assert card.source in line
    code, out, err = main(capfd, ["--estimate", "--model", "qwen", "--seq", "512", "--card", name])
    assert code == 0 and out.splitlines()[0].startswith("verdict") and f"  {name}: sft none 512x1: " in out, err


@pytest.mark.parametrize("spelled, name", [("RTX 4080", "RTX4080"), ("rtx a6000", "RTX-A6000"), ("v100 32gb", "V100-32GB"),
                                          ("RTX_2080_Ti", "RTX2080Ti"), ("a100 80gb", "A100-80GB")])
def test_a_card_is_named_whatever_its_case_spaces_and_dashes(spelled, name):
    assert parse_card(spelled).name == name


def test_two_cards_of_one_total_are_two_cards_and_one_card_twice_is_refused():
    """L40 and L40S print the same total; they are still two cards. The same card in two spellings is one."""
    assert [c.name for c in parse_cards("L40,L40S,A40")] == ["L40", "L40S", "A40"]
    for twice in ("L40,l40", "RTX 4080,RTX4080", "24GB,24.0GB"):
        with pytest.raises(UsageError, match="named twice"):
            parse_cards(twice)
