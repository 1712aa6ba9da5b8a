"""issue395.run.runner: the sweep, the map and --estimate end to end in process; a stdout that cannot be written
(issue 53 item 5: `> /dev/full` was a traceback) is one line and exit 2, in a fresh process. --estimate's output
(issue 22): what it leaves out said where its numbers are read, and a JSON that says what it is; a
Ctrl-C said alike everywhere; the map's dry run (the real Soup setup on CPU, bf16 and NF4, slow); a
--model folder holding only a config built from it. Nothing is faked but the spread's children where
a test says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import SCRIPT, SMOL, main

from issue395.errors import EXIT_USAGE
from issue395.model.registry import FAMILIES
from issue395.results.row import Row


def test_a_quantization_config_is_said_to_be_not_modelled(capfd, tmp_path):
    from issue395.model.registry import config_json

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config_json("llama31-8b"), "quantization_config": {
        "quant_method": "bitsandbytes", "load_in_4bit": True}}))
    code, out, err = main(capfd, ["--estimate", "--model", path, "--seq", "512"])
    assert code == 0, err
    assert [ln for ln in out.splitlines() if ln.startswith("  config: ")] == [  # under the verdict (issue 53 item 11)
        "  config: its quantization_config (bitsandbytes) is NOT modelled: these figures are Soup's "
        "--quant none of the full-precision shapes the config describes"]
    code, out, _ = main(capfd, ["--estimate", "--model", "llama31-8b", "--seq", "512"])
    assert "quantization_config" not in out


def test_the_estimate_says_what_it_assumes_and_what_it_leaves_out(capfd, tmp_path):
    out_json = tmp_path / "e.json"
    code, out, err = main(capfd, ["--estimate", "--model", "mistral-7b", "--quant", "nf4", "--seq", "512",
                                  "--card", "24GB", "--json", out_json])
    assert code == 0, err
    assert "expandable segments, as `soup train` sets them" in out
    assert "host RAM (the machine's, not a card's): Soup's streamed store" in out  # said beside the verdict (issue 36 item 13)
    data = json.loads(out_json.read_text())
    assert data["schema"] >= 2 and data["kind"] == "estimate"
    assert data["targets"] == ["q_proj", "v_proj"] and data["lora_r"] == 8
    [card] = data["rows"][0]["cards"]  # the fit per card lives in each row (issue 20's shape)
    assert card["card"] == "24GB" and card["fits"] is True and card["soup_admits"] is True
    assert any("host RAM" in n for n in data["notes"])


@pytest.mark.slow
@pytest.mark.release
def test_map_dry_run_realises_seq_on_every_row_in_bf16_and_nf4_and_captures_soups_own_number(smol_map_dry_run):
    """SmolLM2's map dry run at seq 64 (the session's, conftest.smol_map_dry_run): a bf16 and an NF4 row, each
    realised at 64; Soup's own pre-flight ran inside each setup (NF4's number under bf16's) with its terms;
    the map's tables and the verdict that nothing was measured are printed."""
    code, stdout, err, saved = smol_map_dry_run
    assert code == 0, err
    rows = [Row.from_json(r) for r in saved["rows"]]
    assert [(r.quant, r.realised, r.status) for r in rows] == [("none", 64, "dry-run"),
                                                              ("nf4", 64, "dry-run")]
    # Soup's pre-flight ran inside the setup (on CPU it budgets float32 weights).
    none, nf4 = rows
    assert none.soup_predicted and nf4.soup_predicted and nf4.soup_predicted < none.soup_predicted
    assert none.gate.terms["seq_len"] == 64 and none.gate.terms["layer_bytes"] == SMOL.pool  # fp32
    for needle in ("margin map", "summary per family and quantization", "verdict: nothing measured"):
        assert needle in stdout


def test_model_takes_a_folder_holding_only_a_config_and_builds_from_it(capfd, tmp_path):
    folder = tmp_path / "only-config"
    folder.mkdir()
    fields = dict(FAMILIES["qwen3-0.6b"].config, model_type="qwen3", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=512, max_position_embeddings=256)
    (folder / "config.json").write_text(json.dumps(fields))
    code, stdout, err = main(capfd, ["--model", folder, "--seq", "64", "--dry-run"])
    assert code == 0, err
    assert "weights synthetic" in stdout
    assert [line.split()[:2] for line in stdout.splitlines() if line.split()[:1] == ["64"]] == [["64", "64"]]


#: The script run as a terminal runs it, then whether torch was imported, on stderr.
WRAP = ("import runpy, sys\nsys.argv = [{script!r}] + {argv!r}\ncode = 0\ntry:\n"
        "    runpy.run_path({script!r}, run_name='__main__')\nexcept SystemExit as exc:\n    code = exc.code\n"
        "print('TORCH', 'torch' in sys.modules, file=sys.stderr)\nsys.exit(code)\n")


def test_estimate_answers_from_a_config_without_importing_torch(tmp_path):
    out = tmp_path / "est.json"
    argv = ["--estimate", "--model", "mistral-7b", "--quant", "nf4", "--seq", "512,2048", "--batch", "1,4",
            "--card", "24GB,16GiB", "--json", str(out)]
    p = subprocess.run([sys.executable, "-c", WRAP.format(script=str(SCRIPT), argv=argv)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "TORCH False" in p.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["seq"], r["batch"]) for r in rows] == [(512, 1), (512, 4), (2048, 1), (2048, 4)]
    for r in rows:
        assert {"seq", "batch", "quant", "steps", "soup_predicted", "corrected_predicted", "needs_free",
                "terms"} <= set(r)
        assert r["needs_free"] > r["corrected_predicted"] > 0
    assert "24GB: total GB" in p.stdout and "16GiB: total GB" in p.stdout and "longest seq that fits" in p.stdout
    for r in rows:  # each arm on each card (issue 20)
        assert [c["card"] for c in r["cards"]] == ["24GB", "16GiB"]
        assert all(c["free_bytes"] == c["total_bytes"] - c["context_bytes"] for c in r["cards"])



@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["--estimate", "--model", "qwen", "--seq", "512", "--card", "T4", "--verbose"],
                                  ["--estimate", "--model", "qwen", "--seq", "512"], ["--card", "list"], ["--help"]])
def test_a_stdout_that_cannot_be_written_is_one_line_and_exit_2_never_a_traceback(argv):
    """Long text (past the buffer: the print itself fails) and short text (the flush at exit fails) alike."""
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, str(SCRIPT), *argv], stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == EXIT_USAGE, done.stderr
    assert lines == [lines[0]] and lines[0].startswith("error: stdout cannot be written (no space left on device)")
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
