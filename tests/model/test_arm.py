"""issue395.model.arm: an arm of the grid, and Soup's prediction for it.

Every prediction is Soup's real estimator (soup_cli, whichever release is installed) fed the
record's shapes; the published figures it must reproduce are the record's (record.py, pinned
against the protocol in test_record). No GPU is needed and nothing is faked.
"""

from __future__ import annotations

import dataclasses
from importlib import metadata

import pytest
from conftest import SMOL, make_row

from issue395.model.arm import Arm, logits_charge, predicted_bytes
from issue395.record import RECORD_A10G_PREDICTED, RECORD_GRID
from issue395.model.registry import SHAPES

RECORD_ARMS = [(k, s) for k, seqs in RECORD_GRID.items() for s in seqs]


def test_an_arm_defaults_to_batch_1_bf16_at_the_grids_first_position_and_is_frozen():
    arm = Arm("smol", 2048)
    assert arm == Arm("smol", 2048, 1, 0, "none")
    assert len({arm, Arm("smol", 2048, 1, 0, "none"), Arm("smol", 2048, 1, 0, "nf4")}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        arm.seq = 4096  # type: ignore[misc]


# --- the prediction: Soup's estimator ------------------------------------------------

@pytest.mark.parametrize("key,seq", RECORD_ARMS)
def test_predicted_bytes_is_soups_estimator_with_protocol_arguments(key, seq):
    from soup_cli.utils.layer_stream import estimate_stream_peak_vram

    s = SHAPES[key]
    direct = estimate_stream_peak_vram(
        layer_bytes=s.pool // 2, buffers=2, extras_bytes=s.extras,
        adapter_params=s.grid_adapter, vocab_size=s.vocab, hidden_size=s.hidden,
        intermediate_size=s.intermediate, n_layers=s.n_layers, seq_len=seq, batch_size=1)
    pred = predicted_bytes(s, seq)
    assert pred == int(direct)
    assert round(pred / 1e9, 3) == RECORD_A10G_PREDICTED[(key, seq)][0]  # smol 2048: 1.596 GB
    assert make_row(key, seq).predicted == pred  # the row carries exactly Soup's figure


def test_smollm2_seq_2048_prediction_is_the_protocols_exact_bytes():
    pred = predicted_bytes(SMOL, 2048)
    version = metadata.version("soup-cli")
    if version != "0.73.3" and pred != 1596396768:
        pytest.skip(f"PROTOCOL's exact figure is for soup-cli 0.73.3; installed {version} "
                    f"gives {pred}")
    assert pred == 1596396768


def test_predicted_bytes_grows_with_batch():
    assert predicted_bytes(SMOL, 4096, 2) > predicted_bytes(SMOL, 4096, 1)
    assert make_row("smol", 4096, batch=2).predicted == predicted_bytes(SMOL, 4096, 2)


@pytest.mark.parametrize("key,seq,batch", [("smol", 2048, 1), ("qwen", 6144, 1), ("smol", 4096, 3)])
def test_logits_charge_is_soups_14_bytes_and_its_loss_holds_12(key, seq, batch):
    from soup_cli.utils.layer_stream import LOGITS_BYTES_PER_ELEMENT, LOGITS_LOSS_BYTES_PER_ELEMENT

    elements = seq * SHAPES[key].vocab * batch
    assert (LOGITS_BYTES_PER_ELEMENT, LOGITS_LOSS_BYTES_PER_ELEMENT) == (14, 12)
    assert logits_charge(SHAPES[key], seq, batch) == (14 * elements, 12.0)
    row = make_row(key, seq, batch=batch)
    assert row.elements == elements
    assert row.logits14 == 14 * elements
    assert row.nonlogits_modelled == row.predicted - 14 * elements
