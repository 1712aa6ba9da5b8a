"""The golden check: what the tool prints and writes for every committed result, --help and
bad command lines, as digests. ``python tests/golden.py OUT.json [HARNESS.py]`` records them
from a harness (default: this tree's); tests/test_golden.py holds this tree to the committed
record, so a change in any rendered byte is a deliberate, reviewed change of that file."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

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


def outputs(harness: Path) -> dict[str, str]:
    mod = load(harness)
    got: dict[str, str] = {}
    saved = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            code, out, err = call(mod.main, ["--help"])
            got["--help"] = f"{code} {digest(out)}"
            for argv in BAD:
                code, out, err = call(mod.main, argv)
                got["bad " + " ".join(argv)] = f"{code} {digest(out)} " + err.strip().replace(
                    os.path.realpath(tmp), "<tmp>")
            for path in saved_results():
                rel = str(path.relative_to(ROOT))
                files = [f"{tmp}/o.json", f"{tmp}/o.md", f"{tmp}/o.png"]
                code, out, err = call(mod.main, ["--from-json", str(path), "--json", files[0],
                                                 "--markdown", files[1], "--plot", files[2]])
                got[rel] = f"{code} text {digest(out)} err {digest(err)} " + " ".join(
                    f"{Path(f).suffix[1:]} {digest(Path(f).read_bytes()) if Path(f).exists() else '-'}"
                    for f in files)
                for f in files:
                    Path(f).unlink(missing_ok=True)
        finally:
            os.chdir(ROOT)
            os.environ.clear()
            os.environ.update(saved)
    return got


if __name__ == "__main__":
    harness = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "issue395_second_stack_vram.py"
    Path(sys.argv[1]).write_text(json.dumps(outputs(harness), indent=1, sort_keys=True) + "\n")
