"""issue395.estimator.fits (--estimate's cards): per card the verdict, the longest seq that fits, and Soup's
two answers beside it (issue 20). CPU only; Soup's numbers are computed by its own estimator
code, no torch."""

from __future__ import annotations

import json
import re

import pytest
from conftest import estimate_config_json, main, readme_yaml, verdicts

from issue395.estimator import cards as C
from issue395.estimator import estimate as E
from issue395.estimator import fits as F
from issue395.estimator.releases import release_source
from issue395.model.registry import config_json
from issue395.record import LORA_R
from issue395.text import gb

MISTRAL = config_json("mistral-7b")


def answer(card, e, context=None, targets=None, lora_r=LORA_R, stream=None, run=None, **kw):
    """One card's answer for Mistral-7B's arm at ``e``'s figures, its adapter, modes and settings as keywords."""
    from issue395.model.arm import Adapter, Arm, Settings
    from issue395.model.streaming import Streaming

    arm = Arm("mistral-7b", e.seq, e.batch, quant=e.quant, adapter=Adapter(targets, lora_r),
              streaming=Streaming.of_training(stream or {}), settings=Settings(**(run or {})))
    (a,) = F.card_answers(MISTRAL, e, [C.budget(card, context)], arm, **kw)
    return a


def test_fits_exactly_when_needs_free_is_within_total_minus_context_and_the_runtimes_growth():
    e = E.estimate(MISTRAL, quant="nf4", seq=512)
    edge = C.Card("edge", e.needs_free + 10**9 + C.STEP_GROWTH_BYTES)
    assert answer(edge, e, context=10**9)["fits"] is True
    a = answer(edge, e, context=10**9 + 1)
    assert a["fits"] is False and a["free_bytes"] == a["total_bytes"] - a["context_bytes"]
    assert a["step_free_bytes"] == a["free_bytes"] - C.STEP_GROWTH_BYTES


def test_a_streamed_run_on_a_hopper_card_keeps_the_runtime_growths_bound_and_the_table_says_so():
    """The measured resident growth (cards.RESIDENT_STEP_GROWTH_BYTES) is a resident run's: a streamed run on an
    H100 is charged the bound, the most measured on streamed arms, and its table's row names it."""
    e = E.estimate(MISTRAL, quant="nf4", seq=512)
    a = answer(C.CARDS["h100"], e)
    assert (a["growth_bytes"], a["growth_source"]) == (C.STEP_GROWTH_BYTES, C.GROWTH_BOUND)
    assert a["step_free_bytes"] == a["free_bytes"] - C.STEP_GROWTH_BYTES
    table = F.estimate_table([e], [C.CARDS["h100"]], MISTRAL, answers=[[a]])
    assert f"  runtime growth GB (by the step's end; {C.GROWTH_BOUND})" in table


def test_soups_gate_is_answered_on_the_free_memory_it_reads_after_the_modules_load():
    """`soup train`'s gate reads the free memory less what the CLI's runtime has loaded by then (the
    free memory it printed on every --find-max probe): its answer here is on that smaller figure."""
    e = E.estimate(MISTRAL, quant="nf4", seq=512)
    card = C.Card("edge", e.soup_predicted + C.CLI_GATE_GROWTH_BYTES)
    assert answer(card, e, context=0)["soup_admits"] is True
    assert answer(card, e, context=1)["soup_admits"] is False


