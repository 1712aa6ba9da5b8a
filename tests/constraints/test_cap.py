"""issue395.constraints.cap: the number an arm's allocator is capped at. Soup's cap is checked against the
prediction Soup itself computed inside its setup on the H200 (captured into the committed
cap-proof rows), not against this tool's estimator."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, cap_of

from issue395.constraints.cap import Cap, apply_cap
from issue395.estimator.releases import release_source

CAP_SOUP = ROOT / "results" / "cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37" / "cap-soup.json"


#: Soup's cap on the record's release is that release's own number, from its own code.
needs_073 = pytest.mark.skipif(release_source("0.73.3") is None,
                               reason="soup-cli 0.73.3's own code is not here (its venv runs it)")


@needs_073
@pytest.mark.parametrize("row", json.loads(CAP_SOUP.read_text())["rows"],
                         ids=lambda r: f"{r['model_key']}-{r['quant']}-{r['seq']}x{r['batch']}")
def test_soups_cap_is_the_number_soup_computed_in_its_own_setup(row):
    got = cap_of("soup", row["model_key"], quant=row["quant"], seq=row["seq"], batch=row["batch"],
                    targets=tuple(row["targets"]), release="0.73.3")
    assert row["cap_at"] == "soup" and row["cap"] == row["soup_predicted"]
    assert abs(got - row["soup_predicted"]) <= 16  # Soup's own float arithmetic, to the byte


def test_the_control_is_uncapped():
    assert cap_of("off", "smol", quant="none", seq=2048, batch=1, targets=("q_proj", "v_proj")) is None
    assert apply_cap(None) is None


@needs_073
def test_the_corrected_caps_sit_above_soups_own_on_an_arm_soup_under_predicts():
    """Mistral-7B NF4 512x1 is the arm Soup under-predicts (cap-soup.json: it died under Soup's cap)."""
    kw = dict(quant="nf4", seq=512, batch=1, targets=("q_proj", "v_proj"), release="0.73.3")
    soup, corrected, free = (cap_of(c, "mistral-7b", **kw) for c in ("soup", "corrected", "needs-free"))
    assert soup < corrected <= free


@pytest.mark.parametrize("task", ["dpo", "kto"])
def test_a_preference_arm_is_capped_at_its_own_tasks_estimate(monkeypatch, task):
    """--cap corrected|needs-free on a --task arm: the cap is the estimator's for that task (a paired
    step, a reference forward), not SFT's; the hook reads the task off the arm it constrains.
    FAKED: apply_cap's CUDA fraction."""
    import issue395.constraints.cap as cap
    from issue395.constraints.constraint import ArmSetting
    from issue395.estimator.estimate import estimate_key
    from issue395.measure.shapes import family_shape
    from issue395.model.arm import Arm

    kw = dict(quant="none", seq=512, batch=2, targets=("q_proj", "v_proj"), soup=False)
    want, sft = estimate_key("smol", task=task, **kw), estimate_key("smol", **kw)
    assert (want.corrected_predicted, want.needs_free) != (sft.corrected_predicted, sft.needs_free)
    capped = []
    monkeypatch.setattr(cap, "apply_cap", capped.append)
    for at, number in (("corrected", want.corrected_predicted), ("needs-free", want.needs_free)):
        kw_cap = {k: v for k, v in kw.items() if k != "soup"}
        assert cap_of(at, "smol", task=task, **kw_cap) == number
        c = Cap(at)
        c.before_setup(ArmSetting(Arm("smol", 512, 2, task=task), family_shape("smol"), "unused"))
        assert c.bytes == number == capped[-1]
