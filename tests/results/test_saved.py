"""issue395.results.saved: rows saved as they finish survive a crash, and a file that is not a result is
named for what it is when read back: a missing, damaged, hollow, deeply nested or endless file, a
FIFO, a row file or an --estimate result is one line and exit 2, never a traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import ROOT, main, make_row, one_error_line

from issue395.results.saved import RowFile

SAVED = ROOT / "results" / "cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37" / "map-512-1024.json"


def test_a_row_file_is_named_for_what_it_is(capfd, tmp_path):
    path = tmp_path / "x.json.rows.jsonl"
    rows = json.loads(SAVED.read_text())["rows"][:2]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    one_error_line(*main(capfd, ["--from-json", path]), "row file", "no environment")


def test_an_estimate_json_is_named_for_what_it_is(capfd, tmp_path):
    est = tmp_path / "est.json"
    assert main(capfd, ["--estimate", "--model", "smol", "--seq", "512", "--json", est])[0] == 0
    one_error_line(*main(capfd, ["--from-json", est]), "--estimate result", "measured results")


def test_each_finished_row_is_a_json_line_beside_the_json_until_the_json_holds_it(tmp_path):
    out = tmp_path / "o.json"
    stale = tmp_path / "o.json.rows.jsonl"
    stale.write_text("a killed run's rows\n")
    rows = RowFile(str(out))
    assert rows.path == stale and not stale.exists()  # a new run starts its own
    measured = [make_row(index=0, real_peak=10**9), make_row(index=1, seq=4096, real_peak=2 * 10**9)]
    for row in measured:
        rows.add(row)
    saved = [json.loads(line) for line in stale.read_text().splitlines()]
    assert saved == [json.loads(json.dumps(r.to_json(), default=str)) for r in measured]
    rows.finish()
    assert not stale.exists()


def test_json_to_stdout_keeps_no_row_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = RowFile("-")
    rows.add(make_row())
    assert rows.path is None and list(tmp_path.iterdir()) == []


def test_a_row_file_that_cannot_be_written_warns_once_and_the_run_goes_on(tmp_path, capsys):
    rows = RowFile(str(tmp_path / "gone" / "o.json"))
    rows.add(make_row(index=0))
    rows.add(make_row(index=1, seq=4096))
    err = capsys.readouterr().err
    assert err.count("warning: cannot save rows to") == 1 and "they are in the tables" in err
    assert not rows.ok


_ENV_FIELDS = '"torch": "2", "transformers": "5", "trl": "0", "peft": "0", "soup_cli": "0", "weights": "x"'


BAD_FILES = [
    ("missing", None),
    ("not-json", "not json {"),
    ("a-list", '["a", "list"]'),
    ("no-schema", '{"environment": {}, "rows": []}'),
    ("hollow-schema2", '{"schema": 2, "environment": {}, "rows": []}'),
    ("hollow-schema1", '{"schema": 1, "environment": {}, "rows": []}'),
    ("environment-not-object", '{"schema": 2, "environment": "x", "rows": [{"model": "m"}]}'),
    ("hollow-row", '{"schema": 2, "environment": {%s}, "rows": [{"model": "m"}]}' % _ENV_FIELDS),
    ("rows-not-a-list", '{"schema": 2, "environment": {%s}, "rows": {"0": {}}}' % _ENV_FIELDS),
    ("schema-999", '{"schema": 999, "environment": {%s}, "rows": []}' % _ENV_FIELDS),
    ("nested-deeply", "[" * 100_000),
    ("fifo", "FIFO"),
    ("dev-zero", "/dev/zero"),
]


@pytest.mark.parametrize("content", [c for _, c in BAD_FILES], ids=[i for i, _ in BAD_FILES])
def test_from_json_of_a_bad_file_exits_2_with_one_line(tmp_path, capfd, content):
    path = tmp_path / "result.json"
    if content == "FIFO":
        os.mkfifo(path)  # reading it would hang: refused before it is opened
    elif content == "/dev/zero":
        path = Path("/dev/zero")  # never ends: refused before it is read
    elif content is not None:
        path.write_text(content)
    try:
        code, out, err = main(capfd, ["--from-json", path])
    except Exception as exc:  # noqa: BLE001 - the bug: an uncaught traceback
        pytest.fail(f"traceback instead of exit 2: {type(exc).__name__}: {exc}")
    one_error_line(code, out, err, "--from-json", str(path))


def test_the_row_file_a_run_keeps_is_the_file_from_json_refuses_as_a_row_file(capfd, tmp_path):
    """One suffix names the file a run writes and the file --from-json refuses: they cannot drift."""
    path = RowFile.path_for(str(tmp_path / "run.outputs.json"))
    rows = RowFile(str(tmp_path / "run.outputs.json"))
    rows.add(make_row(index=0, real_peak=10**9))
    assert rows.path == path and path.exists()
    one_error_line(*main(capfd, ["--from-json", path]), "row file", "no environment")
