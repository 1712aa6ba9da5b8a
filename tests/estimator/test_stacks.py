"""issue395.estimator.stacks: the stack a verdict holds for, read off the installed packages' metadata
(torch never imported), and the table of the stacks the physics was measured on, each row held to its
evidence (the committed results folders, read here). Where a test needs a stack this venv does not
have (transformers 5.24.0, a measured row), the version is FAKED: it says so; nothing else is."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from importlib import metadata

import pytest
from conftest import ROOT

from issue395.estimator import stacks as S
from issue395.estimator.releases import installed_release
from issue395.estimator.terms import BY_KEY

#: The packages every evidence file must name (bitsandbytes: pip's list only where it was installed).
ALWAYS_NAMED = ("torch", "transformers", "peft", "trl", "soup-cli")
VERIFIED_077 = {"torch": "2.11.0+cu130", "transformers": "5.16.1", "peft": "0.20.0", "trl": "0.29.1",
                "bitsandbytes": "0.50.2", "soup-cli": "0.77.0"}
#: what a fresh `pip install "soup-cli[all]==0.77.0"` resolved on 2026-12-01 (issue 37), on the H200's torch
LATEST = dict(VERIFIED_077, transformers="5.24.0", peft="0.21.2")
#: FAKED: a stack no committed run measured, for the rows a test adds to the table
NEWER = dict(LATEST, transformers="5.25.0", peft="0.22.0")


def named_in(folder) -> list[dict[str, str]]:
    """Each evidence file's named versions: a stack*.txt is pip's list on the GPU box, a JSON the
    run's environment."""
    files = []
    for txt in sorted(folder.rglob("stack*.txt")):
        lines = S.box_stack(txt.read_text())
        files.append({p: lines[p] for p in S.PACKAGES if p in lines})
    for path in sorted(folder.rglob("*.json")):
        try:
            env = json.loads(path.read_text()).get("environment") or {}
        except (ValueError, AttributeError):
            continue
        if env.get("gpu"):
            files.append({p: env[p.replace("-", "_")] for p in S.PACKAGES if env.get(p.replace("-", "_"))})
    return files


@pytest.mark.parametrize("row", S.KNOWN_STACKS, ids=lambda r: r.version("soup-cli"))
def test_every_row_of_the_table_is_named_by_each_of_its_evidence_folders(row):
    """A row's every folder holds a file (pip's list or a run's JSON) naming its versions, torch's local
    tag aside; its bitsandbytes is named by pip's list in at least one."""
    bnb = False
    for name in row.evidence:
        folder = ROOT / "results" / name
        assert folder.is_dir(), name
        agreeing = [f for f in named_in(folder) if set(ALWAYS_NAMED) <= set(f)
                    and all(S.release(v) == row.version(p) for p, v in f.items())]
        assert agreeing, f"{name} names no file of the stack {row.versions}"
        bnb = bnb or any("bitsandbytes" in f for f in agreeing)
    assert bnb, row.versions


def test_every_committed_gpu_result_names_a_stack_of_the_table():
    """No committed GPU run's stack is left out of the table: each JSON's environment checks as verified
    (bitsandbytes aside: the environment did not record it)."""
    folders = {p.parent.relative_to(ROOT / "results").parts[0] for p in (ROOT / "results").rglob("*.json")}
    for folder in sorted(folders):
        for f in named_in(ROOT / "results" / folder):
            assert S.check(f).status == "verified", (folder, f)


def test_the_verified_stack_reads_verified_with_its_evidence_and_charges_nothing_extra():
    c = S.check(VERIFIED_077)
    assert c.status == "verified" and c.match is S.KNOWN_STACKS[1] and c.differs == ()
    assert c.line() == ("stack: torch 2.11.0+cu130, transformers 5.16.1, peft 0.20.0, trl 0.29.1, bitsandbytes 0.50.2, "
                        f"soup-cli 0.77.0: verified on this stack ({len(S.KNOWN_STACKS[1].evidence)} results folders: "
                        "issue395/estimator/stacks.py)")
    assert c.to_json()["evidence"][0] == "results/" + S.KNOWN_STACKS[1].evidence[0]


def test_the_latest_stack_soup_admits_reads_verified_with_what_it_charges_for_it():
    """FAKED versions: transformers 5.24.0 and peft 0.21.2, what pip resolves today for soup-cli 0.77.0,
    measured on the H200 beside the pinned stack: verified, and its verdict names the term it charges."""
    c = S.check(LATEST)
    assert c.status == "verified" and c.match is S.KNOWN_STACKS[2] and c.differs == ()
    assert c.charged.startswith("eager_masks: Gemma-2 runs eager attention")
    assert "verified on this stack; charged for it: eager_masks: " in c.words()


