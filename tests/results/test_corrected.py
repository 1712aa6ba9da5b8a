"""issue395.results.corrected: this tool's corrected estimate for a saved row's arm, from its family's public
config and the Soup release the row ran, never from the row's own measurement; None where the
estimator does not model the arm; and the saved row carrying it (issue 52 item 2): read back from the JSON of
a real CPU dry run and of a committed map re-rendered with --from-json. Rows are built by the harness's own
constructor with a peak standing in for a CUDA measurement, or are the committed rows' own measured peaks; the
estimator, Soup's CPU setup in the dry run and the command line are real. Nothing else is faked."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import MAP_512, main, make_row, readme_yaml

from issue395.results.extras import UserConfig
from issue395.results.corrected import corrected, corrected_ratio, with_corrected
from issue395.results.row import Row
from issue395.text import gb, ratio
from issue395.estimator.estimate import estimate, estimate_key
from issue395.model.arm import Settings
from issue395.model.registry import config_json

ENV = {"soup_cli": "0.73.3"}


def test_a_rows_corrected_estimate_is_its_familys_from_the_public_config_whatever_it_measured():
    row = make_row("smol", 2048, real_peak=10**9)
    want = estimate(config_json("smol"), seq=2048, batch=1, targets=("q_proj", "v_proj"), release="0.73.3", soup=False)
    assert corrected(row, ENV) == want.corrected_predicted
    assert corrected(replace(row, real_peak=3 * 10**9), ENV) == corrected(row, ENV)  # not from the peak
    assert corrected_ratio(row, ENV) == want.corrected_predicted / 10**9


def test_the_run_steps_and_shape_reach_it():
    row = make_row("qwen", 4096, batch=1, real_peak=10**9)
    assert corrected(row, dict(ENV, steps=3)) > corrected(row, ENV)
    assert corrected(make_row("qwen", 4096, batch=2, real_peak=10**9), ENV) > corrected(row, ENV)


def test_a_config_rows_own_lora_r_reaches_it():
    """A --config row ran the file's r (4 here): its corrected estimate is at that r, not the protocol's 8."""
    row = make_row("smol", 2048, real_peak=10**9, config=UserConfig("soup.yaml", 4, 8))
    want = estimate(config_json("smol"), seq=2048, batch=1, targets=("q_proj", "v_proj"), lora_r=4, release="0.73.3", soup=False)
    assert corrected(row, ENV) == want.corrected_predicted < corrected(make_row("smol", 2048, real_peak=10**9), ENV)


def test_a_streaming_modes_row_is_estimated_under_its_mode_never_as_if_it_were_absent():
    env = {"soup_cli": "0.77.0"}
    row = make_row("smol", 2048, real_peak=10**9)
    chunked = corrected(replace(row, model_key="smol+chunk512"), env)
    want = estimate(config_json("smol"), seq=2048, batch=1, targets=("q_proj", "v_proj"), release="0.77.0",
                    stream={"stream_loss_chunk": 512}, soup=False)
    assert chunked == want.corrected_predicted and chunked != corrected(row, env)


def test_an_arm_the_estimator_does_not_model_has_none_and_no_ratio():
    row = make_row("smol", 2048, real_peak=10**9)
    assert corrected(replace(row, model_key="custom"), ENV) is None  # a --model run: no public config
    assert corrected_ratio(replace(row, model_key="custom"), ENV) is None
    assert corrected_ratio(make_row("smol", 2048, failure="OOM", real_peak=None), ENV) is None  # nothing measured


def test_an_arm_the_estimator_refuses_has_none_whatever_its_family():
    """A known family under a mode Soup refuses for it (per_expert off DeepSeek-V3), or past its
    positions: the estimator does not model it, so no corrected figure stands beside the row."""
    row = make_row("smol", 2048, real_peak=10**9)
    assert corrected(replace(row, model_key="smol+per_expert"), {"soup_cli": "0.77.0"}) is None
    assert corrected(replace(row, seq=10**6), ENV) is None


def test_a_committed_map_resaved_carries_in_every_row_the_corrected_figures_its_text_renders(capfd, tmp_path):
    """The committed map at seq 512 and 1024 (80 measured rows) re-rendered with --from-json and re-saved
    with --json: every row of the JSON holds its corrected estimate and needs-free, the corrected GB and
    corr/real cells of its table row are those figures, and "never under" is checked from the JSON alone
    with the count the text's verdict states."""
    out = tmp_path / "map.json"
    code, text, err = main(capfd, ["--from-json", MAP_512, "--json", out])
    assert (code, err) == (1, "")  # 1: Soup's own UNDER rows, the map's finding
    data = json.loads(out.read_text())
    rows = data["rows"]
    lines = text.split("margin map (", 1)[1].splitlines()[3:3 + len(rows)]  # the table's rows, in the JSON's order
    for row, line in zip(rows, lines, strict=True):
        cells = line.split()
        assert (cells[0], cells[1], int(cells[2]), int(cells[3])) == (row["model"], row["quant"], row["seq"], row["batch"])
        c = row["corrected"]
        assert (gb(c["allocated"]), ratio(row["derived"]["corrected_over_real"])) == (cells[-3], cells[-2])
        assert c["needs_free"] > c["allocated"]
    judged = [r for r in rows if r["derived"]["corrected_over_real"] is not None]
    assert all(r["corrected"]["allocated"] >= r["real_peak"] for r in judged)  # a script's "never under"
    assert f"corrected estimate: never under on the {len(judged)} measured row(s) it covers" in text
    assert len(judged) == 80
    read = Row.from_json(rows[0])  # the record reads back, typed
    assert (read.corrected.allocated, read.corrected.needs_free) == (rows[0]["corrected"]["allocated"],
                                                                     rows[0]["corrected"]["needs_free"])


