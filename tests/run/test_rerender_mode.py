"""run/rerender_mode.py: --from-json re-renders saved results (merged shards, re-judged rows) and
--compare lists two results' shared arms; every failure while merging, rendering or comparing is one
line naming the file, and a file that is not a result this mode renders is named for what it is."""

from __future__ import annotations

import copy
import json

import pytest
from conftest import ROOT, SWEEP, edited_copy, main, one_error_line, table_lines

from issue395.errors import EXIT_FINDING, EXIT_OK


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
    assert "bench/rerenders.py map-077" in sentence, sentence
    rows = ROOT / "results/map-077-full-h200-soup0.77.0-684477c/map-077-full.json.rows.jsonl"
    line = one_error_line(*main(capfd, ["--from-json", rows]), "row file")
    assert "bench/" in line, line  # the committed ones: the script that renders them


def _two_shards(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_bytes(SWEEP.read_bytes())
    b.write_bytes(SWEEP.read_bytes())
    return a, b


@pytest.mark.parametrize("target, exc", [
    ("merge", KeyError("environment")), ("merge", TypeError("unorderable")),
    ("render_text", ZeroDivisionError("division by zero")),
    ("render_markdown", KeyError("torch")),
    ("compare_table", ZeroDivisionError("division by zero")),
], ids=["merge-key-error", "merge-type-error", "render-zero-division", "markdown-key-error",
        "compare-zero-division"])
def test_any_failure_while_merging_rendering_or_comparing_is_one_line_naming_the_file(
        capfd, tmp_path, monkeypatch, target, exc):
    """Issue 29: any failure while --from-json merges, renders text or markdown, or --compare compares is one
    line naming the file and the exception, and no markdown is left behind."""
    import issue395.run.rerender_mode as rerender_mode

    def boom(*a, **k):
        raise exc

    monkeypatch.setattr(rerender_mode, target, boom)
    a, b = _two_shards(tmp_path)
    argv = {"merge": ["--from-json", a, b], "render_text": ["--from-json", a],
            "render_markdown": ["--from-json", a, "--markdown", tmp_path / "o.md"],
            "compare_table": ["--from-json", a, "--compare", b]}[target]
    line = one_error_line(*main(capfd, argv), str(a) if target != "compare_table" else str(b),
                          type(exc).__name__)
    assert not (tmp_path / "o.md").exists(), line




def test_compare_with_no_arm_in_common_is_one_line(capfd, tmp_path):
    """--compare of two results that share no arm is one line saying so."""
    other = edited_copy(tmp_path, SWEEP, lambda d: [r.update(seq=r["seq"] + 1, realised_width=r["seq"] + 1,
                                                          realised_rows=[r["seq"] + 1] * len(r["realised_rows"]))
                                                 for r in d["rows"]])
    one_error_line(*main(capfd, ["--from-json", SWEEP, "--compare", other]), "--compare", "no arm in common")


def test_compare_with_a_missing_file_names_that_file(saved, tmp_path, capfd):
    """The error must be about the missing --compare file, not some other flaw."""
    missing = tmp_path / "missing.json"
    code, out, err = main(capfd, ["--from-json", saved, "--compare", missing])
    line = one_error_line(code, out, err, "--compare", "missing.json")
    assert str(saved) not in line


def test_from_json_rejudges_an_edited_row_under_and_void(saved, tmp_path, capfd):
    """The saved verdicts ("derived") are never read back: a row edited above its prediction
    re-renders UNDER, one edited to a realised width of 1000 re-renders VOID; exit 1."""
    data = json.loads(saved.read_text())
    assert data["rows"][0]["derived"]["status"] == "ok"
    under = copy.deepcopy(data)
    under["rows"][0]["real_peak"] = under["rows"][0]["predicted"] + 1
    void = copy.deepcopy(data)
    void["rows"][1]["realised_width"] = 1000
    (tmp_path / "under.json").write_text(json.dumps(under))
    (tmp_path / "void.json").write_text(json.dumps(void))

    code, out, err = main(capfd, ["--from-json", tmp_path / "under.json"])
    assert code == EXIT_FINDING, err
    line = table_lines(out, "SmolLM2-135M")[0]
    assert line.split()[0] == "2048" and line.split()[-1] == "UNDER"
    assert line.split()[5] == "1.000x"  # predicted / (predicted + 1), rounded

    code, out, err = main(capfd, ["--from-json", tmp_path / "void.json"])
    assert code == EXIT_FINDING, err
    line = table_lines(out, "SmolLM2-135M")[1]
    assert line.split()[:2] == ["3072", "1000"] and line.split()[-1] == "VOID"
    assert line.split()[5] == "VOID"
    assert "VOID - realised [3072] (width 1000) != requested 3072" in out


def test_from_json_compare_lists_the_byte_difference_of_the_same_arm(saved, tmp_path, capfd):
    """--from-json A --compare B names each result's arms and lists the byte difference of the same arm, and
    how many shared arms are equal to the byte."""
    other = json.loads(saved.read_text())
    other["environment"]["arms"] = "isolated, one fresh process per arm"
    other["rows"][0]["real_peak"] += 1_000_000
    other_path = tmp_path / "other.json"
    other_path.write_text(json.dumps(other))
    code, out, err = main(capfd, ["--from-json", saved, "--compare", other_path])
    assert code == EXIT_OK, err
    assert "compare: A = in one process" in out
    assert "B = isolated, one fresh process per arm" in out
    line = next(x for x in out.splitlines() if x.split()[:2] == ["SmolLM2-135M", "2048"])
    assert line.split()[5] == "1000000"
    assert "9 of 10 shared arm(s) equal to the byte" in out
