"""issue395.results.extras: the typed records a row and a mode carry. Here Soup's resident gate (``ResidentGate``)
answering along an axis, as --find-max asks it of a resident soup.yaml (issue 51 item 4): Soup's own hardware_fit
code runs for real (on CPU; it needs no GPU)."""

from __future__ import annotations

import pytest

from issue395.results.extras import ResidentGate

#: the input Soup's CLI builds for a 1B LoRA run at 2048 tokens (commands/train.py, _build_hardware_fit_input)
INPUT = dict(params_b=1.0, seq_len=2048, batch_size=1, optimizer="adamw_torch", quant="none", peft="lora",
             gradient_checkpointing=False)


@pytest.mark.parametrize("axis, field, step, top", [("seq", "seq_len", 64, 131072), ("batch", "batch_size", 1, 1024)])
def test_soups_resident_gates_longest_is_admitted_by_soups_own_verdict_and_one_step_more_is_refused(
        axis, field, step, top):
    """The longest a 6 GB card's gate admits: Soup's decide_hardware_fit admits it and refuses one step more, the
    input otherwise the file's (only the axis's field changed, as Soup's CLI copies it from the file)."""
    from soup_cli.utils.hardware_fit import HardwareFitInput, decide_hardware_fit

    got = ResidentGate.longest(INPUT, axis, 6_000_000_000, step, step, top)
    admits = lambda v: decide_hardware_fit(HardwareFitInput(**dict(INPUT, **{field: v})),  # noqa: E731
                                           available_vram_gb=6.0).ok
    assert got is not None and step < got < top and admits(got) and not admits(got + step)
    at = ResidentGate.at(INPUT, axis, got, 6_000_000_000)
    assert at.input == dict(INPUT, **{field: got}) and at.admits is True and at.card_total == 6_000_000_000


def test_no_longest_where_soup_admits_not_even_the_smallest_or_its_cli_builds_no_input():
    """A 1 GB card: Soup's gate refuses seq 64 already. No input (Soup's CLI skips its gate): no answer, no verdict."""
    assert ResidentGate.longest(INPUT, "seq", 1_000_000_000, 64, 64, 131072) is None
    assert ResidentGate.longest(None, "seq", 80_000_000_000, 64, 64, 131072) is None
    assert ResidentGate.at(None, "seq", 1024, 80_000_000_000) == ResidentGate() and ResidentGate().admitted