def test_a_cpu_dry_runs_json_carries_the_corrected_estimate_and_the_estimators_needs_free(capfd, tmp_path):
    """A real --dry-run (Soup's setup on CPU, nothing measured): its saved row holds the corrected figure
    its text prints and the estimator's needs-free for that arm, though no peak stands beside them."""
    out = tmp_path / "dry.json"
    code, text, err = main(capfd, ["--dry-run", "--models", "smol", "--seq", "512", "--json", out])
    assert code == 0, err
    (row,) = json.loads(out.read_text())["rows"]
    want = estimate_key("smol", quant="none", seq=512, batch=1, targets=tuple(row["targets"]), soup=False,
                        release=json.loads(out.read_text())["environment"]["soup_cli"])
    assert row["corrected"] == {"allocated": want.corrected_predicted, "needs_free": want.needs_free}
    assert row["derived"]["status"] == "dry-run" and row["derived"]["corrected_over_real"] is None
    line = next(ln for ln in text.splitlines() if ln.split()[:3] == ["512", "512", "1"])
    assert gb(want.corrected_predicted) in line.split()


def test_a_row_saved_before_the_corrected_record_reads_with_none_and_its_resave_writes_it():
    """A schema 3 row as every result before issue 52 saved it (no corrected key) still loads; a re-save
    under the run's environment writes the figures; a malformed record is refused by name."""
    old = make_row("smol", 2048, real_peak=10**9).to_json()
    assert "corrected" in old and old["corrected"] is None
    old.pop("corrected")
    row = Row.from_json(old)
    assert row.corrected is None
    saved = with_corrected(row, ENV).to_json()
    assert saved["corrected"]["allocated"] == corrected(row, ENV)
    with pytest.raises(ValueError, match="row field 'corrected.allocated'"):
        Row.from_json(dict(saved, corrected={"allocated": -1, "needs_free": 5}))
# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


@pytest.mark.slow
@pytest.mark.parametrize("how", ["--model", "--config"])
@pytest.mark.release
def test_a_local_config_json_bases_arm_has_the_corrected_figure_estimate_gives(capfd, tmp_path, cache_dir, how):
    """Issue 36 item 11: a dry-run arm on a local config.json base (by --model or in a --config file) has the
    corrected figure --estimate gives for it, and --from-json prints it."""
    from issue395.model.registry import config_json

    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config_json("smol")))
    if how == "--model":
        argv = ["--model", folder, "--seq", "128"]
        est = ["--estimate", "--model", folder / "config.json", "--seq", "128"]
    else:
        # the measured arm runs the protocol's one micro-batch a step: the estimate it is held to, too
        yaml = readme_yaml(tmp_path, seq=128, base=folder, extra="  gradient_accumulation_steps: 1\n").read_text().replace(
            "quantization: 4bit", "quantization: none")
        (tmp_path / "soup.yaml").write_text(yaml)
        argv = ["--config", tmp_path / "soup.yaml"]
        est = ["--estimate", "--config", tmp_path / "soup.yaml", "--steps", "1"]
    code, out, err = main(capfd, argv + ["--dry-run", "--cache-dir", cache_dir, "--json", tmp_path / "r.json"])
    assert code == 0, err
    (row,) = json.loads((tmp_path / "r.json").read_text())["rows"]
    code, _, err = main(capfd, est + ["--json", tmp_path / "e.json"])
    assert code == 0, err
    (want,) = json.loads((tmp_path / "e.json").read_text())["rows"]
    assert row["corrected_custom"] == want["corrected_predicted"], (row.get("corrected_custom"), want)
    code, out, err = main(capfd, ["--from-json", tmp_path / "r.json"])
    assert f"{want['corrected_predicted'] / 1e9:.4f}" in out, out


