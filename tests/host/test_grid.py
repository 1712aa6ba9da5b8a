"""issue395.host.grid: the arms, in order (model, then seq, then batch): the record's grid, the margin
map's (families, quantizations, seqs within each family's max positions, batches), and shards of
them (--shard modulo the grid on a sweep; whole families dealt heaviest first on the map, so no
shard builds a family twice). Nothing is faked: the registry's families and the planner's real arms."""

from __future__ import annotations

import pytest
from conftest import RECORD_ARMS

from issue395.host.grid import arm_seconds, plan_arms, plan_map, shard_of
from issue395.model.arm import Arm
from issue395.record import MAP_BATCHES, QUANTS
from issue395.model.registry import MAP_FAMILIES, max_positions


def grid():
    return plan_arms(["smol", "qwen"], None, [1])


@pytest.mark.parametrize("n", [1, 2, 3, 4, 9, 10, 11])
def test_shards_cover_every_arm_exactly_once(n):
    arms = grid()
    shards = [shard_of(arms, (k, n)) for k in range(1, n + 1)]
    dealt = sorted(a.index for shard in shards for a in shard)
    assert dealt == list(range(len(arms)))
    for shard in shards:
        assert [a.index for a in shard] == sorted(a.index for a in shard)  # grid order kept


def test_shard_k_of_n_is_every_arm_whose_index_is_k_minus_1_mod_n():
    arms = grid()
    assert [a.index for a in shard_of(arms, (2, 4))] == [1, 5, 9]
    assert [a.index for a in shard_of(arms, (4, 4))] == [3, 7]
    assert [(a.model, a.seq) for a in shard_of(arms, (1, 3))] == [
        ("smol", 2048), ("smol", 4352), ("qwen", 2048), ("qwen", 6144)]
    assert shard_of(arms, (1, 1)) == arms


def test_the_default_map_grid_stays_within_each_familys_max_positions():
    arms = plan_map(MAP_FAMILIES + ("llama31-8b",), QUANTS, None, MAP_BATCHES)
    # the first grid's 129 arms, and seq 512 and 1024 for each family, quantization and batch
    assert len(arms) == 129 + 10 * 2 * 2 * 2
    assert all(a.seq <= max_positions(a.model) for a in arms)
    assert {(a.quant, a.seq, a.batch) for a in arms if a.model == "llama31-8b"} == {("nf4", 512, 1)}
    assert sorted({a.seq for a in arms if a.model == "phi-2"}) == [512, 1024, 2048]
    assert [a.index for a in arms] == list(range(len(arms)))


def test_a_map_shard_is_whole_families_dealt_evenly_and_every_arm_once():
    """Modulo shards would make every shard build every family's checkpoint; the map's
    shards each own whole families, and the heaviest (Mistral-7B) does not share a shard
    with the next heaviest while a lighter one is free."""
    arms = plan_map(MAP_FAMILIES + ("llama31-8b",), QUANTS, None, MAP_BATCHES)
    shards = [shard_of(arms, (k, 2), whole_models=True) for k in (1, 2)]
    assert sorted(a.index for s in shards for a in s) == [a.index for a in arms]
    families = [{a.model for a in s} for s in shards]
    assert not families[0] & families[1] and families[0] | families[1] == {a.model for a in arms}
    loads = [sum(arm_seconds(a) for a in s) for s in shards]
    assert max(loads) / min(loads) < 1.1, loads
    assert "mistral-7b" in families[0]  # the heaviest family goes to the first shard


def test_the_map_orders_family_then_quantization_then_seq_then_batch_and_drops_seqs_past_max_positions():
    arms = plan_map(("phi-2", "smol"), ("none", "nf4"), (2048, 4096), (1, 4))
    assert [(a.model, a.quant, a.seq, a.batch) for a in arms[:5]] == [
        ("phi-2", "none", 2048, 1), ("phi-2", "none", 2048, 4), ("phi-2", "nf4", 2048, 1),
        ("phi-2", "nf4", 2048, 4), ("smol", "none", 2048, 1)]
    assert not any(a.model == "phi-2" and a.seq == 4096 for a in arms)  # phi-2 stops at 2048 positions
    assert len(arms) == 4 + 8 and [a.index for a in arms] == list(range(12))


def test_a_streaming_mode_costs_what_its_family_costs_and_a_larger_family_costs_more():
    assert arm_seconds(Arm.at("smol+chunk512", 512)) == arm_seconds(Arm("smol", 512))
    assert arm_seconds(Arm("mistral-7b", 512)) > arm_seconds(Arm("qwen3-0.6b", 512)) > arm_seconds(Arm("smol", 512))


def test_plan_arms_is_the_record_grid_in_order():
    arms = plan_arms(["smol", "qwen"], None, [1])
    assert [(a.model, a.seq, a.batch) for a in arms] == [(k, s, 1) for k, s in RECORD_ARMS]
    assert [a.index for a in arms] == list(range(10))


def test_plan_arms_runs_the_protocols_bf16_unless_a_config_names_its_quantization():
    assert {a.quant for a in plan_arms(["smol"], [2048], [1, 2])} == {"none"}
    assert [(a.model, a.quant) for a in plan_arms(["mistral-7b"], [512], [1], "nf4")] == [("mistral-7b", "nf4")]


def test_plan_arms_orders_model_then_seq_then_batch():
    arms = plan_arms(["qwen", "smol"], [4096, 2048], [2, 1])
    assert [(a.model, a.seq, a.batch) for a in arms] == [
        ("qwen", 4096, 2), ("qwen", 4096, 1), ("qwen", 2048, 2), ("qwen", 2048, 1),
        ("smol", 4096, 2), ("smol", 4096, 1), ("smol", 2048, 2), ("smol", 2048, 1)]
    assert [a.index for a in arms] == list(range(8))


def test_a_task_is_the_grids_innermost_axis_and_every_batch_runs_under_every_task():
    """The map and the sweep alike: one shape's tasks side by side; KTO's batch 1 is planned (it is
    a SKIPPED row, never dropped); without --task, the protocol's SFT alone."""
    arms = plan_map(["llama32-1b"], ["none"], [512], [1, 2], ("sft", "kto"))
    assert [(a.seq, a.batch, a.task, a.index) for a in arms] == [
        (512, 1, "sft", 0), (512, 1, "kto", 1), (512, 2, "sft", 2), (512, 2, "kto", 3)]
    assert [a.task for a in plan_arms(["smol"], [2048], [1], tasks=("dpo", "orpo"))] == ["dpo", "orpo"]
    assert {a.task for a in plan_map(["llama32-1b"], QUANTS, None, MAP_BATCHES)} == {"sft"}


def test_a_map_seq_past_one_familys_positions_is_left_out_for_it_and_named():
    """--map --seq 512,4096 on SmolLM2 (8192 positions) and phi-2 (2048): settled, not refused (the
    first GPU try of the task map stopped at the options); phi-2 plans 512 alone, SmolLM2 both, and
    what is left out is named with its reason for the result's 'not on this map' lines."""
    from issue395.host.grid import past_positions, plan_map
    from issue395.run.options import settle
    from issue395.run.parser import build_parser

    argv = ["--map", "--families", "smol,phi-2", "--quant", "none", "--seq", "512,4096", "--batch", "1"]
    run = settle(build_parser().parse_args(argv), argv)
    assert {(a.model, a.seq) for a in plan_map(run.models, run.quants, run.seqs, run.batches)} == {
        ("smol", 512), ("smol", 4096), ("phi-2", 512)}
    assert past_positions(run.models, run.seqs) == ["phi-2 at seq 4096: past its maximum positions (2048)"]
