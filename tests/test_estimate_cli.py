"""--estimate's Soup's own number against the one Soup's setup computed on the GPU (a committed map
arm, read back through Result): still to move to test_soup_number (issue 21); the rest of
--estimate's command line is in test_runner and test_options. CPU, no GPU: the committed result
stands in for one; nothing faked."""

from __future__ import annotations

import json

from conftest import ROOT, main

from issue395.result import Result

#: A committed map arm of Mistral-7B NF4 512 x 1 for each tested Soup release.
SAVED = {"0.73.3": "results/cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37/map-512-1024.json",
         "0.77.0": "results/untied-seq512-h200x2-soup0.73.3-and-0.77.0-f3ad9d2/map077-untied.json"}


def test_soups_own_number_from_the_config_is_the_one_its_setup_computed_on_the_gpu(capfd, tmp_path):
    from issue395.soup_number import installed_release

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
