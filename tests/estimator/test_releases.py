"""issue395.estimator.releases and soup_number's reading of a release: every soup-cli release from
0.73.3 to 0.77.0 read from its own source, its features held to the committed table, its own number
computed by its own code. The installed release runs in every venv; the releases between run from
their unpacked wheels where ISSUE395_RELEASE_SOURCES names them (.ci/run fetches them), each checked
against the same release's real import in a child process. Nothing is faked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, main

from issue395.errors import UsageError
from issue395.estimator import estimate as E
from issue395.estimator.releases import RELEASE_FEATURES, RELEASES_ENV, installed_release, wheel_sources
from issue395.estimator.releases import soup_dir as _soup_dir
from issue395.estimator.soup_number import features, read_features, soup_preflight_from_config
from issue395.model.registry import config_json

WHEELS = wheel_sources()
needs_wheels = pytest.mark.skipif(not WHEELS, reason=f"{RELEASES_ENV} names no unpacked soup-cli wheels "
                                  "(.ci/run fetches the releases between 0.73.3 and 0.77.0)")
MISTRAL = config_json("mistral-7b")
QV = ("q_proj", "v_proj")


def test_the_installed_release_reads_as_its_row_of_the_table():
    assert read_features(_soup_dir()) == RELEASE_FEATURES[installed_release()]


@needs_wheels
@pytest.mark.parametrize("release", sorted(RELEASE_FEATURES))
def test_each_releases_own_source_reads_as_its_row_of_the_table(release):
    if release not in WHEELS:
        pytest.skip(f"soup-cli {release} is not unpacked under {RELEASES_ENV}")
    assert read_features(WHEELS[release]) == RELEASE_FEATURES[release]


#: The child: the release's real soup_cli imported, its own setup's pieces (the wrapper's rows and
#: refill, the mixin's adapter count and large-slot budget, the estimator's signature) applied to
#: the shard bytes the parent counted; prints the number and the keywords.
CHILD = r"""
import importlib, inspect, json, sys
from types import SimpleNamespace
import soup_cli.utils.layer_stream as ls
import soup_cli.trainer.stream_setup as ss
out = []
for job in json.loads(sys.argv[1]):
    assert ls.__file__.startswith(job["src"]), ls.__file__
    module, cls = job["wrapper"]
    W = getattr(importlib.import_module(module), cls)
    M = ss.StreamingSetupMixin
    tcfg = SimpleNamespace(lora=SimpleNamespace(target_modules=job["targets"], r=job["r"]), moe_lora=False)
    kw = dict(job["plain"], batch_size=job["batch"] * W._STREAM_ROWS_PER_EXAMPLE,
              adapter_params=M._estimate_adapter_params(object.__new__(W), tcfg, SimpleNamespace(**job["config"])),
              logits_bytes_per_element=float(ls.LOGITS_BYTES_PER_ELEMENT))
    if hasattr(M, "_stream_large_budget_bytes"):
        kw["large_layer_bytes"] = object.__new__(W)._stream_large_budget_bytes(job["slot"], job["n_large"])
    else:
        kw["large_layer_bytes"] = job["slot"]
    kw = {k: kw[k] for k in job["names"]}
    assert set(kw) <= set(inspect.signature(ls.estimate_stream_peak_vram).parameters)
    out.append([int(ls.estimate_stream_peak_vram(**kw)), kw])
print(json.dumps(out))
"""

#: (task, batch, targets as Soup's config holds them) on Mistral-7B NF4 2048: untied, so every
#: release-dependent rule shows (the pair split, the refill slot, rows, a string target's count).
CASES = [("sft", 1, list(QV)), ("dpo", 1, list(QV)), ("kto", 2, list(QV)), ("orpo", 1, list(QV)),
         ("simpo", 1, list(QV)), ("sft", 1, "all-linear")]


@needs_wheels
@pytest.mark.parametrize("release", sorted(RELEASE_FEATURES))
def test_each_releases_number_by_its_own_code_read_here_is_its_real_imports(release):
    """The child is given only the shard bytes counted here (the layer, extras, the vocab slot);
    rows, the refill slot, the adapter count, the signature and the sum are the real import's."""
    from issue395.tasks import TASKS

    if release not in WHEELS:
        pytest.skip(f"soup-cli {release} is not unpacked under {RELEASES_ENV}")
    src = WHEELS[release]
    mine, jobs = [], []
    slot = 2 * MISTRAL["vocab_size"] * MISTRAL["hidden_size"] if read_features(src).splits_untied_pair else 0
    for task, batch, targets in CASES:
        got, kw = soup_preflight_from_config(MISTRAL, quant="nf4", seq=2048, batch=batch, lora_r=8,
                                             targets=targets, release=release, task=task)
        mine.append([got, kw])
        plain = {k: kw[k] for k in kw if k not in ("batch_size", "adapter_params", "large_layer_bytes",
                                                   "logits_bytes_per_element")}
        jobs.append({"src": str(src), "wrapper": TASKS[task].wrapper, "targets": targets, "r": 8,
                     "config": MISTRAL, "names": list(kw), "plain": plain, "batch": batch, "slot": slot,
                     "n_large": 2 if slot else 0})
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(jobs)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(src.parent)), cwd=str(src.parent.parent), timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout) == mine


