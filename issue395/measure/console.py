"""What the user sees while arms run: Soup's console sent to a per-arm log, the progress line,
Ctrl-C, SIGTERM and SIGHUP.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import stat
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from ..constants import GB
from ..results.row import Row


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """A config's warnings and the hub client's retries are not this tool's one line."""
    from transformers.utils import logging as hf_logging

    verbosity, hub = hf_logging.get_verbosity(), logging.getLogger("huggingface_hub")
    level = hub.level
    hf_logging.set_verbosity_error()
    hub.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hub.setLevel(level)


class StampedLog:
    """A log whose lines carry seconds since the arm began: where setup time goes."""

    def __init__(self, raw: Any):
        self.raw, self.t0, self.at_line_start = raw, time.perf_counter(), True

    def write(self, text: str) -> int:
        for piece in text.splitlines(keepends=True):
            if self.at_line_start:
                self.raw.write(f"[{time.perf_counter() - self.t0:8.3f}s] ")
            self.raw.write(piece)
            self.at_line_start = piece.endswith(("\n", "\r"))
        return len(text)

    def flush(self) -> None:
        self.raw.flush()

    def isatty(self) -> bool:
        return False


LIBRARY_LOGGERS = ("transformers", "trl", "peft", "datasets", "accelerate", "soup_cli",
                   "huggingface_hub", "torch", "bitsandbytes", "py.warnings")


SOUP_MODULES = ("datasets", "peft", "trl", "soup_cli.config.loader", "soup_cli.data.loader", "soup_cli.trainer.sft",
                "soup_cli.trainer.stream_setup", "soup_cli.utils.layer_stream",
                "soup_cli.utils.layer_stream_runtime", "soup_cli.data.sft_format")


@contextlib.contextmanager
def soup_console(log_path: Path, verbose: bool) -> Iterator[None]:
    """Rich consoles and logging handlers bind their stream when created, so a plain stdout
    redirect would miss them: each is pointed at the log too. Soup's modules are imported inside
    the redirect (so their consoles exist to be redirected, and what a library says as it loads,
    e.g. bitsandbytes' "Failed to load CPU gemm_4bit_forward" on every run, lands in the log)."""
    if verbose:
        for name in SOUP_MODULES:
            importlib.import_module(name)
        yield
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as raw:
        fh = StampedLog(raw)
        handler = logging.StreamHandler(fh)
        saved = []
        for name in ("",) + LIBRARY_LOGGERS:
            lg = logging.getLogger(name)
            saved.append((lg, lg.handlers[:], lg.propagate))
            lg.handlers, lg.propagate = [handler], not name
        consoles: dict[int, tuple[Any, Any]] = {}
        try:
            with contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
                for name in SOUP_MODULES:
                    importlib.import_module(name)
                consoles = {id(c): (c, c._file) for m, mod in list(sys.modules.items())
                            if m.startswith("soup_cli") and hasattr(c := getattr(mod, "console", None), "_file")}
                for con, _ in consoles.values():
                    con.file = fh
                yield
        finally:
            for con, original in consoles.values():
                con._file = original  # rich keeps None ("stdout at print time") here
            for lg, handlers, propagate in saved:
                lg.handlers, lg.propagate = handlers, propagate