def test_soup_admits_a_run_that_will_oom_where_its_number_is_under_needs_free():
    e = E.estimate(MISTRAL, quant="nf4", seq=512)
    assert e.soup_predicted < e.needs_free  # the miss the cap runs showed (README)
    between = C.Card("between", (e.soup_predicted + e.needs_free) // 2)
    a = answer(between, e, context=0)
    assert (a["soup_admits"], a["fits"], a["disagreement"]) == (True, False, F.ADMITS_OOM)


@pytest.mark.skipif(release_source("0.73.3") is None, reason="soup-cli 0.73.3's own code is not here (its venv runs it)")
def test_on_23gb_soup_refuses_runs_that_would_fit():
    e = E.estimate(MISTRAL, quant="nf4", seq=32256, release="0.73.3")
    a = answer(C.parse_card("23GB"), e, context=0)
    assert (a["fits"], a["soup_admits"], a["disagreement"]) == (True, False, F.REFUSES)
    assert a["longest_seq"] == 32256 > a["longest_seq_soup_admits"]
    assert "Soup refuses" in F.seq_direction(a)


def test_both_longest_seqs_are_the_last_multiple_of_64_each_rule_admits():
    from issue395.model.arm import Arm

    free = 20 * 10**9
    kw = dict(quant="nf4", batch=1)
    arm = Arm("mistral-7b", 64, **kw)  # its seq is the axis searched
    fit, soup = F.longest_seq(MISTRAL, free, arm), F.longest_seq_soup_admits(MISTRAL, free, arm)
    assert E.estimate(MISTRAL, seq=fit, **kw).needs_free <= free < E.estimate(MISTRAL, seq=fit + 64, **kw).needs_free
    assert (E.estimate(MISTRAL, seq=soup, **kw).soup_predicted <= free
            < E.estimate(MISTRAL, seq=soup + 64, **kw).soup_predicted)


def test_a_workspace_config_above_32mib_raises_needs_free_on_that_card_only():
    e = E.estimate(MISTRAL, quant="nf4", seq=512)
    plain = answer(C.parse_card("A10G"), e)
    big = answer(C.parse_card("A10G"), e, env=":4096:16")
    assert big["needs_free"] > plain["needs_free"] == e.needs_free
    assert big["cublas_workspace_bytes"] == 64 * 2**20


def test_the_reserve_row_is_the_cards_own_estimates_reserve_not_the_workspace_it_adds():
    """The table's "allocator's reserve" row is needs free less the split peak of the same estimate: on a card whose
    cuBLAS workspace config raises needs free, the split peak rises with it and the reserve stays the allocator's,
    where needs free less the card-agnostic split peak would count the workspaces' growth in it."""
    e = E.estimate(MISTRAL, quant="nf4", seq=512)
    big = answer(C.parse_card("A10G"), e, env=":4096:16")
    assert big["reserve_bytes"] == e.needs_free - e.split_allocated == answer(C.parse_card("A10G"), e)["reserve_bytes"]
    assert big["needs_free"] > e.needs_free
    table = F.estimate_table([e], [C.parse_card("A10G")], MISTRAL, answers=[[big]])
    row = next(line for line in table.splitlines() if "allocator's reserve GB" in line)
    assert row.split()[-1] == gb(big["reserve_bytes"])


def test_the_json_carries_every_card_for_every_arm(capfd, tmp_path):
    out = tmp_path / "e.json"
    code, text, err = main(capfd, ["--estimate", "--model", "mistral-7b", "--quant", "nf4", "--seq", "512,32768",
                                   "--card", "RTX4090,24GB", "--context", "0.5", "--json", out])
    assert code == 0, err
    for row in json.loads(out.read_text())["rows"]:
        assert [c["card"] for c in row["cards"]] == ["RTX4090", "24GB"]
        for c in row["cards"]:
            assert {"card", "total_bytes", "context_bytes", "free_bytes", "needs_free", "fits", "longest_seq",
                    "soup_admits", "longest_seq_soup_admits"} <= set(c)
            assert c["context_bytes"] == 500_000_000 and c["free_bytes"] == c["total_bytes"] - c["context_bytes"]
    for words in ("RTX4090: total GB", "  context GB (given)", "  free GB (total - context)",
                  "  longest seq that fits", "  Soup's gate admits it", "  longest seq Soup's gate admits",
                  F.REFUSES):
        assert words in text


def test_context_without_a_card_is_one_line(capfd):
    code, _, err = main(capfd, ["--estimate", "--model", "smol", "--seq", "512", "--context", "0.5"])
    assert code == 2 and "--context" in err and len(err.strip().splitlines()) == 1


def test_a_wide_grid_is_one_row_per_arm_and_its_lines_stay_under_160_characters(capfd):
    """Issue 22, usability: a column per (quant, seq, batch) ran off the terminal past 6 arms."""
    from conftest import main

    code, out, err = main(capfd, ["--estimate", "--model", "llama31-8b", "--seq", "512,1024,2048,4096",
                                  "--quant", "none,nf4", "--card", "24GB,A10G,RTX4090"])
    assert code == 0, err
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("arm "))
    table = lines[start:start + 2 + 8]
    assert all(len(ln) < 160 for ln in table), max(map(len, table))
    assert [ln.split()[:2] for ln in table[2:]] == [[q, f"{s}x1"] for q in ("none", "nf4")
                                                    for s in (512, 1024, 2048, 4096)]
    code, out, _ = main(capfd, ["--estimate", "--model", "llama31-8b", "--seq", "512,1024,2048", "--quant", "none,nf4"])
    assert "none 512x1" in out.splitlines()[2]  # six arms: still a column each (under the verdict, the header)


