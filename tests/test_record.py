"""issue395.record: what the record holds (its grid and the map's, the protocol's constants,
every published figure), against docs/PROTOCOL.md's figures typed in independently (conftest's
PUBLISHED). Plain data: nothing runs, nothing is faked. The Row that carries these figures is
test_row's, the arms planned from the grid test_grid's.
"""

from __future__ import annotations

from conftest import PUBLISHED, RECORD_ARMS, SMOL

from issue395.constants import GB
from issue395.record import (
    DATA_ROWS,
    GRID_ADAPTER_FACTOR,
    LORA_ALPHA,
    LORA_R,
    LORA_TARGETS,
    MAP_BATCHES,
    MAP_SEQS,
    OVERSHOOT,
    QUANTS,
    RECORD_A10G_OVERESTIMATE,
    RECORD_A10G_PEAK,
    RECORD_A10G_PREDICTED,
    RECORD_DETERMINISM,
    RECORD_GRID,
    RECORD_RTX3050,
    SOUP_QUANT,
)
from issue395.results.schema import SCHEMA


# --- the record as data ------------------------------------------------------------

def test_the_grid_and_published_figures_are_the_protocols():
    assert RECORD_GRID == {"smol": (2048, 3072, 4096, 4352, 5120, 6144),
                             "qwen": (2048, 4096, 5120, 6144)}
    assert [(k, s) for k, seqs in RECORD_GRID.items() for s in seqs] == RECORD_ARMS
    assert RECORD_A10G_PREDICTED == {k: (p, r) for k, (p, _, r) in PUBLISHED.items()}
    assert {k: round(v / 1e9, 4) for k, v in RECORD_A10G_PEAK.items()} == \
        {k: real for k, (_, real, _) in PUBLISHED.items()}
    assert RECORD_A10G_OVERESTIMATE == {"mean": 1.152, "pstdev": 0.0249}


def test_each_published_ratio_is_its_predicted_over_its_real_peak():
    for arm, (predicted_gb, ratio) in RECORD_A10G_PREDICTED.items():
        assert round(predicted_gb * GB / RECORD_A10G_PEAK[arm], 3) == ratio, arm


def test_the_other_published_runs_lie_on_the_grid_and_repeat_the_a10g_peaks():
    assert all(seq in RECORD_GRID[model] for model, seq in RECORD_RTX3050)
    for arm, (first, second, spread_pct) in RECORD_DETERMINISM.items():
        assert first == RECORD_A10G_PEAK[arm] / GB  # the first run is the grid's peak
        assert round((max(first, second) / min(first, second) - 1) * 100, 2) == spread_pct


def test_the_protocols_constants():
    assert (LORA_R, LORA_ALPHA, LORA_TARGETS) == (8, 16, ("q_proj", "v_proj"))
    assert (DATA_ROWS, OVERSHOOT, GB, SCHEMA) == (4, 3, 1e9, 3)
    assert SOUP_QUANT == {"none": "none", "nf4": "4bit"}


def test_the_grids_adapter_count_is_twice_loras_a_and_b_on_q_and_v():
    """PROTOCOL: SmolLM2's 921,600 = 2 x 460,800, r 8 on q_proj (576 -> 576) and v_proj
    (576 -> 3 kv heads x 64) in each of its 30 layers."""
    per_layer = LORA_R * ((576 + 576) + (576 + 3 * 64))
    assert GRID_ADAPTER_FACTOR * 30 * per_layer == SMOL.grid_adapter == 921_600


def test_the_map_grid_reaches_below_the_records_and_every_quantization_has_a_soup_spelling():
    assert MAP_SEQS == tuple(sorted(MAP_SEQS)) and MAP_SEQS[:2] == (512, 1024)
    assert MAP_SEQS[1] < min(min(seqs) for seqs in RECORD_GRID.values())  # where NF4's misses live
    assert MAP_BATCHES == (1, 4)
    assert set(QUANTS) == set(SOUP_QUANT)


