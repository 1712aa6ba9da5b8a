"""issue395.results.saved: rows saved as they finish survive a crash, a row file with its header renders
as the interrupted run it is, and a file that is not a result is named for what it is when read back: a
missing, damaged, hollow, deeply nested or endless file, a FIFO, a row file without a header or an
--estimate result is one line and exit 2, never a traceback."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest
from conftest import ROOT, h, main, make_row, one_error_line

from issue395.errors import EXIT_INTERRUPTED, UsageError
from issue395.results.corrected import with_corrected
from issue395.results.saved import RowFile
from issue395.host import arms
from issue395.run import measure_mode

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
    with pytest.raises(UsageError, match="did not finish"):  # never deleted (issue 36, item 1)
        RowFile(str(out))
    assert stale.read_text() == "a killed run's rows\n"
    stale.write_text("")  # one that holds no row is no run's: a new run starts its own
    rows = RowFile(str(out))
    assert rows.path == stale and not stale.exists()
    measured = [make_row(index=0, real_peak=10**9), make_row(index=1, seq=4096, real_peak=2 * 10**9)]
    for row in measured:
        rows.add(row)
    saved = [json.loads(line) for line in stale.read_text().splitlines()]
    # each as the final JSON writes it: with the corrected figures the text renders for it
    assert saved == [json.loads(json.dumps(with_corrected(r).to_json(), default=str)) for r in measured]
    assert all(line["corrected"]["allocated"] for line in saved)
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
    assert err.count("warning: cannot save rows to") == 1 and "every row is in the tables" in err
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


def test_a_row_file_without_a_header_is_the_file_from_json_refuses_as_a_row_file(capfd, tmp_path):
    """One suffix names the file a run writes and the file --from-json refuses: they cannot drift."""
    path = RowFile.path_for(str(tmp_path / "run.outputs.json"))
    rows = RowFile(str(tmp_path / "run.outputs.json"))  # no environment: no header, as before the header
    rows.add(make_row(index=0, real_peak=10**9))
    assert rows.path == path and path.exists()
    one_error_line(*main(capfd, ["--from-json", path]), "row file", "no environment")


COMMITTED_ROW_FILE = ROOT / "results" / "map-077-full-h200-soup0.77.0-684477c" / "map-077-full.json.rows.jsonl"


def test_a_committed_row_file_from_before_the_header_is_refused_with_the_same_line_word_for_word(capfd):
    line = one_error_line(*main(capfd, ["--from-json", COMMITTED_ROW_FILE]))
    assert line == (f"error: --from-json {COMMITTED_ROW_FILE}: this is a run's row file (its measured rows, one JSON "
                    "line each, kept when the run could not write its --json); it holds no environment to judge "
                    "them by, so --from-json cannot render it: read the lines as they are (a committed one under "
                    "results/ is rendered by the bench/ script its folder's commands.txt or README names)")


class Killed(BaseException):  # not Exception: the runner keeps the rows of a harness bug
    """Stands for the SIGKILL that stopped the 0.77.0 map before it wrote its --json: nothing after it runs."""


def killed(*_, **__):
    raise Killed


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, cache_dir):
    """A real dry run of two arms killed where it would write its --json: its row file, as the
    runner left it, and the tables the run itself printed."""
    folder = tmp_path_factory.mktemp("stopped")
    out = folder / "o.json"
    with pytest.MonkeyPatch.context() as mp, pytest.raises(Killed):
        mp.setattr(measure_mode, "write_outputs", killed)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            h.main(["--sweep", "--dry-run", "--models", "smol", "--seq", "64,128", "--cache-dir", str(cache_dir),
                    "--json", str(out)])
    assert not out.exists()
    return RowFile.path_for(str(out)), printed.getvalue()


def test_a_run_stopped_before_its_json_renders_from_its_row_file_as_the_interrupted_run(capfd, stopped_run, tmp_path):
    path, printed = stopped_run
    back = tmp_path / "back.json"
    code, out, err = main(capfd, ["--from-json", path, "--json", back])
    assert code == EXIT_INTERRUPTED, err
    # The tables the run printed, from its rows and its stack: only the stack line says where they came from.
    stack, *tables = out.splitlines()
    run_stack = next(line for line in printed.splitlines() if line.startswith("stack: "))
    assert stack == run_stack + f" | rows from {RowFile.ROWS_FROM}"
    assert tables[:len(tables) - 2] == printed.split(run_stack + "\n", 1)[1].splitlines()
    assert tables[-1] == "interrupted: 2 row(s) set up (dry run: nothing measured) before the stop"
    saved = json.loads(back.read_text())
    assert saved["interrupted"] and saved["exit_code"] == EXIT_INTERRUPTED and len(saved["rows"]) == 2
    assert saved["environment"]["rows_from"] == RowFile.ROWS_FROM
    assert saved["environment"]["command"].endswith(f"--json {path.with_suffix('').with_suffix('')}")


def test_a_row_files_half_written_last_line_is_left_out_and_said(capfd, stopped_run, tmp_path):
    path, _ = stopped_run
    lines = path.read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.json.rows.jsonl"
    cut.write_text("".join(lines[:2]) + lines[2][:len(lines[2]) // 2])  # the header, one row, half a row
    back = tmp_path / "back.json"
    code, out, err = main(capfd, ["--from-json", cut, "--json", back])
    assert code == EXIT_INTERRUPTED, err
    saved = json.loads(back.read_text())
    assert [r["seq"] for r in saved["rows"]] == [64]
    assert saved["environment"]["rows_from"] == RowFile.ROWS_FROM + "; its last line, half-written, is left out"
    assert "interrupted: 1 row(s)" in out


def test_a_parents_row_file_header_holds_its_own_stack_and_says_so(capfd, tmp_path, monkeypatch):
    """A parent of children (--isolate) stopped before any child reported: the header is all there is."""
    out = tmp_path / "o.json"
    monkeypatch.setattr(measure_mode, "spread", killed)
    with pytest.raises(Killed):
        main(capfd, ["--sweep", "--dry-run", "--isolate", "--models", "smol", "--seq", "64", "--json", out])
    header = json.loads(RowFile.path_for(str(out)).read_text())
    assert header["kind"] == "sweep" and header["environment"]["stack_of"] == arms.STACK_OF_PARENT
    assert "--isolate" in header["environment"]["command"] and header["environment"]["gpu"] is None
    code, text, err = main(capfd, ["--from-json", RowFile.path_for(str(out))])
    assert code == EXIT_INTERRUPTED, err
    assert f"| stack of {arms.STACK_OF_PARENT} | rows from {RowFile.ROWS_FROM}" in text.splitlines()[0]


EROFS = (30, "Read-only file system")


def unfinished_row_file(tmp_path, name="m.json", header=True):
    """A row file as a killed run leaves it: its header (since 0439a03) and a row's line."""
    from issue395.results.saved import RowFile

    rows = RowFile.path_for(str(tmp_path / name))
    lines = ([json.dumps({RowFile.HEADER: 1, "tool": "x", "kind": "map", "environment": {}})] if header else [])
    rows.write_text("\n".join(lines + [json.dumps({"model": "smol", "seq": 512})]) + "\n")
    return rows


# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


@pytest.mark.parametrize("argv", [
    ["--map", "--families", "smol", "--quant", "none", "--seq", "512", "--batch", "1", "--dry-run"],
    ["--dry-run", "--models", "smol", "--seq", "64"],
    ["--estimate", "--model", "smol", "--seq", "512"],
])
@pytest.mark.parametrize("header", [True, False])
def test_a_json_whose_row_file_holds_an_unfinished_runs_rows_is_refused_and_kept(capfd, tmp_path, argv,
                                                                                       header):
    """Issue 36 item 1: a --json whose row file holds an unfinished run's rows (with or without its header) is
    one line naming the file and --from-json, in every mode, and the row file is kept byte for byte."""
    rows = unfinished_row_file(tmp_path, header=header)
    before = rows.read_bytes()
    line = one_error_line(*main(capfd, argv + ["--json", tmp_path / "m.json"]), str(rows), "--from-json")
    assert "move it" in line, line
    assert rows.read_bytes() == before


def test_an_empty_row_file_holds_no_rows_and_is_no_bar(capfd, tmp_path):
    """Issue 36 item 1: an empty row file holds no rows and does not stop a run writing its --json."""
    from issue395.results.saved import RowFile

    RowFile.path_for(str(tmp_path / "m.json")).write_text("")
    code, out, err = main(capfd, ["--estimate", "--model", "smol", "--seq", "512", "--json", tmp_path / "m.json"])
    assert code == 0, err


def test_a_row_file_on_a_folder_turned_read_only_keeps_its_rows_and_the_run_goes_on(capfd, tmp_path, monkeypatch):
    """The fault is faked (root ignores a read-only mode): the row file's appends and its removal
    raise EROFS from the second row on, as on a remounted folder."""
    from pathlib import Path

    from issue395.results.saved import RowFile

    rf = RowFile(str(tmp_path / "o.json"), {"command": "x"})
    rf.write({"row": 1})
    real_open, real_unlink = open, Path.unlink

    def ro_open(path, mode="r", *a, **kw):
        if str(path) == str(rf.path) and "a" in mode:
            raise OSError(*EROFS)
        return real_open(path, mode, *a, **kw)

    def ro_unlink(self, *a, **kw):
        if str(self) == str(rf.path):
            raise OSError(*EROFS)
        return real_unlink(self, *a, **kw)

    monkeypatch.setattr("builtins.open", ro_open)
    monkeypatch.setattr(Path, "unlink", ro_unlink)
    rf.write({"row": 2})  # no exception: the run goes on
    rf.write({"row": 3})
    monkeypatch.undo()
    assert [json.loads(ln) for ln in rf.path.read_text().splitlines()][1:] == [{"row": 1}]
    err = capfd.readouterr().err
    assert err.count("warning") == 1 and "Read-only file system" in err and str(rf.path) in err