#: Soup's own number for Mistral-7B NF4 2048 x 1, SFT, as each release's real import gave it
#: (r3-releases.md, every release's wheel): the one change is 0.74.0's pair split.
MISTRAL_SFT = {"0.73.3": 2_469_936_792, "0.74.0": 2_201_501_336, "0.75.0": 2_201_501_336,
               "0.75.1": 2_201_501_336, "0.75.2": 2_201_501_336, "0.76.0": 2_201_501_336,
               "0.76.1": 2_201_501_336, "0.77.0": 2_201_501_336}


def _here():
    return {installed_release(): _soup_dir(), **WHEELS}


@pytest.mark.parametrize("release", sorted(MISTRAL_SFT))
def test_a_release_between_gives_its_own_number_not_the_nearest_releases(release):
    """Before: 0.74.0 and 0.75.0/.1 were handed 0.73.3's two vocab matrices (+268,435,456 B, silently),
    0.75.2 and 0.76.x 0.77.0's keywords (a TypeError, exit 2)."""
    if release not in _here():
        pytest.skip(f"soup-cli {release}'s source is not here ({RELEASES_ENV})")
    got, _ = soup_preflight_from_config(MISTRAL, quant="nf4", seq=2048, batch=1, targets=QV, lora_r=8, release=release)
    assert got == MISTRAL_SFT[release]


@pytest.mark.parametrize("release", sorted(RELEASE_FEATURES))
def test_the_corrected_estimate_keeps_the_vocab_slots_the_release_keeps(release):
    """The physics follows the release's detected split (0.74.0 on: one slot for the untied pair),
    not the nearest of two measured releases: 0.74.0 was charged 0.73.3's second matrix."""
    e = E.estimate(MISTRAL, quant="nf4", seq=2048, release=release, soup=False)
    matrices = 1 if RELEASE_FEATURES[release].splits_untied_pair else 2
    assert e.terms["extras"] == matrices * 2 * 32768 * 4096 + 2 * 4096


@pytest.mark.parametrize("task, batch, extra_slots", [("sft", 1, 0), ("orpo", 1, 0), ("simpo", 1, 0),
                                                       ("dpo", 1, 1), ("kto", 2, 1)])
def test_dpo_and_kto_on_an_untied_model_charge_the_refill_slot_twice_from_076(task, batch, extra_slots):
    """On 0.76.0 on, the task's own _STREAM_REFILL_BEFORE_BACKWARD doubles the large slot on an untied
    model (#1049); a paired task runs 2 x batch rows. Against the release's own SFT number."""
    release = next((r for r in ("0.77.0", "0.76.1", "0.76.0") if r in _here()), None)
    if release is None:
        pytest.skip("no release from 0.76.0 on is here")
    rows = 2 if task in ("dpo", "orpo", "simpo") else 1
    sft, _ = soup_preflight_from_config(MISTRAL, quant="nf4", seq=2048, batch=batch * rows, targets=QV, lora_r=8,
                                        release=release)
    got, kw = soup_preflight_from_config(MISTRAL, quant="nf4", seq=2048, batch=batch, targets=QV, lora_r=8,
                                         release=release, task=task)
    assert kw["batch_size"] == batch * rows
    assert got - sft == extra_slots * 268_435_456


def test_a_release_whose_source_is_not_here_and_not_read_is_one_line():
    with pytest.raises(UsageError, match="neither installed"):
        features("0.70.0")
    with pytest.raises(UsageError, match="not here"):
        soup_preflight_from_config(MISTRAL, quant="nf4", seq=512, batch=1, targets=QV, lora_r=8, release="0.70.0")


def test_a_release_not_in_the_table_is_read_from_its_source_and_said_so(capfd, tmp_path, monkeypatch):
    """The installed soup_cli's source presented as 0.78.0 (a dist-info of that version beside it):
    its features and number come from that source, and the header says it is not a pinned release."""
    real, installed = _soup_dir(), installed_release()
    (tmp_path / "soup_cli").symlink_to(real, target_is_directory=True)
    (tmp_path / "soup_cli-0.78.0.dist-info").mkdir()
    monkeypatch.setenv("ISSUE395_SOUP_SOURCE", str(tmp_path / "soup_cli"))
    out = tmp_path / "e.json"
    code, stdout, err = main(capfd, ["--estimate", "--model", "mistral-7b", "--quant", "nf4", "--seq", "2048",
                                     "--json", out])
    assert code == 0, err
    head = next(line for line in stdout.splitlines() if line.startswith("soup-cli"))  # below the verdict lines
    assert head.startswith("soup-cli 0.78.0 (read from its own source; not a release")
    data = json.loads(out.read_text())
    assert data["soup_cli"] == "0.78.0" and data["rows"][0]["soup_predicted"] == MISTRAL_SFT[installed]


def test_ci_fetches_the_releases_between_and_the_readme_says_so():
    import re

    ci = (ROOT / ".ci" / "run").read_text()
    between = re.search(r'BETWEEN="([^"]*)"', ci).group(1).split()
    assert set(between) == set(RELEASE_FEATURES) - {"0.73.3", "0.77.0"} and 'soup-cli==$v' in ci
    assert RELEASES_ENV in ci and RELEASES_ENV in (ROOT / "README.md").read_text()
