"""The command line (or, in a child, its job file) settled into its request and executed by its mode's
module, chosen by the request's type; bad input is one line.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from ..errors import EXIT_INTERRUPTED, EXIT_USAGE, UsageError
from ..measure.console import Stop
from . import measure_mode
from ..host.arms import Protocol
from .options import CARD_LIST, MODES, SOUP_PATCH, settle
from .parser import build_parser
from ..host.spread import CHILD_JOB, die_with_parent, read_job

#: Each request's execution, by its type.
EXECUTE = {m.request: m.execute for m in (SOUP_PATCH, CARD_LIST, *MODES)}


def cli(argv: list[str], protocol: Protocol) -> int:
    """The command line (or, in a child, its job file) settled and executed; bad input is one line, and so is
    a stdout that cannot be written (a full disk, ``> /dev/full``: issue 53 item 5), never a traceback."""
    out = WatchedStdout(sys.stdout)
    try:
        with contextlib.redirect_stdout(out):
            code = settled_and_executed(list(argv), protocol)
            out.flush()
    except SystemExit:  # --help: argparse swallows its own write's error
        if out.failed is None:
            raise
    except OSError:
        if out.failed is None:
            raise
    return code if out.failed is None else stdout_lost(out.failed)


class WatchedStdout:
    """stdout as the run writes it, its first failure kept (the run's own OSErrors are not stdout's)."""

    def __init__(self, stream: Any) -> None:
        self._stream, self.failed = stream, None

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            self.failed = self.failed or exc
            raise

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            self.failed = self.failed or exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def stdout_lost(exc: OSError) -> int:
    """One line on stderr for a stdout that could not be written, exit 2; stdout then goes to /dev/null so
    the interpreter's own flush at exit does not fail again."""
    print(f"error: stdout cannot be written ({(exc.strerror or str(exc)).lower()}): the answer printed there is "
          "lost; give --json PATH to keep it in a file, or send stdout where it can be written", file=sys.stderr)
    with contextlib.suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.__stdout__.fileno())
        os.close(null)
    return EXIT_USAGE


def settled_and_executed(argv: list[str], protocol: Protocol) -> int:
    """The command line (or a child's job file) settled and executed by its mode; bad input is one line."""
    tolerant_streams()
    try:
        job_file = os.environ.pop(CHILD_JOB, None)
        if job_file:
            die_with_parent()
            run, job = read_job(job_file)
            return measure_mode.execute(run, protocol, job)
        request = settle(build_parser().parse_args(argv), argv)
        # --json -: the JSON is stdout's, so every human line (tables, progress) goes to stderr
        with contextlib.redirect_stdout(sys.stderr) if request.outputs.json == "-" else contextlib.nullcontext():
            return execute(request, protocol)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted while writing the outputs of a complete run: they may be missing or partial"
              if Stop.finishing else "interrupted before any arm ran", file=sys.stderr)
        return EXIT_INTERRUPTED


def tolerant_streams() -> None:
    """A terminal or pipe that cannot encode a character (PYTHONIOENCODING=ascii, LC_ALL=C) shows
    '?' for it: an em dash in a table must never stop the run before its outputs are written."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None and getattr(stream, "errors", "strict") in ("strict", None):
            with contextlib.suppress(Exception):
                reconfigure(errors="replace")


def execute(request: Any, protocol: Protocol) -> int:
    """The request executed by its mode's module."""
    return EXECUTE[type(request)](request, protocol)
