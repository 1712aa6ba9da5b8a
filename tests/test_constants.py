"""issue395.constants: the facts the measurement and the estimator share are the ones torch's
caching allocator uses (read from the installed torch's own header), and the size bounds on a
config sit above every real model and are one bound for both paths. Nothing is faked: the real
header, the registry's public configs, the measured path's and the estimator's own checks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from issue395.constants import (CONFIG_LIMITS, K_MIN_BLOCK_SIZE, K_MIN_LARGE_ALLOC, K_ROUND_LARGE, K_SMALL_SIZE,
                                block_bytes)


def test_block_bytes_rounds_up_to_512():
    assert block_bytes(1) == 512
    assert block_bytes(0) == 512
    assert block_bytes(512) == 512
    assert block_bytes(513) == 1024
    assert block_bytes(2002) == 2048  # a bf16 logits tensor of 1001 elements
    assert block_bytes(4004) == 4096  # its fp32 upcast


def test_allocator_constants_match_the_installed_torch_headers():
    hdr = next(Path(importlib.util.find_spec("torch").submodule_search_locations[0]).glob(
        "include/c10/core/AllocatorConfig.h"), None)
    if hdr is None:
        pytest.skip("torch headers not installed")
    text = hdr.read_text()
    for name, value in (("kMinBlockSize", K_MIN_BLOCK_SIZE), ("kSmallSize", K_SMALL_SIZE),
                        ("kMinLargeAlloc", K_MIN_LARGE_ALLOC), ("kRoundLarge", K_ROUND_LARGE)):
        assert f"constexpr size_t {name} = {value};" in text


def test_every_registered_family_sits_within_the_config_bounds():
    """The bounds are past every real model: each family's public config is inside them."""
    from issue395.model.registry import FAMILIES, config_json

    for key in FAMILIES:
        config = config_json(key)
        for name, bound in CONFIG_LIMITS.items():
            assert config.get(name) is None or 1 <= config[name] <= bound, (key, name, config[name])


#: A small llama config.json: every size well inside the bounds.
SMALL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}


@pytest.mark.parametrize("name", sorted(CONFIG_LIMITS))
def test_the_measured_path_and_the_estimator_refuse_a_config_at_the_same_bound(name):
    """One past the bound both refuse it, naming the field; at the bound neither refuses that field
    (the estimator may still refuse another, e.g. a head_dim no model has)."""
    from issue395.estimator.arch import arch_from_config
    from issue395.errors import UsageError
    from issue395.measure.shapes import size_problem

    bound = CONFIG_LIMITS[name]
    assert size_problem(name, bound) is None and name in size_problem(name, bound + 1)
    with pytest.raises(UsageError, match=f"config {name} is {bound + 1}"):
        arch_from_config(dict(SMALL, **{name: bound + 1}))
    try:
        arch_from_config(dict(SMALL, **{name: bound}))
    except UsageError as exc:
        assert f"config {name} " not in str(exc)


def test_a_large_pool_request_may_keep_up_to_one_mib_past_it_and_a_small_pool_one_nothing():
    """Issue 52 item 1: the default allocator's should_split keeps a large-pool block whole when its rest is
    kSmallSize or less, so a request over 1 MiB may be charged up to 1 MiB past its 512 B rounding; one of 1 MiB
    or less (the small pool) splits at 512 B."""
    from issue395.constants import unsplit_bound

    assert unsplit_bound(K_SMALL_SIZE) == 0 and unsplit_bound(512) == 0
    assert unsplit_bound(K_SMALL_SIZE + 1) == K_SMALL_SIZE == unsplit_bound(7 * K_SMALL_SIZE)


def _anatomy(folder: str, name: str) -> dict:
    import json

    root = Path(__file__).resolve().parents[1] / "results"
    return json.loads(next(root.glob(f"{folder}/{name}")).read_text())


def test_a_request_served_by_a_cached_block_it_cannot_split_is_charged_that_block():
    """Issue 52 item 1, on the real allocator as measured (H200, Mistral-7B NF4 LoRA r256 all-linear 1024x1, three
    steps): at the optimizer step's peak every live block the step made is adapter-shaped (7 MiB, 2 MiB, 0.5 MiB
    and the 32 MiB workspace), and max_memory_allocated stands above the history's requested bytes by whole MiB
    (166 of them), never more than 1 MiB per live large-pool block (unsplit_bound); the same arm under expandable
    segments (every block split at 512 B) stands within 26 KB of its requests."""
    from issue395.constants import unsplit_bound

    d = _anatomy("fit4-anatomy-findmax-h200-soup0.77.0-*/call-1-2", "anatomy-sft-mistral-nf4-1024x1-r256-all-s3-a1.json")
    unseen = d["real_peak"] - d["replayed_peak"]
    peak = next(p for p in d["phases"] if p["from"] == "optimizer step 2 start")
    assert peak["max"] == d["replayed_peak"]
    assert unseen > 0 and unseen % K_SMALL_SIZE == 0
    assert unseen <= sum(unsplit_bound(int(size)) * n for size, n in peak["live"].items())
    split = _anatomy("pages2-soup-patch-map4-modes-h200-soup0.77.0-*/call-1-3",
                     "pages-sft-mistral-nf4-1024x1-r256-all-s2-a4.json")
    assert 0 <= split["real_peak"] - split["requested_peak"] < 26 * 1024 < unseen


def test_the_layer_rule_charges_a_rest_only_where_a_block_is_cut_or_has_its_own_segment():
    """Issue 52 item 1: the binding layer's blocks are charged the allocator's unsplit rests: none for blocks the
    small pool splits at 512 B (1 MiB or less), one 1 MiB a 20 MiB segment the blocks under 10 MiB fill
    (only the segment's last block keeps its rest), one 1 MiB a block of 10 MiB or more."""
    from issue395.constants import MiB, layer_remainders

    assert layer_remainders([MiB, 512 * 1024, 4096] * 40) == 0  # the small pool: split at 512 B
    assert layer_remainders([3 * MiB] * 6) == MiB  # 18 MiB: one segment
    assert layer_remainders([3 * MiB] * 7) == 2 * MiB  # 21 MiB: a second segment
    assert layer_remainders([54 * MiB, 18 * MiB]) == 2 * MiB
    assert layer_remainders([3 * MiB, 54 * MiB, 1024]) == 2 * MiB


def test_the_loss_rule_charges_a_rest_only_for_blocks_cut_from_20_mib_segments():
    """Issue 52 item 1: the loss phase's blocks over 1 MiB and under 10 MiB (kMinLargeAlloc) are cut from 20 MiB
    segments, whose last block keeps its rest: 1 MiB a segment they fill (the layer rule); a block of 10 MiB or more
    keeps only its fresh segment's tail (segment_tail, the allocator rounding's), and the small pool nothing."""
    from issue395.constants import MiB, cut_remainders

    assert cut_remainders([9 * MiB] * 4 + [9 * MiB // 2] * 3) == 3 * MiB  # Gemma-3-1B 2048x1: 49.5 MiB
    assert cut_remainders([2048 * MiB] * 3 + [32 * MiB] * 4 + [16 * MiB] * 3) == 0  # own segments
    assert cut_remainders([MiB, 576 * 1024] * 7) == 0  # the small pool splits at 512 B
    assert cut_remainders([32 * MiB, 8 * MiB, 8 * MiB, 8 * MiB]) == 2 * MiB  # 24 MiB cut: two segments
