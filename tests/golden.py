"""The golden check, as readable text: what the tool prints and writes for every committed
result, ``--help`` and the bad command lines, each kept under tests/golden/ as the text itself,
so a wrong number reads as that number changing in a diff, not as one hash replacing another.

Per result ``results/F/X.json``: ``tests/golden/results/F/X.txt`` (the rendered text),
``X.md`` (the markdown) and ``X.json.diff`` (what re-saving the JSON changes against the file
as committed; empty where it is byte-for-byte the same). A PNG is not readable, so
``tests/golden/results.status`` keeps, one line a result, its exit code, its stderr and the
plot's digest. ``help.txt`` is ``--help``; ``bad-command-lines.txt`` is each bad command line
with its exit code and its one line on stderr.

``python tests/golden.py --record [HARNESS.py]`` writes the files from a harness (default:
this tree's); tests/test_golden.py holds this tree to them. The outputs do not depend on the
installed soup-cli release (0.73.3 and 0.77.0 render every one the same), so one set is kept."""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib.util
import io
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"

#: Command lines that must fail with one line and exit 2, before anything runs.
BAD = [
    ["--seq", "abc"], ["--seq", ""], ["--seq", "2048,,4096"], ["--seq", "32"], ["--seq", "2048,2048"],
    ["--seq", "-5"], ["--seq", "1e3"], ["--seq", "٣"], ["--batch", "0"], ["--batch", "x"],
    ["--batch", "1,1"], ["--models", "nope"], ["--models", ""], ["--models", "smol,smol"],
    ["--models", "smol,"], ["--families", "llama32-1b"], ["--quant", "nf4"], ["--map", "--families", "nope"],
    ["--map", "--families", ""], ["--map", "--families", "smol,smol"], ["--map", "--quant", "int8"],
    ["--map", "--quant", "none,none"], ["--map", "--models", "smol"], ["--map", "--isolate"],
    ["--map", "--determinism"], ["--map", "--seq", "4096", "--families", "phi-2"],
    ["--map", "--model", "x"], ["--model", "x", "--models", "smol"], ["--model", " "], ["--model", "cfg.json"],
    ["--determinism", "1"], ["--determinism", "2,3"], ["--determinism", "x"], ["--shard", "0/2"],
    ["--shard", "3/2"], ["--shard", "a/b"], ["--shard", "1-2"], ["--shard", "1/2", "--gpus", "0"],
    ["--shard", "1/2", "--isolate"], ["--gpus", "x"], ["--gpus", "-1"], ["--seq", "9000", "--models", "smol"],
    ["--dry-run", "--snapshot"], ["--dry-run", "--snapshot-dir", "snaps"], ["--compare", "a.json"],
    ["--from-json", "missing.json"], ["--from-json", "."], ["--from-json", "/dev/null"],
    ["--json", "."], ["--plot", "p.svg"], ["--markdown", "."], ["--json", "a.json", "--markdown", "a.json"],
    ["--json", "a.json.rows.jsonl.x", "--markdown", "a.json.rows.jsonl"],
    ["--json", "a.json", "--plot", "a.json"], ["--log-dir", "/proc/x"], ["--cache-dir", "/proc/x"],
    ["--weights", "cloud"], ["--bogus"], ["positional"], ["--seq"], ["--model", "x"],
    ["--cache-dir", "/"], ["--snapshot-dir", "/proc/1/x"],
]


def load(harness: Path):
    spec = importlib.util.spec_from_file_location(f"golden_{abs(hash(str(harness)))}", harness)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    sys.path.insert(0, str(harness.parent))
    spec.loader.exec_module(mod)
    return mod


def call(main, argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # --help
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def digest(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def saved_results() -> list[Path]:
    return sorted(p for p in (ROOT / "results").rglob("*.json"))


def quoted(argv: list[str]) -> str:
    """A command line as one unambiguous line (empty and blank arguments stay visible)."""
    return " ".join(a if a and a.strip() == a and " " not in a else repr(a) for a in argv)


def result_outputs(mod, path: Path, tmp: str) -> tuple[dict[str, str], str]:
    """One saved result re-rendered: its golden files' texts, and its line in results.status."""
    rel = path.relative_to(ROOT)
    files = [f"{tmp}/o.json", f"{tmp}/o.md", f"{tmp}/o.png"]
    code, out, err = call(mod.main, ["--from-json", str(path), "--json", files[0],
                                     "--markdown", files[1], "--plot", files[2]])
    saved_json, md, png = (Path(f) for f in files)
    base = str(rel.with_suffix(""))
    got = {f"{base}.txt": out,
           f"{base}.md": md.read_text() if md.exists() else "(no markdown written)\n",
           f"{base}.json.diff": "".join(difflib.unified_diff(
               path.read_text().splitlines(True), saved_json.read_text().splitlines(True),
               f"{rel} (committed)", f"{rel} (re-saved)", n=1))
           if saved_json.exists() else "(no JSON written)\n"}
    status = (f"{rel}  exit {code}  plot {digest(png.read_bytes()) if png.exists() else '-'}  "
              f"stderr {err.strip() or '-'}")
    for f in files:
        Path(f).unlink(missing_ok=True)
    return got, status


def golden_names() -> set[str]:
    """The name of every golden file the outputs make, without rendering any (the results' three each)."""
    names = {"help.txt", "bad-command-lines.txt", "results.status"}
    for path in saved_results():
        base = str(path.relative_to(ROOT).with_suffix(""))
        names |= {f"{base}.txt", f"{base}.md", f"{base}.json.diff"}
    return names


def outputs(harness: Path, part: tuple[int, int] = (0, 1)) -> dict[str, str]:
    """Every golden file's text, keyed by its path under tests/golden/. ``part`` (i, n) renders only the
    i-th of n slices (the test spreads the render over processes): --help and the bad command lines in the
    first, every n-th result from the i-th, and results.status holding only that slice's lines."""
    i, n = part
    mod = load(harness)
    got: dict[str, str] = {}
    saved = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            if i == 0:
                code, out, err = call(mod.main, ["--help"])
                got["help.txt"] = f"exit {code}\n{out}"
                bad = []
                for argv in BAD:
                    code, out, err = call(mod.main, argv)
                    bad.append(f"$ {quoted(argv)}\nexit {code}, stdout {'empty' if not out else repr(out)}\n"
                               f"{err.strip()}\n")
                got["bad-command-lines.txt"] = "\n".join(bad)
            status = []
            for path in saved_results()[i::n]:
                files, line = result_outputs(mod, path, tmp)
                got.update(files)
                status.append(line)
            got["results.status"] = "\n".join(status) + "\n"
            # Only this run's own folders are masked: a committed result's /tmp paths are its record.
            got = {k: v.replace(os.path.realpath(tmp), "<tmp>").replace(tmp, "<tmp>")
                   .replace(str(ROOT), "<root>") for k, v in got.items()}
        finally:
            os.chdir(ROOT)
            os.environ.clear()
            os.environ.update(saved)
    return got


def recorded() -> dict[str, str]:
    return {str(p.relative_to(GOLDEN)): p.read_text() for p in sorted(GOLDEN.rglob("*")) if p.is_file()}


def record(harness: Path) -> None:
    shutil.rmtree(GOLDEN, ignore_errors=True)
    for name, text in outputs(harness).items():
        (GOLDEN / name).parent.mkdir(parents=True, exist_ok=True)
        (GOLDEN / name).write_text(text)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--record"]:
        sys.exit("usage: python tests/golden.py --record [HARNESS.py]")
    record(Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "issue395_second_stack_vram.py")
