"""The command line settled once into one typed request (issue395.run.request): the checks every mode
shares (its outputs, its inputs), then the mode it asks for, by ``MODES``, whose own module settles its
request and executes it (issue395.run.runner dispatches on the request's type). A new mode is one
request and one module, listed here.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import UsageError
from ..results.saved import RowFile
from . import estimate_mode, find_max_mode, measure_mode, patchout, rerender_mode
from .checks import (PLOT_NEEDS, _shown, check_output, config_is_a_file, never_replaced, no_output_is_an_input,
                     require_installed)
from .clashes import check
from ..host.measured import MeasureRequest
from .request import CardListRequest, EstimateRequest, FindMaxRequest, RerenderRequest, SoupPatchRequest


@dataclass(frozen=True)
class Mode:
    """One mode: its request, whether the command line asks for it, its settle and its execution."""

    request: type
    chosen: Callable[[argparse.Namespace], bool]
    settle: Callable[[argparse.Namespace, list], Any]
    execute: Callable[..., int]


#: --card list, before anything else is read of the command line.
CARD_LIST = Mode(CardListRequest, estimate_mode.card_list_chosen, estimate_mode.settle_card_list,
                 estimate_mode.list_cards)

#: --soup-patch, alone: the diff, nothing measured or estimated.
SOUP_PATCH = Mode(SoupPatchRequest, patchout.chosen, patchout.settle, patchout.execute)

#: The modes after the shared checks, each asked by its own options, the first asked settled (an
#: option another mode takes is refused in its clashes); the measured arms when none other is asked.
MODES = (Mode(RerenderRequest, rerender_mode.chosen, rerender_mode.settle, rerender_mode.execute),
         Mode(FindMaxRequest, find_max_mode.chosen, find_max_mode.settle, find_max_mode.execute),
         Mode(EstimateRequest, estimate_mode.chosen, estimate_mode.settle, estimate_mode.execute),
         Mode(MeasureRequest, measure_mode.chosen, measure_mode.settle, measure_mode.execute))


def settle(args: argparse.Namespace, argv: list[str]) -> Any:
    """Every check that needs no GPU and no Soup setup, before anything runs or prints: the request."""
    if SOUP_PATCH.chosen(args):
        return SOUP_PATCH.settle(args, argv)
    if CARD_LIST.chosen(args):
        return CARD_LIST.settle(args, argv)
    check("settle", args)
    try:
        shared_checks(args)
        request = next(m for m in MODES if m.chosen(args)).settle(args, argv)
        for flag in ("--json", "--markdown", "--plot"):  # after each mode's own: an input is said as one
            never_replaced(flag, getattr(args, flag[2:]))
        return request
    except OSError as exc:  # a path no filesystem takes (a name too long, a loop): one line naming it
        raise UsageError(f"{path_flag(args, exc.filename)} {_shown(str(exc.filename))}: "
                         f"{(exc.strerror or 'cannot be used').lower()}") from None


def path_flag(args: argparse.Namespace, filename: object) -> str:
    """The option whose value an OSError's path came from (or the generic 'a path')."""
    name = str(filename or "")
    for key, value in vars(args).items():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str) and v and (v in name or os.path.expanduser(v) in name):
                return "--" + key.replace("_", "-")
    return "a path:"


def shared_checks(args: argparse.Namespace) -> None:
    """What every mode checks first: its paths as typed (~ expanded), its outputs (writable, each its own
    file, never the soup.yaml), the options that clash beside --from-json and --config."""
    for key in ("json", "markdown", "plot", "log_dir", "snapshot_dir", "compare"):  # as --model is
        if getattr(args, key) not in (None, "-"):
            setattr(args, key, os.path.expanduser(getattr(args, key)))
    if args.from_json:
        args.from_json = [os.path.expanduser(p) for p in args.from_json]
    check("options", args)
    if args.config is not None:
        config_is_a_file(args.config)
    outputs = {f: getattr(args, f.strip("-").replace("-", "_")) for f in ("--json", "--markdown", "--plot")}
    for flag, path in outputs.items():
        if path is not None:
            check_output(flag, path)
    named = [(f, os.path.realpath(p)) for f, p in outputs.items() if p]
    named = [(f, p) for f, p in named if not p.endswith(os.sep + "-") or outputs[f] != "-"]
    named += [("--json's row file", str(RowFile.path_for(args.json)))] if args.json not in (None, "-") else []
    for i, (f, p) in enumerate(named):
        twin = next((g for g, q in named[i + 1:] if q == p), None)
        if twin:
            raise UsageError(f"{f} and {twin} name the same file {p}; each output needs its own path")
    no_output_overwrites_the_config(args, outputs)
    if not args.from_json:  # never replaced: the rows of a run that did not finish (--from-json renders them)
        RowFile.refuse_unfinished(args.json)
    if args.plot is not None:
        require_installed("--plot", PLOT_NEEDS, "pip install matplotlib")
    check("compare", args)


def no_output_overwrites_the_config(args: argparse.Namespace, outputs: dict) -> None:
    """--config's soup.yaml is an input as --model's config is: no output (nor --json's row
    file) may be it under any spelling (../, a symlink, a hard link), in any mode."""
    if args.config is None:
        return
    rows = {"--json's row file": str(RowFile.path_for(args.json))} if args.json not in (None, "-") else {}
    no_output_is_an_input({**outputs, **rows}, [("--config", os.path.expanduser(args.config))])
