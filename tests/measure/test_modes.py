"""issue395.measure.modes: --measure and --sdpa. On a dry run no probe runs; the constants are read from
the installed Soup, not copied."""

from __future__ import annotations

from issue395.measure.modes import measure_mode, sdpa_mode
from issue395.record import MEASURE_VOCABS, SDPA_BACKENDS, SDPA_SEQS


def test_a_dry_measure_reports_soups_shipped_constants_and_runs_no_probe():
    from soup_cli.utils import layer_stream

    m = measure_mode(dry_run=True)
    assert m["constants"] == {"LOGITS_BYTES_PER_ELEMENT": layer_stream.LOGITS_BYTES_PER_ELEMENT,
                              "LOGITS_LOSS_BYTES_PER_ELEMENT": layer_stream.LOGITS_LOSS_BYTES_PER_ELEMENT}
    assert m["constants"]["LOGITS_BYTES_PER_ELEMENT"] == 14  # docs: Soup's 14 bytes per logits element
    assert m["repeats"] == ["n/a (dry run)"] * 3 and m["spread"] == "-"
    assert list(m["by_vocab"]) == list(MEASURE_VOCABS)
    assert set(m["by_vocab"].values()) == {"n/a (dry run)"}


def test_a_dry_sdpa_names_every_backend_and_seq_and_measures_nothing():
    s = sdpa_mode(dry_run=True)
    assert s["seqs"] == list(SDPA_SEQS)
    assert list(s["extra_mb"]) == list(SDPA_BACKENDS)
    assert all(v == ["n/a (dry run)"] * len(SDPA_SEQS) for v in s["extra_mb"].values())