def test_the_readmes_does_it_fit_example_is_what_estimate_prints(capfd, tmp_path, monkeypatch):
    """The README's soup.yaml through --estimate --config prints the README's fit rows, line for
    line (the README is the first thing a user reads: a figure there the tool no longer prints
    is one it did not obtain). Checked where the installed soup-cli is the release the README ran."""
    from conftest import ROOT

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    yaml_block = readme.split("```yaml\n", 1)[1].split("```", 1)[0]
    shown = readme.split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    (tmp_path / "soup.yaml").write_text(yaml_block, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    code, out, _ = main(capfd, ["--estimate", "--config", "soup.yaml", "--card", "T4"])
    assert code == 0
    from issue395.estimator.releases import installed_release

    lines = out.splitlines()
    head = next(s for s in shown if s.startswith("soup-cli"))  # the table's head, below the verdict
    if f"soup-cli {installed_release()}," not in head:  # Soup's own number moves between releases
        pytest.skip(f"the README shows the pinned release's output ({head.split(',')[0]})")
    missing = [s for s in shown if s.rstrip() not in (ln.rstrip() for ln in lines)]
    assert not missing, missing


def test_the_readmes_dpo_example_is_what_estimate_prints(capfd, tmp_path, monkeypatch):
    """The README's second soup.yaml (task: dpo) through --estimate --config prints the README's
    verdict lines, line for line: Soup admits a run that will OOM, on the card its command names. Checked
    where the installed soup-cli is the release its command names (the corrected peak moves by release)."""
    from conftest import ROOT

    from issue395.estimator.releases import installed_release

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    yaml_block = readme.split("```yaml\n")[2].split("```", 1)[0]
    command = next(b for b in readme.split("```bash\n")[1:] if "soup-dpo.yaml" in b.split("```", 1)[0]
                   ).split("```", 1)[0].split()
    shown = readme.split("```text\n")[2].split("```", 1)[0].splitlines()
    assert "task: dpo" in yaml_block and "--card" in command
    named = command[command.index("soup-cli") + 1] if "soup-cli" in command else None
    if named is not None and named != installed_release():
        pytest.skip(f"the README shows soup-cli {named}'s output")
    (tmp_path / "soup-dpo.yaml").write_text(yaml_block, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    code, out, _ = main(capfd, ["--estimate", "--config", "soup-dpo.yaml", "--card", command[command.index("--card") + 1]])
    assert code == 0
    lines = [ln.rstrip() for ln in out.splitlines()]
    missing = [s for s in shown if s.rstrip() not in lines]
    assert not missing, missing
    assert "Soup admits a run that will OOM" in "\n".join(shown)


ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_all_linear_gates_on_soups_own_count_and_the_corrected_peak_keeps_the_real_adapter():
    """Soup's _estimate_adapter_params counts a string target (all-linear, auto) as 4 modules, both
    releases; its gate reads that number. Before: the seven resolved modules reached Soup's number too
    (r 64, Mistral-7B: +805 MB), so on a card between the two the verdict was 'Soup refuses'."""
    kw = dict(quant="nf4", seq=1024, lora_r=64)
    spelled = E.estimate(MISTRAL, targets="all-linear", **kw)
    named = E.estimate(MISTRAL, targets=ALL_LINEAR, **kw)
    four = E.estimate(MISTRAL, targets=ALL_LINEAR[:4], **kw)
    assert spelled.soup_terms["adapter_params"] == four.soup_terms["adapter_params"] < named.soup_terms["adapter_params"]
    assert spelled.terms == named.terms and spelled.corrected_predicted == named.corrected_predicted
    between = C.Card("between", (spelled.soup_predicted + named.soup_predicted) // 2 + C.GATE_GROWTH_BYTES)
    assert answer(between, spelled, context=0, targets="all-linear", lora_r=64)["soup_admits"] is True
    assert answer(between, named, context=0, targets=ALL_LINEAR, lora_r=64)["soup_admits"] is False


def test_estimate_targets_all_linear_on_the_command_line_is_soups_count(capfd, tmp_path):
    out = tmp_path / "e.json"
    code, _, err = main(capfd, ["--estimate", "--model", "mistral-7b", "--quant", "nf4", "--seq", "1024",
                                "--targets", "all-linear", "--lora-r", "64", "--json", out])
    assert code == 0, err
    data = json.loads(out.read_text())
    want = E.estimate(MISTRAL, quant="nf4", seq=1024, lora_r=64, targets="all-linear")
    assert data["targets"] == list(ALL_LINEAR) and data["soup_targets"] == "all-linear"
    assert data["rows"][0]["soup_predicted"] == want.soup_predicted


# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


def test_a_context_the_card_holds_still_answers(capfd, tmp_path):
    """Issue 29 item 9: a --context the card holds is charged (its bytes in the JSON) and still leaves a
    positive step-free figure."""
    data, _ = estimate_config_json(capfd, tmp_path, readme_yaml(tmp_path), "--card", "T4", "--context", "2")
    (card,) = data["rows"][0]["cards"]
    assert card["context_bytes"] == 2 * 10**9 and card["step_free_bytes"] > 0


def test_a_card_no_seq_fits_on_says_so_not_oom_past_none():
    """Issue 29 item 12: where no seq fits the card, the seq direction says 'no seq' and names Soup's own
    longest, never 'past none'."""
    from issue395.estimator.fits import seq_direction

    text = seq_direction({"longest_seq": None, "longest_seq_soup_admits": 4096})
    assert "past none" not in text and "4096" in text and "no seq" in text, text


def test_soup_refusing_every_seq_says_so_not_past_none():
    """Issue 29 item 12: where Soup's gate refuses every seq, the seq direction says 'every seq', never 'past
    none'."""
    from issue395.estimator.fits import seq_direction

    text = seq_direction({"longest_seq": 2048, "longest_seq_soup_admits": None})
    assert "past none" not in text and "every seq" in text, text


def test_the_probe_refuses_past_four_times_the_free_memory_without_measuring(capfd, tmp_path):
    """Issue 29 item 4: Soup's measured-probe gate admits by the one step against the free memory, and refuses
    without measuring past four times the free memory."""
    from issue395.estimator.fits import Gate

    gate = Gate(probe=True)
    assert gate.admits(soup_predicted=3 * 10**9, one_step_allocated=10**9, available=10**9)
    assert not gate.admits(soup_predicted=5 * 10**9, one_step_allocated=10**9, available=10**9)


@pytest.mark.parametrize("model, card", [("phi3-mini", "T4"), ("smol", "H200"), ("qwen", "A100-80GB")])
def test_a_longest_seq_that_is_the_models_positions_says_so(capfd, model, card):
    """Issue 36 item 4: where the longest seq that fits is the model's max positions, not memory, the verdict
    says 'max positions'."""
    code, out, err = main(capfd, ["--estimate", "--model", model, "--seq", "1024", "--card", card])
    assert code == 0, err
    (line,) = verdicts(out)
    assert "max positions" in line, line


def test_a_longest_seq_memory_stops_says_no_positions(capfd):
    """Issue 36 item 4: where memory stops the longest seq, the verdict does not say 'max positions'."""
    code, out, err = main(capfd, ["--estimate", "--model", "mistral-7b", "--quant", "nf4", "--seq", "1024",
                                  "--card", "T4"])
    assert code == 0, err
    (line,) = verdicts(out)
    assert "max positions" not in line, line


@pytest.mark.parametrize("card", ["0.5GB", "1GB", "1GiB"])
def test_a_card_with_no_room_is_one_clear_line_never_a_negative_free_figure(capfd, card):
    """Issue 36 item 13: a card with no room is one 'no room' verdict and no negative figure anywhere in the
    output."""
    code, out, err = main(capfd, ["--estimate", "--model", "smol", "--seq", "512", "--card", f"{card},H200",
                                  "--verbose"])
    assert code == 0, err
    (line,) = [ln for ln in verdicts(out) if ln.startswith(card)]
    assert "no room" in line and "-0." not in line, line
    assert not re.search(r"\s-\d+\.\d+", out), out  # no negative figure anywhere in the table either


def test_a_cards_context_cell_is_what_the_legend_says_it_is(capfd):
    """Issue 36 item 13: each card's context cell is labelled as the legend names it (the H200's is not the
    bound)."""
    code, out, err = main(capfd, ["--estimate", "--model", "smol", "--seq", "512", "--card", "H200,T4",
                                  "--verbose"])
    assert code == 0, err
    for card in ("H200", "T4"):
        i = out.splitlines().index(next(ln for ln in out.splitlines() if ln.startswith(f"{card}: total GB")))
        label, value = re.match(r"\s+context GB \((.+)\)\s+(\S+)$", out.splitlines()[i + 1]).groups()
        # the legend names this label and the figure it stands for on this card
        (legend,) = [ln for ln in out.splitlines() if ln.startswith("fits: ")]
        assert f"'{label}'" in legend, (label, legend)
        if card == "H200":
            assert label != "bound" and value != "0.8500"
            assert f"{card} " in legend or "H200" in legend, legend


@pytest.mark.parametrize("model", ["deepseek-v3", "kimi-k2", "mistral-7b"])
def test_the_host_ram_the_streamed_store_needs_is_beside_the_verdict(capfd, model):
    """Issue 36 item 13: the host RAM the streamed store needs is the line under the card's verdict, of the
    config's own depth."""
    from issue395.measure.shapes import soup_has_stream_modes

    if model != "mistral-7b" and not soup_has_stream_modes():
        pytest.skip("soup-cli 0.73.3 does not stream deepseek_v3")
    code, out, err = main(capfd, ["--estimate", "--model", model, "--quant", "nf4", "--seq", "512", "--card", "H100"])
    assert code == 0, err
    lines = out.splitlines()
    (i,) = [k for k, ln in enumerate(lines) if ln.startswith("  H100: ")]
    assert "host RAM" in lines[i + 1] and "GB" in lines[i + 1], lines[i + 1]
    gbs = float(re.search(r"store[^0-9]*([0-9.]+) GB", lines[i + 1]).group(1))
    assert (gbs > 20) == (model != "mistral-7b"), lines[i + 1]  # the store of the config's own depth (4 of 61 layers here)
    assert not any(ln.startswith("note: not estimated: host RAM") for ln in lines)
README_SOUP = ("base: mistralai/Mistral-7B-v0.3\ndata: {{train: data.jsonl, max_length: {seq}}}\ntraining: {{batch_size: 1, "
               "quantization: 4bit, stream_layers: true, lora: {{r: 8, alpha: 16, target_modules: [q_proj, v_proj]}}}}\n")


@pytest.mark.parametrize("seq, card, code, words", [
    (2048, "T4", 0, ["fits on T4, and Soup's gate admits it there", "--exit-code 0"]),
    (2048, "3.3GB", 1, ["does NOT fit on 3.3GB (needs ", "--exit-code 1"]),
    (2048, "3.3GB,T4", 1, ["does NOT fit on 3.3GB (needs ", "fits on T4, and Soup's gate admits it there"]),
    (19584, "T4", 3, ["fits on T4, but Soup's gate refuses it there", "--exit-code 3"]),
])
def test_the_verdict_is_the_first_line_and_says_what_the_exit_code_answers(capfd, tmp_path, seq, card, code, words):
    """Issue 53 item 13: line 1 was a 213-character header; it is now the verdict over every card (this tool's
    fit and Soup's gate), naming the exit code --exit-code gives, which it agrees with."""
    from conftest import main

    yaml = tmp_path / "soup.yaml"
    yaml.write_text(README_SOUP.format(seq=seq))
    got, out, err = main(capfd, ["--estimate", "--config", yaml, "--card", card, "--exit-code"])
    assert got == code, err
    first = out.splitlines()[0]
    # one readable line, though a release's disagreement words lengthen it (0.77.0: "a run that will OOM")
    assert first.startswith("verdict (this tool's estimate and Soup's own gate): ") and len(first) < 300, first
    for w in words:
        assert w in first, (w, first)
    assert out.splitlines()[1].startswith("--estimate: mistralai/Mistral-7B-v0.3, from --config ")


def test_without_a_card_the_first_line_is_what_it_needs_free(capfd):
    from conftest import main

    code, out, err = main(capfd, ["--estimate", "--model", "qwen", "--seq", "512,1024"])
    first = out.splitlines()[0]
    assert code == 0 and first.startswith("verdict: needs ") and "at sft none 1024x1" in first, first


def test_every_card_line_carries_its_arms_tag_and_says_fits_as_does_not_fit_does(capfd):
    """Issue 53 item 11: SFT lines had no task/quant/shape tag where DPO lines did, and "fits (4.70 of 14.99 GB
    free)" stood beside "does NOT fit (needs 27.55 GB, ...)": every line is `CARD: TASK QUANT SEQxBATCH:` and
    both verdicts read (needs X GB, Y GB free)."""
    from conftest import main

    code, out, err = main(capfd, ["--estimate", "--model", "qwen", "--seq", "512,16384", "--task", "sft,dpo",
                                  "--card", "T4"])
    cards = [ln.strip() for ln in out.splitlines() if ln.startswith("  T4: ")]
    assert [ln.split(":")[1].strip() for ln in cards] == ["sft none 512x1", "sft none 16384x1", "dpo none 512x1",
                                                           "dpo none 16384x1"], cards
    assert any("does NOT fit (needs " in ln for ln in cards) and any(": fits (needs " in ln for ln in cards)
    assert all(" GB free)" in ln for ln in cards)


# Issue 51 item 4: --find-max's first probe on a resident soup.yaml is the corrected resident estimate's longest.

@pytest.mark.parametrize("axis, kw, step", [("seq", {"batch": 1}, 64), ("batch", {"seq": 1024}, 1)])
def test_the_longest_resident_value_fits_and_one_step_more_does_not(axis, kw, step):
    """On a 12 GB budget, Llama-3.2-1B resident: estimate_resident's needs-free at the answer fits, one step more
    does not (the search over the estimator, not its terms)."""
    from issue395.estimator.resident import estimate_resident

    from issue395.model.arm import Arm

    config, free = config_json("llama32-1b"), 12_000_000_000
    arm = Arm.at("llama32-1b+resident", **{"seq": 64, "batch": 1, **kw})
    got, why = F.longest_resident(axis, config, free, arm)
    assert why is None and got is not None and got > step
    assert estimate_resident(config, **{**kw, axis: got}).needs_free <= free
    assert estimate_resident(config, **{**kw, axis: got + step}).needs_free > free
    assert F.longest_resident(axis, config, 10**9, arm) == (None, None)  # not even the smallest fits 1 GB


def test_a_resident_run_the_estimator_does_not_model_has_no_longest_and_says_why():
    """Qwen3.5 resident without checkpointing is refused whole; Gemma-3-1B without checkpointing is modelled only
    below its 512-token window, so on a card where that fits the answer is none, and why; with checkpointing it
    answers."""
    from issue395.model.arm import Arm

    got, why = F.longest_resident("seq", config_json("qwen3.5"), 80 * 10**9, Arm.at("qwen3.5+resident", 64))
    assert got is None and why.startswith("a resident qwen3_5_text run without gradient checkpointing is not yet "
                                          "modelled by this estimator")
    gemma = config_json("gemma3-1b")
    got, why = F.longest_resident("seq", gemma, 80 * 10**9, Arm.at("gemma3-1b+resident", 64))
    assert got is None and why.startswith("it fits up to seq 448 and is not modelled past it: a resident gemma3_text "
                                          "run past its sliding window (512)")
    assert F.longest_resident("seq", gemma, 80 * 10**9, Arm.at("gemma3-1b+resident+gc", 64))[0] > 512


def test_the_fit_answers_take_the_arm_its_settings_and_adapter_move_the_longest():
    """Issue 50 item 2 (house5c): the fit answers (longest, longest_soup_admits, card_answers) take the typed Arm and
    answer its whole run: a --config file's gradient accumulation and a wider adapter shorten the longest seq that
    fits on a card, and card_answers' longest is ``longest``'s for that Arm (one entry, not a keyword list)."""
    from dataclasses import replace

    from issue395.estimator.resident import estimate_run
    from issue395.model.arm import Adapter, Arm, Settings

    plain = Arm("mistral-7b", 512, quant="nf4")
    held = replace(plain, settings=Settings(accumulation=4), steps=2)
    wide = replace(plain, adapter=Adapter(("q_proj", "k_proj", "v_proj", "o_proj"), 64))
    free = 20 * 10**9
    base = F.longest("seq", MISTRAL, free, plain)
    assert F.longest("seq", MISTRAL, free, held) < base and F.longest("seq", MISTRAL, free, wide) < base
    card = C.Card("20", free + C.STEP_GROWTH_BYTES)
    for arm in (plain, held, wide):
        (a,) = F.card_answers(MISTRAL, estimate_run(arm, MISTRAL), [C.budget(card, 0)], arm)
        assert a["longest_seq"] == F.longest("seq", MISTRAL, free, arm)


def test_the_probe_gate_answers_the_one_step_it_measures_whatever_the_runs_optimizer():
    """Issue 50 item 2 (house5c): under training.stream_vram_probe Soup's gate reads one measured step, before any
    optimizer state (Gate.measured): its longest is the same for a two-step adamw_8bit run as for the one-step
    plain run, while the plain gate (Soup's number) is unmoved by either."""
    from dataclasses import replace

    from issue395.model.arm import Arm, Settings

    gate = F.Gate(probe=True)
    one = Arm("mistral-7b", 512, quant="nf4")
    run = replace(one, steps=2, settings=Settings(optimizer="adamw_8bit"))
    assert gate.measured(run) == replace(one, settings=Settings())
    free = 12 * 10**9
    assert (F.longest_soup_admits("seq", MISTRAL, free, run, gate)
            == F.longest_soup_admits("seq", MISTRAL, free, one, gate) is not None)
    assert F.longest_soup_admits("seq", MISTRAL, free, run) == F.longest_soup_admits("seq", MISTRAL, free, one)


def test_soups_probe_reads_a_one_step_estimates_forward_and_backward_not_its_optimizer_step():
    """Soup's stream_vram_probe (measure_step_peak_bytes) runs a forward and a backward, no optimizer step; a
    one-step estimate of a large adapter binds in its optimizer step (the states it makes), which the probe never
    sees: Gate.probed reads the forward and backward's peak. A small adapter's is its corrected peak."""
    from issue395.estimator.estimate import estimate_key
    from issue395.estimator.fits import Gate

    everything = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    large = estimate_key("mistral-7b", seq=256, lora_r=64, targets=everything, soup=False, release="0.77.0")
    small = estimate_key("mistral-7b", seq=256, soup=False, release="0.77.0")
    assert large.phase == "optimizer" and Gate(probe=True).probed(large) == large.forward_backward
    assert large.forward_backward < large.corrected_predicted - 10**9
    assert Gate(probe=True).probed(small) == small.corrected_predicted == small.forward_backward


def test_a_one_step_runs_split_peak_is_its_own_phases_binding_without_the_rests():
    """Expandable segments split every block, so the split peak binds over the terms less the remainders, which
    may be another phase than the corrected peak's: Mistral-7B NF4 r64 all-linear 2048x1, one step, binds in its
    optimizer step with its rests and in its layer phase without them; split_allocated is the latter (needs_free's
    allocated peak), never the optimizer step less its rests."""
    from issue395.estimator.estimate import ADAPTER_RESTS, estimate_key
    from issue395.estimator.terms import Phase

    everything = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    e = estimate_key("mistral-7b", quant="nf4", seq=2048, lora_r=64, targets=everything, soup=False,
                     release="0.77.0", transformers="5.16.1")
    rests = sum(e.terms.get(t.key, 0) for t in ADAPTER_RESTS if Phase.OPTIMIZER in t.phases)
    assert e.phase == "optimizer" and e.split_allocated == e.needs_free - e.reserve
    assert e.split_allocated > e.corrected_predicted - rests  # the optimizer step less its rests is not the split peak