class Stop:
    """Ctrl-C during an arm stops after that arm; a second Ctrl-C, a first one with no arm in
    flight (set-up, a checkpoint build), SIGTERM, or SIGHUP (the terminal or ssh session closed)
    stops now, by KeyboardInterrupt, so the scratch folder is removed and the rows so far are
    kept. The runner marks each arm ``with Stop.arm():``."""

    requested = False
    in_flight = 0  # arms running now (``Stop.arm``)
    #: Every arm is measured and judged: what is left (tables, outputs, the scratch folder's
    #: removal) finishes a complete run, so a first Ctrl-C here is noted, not a stop.
    finishing = False
    #: Called on a first Ctrl-C that waits: children in their own process group never see the
    #: terminal's Ctrl-C, so the parent passes it on and each stops after its own arm in flight.
    relays: list[Callable[[], None]] = []

    @classmethod
    @contextlib.contextmanager
    def arm(cls) -> Iterator[None]:
        """An arm (or the children running arms) in flight: a first Ctrl-C waits for it."""
        cls.in_flight += 1
        try:
            yield
        finally:
            cls.in_flight -= 1

    @classmethod
    def finish(cls) -> None:
        """Measuring is over (whether or not a stop cut it short): what follows only reports it."""
        cls.finishing = True

    @classmethod
    def install(cls, quiet: bool = False) -> None:
        cls.in_flight, cls.finishing = 0, False

        def say(text: str) -> None:
            if not quiet:  # sys.stderr may be an arm's Soup log now; the user must see this
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    print(f"\ninterrupt: {text}", file=sys.__stderr__, flush=True)

        def on_int(signum: int, frame: Any) -> None:
            if cls.requested:
                raise KeyboardInterrupt
            if cls.finishing:  # the run counts as complete: its outputs say so and it exits as such
                cls.requested = True  # a second Ctrl-C stops now
                say("every arm is measured: writing the outputs of the complete run "
                    "(Ctrl-C again to stop now)")
                return
            cls.requested = True
            if not cls.in_flight:
                say("no arm in flight: stopping now")
                raise KeyboardInterrupt
            say("stopping after the arm in flight (Ctrl-C again to stop now)")
            for relay in list(cls.relays):
                relay()

        def on_term(signum: int, frame: Any) -> None:
            cls.requested = True
            raise KeyboardInterrupt

        def on_hup(signum: int, frame: Any) -> None:
            terminal_gone()
            on_term(signum, frame)

        with contextlib.suppress(ValueError):  # not the main thread
            signal.signal(signal.SIGINT, on_int)
            signal.signal(signal.SIGTERM, on_term)
            if hasattr(signal, "SIGHUP"):
                signal.signal(signal.SIGHUP, on_hup)


def terminal_gone() -> None:
    """After a hang-up, writing to the closed terminal fails (EIO): stdout and stderr that were
    that terminal (a character device) now write to /dev/null, so the rows are still saved (--json) and the scratch
    folder still removed. Streams redirected to files or pipes are left alone."""
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            for fd in (1, 2):
                with contextlib.suppress(OSError):
                    if stat.S_ISCHR(os.fstat(fd).st_mode):  # a hung-up tty may fail isatty
                        os.dup2(null, fd)
        finally:
            os.close(null)


class Progress:
    """A live bar with the time left on stderr when it is a terminal (rich comes with Soup);
    otherwise one line per finished arm: i/n, the arm, its status and peak, time left."""

    def __init__(self, total: int, started: float):
        self.total, self.started, self.done, self.bar = total, started, 0, None
        self.first_done: float = 0.0  # elapsed when the first arm finished (imports, first setup)
        if sys.stderr.isatty() and total > 1:
            with contextlib.suppress(ImportError):
                from rich.console import Console
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )
                from rich.progress import Progress as Bar

                self.bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TimeElapsedColumn(), TimeRemainingColumn(),
                               console=Console(file=sys.__stderr__), transient=True)
                self.task = self.bar.add_task("arms", total=total)
                self.bar.start()

    def arm(self, row: Row) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.started
        peak = f"{row.real_peak / GB:.4f} GB" if row.measured else "no peak"
        what = f"{row.label} {row.quant + ' ' if row.quant != 'none' else ''}seq {row.seq} batch {row.batch}"
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done, description=f"{what}: {row.status}, {peak}")
            return
        remaining = max(self.total - self.done, 0)
        if self.done == 1:
            self.first_done = elapsed
        if not remaining:
            eta = "~0 s left"
        elif self.done < 2:  # the first arm carries the imports and first setup: not a rate
            eta = "time left: estimating"
        else:
            eta = f"~{(elapsed - self.first_done) / (self.done - 1) * remaining:.0f} s left"
        print(f"[arm {self.done}/{self.total}] {what}: {row.status}, {peak}; elapsed {elapsed:.1f} s, "
              f"{eta}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
