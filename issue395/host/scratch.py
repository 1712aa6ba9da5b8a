"""Everything the tool writes outside its outputs goes in one scratch folder, removed at exit;
folders left by killed runs are reaped.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional

from ..errors import UsageError
from ..measure.builder import safetensors_problem

SCRATCH_PREFIX = "issue395-scratch-"


def writable_folder(flag: str, folder: str, given: Optional[str] = None) -> None:
    """A folder the tool may write into: it exists, or the nearest one above it is writable.
    ``given`` is the value on the command line when the folder is an output file's."""
    if not folder.strip():
        raise UsageError(f"{flag}: the path is empty; give a folder")
    named = f"{flag} {given if given is not None else folder}"
    p = Path(folder).expanduser().absolute()
    if p.exists() and not p.is_dir():
        raise UsageError(f"{named}: {p} is not a folder" if given is not None else f"{named}: not a folder")
    while not p.exists():
        p = p.parent
    if not p.is_dir() or not os.access(p, os.W_OK) or not can_make_in(p):
        raise UsageError(f"{named}: {'its folder ' if given is not None else ''}{p} cannot be written")


def can_make_in(folder: Path) -> bool:
    """A folder can be made in ``folder``: tried, and removed (os.access says yes to root on /proc,
    and a read-only mount answers only when written)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".issue395-probe-", dir=folder))
    except OSError:
        return False
    return True


def process_start(pid: int) -> Optional[str]:
    """A process's start time (Linux), so a reused pid is not taken for the owner."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_alive(folder: Path) -> bool:
    """Whether the run that made a scratch folder still runs: its pid is in the name, its
    start time in the folder's owner file."""
    m = re.match(rf"{SCRATCH_PREFIX}(\d+)-", folder.name)
    if not m:
        return True  # not ours to judge
    pid = int(m.group(1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        started = (folder / "owner").read_text().split()[1]
    except (OSError, IndexError):
        return True  # still being made
    return process_start(pid) in (None, started)


def reap_dead_scratch(tmp: Path) -> None:
    """Remove scratch left by killed runs (SIGKILL runs no clean-up); a running run's stays."""
    for folder in tmp.glob(SCRATCH_PREFIX + "*"):
        if folder.is_dir() and not folder.is_symlink() and not owner_alive(folder):
            shutil.rmtree(folder, ignore_errors=True)


class Scratch:
    """One folder for data, Soup output, shards and checkpoints; removed at exit. Soup ignores
    its cache variable outside $HOME, the working directory and $TMPDIR, so the root it really
    resolves is checked: a shard cache escaped to ~/.soup would outlive the run."""

    def __init__(self, cache_dir: Optional[str] = None, shard_dir: Optional[str] = None):
        self.cache_dir = Path(cache_dir).resolve() if cache_dir else None
        # --shard-dir: Soup's shards on their own volume (/dev/shm), the checkpoints where they were
        self.shard_dir = Path(shard_dir).resolve() if shard_dir else None
        self.root: Optional[Path] = None
        self._saved: dict[str, Optional[str]] = {}

    def __enter__(self) -> "Scratch":
        tmp = Path(tempfile.gettempdir())
        reap_dead_scratch(tmp)
        self.root = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=tmp))
        (self.root / "owner").write_text(f"{os.getpid()} {process_start(os.getpid())}\n")
        self.shard_root = (self.shard_dir or self.cache_dir or self.root) / "layer-stream"
        self.shard_root.mkdir(parents=True, exist_ok=True)
        env = {"SOUP_LAYER_STREAM_CACHE_DIR": str(self.shard_root),
               "SOUP_AUDIT_LOG_PATH": str(self.root / "soup-audit.jsonl"),
               "HF_HOME": str(self.root / "hf"), "HF_DATASETS_CACHE": str(self.root / "hf" / "datasets"),
               "XDG_CACHE_HOME": str(self.root / "xdg"), "TRITON_CACHE_DIR": str(self.root / "triton"),
               "TORCHINDUCTOR_CACHE_DIR": str(self.root / "inductor"),
               "MPLCONFIGDIR": str(self.root / "mpl"),
               # An unreachable hub should fail fast, not retry for half a minute.
               "HF_HUB_ETAG_TIMEOUT": os.environ.get("HF_HUB_ETAG_TIMEOUT", "10"),
               "HF_HUB_DOWNLOAD_TIMEOUT": os.environ.get("HF_HUB_DOWNLOAD_TIMEOUT", "20")}
        self._saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        return self

    def __exit__(self, *exc: Any) -> None:
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    def path(self, *parts: str) -> Path:
        assert self.root is not None
        p = self.root.joinpath(*parts)
        p.mkdir(parents=True, exist_ok=True)
        return p

    def checkpoint_root(self) -> Path:
        root = (self.cache_dir or self.root) / "checkpoints"
        root.mkdir(parents=True, exist_ok=True)
        return root

    def verify_shard_root(self) -> None:
        """Fail loudly if Soup would put its shard cache anywhere but here."""
        real = os.path.realpath(soup_shard_root())
        if real != os.path.realpath(self.shard_root):
            raise UsageError(f"Soup would write its layer-stream shard cache to {real}, not "
                             f"{self.shard_root}: {'--shard-dir' if self.shard_dir else '--cache-dir'} must "
                             "lie under $HOME, the working directory or the temp dir")

    @contextlib.contextmanager
    def sharding(self, base: str) -> Iterator[None]:
        """Processes sharing a shard cache must not shard one model at once: until its shards are
        cached, a model's first arm holds a lock on them; once they are, nobody waits."""
        import fcntl

        from soup_cli.utils.layer_shard import resolve_shard_dir

        folder = Path(resolve_shard_dir(base))
        if (folder / "index.json").exists():
            yield
            return
        with open(self.shard_root / f".{folder.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def repair_shards(self, base: str) -> None:
        """A cached shard set that cannot be read is removed, so Soup re-shards it: Soup itself
        checks only that its shard files exist."""
        from soup_cli.utils.layer_shard import resolve_shard_dir

        folder = Path(resolve_shard_dir(base))
        if not (folder / "index.json").exists():
            return  # nothing cached, or another process is sharding it now (Soup writes index.json last)
        problems = [p for p in (safetensors_problem(f) for f in sorted(folder.glob("*.safetensors"))) if p]
        try:
            json.loads((folder / "index.json").read_text())
        except (OSError, ValueError):
            problems.append("index.json cannot be read")
        if problems:
            print(f"note: Soup's cached shards in {folder} are damaged ({problems[0]}); "
                  "removing them so Soup shards again", file=sys.stderr, flush=True)
            shutil.rmtree(folder, ignore_errors=True)


def soup_shard_root(override: Optional[str] = None) -> str:
    """Where Soup will really put its shard cache, by Soup's own resolution; with
    ``override``, where it would were SOUP_LAYER_STREAM_CACHE_DIR that folder."""
    from soup_cli.utils import layer_shard
    from soup_cli.utils.paths import is_under

    key = "SOUP_LAYER_STREAM_CACHE_DIR"
    saved = os.environ.get(key)
    if override is not None:
        os.environ[key] = override
    try:
        return layer_shard._resolve_cache_root(None, is_under)
    finally:
        if override is not None:
            os.environ.pop(key, None) if saved is None else os.environ.__setitem__(key, saved)


def shard_dir_of(given: Optional[str]) -> Optional[str]:
    """--shard-dir: Soup's shard cache on its own volume (absolute); refused where Soup would ignore it."""
    if given is None:
        return None
    writable_folder("--shard-dir", given)
    folder = os.path.abspath(os.path.expanduser(given))
    shards = os.path.join(os.path.realpath(folder), "layer-stream")
    if os.path.realpath(soup_shard_root(shards)) != shards:
        raise UsageError(f"--shard-dir {given} is outside $HOME, the working directory and the temp dir; "
                         "Soup would ignore it and write its shard cache to ~/.soup instead "
                         "(on /dev/shm: set TMPDIR=/dev/shm)")
    return folder


def cache_dir_of(given: Optional[str], shard_dir: Optional[str]) -> Optional[str]:
    """--cache-dir (absolute), refused where Soup would silently ignore it for its shard cache (it
    would write to ~/.soup instead); with --shard-dir Soup never reads it. Soup's own resolution
    decides (a light import: neither torch nor the hub client)."""
    cache = os.path.abspath(os.path.expanduser(given)) if given else None
    if cache and shard_dir is None:
        shards = os.path.join(os.path.realpath(cache), "layer-stream")
        if os.path.realpath(soup_shard_root(shards)) != shards:
            raise UsageError(f"--cache-dir {given} is outside $HOME, the working directory and the temp "
                             "dir; Soup would ignore it and write its shard cache to ~/.soup instead")
    return cache

