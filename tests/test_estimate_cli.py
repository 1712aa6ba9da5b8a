"""--estimate on the command line: "does this run fit?" from a config.json or a family, on CPU,
without importing torch; Soup's own number as its setup would compute it; bad input one line.
And the findings report: the committed markdown is what bench/findings.py renders now."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, SCRIPT, main, one_error_line

from issue395.result import Result

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


#: A committed map arm of Mistral-7B NF4 512 x 1 for each tested Soup release.
SAVED = {"0.73.3": "results/cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37/map-512-1024.json",
         "0.77.0": "results/untied-seq512-h200x2-soup0.73.3-and-0.77.0-f3ad9d2/map077-untied.json"}


def test_soups_own_number_from_the_config_is_the_one_its_setup_computed_on_the_gpu(capfd, tmp_path):
    from issue395.estimate import installed_release

    saved = Result.from_json(json.loads((ROOT / SAVED[installed_release()]).read_text()))
    assert saved.environment["soup_cli"] == installed_release()
    arm = next(r for r in saved.rows if (r.model_key, r.quant, r.seq, r.batch) == ("mistral-7b", "nf4", 512, 1))
    out = tmp_path / "e.json"
    code, _, err = main(capfd, ["--estimate", "--model", "mistral-7b", "--quant", "nf4", "--seq", "512",
                                "--json", out])
    assert code == 0, err
    (row,) = json.loads(out.read_text())["rows"]
    assert row["soup_predicted"] == arm.soup_predicted
    assert row["corrected_predicted"] >= arm.real_peak > row["soup_predicted"]  # the miss, and the fix


@pytest.mark.parametrize("config, argv, words", [
    ({"model_type": "bert", "hidden_size": 64}, ["--seq", "512"], ["bert"]),
    ({"model_type": "llama", "hidden_size": 64}, ["--seq", "512"], ["intermediate_size"]),
    (None, ["--seq", "512", "--card", "lots"], ["--card"]),
    (None, ["--seq", "999999"], ["999999"]),
    (None, ["--seq", "512", "--targets", "q_proj,v_proj"], ["q_proj"]),
    (None, [], ["--seq"]),
])
def test_bad_estimate_input_is_one_line_and_exit_2(capfd, tmp_path, config, argv, words):
    if config is None:  # Phi-3: fused qkv_proj, 4096 positions
        model = "phi3-mini"
    else:
        model = tmp_path / "config.json"
        model.write_text(json.dumps(config))
    one_error_line(*main(capfd, ["--estimate", "--model", model, *argv]), *words)


def test_the_committed_findings_report_is_what_the_results_render_to_now():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "findings.py")], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out == (ROOT / "results" / "FINDINGS.md").read_text()
