"""issue395.measure.margin: where an arm's margin goes: Soup's prediction split into its own terms by its
own term functions, the blocks live at the peak named by shape, the note that names the term that
misses, and the arms worth attributing. Real: Soup's estimator and term functions (soup_cli
imported), rows built by the harness's own constructor. FAKED: the measured peak and the allocator
attribution, written by hand where a CUDA snapshot would have produced them (none can be taken here).
"""

from __future__ import annotations

from conftest import SMOL, make_row

from issue395.results.extras import Gate
from issue395.measure.margin import estimator_terms, margin_arms, margin_breakdown, shape_classes
from issue395.report.tables import margins_table


def soup_kwargs(seq, batch=1):
    return dict(layer_bytes=SMOL.pool // 2, buffers=2, extras_bytes=SMOL.extras, adapter_params=552960,
                vocab_size=SMOL.vocab, hidden_size=SMOL.hidden, intermediate_size=SMOL.intermediate,
                n_layers=SMOL.n_layers, seq_len=seq, batch_size=batch, logits_bytes_per_element=14.0)


def test_estimator_terms_are_soups_own_terms_and_leave_only_its_small_slack():
    from soup_cli.utils.layer_stream import estimate_stream_peak_vram

    kw = soup_kwargs(2048)
    predicted = estimate_stream_peak_vram(**kw)
    terms = estimator_terms(kw, predicted)
    assert terms["weights"] == SMOL.pool + SMOL.extras
    assert terms["logits"] == 14 * 2048 * SMOL.vocab
    assert terms["activations"] == (2 * SMOL.n_layers * SMOL.hidden + 4 * (SMOL.hidden + SMOL.intermediate)) * 2048
    # what is left is Soup's fixed slack and the adapter's optimizer charge: small and positive
    assert 0 < terms["rest"] < 0.05 * predicted


def test_a_thin_margin_names_the_term_that_misses_and_by_how_much_per_token():
    from soup_cli.utils.layer_stream import estimate_stream_peak_vram

    kw = soup_kwargs(2048)
    own = estimate_stream_peak_vram(**kw)
    terms = estimator_terms(kw, own)
    extra = 100 * 2048  # activations 100 bytes per token beyond their charge
    classes = {"logits": terms["logits"], "activations": terms["activations"] + extra, "rest": 0}
    real = terms["weights"] + sum(classes.values())
    row = make_row(real_peak=real, soup_predicted=own, gate=Gate(kw),
                   attribution={"resident_at_peak": terms["weights"], "classes": classes, "complete": True})
    m = margin_breakdown(row)
    acts = next(t for t in m["terms"] if t["term"] == "activations")
    assert acts["missed"] == extra and acts["missed"] / acts["per"][0] == 100
    assert m["ratio"] < 1.05 and "activations term misses" in m["note"] and "100.00 bytes per token" in m["note"]
    assert "where the margin goes" in margins_table([m])


def test_a_margin_carries_the_sizes_of_the_blocks_live_at_its_peak_to_be_named_when_rendered():
    from soup_cli.utils.layer_stream import estimate_stream_peak_vram

    kw = soup_kwargs(2048)
    own = estimate_stream_peak_vram(**kw)
    blocks = [[4 * 2048 * SMOL.vocab, 3], [2 * 2048 * SMOL.hidden, 30]]
    attribution = {"resident_at_peak": own // 2, "classes": {}, "complete": True,
                   "physical": {"the rest": 1, "resident weights": own // 2}, "live_blocks": blocks}
    row = make_row(real_peak=own, soup_predicted=own, gate=Gate(kw), attribution=attribution)
    assert margin_breakdown(row)["live_blocks"] == blocks
    assert "live_blocks" not in margin_breakdown(make_row(real_peak=own, soup_predicted=own, gate=Gate(kw),
                                                          attribution=dict(attribution, live_blocks=None)))


def test_shape_classes_name_logits_attention_scores_and_activations():
    classify = shape_classes(SMOL, 2048, 1)
    e = 2048 * SMOL.vocab
    assert classify(2 * e) == classify(4 * e) == "logits"
    assert classify(9 * 2048 * 2048 * 2) == "activations"  # heads x seq^2, bf16
    assert classify(2048 * SMOL.intermediate * 2) == "activations"
    assert classify(12345) == "rest"


def test_the_arms_worth_attributing_are_each_familys_tightest_measured_arm_and_every_under():
    """Soup's own number over the peak is the margin: smol 4096's 1.1x is tighter than 2048's 1.5x; a
    row without Soup's number or without a peak is never picked; qwen's UNDER is picked beside its
    family's tightest (the same arm here), in grid order."""
    gb = 10**9
    rows = [make_row("smol", 2048, index=0, real_peak=gb, soup_predicted=int(1.5 * gb)),
            make_row("smol", 4096, index=1, real_peak=2 * gb, soup_predicted=int(2.2 * gb)),
            make_row("smol", 6144, index=2, real_peak=3 * gb),  # Soup's number not captured
            make_row("smol", 8192, index=3, failure="OOM", real_peak=None, soup_predicted=gb),
            make_row("qwen", 2048, index=4, real_peak=gb, soup_predicted=2 * gb),
            make_row("qwen", 4096, index=5, real_peak=2 * gb, soup_predicted=int(1.9 * gb))]
    assert rows[5].status == "UNDER" and rows[1].margin_ratio < rows[0].margin_ratio
    assert [(a.model, a.seq, a.index) for a in margin_arms(rows)] == [("smol", 4096, 1), ("qwen", 4096, 5)]
