"""Which attention the installed transformers runs, read from its source without importing it, and
what eager attention adds to the estimate (docs/PEAK.md, "eager_masks")."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT
from issue395.estimator import attention as A
from issue395.estimator import estimate as E
from issue395.model.registry import config_json


def _tree(tmp_path, model_type: str, body: str):
    d = tmp_path / "transformers" / "models" / model_type
    d.mkdir(parents=True)
    (d / f"modeling_{model_type}.py").write_text(body)
    return str(tmp_path / "transformers")


def test_a_model_file_that_declares_no_sdpa_runs_eager_and_the_rest_do_not(tmp_path):
    """transformers 5.24.0's own line for Gemma-2 reads as eager; SDPA declared, or no file, does not."""
    root = _tree(tmp_path, "gemma2", "class Gemma2PreTrainedModel(PreTrainedModel):\n"
                                     "    _supports_sdpa = False  # sdpa does not support softcapping\n")
    assert A.runs_eager("gemma2", root)
    other = _tree(tmp_path / "b", "gemma2", "class G(PreTrainedModel):\n    _supports_sdpa = True\n")
    assert not A.runs_eager("gemma2", other) and not A.runs_eager("llama", root)


def test_the_installed_transformers_is_located_not_imported():
    code = ("import sys; sys.path.insert(0, %r); from issue395.estimator import attention as A;"
            "print(A.transformers_root() is not None, A.runs_eager('llama'), 'transformers' in sys.modules)"
            % str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False", "False"]


def test_a_saved_rows_release_decides_by_the_table_and_five_24_charges_two_bf16_masks():
    """A saved row on the pinned 5.16.1 is SDPA; on 5.24.0 Gemma-2 holds two (rows, 1, seq, seq) bf16
    masks: the 8,388,608 B an independent probe measured on DPO 1024x1 (2 rows)."""
    assert not A.eager("gemma2", "5.16.1") and A.eager("gemma2", "5.24.0") and not A.eager("llama", "5.24.0")
    c = config_json("gemma2-2b")
    old = E.estimate(c, seq=1024, task="dpo", soup=False, transformers="5.16.1", release="0.77.0")  # the probe's
    new = E.estimate(c, seq=1024, task="dpo", soup=False, transformers="5.24.0", release="0.77.0")
    assert "eager_masks" not in old.terms and new.terms["eager_masks"] == 8_388_608
    assert new.corrected_predicted - old.corrected_predicted == 8_388_608  # the loss phase binds on both
    measured = {"5.16.1": 12_283_596_288, "5.24.0": 12_291_984_896}  # issue 37's probe, allocated peaks
    assert old.corrected_predicted >= measured["5.16.1"] and new.corrected_predicted >= measured["5.24.0"]