def test_a_stack_newer_than_the_latest_measured_reads_not_verified_naming_what_differs():
    """FAKED versions: a transformers and peft no committed run measured."""
    c = S.check(NEWER)
    assert c.status == "not verified" and c.match is None
    assert c.differs == (("transformers", "5.25.0", "5.16.1"), ("peft", "0.22.0", "0.20.0"))
    assert c.words() == ("not verified on this stack: transformers 5.25.0 (verified on 5.16.1), peft 0.22.0 "
                         "(verified on 0.20.0); charged for it: nothing extra (issue395/estimator/stacks.py)")
    j = c.to_json()
    assert (j["verified"], j["charged"], j["packages"]["transformers"]) == (False, "nothing extra", "5.25.0")


def test_a_measured_row_carries_its_notes_per_term_and_charges_them():
    """A FAKED row of the kind the GPU comparison adds: a newer stack measured, not verified, with a note
    on one term. The check matches it, says measured, names what differs from the verified stack, and
    charges the note."""
    note = S.TermNote("allocated_allowance", "+8,388,608 B on Gemma-2's forward (a FAKED note)")
    measured = S.KnownStack(tuple((p, S.release(NEWER[p])) for p in S.PACKAGES), ("a-folder",), verified=False,
                            notes=(note,))
    c = S.check(NEWER, known=S.KNOWN_STACKS + (measured,))
    assert c.status == "measured, not verified" and c.match is measured
    assert c.charged == "allocated_allowance: +8,388,608 B on Gemma-2's forward (a FAKED note)"
    assert "measured on it (results/a-folder)" in c.words() and "transformers 5.25.0 (verified on 5.16.1)" in c.words()
    assert c.to_json()["notes"] == [{"term": "allocated_allowance", "note": note.note}]


def test_a_verified_row_with_notes_says_what_it_charges():
    """A FAKED row: a newer stack verified once its difference is modelled; its note is charged."""
    note = S.TermNote("allocated_allowance", "+8 MiB (a FAKED note)")
    row = S.KnownStack(tuple((p, S.release(NEWER[p])) for p in S.PACKAGES), ("a", "b"), notes=(note,))
    c = S.check(NEWER, known=S.KNOWN_STACKS + (row,))
    assert c.status == "verified" and c.differs == ()
    assert c.words() == ("verified on this stack; charged for it: allocated_allowance: +8 MiB (a FAKED note) "
                         "(2 results folders: issue395/estimator/stacks.py)")


def test_every_note_in_the_table_names_a_term_of_the_estimate():
    for row in S.KNOWN_STACKS:
        assert all(n.term in BY_KEY for n in row.notes), row.versions
        assert row.verified or row.notes, f"a measured row says what it charges: {row.versions}"


def test_bitsandbytes_decides_only_an_nf4_verdict():
    """FAKED: bitsandbytes not installed. A bf16 verdict neither compares nor names it; an NF4 one does."""
    without = dict(VERIFIED_077, bitsandbytes=S.NOT_INSTALLED)
    assert S.check(without, nf4=False).status == "verified"
    assert "bitsandbytes" not in S.check(without, nf4=False).names()
    c = S.check(without, nf4=True)
    assert c.differs == (("bitsandbytes", "not installed", "0.50.2"),)


def test_a_saved_result_that_did_not_record_a_package_says_so():
    recorded = {k: v for k, v in VERIFIED_077.items() if k != "bitsandbytes"}
    assert S.check(recorded).words().startswith("verified on this stack, bitsandbytes not recorded (")
    assert S.check(recorded, nf4=False).words().startswith("verified on this stack (")


def test_a_torch_build_tag_is_not_a_different_release_but_another_release_is():
    assert S.check(dict(VERIFIED_077, torch="2.11.0")).status == "verified"
    assert S.check(dict(VERIFIED_077, torch="2.13.0+cpu")).differs == (("torch", "2.13.0+cpu", "2.11.0"),)


def test_the_installed_stack_is_read_from_metadata_and_names_the_release_soups_number_is_read_from():
    found = S.installed_stack()
    for p in ("torch", "transformers", "peft", "trl"):
        assert found[p] == metadata.version(p)
    assert found["soup-cli"] == installed_release()
    assert S.installed_stack(lambda p: {"transformers": "5.24.0"}.get(p, S.NOT_INSTALLED))["transformers"] == "5.24.0"


def test_reading_the_stack_imports_no_torch():
    code = ("import sys; from issue395.estimator.stacks import check_installed; print(check_installed().line()); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"stack: torch {metadata.version('torch')}, ")


def test_a_row_is_frozen_and_its_versions_name_every_package():
    for row in S.KNOWN_STACKS:
        assert tuple(p for p, _ in row.versions) == S.PACKAGES
        with pytest.raises(Exception):
            replace(row).verified = False  # type: ignore[misc]
