"""run/rerender_mode.py: --from-json re-renders saved results (merged shards, re-judged rows) and
--compare lists two results' shared arms; every failure while merging, rendering or comparing is one
line naming the file, and a file that is not a result this mode renders is named for what it is."""

from __future__ import annotations
import json
from conftest import main, one_error_line


# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


def test_a_find_max_json_is_named_as_one_not_as_a_foreign_file(capfd, tmp_path):
    """Issue 36 item 8: --from-json on a --find-max result names it as one, not as a foreign file."""
    path = tmp_path / "fm.json"
    path.write_text(json.dumps({"tool": "issue395-second-stack-vram", "schema": 3, "kind": "find-max",
                                "measured": {"probes": []}}))
    line = one_error_line(*main(capfd, ["--from-json", path]), "--find-max result")
    assert "not a result this tool" not in line, line


def test_the_readme_says_what_renders_the_committed_full_maps_row_file(capfd):
    """Issue 36 item 8: the README names the script that renders the committed full map's row file, and
    --from-json on that row file is one line naming bench/."""
    from conftest import ROOT

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    sentence = readme[readme.index("results/map-077-full-h200-soup0.77.0-684477c/`"):][:400]
    assert "bench/map_077_full.py" in sentence, sentence
    rows = ROOT / "results/map-077-full-h200-soup0.77.0-684477c/map-077-full.json.rows.jsonl"
    line = one_error_line(*main(capfd, ["--from-json", rows]), "row file")
    assert "bench/" in line, line  # the committed ones: the script that renders them
