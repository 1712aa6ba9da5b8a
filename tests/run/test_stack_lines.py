"""Every verdict names the stack it holds for: --estimate's and --find-max's verdict blocks carry a
`stack:` line (the packages where the tool runs, and whether the physics was verified there), and
--estimate's JSON its `stack`. Through the command line, in process, on CPU, with the real Soup loader.
Where a test needs a stack this venv does not have, the versions are FAKED (``stacks.package_version``,
what the installed metadata says): it says so; soup-cli is always the installed release."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, SCRIPT, main

from issue395.estimator import stacks
from issue395.estimator.releases import installed_release

#: the README's soup.yaml (Mistral-7B NF4 at 2048 x 1)
NF4_YAML = (ROOT / "README.md").read_text(encoding="utf-8").split("```yaml\n", 1)[1].split("```", 1)[0]
BF16_YAML = NF4_YAML.replace("quantization: 4bit", "quantization: none")
H200 = {"torch": "2.11.0+cu130", "transformers": "5.16.1", "peft": "0.20.0", "trl": "0.29.1", "bitsandbytes": "0.50.2"}
#: what a fresh `pip install "soup-cli[all]==0.77.0"` resolved on 2026-12-01 (issue 37), on the H200's torch
LATEST = dict(H200, transformers="5.24.0", peft="0.21.2")


@pytest.fixture
def soup_yaml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def write(text=NF4_YAML):
        (tmp_path / "soup.yaml").write_text(text, encoding="utf-8")
        return "soup.yaml"
    return write


def fake_versions(monkeypatch, versions: dict) -> None:
    """FAKED: the installed metadata's versions of torch, transformers, peft, trl and bitsandbytes."""
    monkeypatch.setattr(stacks, "package_version", lambda name: versions.get(name, stacks.NOT_INSTALLED))


def verdict_block(out: str) -> list[str]:
    """The lines above the table's legend: the head, one line a card, the stack, the file's keys (the
    host RAM line under the verdicts left out: the machine's, not the stack's; the verdict's own first line,
    issue 53 item 13, and the LoRA line, item 9, too)."""
    lines = [ln for ln in out.splitlines()[1:] if not ln.startswith("  LoRA ")]
    return [ln for ln in lines[:next(i for i, ln in enumerate(lines) if ln.startswith("(Soup's pre-flight"))]
            if not ln.startswith("  host RAM")]


def test_the_estimates_verdict_names_the_installed_stack_under_the_card_lines_and_in_its_json(capfd, soup_yaml, tmp_path):
    code, out, err = main(capfd, ["--estimate", "--config", soup_yaml(), "--card", "T4,A10G", "--json", "e.json"])
    assert code == 0, err
    block = verdict_block(out)
    stack = stacks.check_installed(nf4=True)
    assert block[1].startswith("  T4: ") and block[2].startswith("  A10G: ") and block[3] == f"  {stack.line()}"
    assert block[3].startswith(f"  stack: torch {stacks.package_version('torch')}, transformers "
                               f"{stacks.package_version('transformers')}, ")
    assert f"soup-cli {installed_release()}: " in block[3]
    assert json.loads((tmp_path / "e.json").read_text())["stack"] == stack.to_json()


def test_under_the_latest_stack_the_estimate_names_what_it_charges_for_it(capfd, soup_yaml, monkeypatch, tmp_path):
    """FAKED: transformers 5.24.0 and peft 0.21.2 on the H200's torch (what pip resolves today), measured
    with soup-cli 0.77.0: verified there, charging Gemma-2's eager masks; beside 0.73.3, not verified, and
    the one package that differs from the nearest verified row is soup-cli."""
    fake_versions(monkeypatch, LATEST)
    code, out, err = main(capfd, ["--estimate", "--config", soup_yaml(), "--card", "T4", "--json", "e.json"])
    assert code == 0, err
    head = (f"  stack: torch 2.11.0+cu130, transformers 5.24.0, peft 0.21.2, trl 0.29.1, bitsandbytes 0.50.2, soup-cli "
            f"{installed_release()}: ")
    saved = json.loads((tmp_path / "e.json").read_text())["stack"]
    if installed_release() == "0.77.0":
        assert verdict_block(out)[2].startswith(head + "verified on this stack; charged for it: eager_masks: Gemma-2 ")
        assert (saved["status"], saved["verified"]) == ("verified", True) and saved["charged"].startswith("eager_masks")
    else:
        assert verdict_block(out)[2] == (head + f"not verified on this stack: soup-cli {installed_release()} (verified on "
                                         "0.77.0); charged for it: nothing extra (issue395/estimator/stacks.py)")
        assert (saved["status"], saved["verified"], saved["charged"]) == ("not verified", False, "nothing extra")


