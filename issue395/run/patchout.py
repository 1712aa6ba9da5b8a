"""--soup-patch OUT.diff: the unified diff that makes the installed soup-cli's own gates (streamed and
resident) compare this tool's corrected peak (issue395.estimator.soup_patch), written safely. It runs
nothing else, so it is settled before anything else of the command line and stands alone on it. No
torch, no Soup import: Soup is read from its source.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..errors import EXIT_OK, UsageError
from ..estimator.releases import PATCH_MODULE, installed_release, soup_dir
from ..estimator.soup_number import patched
from ..estimator.soup_patch import NO_RESIDENT_GATE, soup_patch
from ..report.outputs import write_output
from .checks import check_output, never_replaced
from .request import SoupPatchRequest


def chosen(args: argparse.Namespace) -> bool:
    return args.soup_patch is not None


def settle(args: argparse.Namespace, argv: list[str]) -> SoupPatchRequest:
    """The command line holds --soup-patch alone; its path is a file outside the installed soup_cli,
    which is a release's own source (never one already patched)."""
    others = sorted({w.split("=")[0] for w in argv if w.startswith("--")} - {"--soup-patch"})
    if others:
        raise UsageError(f"--soup-patch writes the diff and runs nothing else: it stands alone (not with "
                         f"{', '.join(others)})")
    path = os.path.expanduser(args.soup_patch)
    check_output("--soup-patch", path)
    never_replaced("--soup-patch", path)
    src = soup_dir()
    if os.path.realpath(path).startswith(os.path.realpath(src) + os.sep):
        raise UsageError(f"--soup-patch {path} is inside the installed soup_cli ({src}), which the diff is made "
                         "from: give a path outside it")
    if patched(src) is not None:
        raise UsageError(f"--soup-patch: the installed soup_cli ({src}) is already patched ({patched(src)}); "
                         "the diff is made against a release's own source: reinstall soup-cli first")
    return SoupPatchRequest(path, str(src), tuple(argv))


def execute(request: SoupPatchRequest, protocol: Any = None) -> int:
    """Write the diff; say what it is and how to apply it."""
    src = Path(request.soup_cli)
    diff = soup_patch(src)
    try:
        write_output(request.path, diff.encode("utf-8"))
    except OSError as exc:
        raise UsageError(f"--soup-patch {request.path}: cannot be written "
                         f"({(exc.strerror or str(exc)).lower()})") from None
    where = os.path.abspath(request.path)
    resident = "+++ b/soup_cli/commands/train.py" in diff
    print(f"--soup-patch: wrote {request.path} ({diff.count(chr(10)):,} lines): soup-cli {installed_release()}'s own "
          f"gates compare this tool's corrected peak; it adds soup_cli/{PATCH_MODULE} (this tool's estimator, "
          "generated from its source) and patches soup_cli/trainer/stream_setup.py (_stream_budget_lines, the "
          "streamed gate)" + (" and soup_cli/commands/train.py (_hardware_fit_preflight, the resident gate; train, "
                              "expandable segments before detect_device)" if resident else ""))
    if not resident:
        print(f"  {NO_RESIDENT_GATE}")
    print(f"  apply it: cd {src.parent} && patch -p1 --dry-run < {where} && patch -p1 < {where}")
    return EXIT_OK
