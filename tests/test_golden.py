"""Behaviour is unchanged, byte for byte: every committed result renders to the same text,
markdown, JSON and plot, and --help and the bad command lines in tests/golden.py give the
same exit and the same one line, as tests/data/golden-outputs.json recorded them (from the
single-file harness before the split). A deliberate change of any of them re-records that
file (``python tests/golden.py tests/data/golden-outputs.json``) in the same commit."""

from __future__ import annotations

import json

import pytest
from golden import ROOT, outputs

GOLDEN = ROOT / "tests" / "data" / "golden-outputs.json"


@pytest.mark.slow
def test_every_saved_result_help_and_bad_command_line_renders_as_recorded():
    recorded = json.loads(GOLDEN.read_text())
    now = outputs(ROOT / "issue395_second_stack_vram.py")
    changed = {k: (recorded.get(k), now.get(k)) for k in recorded.keys() | now.keys()
               if recorded.get(k) != now.get(k)}
    assert not changed, json.dumps(changed, indent=1)