def test_under_a_stack_no_run_measured_the_estimate_says_not_verified_naming_what_differs(capfd, soup_yaml, monkeypatch,
                                                                                         tmp_path):
    """FAKED: a transformers and peft newer than any committed run's, on the H200's torch."""
    fake_versions(monkeypatch, dict(LATEST, transformers="5.25.0", peft="0.22.0"))
    code, out, err = main(capfd, ["--estimate", "--config", soup_yaml(), "--card", "T4", "--json", "e.json"])
    assert code == 0, err
    assert verdict_block(out)[2] == (
        f"  stack: torch 2.11.0+cu130, transformers 5.25.0, peft 0.22.0, trl 0.29.1, bitsandbytes 0.50.2, soup-cli "
        f"{installed_release()}: not verified on this stack: transformers 5.25.0 (verified on 5.16.1), peft 0.22.0 "
        "(verified on 0.20.0); charged for it: nothing extra (issue395/estimator/stacks.py)")
    saved = json.loads((tmp_path / "e.json").read_text())["stack"]
    assert (saved["status"], saved["verified"], saved["charged"]) == ("not verified", False, "nothing extra")
    assert [d["package"] for d in saved["differs"]] == ["transformers", "peft"]


def test_on_the_stack_the_physics_was_verified_on_the_estimate_says_verified(capfd, soup_yaml, monkeypatch):
    """FAKED: the H200's versions of torch, transformers, peft, trl and bitsandbytes (both soup-cli
    releases a venv here holds, 0.73.3 and 0.77.0, have a verified row)."""
    if installed_release() not in ("0.73.3", "0.77.0"):
        pytest.skip(f"soup-cli {installed_release()} has no verified row")
    fake_versions(monkeypatch, H200)
    code, out, err = main(capfd, ["--estimate", "--config", soup_yaml(), "--card", "T4"])
    assert code == 0, err
    line = verdict_block(out)[2]
    assert line.endswith("results folders: issue395/estimator/stacks.py)") and ": verified on this stack (" in line


def test_a_bf16_verdict_neither_compares_nor_names_bitsandbytes(capfd, soup_yaml, monkeypatch):
    """FAKED: bitsandbytes not installed, the rest the H200's."""
    fake_versions(monkeypatch, {k: v for k, v in LATEST.items() if k != "bitsandbytes"})
    code, out, _ = main(capfd, ["--estimate", "--config", soup_yaml(BF16_YAML), "--card", "T4"])
    assert code == 0 and "bitsandbytes" not in verdict_block(out)[2]
    code, out, _ = main(capfd, ["--estimate", "--config", soup_yaml(), "--card", "T4"])
    assert code == 0 and "bitsandbytes not installed (verified on 0.50.2)" in verdict_block(out)[2]


def test_the_find_max_plan_names_the_stack_beside_the_two_answers(capfd, soup_yaml):
    code, out, err = main(capfd, ["--find-max", "seq", "--config", soup_yaml(), "--emulate-card", "T4", "--dry-run"])
    assert code == 0, err
    lines = out.splitlines()
    assert lines[1].startswith("  computed by this tool") and lines[2].startswith("  like for like")
    assert lines[3].startswith("  computed by Soup") and lines[4] == f"  {stacks.check_installed(nf4=True).line()}"


def test_the_estimate_reads_the_stack_without_importing_torch(tmp_path):
    (tmp_path / "soup.yaml").write_text(NF4_YAML, encoding="utf-8")
    code = (f"import runpy, sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "sys.argv = [sys.argv[1], '--estimate', '--config', 'soup.yaml', '--card', 'T4']\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "print(sorted(m for m in ('torch', 'transformers', 'peft', 'trl', 'bitsandbytes') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "  stack: torch " in done.stdout and done.stdout.rstrip().endswith("[]"), done.stdout
