"""Where each model's weights come from: built checkpoints verified before use and rebuilt when
damaged, a builder thread one model ahead, hub snapshots, NF4 aliases.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import UsageError, last_line
from ..record import QUANTS
from ..model.registry import Shape
from ..measure.builder import checkpoint_fingerprint, prepare_checkpoint, safetensors_problem
from ..measure.console import Stop
from ..measure.shapes import config_only
from .cardlock import DiskLedger
from .measured import MeasureRequest
from .scratch import Scratch


def quant_alias(scratch: Scratch, base: str, quant: str) -> Path:
    return (scratch.shard_root.parent / "quant-aliases"
            / f"{Path(base).name}-{hashlib.sha256(base.encode()).hexdigest()[:8]}.{quant}")


def shard_tag(quant: str, stream: tuple = ()) -> str:
    """What Soup shards a base differently by: its quantization, and a per-expert layout."""
    return f"{quant}-per_expert" if dict(stream).get("stream_expert_layout") == "per_expert" else quant


#: Every tag but the base's own ("none", fused): each gets its own alias path.
ALIAS_TAGS = (*QUANTS[1:], *(shard_tag(q, (("stream_expert_layout", "per_expert"),)) for q in QUANTS))


def quant_base(scratch: Scratch, base: str, quant: str, stream: tuple = ()) -> str:
    """Soup keys its shard folder by the base path alone (re-sharding in place on a new quantization),
    so an NF4 arm gets its own path: a symlink beside the shard cache, shared by all who share it.
    A per-expert layout shards differently again, so it gets its own path too."""
    quant = shard_tag(quant, stream)
    if quant == "none":
        return base
    alias = quant_alias(scratch, base, quant)
    alias.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        alias.symlink_to(Path(base).resolve(), target_is_directory=True)
    return str(alias)


def checkpoint_problem(dest: Path) -> Optional[str]:
    """Why a cached synthetic checkpoint cannot be used (None if it can)."""
    try:
        manifest = json.loads((dest / ".complete").read_text())
    except (OSError, ValueError):
        return "no completion marker"
    for name in ("config.json", "tokenizer.json"):
        if not (dest / name).is_file():
            return f"{name} is missing"
    return safetensors_problem(dest / "model.safetensors", manifest)


def synthetic_checkpoint(shape: Shape, root: Path) -> tuple[Path, float]:
    """The built checkpoint of ``shape`` under ``root`` and the seconds spent building it."""
    started = time.perf_counter()
    dest, building = start_checkpoint(shape, root)
    return dest, 0.0 if building is None else time.perf_counter() - started


def checkpoint_name(shape: Shape) -> str:
    return f"{shape.key}-{checkpoint_fingerprint(shape)}"


def start_checkpoint(shape: Shape, root: Path,
                     writer: Any = None) -> tuple[Path, Optional[Callable[[], Path]]]:
    """The checkpoint of ``shape`` under ``root``, and None if it verified, else a call that waits
    for its weights (written by ``writer``, an executor, when given); a damaged one is rebuilt."""
    dest = root / checkpoint_name(shape)
    problem = checkpoint_problem(dest) if dest.exists() else None
    if dest.exists() and problem is None:
        return dest, None
    if problem:
        print(f"note: cached checkpoint {dest} is damaged ({problem}); rebuilding it",
              file=sys.stderr, flush=True)
    partial = root / f".{dest.name}.partial-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    write = prepare_checkpoint(shape, partial)

    def finish() -> Path:
        try:  # a Ctrl-C or SIGTERM stops the writer between tensors: nothing half-built is left
            (partial / ".complete").write_text(json.dumps(write(stop=lambda: Stop.requested)))
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        if dest.exists() and checkpoint_problem(dest) is not None:
            shutil.rmtree(dest, ignore_errors=True)
        try:
            partial.rename(dest)
        except OSError:  # another process built the same checkpoint first: theirs is as good
            shutil.rmtree(partial, ignore_errors=True)
        return dest

    if writer is None:
        finish()
        return dest, lambda: dest
    return dest, writer.submit(finish).result


def building(shape: Shape) -> None:
    """Said before the wait, terminal or not: a 7B model's weights take minutes to write on CPU."""
    print(f"building {shape.name}'s synthetic checkpoint (architecture-exact weights, written on CPU; --cache-dir "
          "keeps it for the next run) ...", file=sys.stderr, flush=True)


def built(seconds: float) -> None:
    print(f"  built in {seconds:.1f} s (measured)", file=sys.stderr, flush=True)