def test_a_config_rows_corrected_figure_charges_the_accumulation_and_optimizer_it_ran():
    """Issue 50: a --config arm runs the file's gradient accumulation and optimizer, so the corrected figure beside
    its row is the estimator's for that run (the held gradients of micro-batch 2 on; from step 2 on, the
    optimizer's states), the same keywords --estimate --config charges; the protocol's row keeps its own."""
    from issue395.estimator.estimate import estimate_key
    from issue395.model.arm import Arm
    from issue395.model.registry import SHAPES
    from issue395.results.corrected import corrected
    from issue395.results.row import arm_row

    plain = arm_row(Arm("qwen", 2048, 1), SHAPES["qwen"])
    run = arm_row(Arm("qwen", 2048, 1, settings=Settings("adamw_8bit", 4)), SHAPES["qwen"])
    for steps in (1, 2):
        env = {"steps": steps}
        want = estimate_key("qwen", seq=2048, batch=1, targets=tuple(run.targets), steps=steps, soup=False,
                            optimizer="adamw_8bit", accumulation=4).corrected_predicted
        assert corrected(run, env) == want != corrected(plain, env)
    # one step: no optimizer state yet, so only the gradients held across micro-batches add
    assert corrected(run, {"steps": 1}) > corrected(plain, {"steps": 1})


def _committed_measured_rows():
    """Every measured row of every committed result the corrected column models, as its render reads it (the
    row's own release, transformers, steps, task and run); pre-workspace-fix-*'s in-process rows are left out:
    their peaks hold an earlier arm's cuBLAS workspaces, the defect that folder keeps the evidence of."""
    from pathlib import Path

    from issue395.errors import UsageError
    from issue395.results.saved import load_result

    root = Path(__file__).resolve().parents[2] / "results"
    for path in sorted(root.rglob("*.json")):
        if path.relative_to(root).parts[0].startswith("pre-workspace-fix-"):
            continue
        try:
            res = load_result(str(path))
        except (UsageError, SystemExit):
            continue  # not a saved result: an anatomy, find-max or --estimate file
        for r in res.rows:
            c = corrected(r, res.environment) if r.measured else None
            if c is not None:
                yield str(path.relative_to(root)), r, c


def test_the_corrected_estimate_is_never_under_on_any_committed_measured_row():
    """Issue 52 item 1: at or above the real peak (measured: max_memory_allocated, the default allocator) on every
    committed measured row of a saved result, and on the default-allocator anatomy runs of large adapters
    (results/fit4-anatomy-findmax-*/call-1-2: r64-r256, all-linear, accumulation, three steps), where the adapter
    blocks' unsplit remainders are charged; on the same arms under expandable segments (pages-*), the peak with
    every block split stands at or above theirs."""
    import importlib.util
    from pathlib import Path

    rows = list(_committed_measured_rows())
    assert len(rows) > 1800
    under = [(p, r.model_key, r.quant, r.seq, r.batch, c / r.real_peak) for p, r, c in rows if c < r.real_peak]
    assert under == []
    bench = Path(__file__).resolve().parents[2] / "bench" / "rerenders.py"
    spec = importlib.util.spec_from_file_location("rerenders", bench)
    fit4 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit4)
    default = fit4.anatomy()
    assert len(default) == 11 and all(e.corrected_predicted >= d["real_peak"] for _, d, e in default)
    split = [row for call in fit4.PAGE_CALLS for row in fit4.anatomy(call, "pages-")]
    assert len(split) == 13 and all(e.split_allocated >= d["real_peak"] for _, d, e in split)


def test_an_nf4_rows_estimate_takes_the_card_its_result_ran_on():
    """Which gemm_4bit kernel ran is the card's (estimator/gemm4bit.py): a Mistral-7B NF4 512x1 row saved from an
    H200 with bitsandbytes 0.50.2 recorded is estimated with the H200's answer (no shape fuses: the layer walk is
    admitted), lower than the card-agnostic estimate of the same row from a result that recorded no bitsandbytes;
    a bf16 row is the same either way."""
    from issue395.measure.shapes import family_shape
    from issue395.model.arm import Arm
    from issue395.results.row import arm_row

    def row(quant: str) -> Row:  # the harness's own constructor, a peak standing in for a measurement
        return arm_row(Arm.at("mistral-7b", 512, 1, quant=quant), family_shape("mistral-7b"), real_peak=10**9,
                       realised_width=512, realised_rows=(512,))

    nf4, bf16 = row("nf4"), row("none")
    saved = {"soup_cli": "0.77.0", "transformers": "5.16.1", "gpu": "NVIDIA H200"}
    known, unknown = corrected(nf4, dict(saved, bitsandbytes="0.50.2")), corrected(nf4, saved)
    assert known < unknown and unknown - known > 10 * 2**20
    assert corrected(bf16, dict(saved, bitsandbytes="0.50.2")) == corrected(bf16, saved)
