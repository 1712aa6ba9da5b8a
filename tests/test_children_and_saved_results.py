"""What a review of the redesign found: children started with a command line they refuse, a
shard folder deleted under a peer, bf16 and NF4 arms sharing Soup's shards, map rows labelled
as the record's, and saved results the renderer could not draw. Each test pins the fix.

Everything runs on CPU with the real harness functions; no Soup setup runs here.
"""

from __future__ import annotations

import json
import socket

import pytest
from conftest import SMOL, h, main, make_row, one_error_line


def child_command_line(**run):
    job = h.Job((1, 2), (h.Arm("smol", 2048),))
    return h.child_argv(h.Run(**run), job, "out.json", "/tmp/cache")


def test_a_child_of_a_model_run_gets_a_command_line_it_accepts():
    argv = child_command_line(custom_model="/some/checkpoint", models=("custom",), seqs=(64,),
                              weights="local", isolate=True)
    assert "--weights" not in argv
    args = h.build_parser().parse_args(argv)
    assert args.model == "/some/checkpoint" and args.shard == "1/2"


def test_a_map_child_inherits_the_default_quantizations_rather_than_demanding_nf4():
    argv = child_command_line(map=True, models=("smol",), quants=h.QUANTS, batches=(1, 4))
    assert "--quant" not in argv and "--map" in argv
    narrowed = child_command_line(map=True, models=("smol",), quants=("none",), batches=(1,))
    assert narrowed[narrowed.index("--quant") + 1] == "none"


def test_a_map_spread_gives_children_their_own_scratch_so_each_family_can_be_freed():
    job = h.Job((1, 2), (h.Arm("smol", 2048),))
    assert "--cache-dir" not in h.child_argv(h.Run(map=True, models=("smol",)), job, "o.json", None)


def test_repair_leaves_a_shard_folder_that_a_peer_is_still_writing(tmp_path):
    from safetensors.torch import save_file
    from soup_cli.utils.layer_shard import layer_shard_path, resolve_shard_dir

    import torch

    with h.Scratch(str(tmp_path / "cache")) as scratch:
        base = str(tmp_path / "model")
        folder = resolve_shard_dir(base)
        save_file({"w": torch.zeros(4)}, layer_shard_path(folder, 0))  # index.json comes last
        scratch.repair_shards(base)
        assert (tmp_path / "cache" / "layer-stream").exists()
        assert list(__import__("pathlib").Path(folder).glob("*.safetensors"))


def test_nf4_arms_get_their_own_soup_shard_folder_and_bf16_arms_keep_theirs(tmp_path):
    from soup_cli.utils.layer_shard import resolve_shard_dir

    base = tmp_path / "model"
    base.mkdir()
    with h.Scratch(str(tmp_path / "cache")) as scratch:
        assert h.quant_base(scratch, str(base), "none") == str(base)
        nf4 = h.quant_base(scratch, str(base), "nf4")
        assert resolve_shard_dir(nf4) != resolve_shard_dir(str(base))
        assert __import__("pathlib").Path(nf4).resolve() == base.resolve()
        assert h.quant_base(scratch, str(base), "nf4") == nf4  # the same alias again


def test_an_nf4_row_of_a_record_model_quotes_no_a10g_figure():
    arm = h.Arm("smol", 2048, 1, 0, "nf4")
    row = h.arm_row(arm, SMOL, realised_width=2048, realised_rows=(2048,), real_peak=10**9)
    assert row.record_peak is None and row.vs_record is None
    assert make_row(real_peak=10**9).record_peak == h.RECORD_A10G_PEAK[("smol", 2048)]


def test_a_sweep_row_under_by_soups_own_number_says_so_beside_its_ratio():
    peak = 1_500_000_000
    row = make_row(real_peak=peak, soup_predicted=peak - 1)
    text = h.sweep_table([row])
    assert "UNDER by Soup's own pre-flight" in text and row.status == "UNDER"


def test_compare_matches_the_same_quantization_only():
    bf16 = make_row(real_peak=10**9)
    nf4 = h.arm_row(h.Arm("smol", 2048, 1, 0, "nf4"), SMOL, realised_width=2048, realised_rows=(2048,),
                    real_peak=9 * 10**8)
    a = h.Result(environment={"arms": "a", "date": "d"}, rows=[bf16, nf4])
    text = h.compare_table(a, a)
    assert "2 of 2 shared arm(s) equal to the byte" in text
    lines = [line.split() for line in text.splitlines() if line.split()[:1] == ["SmolLM2-135M"]]
    assert [cells[1] for cells in lines] == ["none", "nf4"], "two arms of one seq, told apart"
    assert "quant" not in h.compare_table(*[h.Result(environment={}, rows=[bf16])] * 2)


def test_merged_map_shards_keep_each_familys_thinnest_margin_as_the_live_run_does():
    margin = dict(model="m", model_key="smol", quant="none", seq=2048, batch=1, ratio=1.2, terms=[],
                  complete=True, note=None)
    parts = [h.Result(environment={"torch": "t"}, kind="map", margins=[dict(margin, ratio=r)],
                      rows=[make_row(index=i, real_peak=10**9, seq=2048 + 1024 * i)])
             for i, r in enumerate((1.2, 1.1))]
    assert [m["ratio"] for m in h.merge(parts).margins] == [1.1]


@pytest.mark.parametrize("edit", [
    lambda d: d.update(measure={"x": 1}),
    lambda d: d["rows"][0].update(logits14=None),
    lambda d: d["rows"][0].update(predicted=0),
    lambda d: d["rows"][0].update(attribution={"a": 1}),
    lambda d: d.update(kind="map", margins=[{"x": 1}]),
], ids=["measure-block", "no-logits14", "predicted-0", "attribution-block", "margins-block"])
def test_a_saved_result_the_renderer_cannot_draw_is_one_line_and_exit_2(capfd, tmp_path, edit):
    data = h.Result(environment={"torch": "x", "transformers": "x", "trl": "x", "peft": "x",
                                 "soup_cli": "x", "weights": "synthetic"},
                    rows=[make_row(dry_run=True)]).to_json()
    edit(data)
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(data))
    one_error_line(*main(capfd, ["--from-json", path]), "--from-json")


def test_a_half_built_checkpoint_of_another_host_is_left_alone(tmp_path):
    other = tmp_path / ".smol-abc.partial-elsewhere-1"
    mine_dead = tmp_path / f".smol-abc.partial-{socket.gethostname()}-999999"
    for folder in (other, mine_dead):
        folder.mkdir()
    h.reap_dead_partials(tmp_path)
    assert other.exists() and not mine_dead.exists()


def test_a_childs_repeat_tag_that_is_not_a_number_is_one_line_and_exit_2(capfd):
    one_error_line(*main(capfd, ["--_repeat", "x", "--dry-run"]), "--_repeat")