class Checkpoints:
    """Where each model's weights come from: synthetic ones built by a thread one model ahead,
    overlapping this model's arms. Without --cache-dir a model's checkpoint and shards go once
    its last arm is done: the map's families would not fit a GPU box's disk together."""

    def __init__(self, keys: list[str], shapes: dict[str, Shape], run: MeasureRequest, scratch: Scratch,
                 disk: Optional[DiskLedger] = None, shard_sets: Optional[dict[str, int]] = None):
        self.shapes, self.run, self.scratch, self.keys = shapes, run, scratch, keys
        self.shard_sets = shard_sets or {}  # each family's shard folders its arms make (shard_tag)
        # the disk's share is only asked where a release frees it: a --cache-dir keeps every checkpoint
        self.disk = None if run.cache_dir else disk
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        self.paths: dict[str, str] = {}
        self.pending: dict[str, tuple[Callable[[], Path], float]] = {}
        self.build_s: dict[str, float] = {}
        reap_dead_partials(scratch.checkpoint_root())
        self.start(keys[0] if keys else None)

    def start(self, key: Optional[str], now: bool = True) -> None:
        """Its build started (``now``: the lane needs it next and waits for the disk; else one ahead,
        started only where the disk holds it beside the lanes' others)."""
        if key is not None and key != "custom" and self.run.weights == "synthetic" \
                and key not in self.pending and key not in self.paths:
            if not self.disk_share(key, now):
                return
            started = time.perf_counter()
            dest, building = start_checkpoint(self.shapes[key], self.scratch.checkpoint_root(), self.writer)
            if building is None:
                self.paths[key] = str(dest)  # cached: nothing is built, nothing is timed
            else:
                self.pending[key] = (building, started)

    def disk_share(self, key: str, now: bool) -> bool:
        """Whether ``key``'s build may start: its bytes held in the lanes' disk ledger (a sound cached
        one holds none). Charged the checkpoint's bytes, and where Soup's shards go to the same disk,
        as many again for each shard folder the family's arms make (shard_tag: a quantization, a
        layout), all kept until its release: a bf16 set is the layers' bytes, an NF4 one less."""
        shape = self.shapes[key]
        root = self.scratch.checkpoint_root()
        cached = root / checkpoint_name(shape)
        if self.disk is None or (cached.exists() and checkpoint_problem(cached) is None):
            return True
        shards = Path(self.scratch.shard_root)
        same = shards.exists() and os.stat(shards).st_dev == os.stat(root).st_dev
        size = shape.checkpoint_bytes * (1 + max(1, self.shard_sets.get(key, 1)) if same else 1)
        if not now:
            return self.disk.try_hold(key, size)
        waited = self.disk.hold(key, size)
        if waited >= 1.0:
            print(f"note: {shape.name}'s checkpoint ({size / 1e9:.1f} GB with its shards where they share its "
                  f"disk, computed) waited {waited:.0f} s (measured) for other lanes to free the disk",
                  file=sys.stderr, flush=True)
        return True

    def release(self, key: str) -> None:
        """A model's built checkpoint and Soup's shards of it, gone (scratch only)."""
        from soup_cli.utils.layer_shard import resolve_shard_dir

        path = self.paths.pop(key, None)
        if path and not self.run.cache_dir and Path(path).is_relative_to(self.scratch.root):
            shutil.rmtree(resolve_shard_dir(path), ignore_errors=True)
            for quant in ALIAS_TAGS:  # the aliases its arms made
                alias = quant_alias(self.scratch, path, quant)
                if os.path.lexists(alias):
                    shutil.rmtree(resolve_shard_dir(str(alias)), ignore_errors=True)
                    alias.unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)
        if self.disk is not None:
            self.disk.release(key)
        self.paths[key] = ""  # never rebuilt in this run

    def get(self, key: str) -> str:
        self.start(key)
        following = self.keys[self.keys.index(key) + 1:] if key in self.keys else []
        if following:
            self.start(following[0], now=False)  # one model ahead, built while this one's arms run
        if self.paths.get(key):
            return self.paths[key]
        if key in self.pending:
            building(self.shapes[key])
            wait, started = self.pending.pop(key)
            path = wait()
            self.build_s[key] = round(time.perf_counter() - started, 2)
            built(self.build_s[key])
        elif key == "custom" and config_only(self.run.arm.checkpoint):
            building(self.shapes[key])
            path, self.build_s[key] = synthetic_checkpoint(self.shapes[key], self.scratch.checkpoint_root())
            built(self.build_s[key])
        elif key == "custom":
            model = self.run.arm.checkpoint
            path = Path(model).resolve() if Path(model).exists() else hub_snapshot(model, self.scratch)
        else:
            path = hub_snapshot(self.shapes[key].hub_id, self.scratch)
        self.paths[key] = str(path)
        return self.paths[key]

    def close(self) -> None:
        self.writer.shutdown(wait=True, cancel_futures=True)
        for partial in self.scratch.checkpoint_root().glob(f".*.partial-{socket.gethostname()}-{os.getpid()}"):
            shutil.rmtree(partial, ignore_errors=True)  # a build cancelled before it ran


def reap_dead_partials(root: Path) -> None:
    """Half-built checkpoints whose builder is gone (SIGKILL runs no clean-up) are removed."""
    for folder in root.glob(".*.partial-*"):
        m = re.fullmatch(r"\..+?\.partial-(?:(.+)-)?(\d+)", folder.name)
        if not m or m.group(1) not in (None, socket.gethostname()) or not folder.is_dir() \
                or folder.is_symlink():
            continue
        try:
            os.kill(int(m.group(2)), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:
            pass


def hub_snapshot(repo_id: str, scratch: Scratch) -> Path:
    """A hub checkpoint fetched into scratch (or --cache-dir), so Soup reads a local folder:
    Soup's own hub path would cache the weights under ~/.soup, outside scratch."""
    from huggingface_hub import snapshot_download

    root = (scratch.cache_dir / "hub") if scratch.cache_dir else scratch.path("hub")
    try:
        return Path(snapshot_download(repo_id, local_dir=str(root / repo_id.replace("/", "--")),
                                      allow_patterns=["*.safetensors", "*.json", "*.txt", "*.model",
                                                      "*.jinja"]))
    except Exception as exc:
        raise UsageError(f"cannot fetch {repo_id} from the hub ({last_line(exc)}); "
                         "--weights synthetic builds the same shapes with no network") from None
