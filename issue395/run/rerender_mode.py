"""--from-json: saved results (one, or shards of one run) settled once into a ``RerenderRequest`` and
executed here: re-judged, merged and rendered, maybe beside --compare's; no GPU."""

from __future__ import annotations

import argparse
import sys

from ..errors import EXIT_USAGE, UsageError, last_line
from ..results.merge import merge
from ..results.result import Result
from ..results.saved import RowFile, load_result
from ..report.outputs import render_markdown, write_outputs
from ..report.tables import arm_pairs, compare_table, render_text
from .checks import check_input, no_output_is_an_input, one_int
from ..host.measured import Outputs
from .request import RerenderRequest


def chosen(args: argparse.Namespace) -> bool:
    return bool(args.from_json)


def settle(args: argparse.Namespace, argv: list[str]) -> RerenderRequest:
    """The saved results and --compare's, each an input no output may be."""
    for path in args.from_json + ([args.compare] if args.compare else []):
        check_input("--compare" if path == args.compare else "--from-json", path)
    inputs = [("--from-json", p) for p in args.from_json] + ([("--compare", args.compare)] if args.compare else [])
    no_output_is_an_input({f: getattr(args, f.strip("-")) for f in ("--json", "--markdown", "--plot")}, inputs)
    one_int("--steps", args.steps, 1)  # a bad number is one line, as in every mode
    return RerenderRequest(tuple(args.from_json), args.compare, Outputs.of(args), tuple(argv))


def execute(run: RerenderRequest, protocol: object = None) -> int:
    """Saved results (one, or shards of one run) re-judged, merged and rendered; no GPU. A saved
    result this tool cannot merge, render or compare is one line naming it, never a traceback."""
    results = [load_result(p) for p in run.from_json]
    named = "--from-json " + " ".join(run.from_json)
    odd = [p for p, r in zip(run.from_json, results) if r.kind != results[0].kind]
    if odd:  # e.g. a glob over a folder that holds a sweep beside the map's parts
        raise UsageError(f"--from-json {odd[0]} is a {results[run.from_json.index(odd[0])].kind} among "
                         f"{results[0].kind} parts ({run.from_json[0]}, ...): a map and a sweep do not merge")
    parts = [(p, r.environment) for p, r in zip(run.from_json, results)] if len(results) > 1 else None
    try:
        result = merge(results, f"merged from {len(results)} result(s)") if len(results) > 1 else results[0]
        text = render_text(result)
        if run.outputs.markdown:  # a hand-edited result that cannot become markdown: said before any table
            render_markdown(result, parts)
    except UsageError as exc:
        raise UsageError(f"{named}: {exc}") from None
    except Exception as exc:
        raise UsageError(f"{named}: a saved block cannot be rendered ({last_line(exc)})") from None
    if run.compare:
        other = load_result(run.compare, "--compare")
        if not shares_an_arm(result, other):
            raise UsageError(f"--compare {run.compare}: no arm in common with {named} (no measured arm "
                             "with the same model, quant, seq, batch and repeat in both)")
        try:
            text += "\n" + compare_table(result, other, (", ".join(run.from_json), run.compare)) + "\n"
        except Exception as exc:
            raise UsageError(f"--compare {run.compare}: cannot be compared with {named} ({last_line(exc)})") from None
    print(text, end="")
    try:
        unwritten = write_outputs(result, run.outputs, RowFile(None), parts)
    except Exception as exc:  # rendering the markdown or plot of a hand-edited result
        unwritten = f"{named}: an output cannot be rendered from it ({last_line(exc)})"
    if unwritten:
        print(f"error: {unwritten}", file=sys.stderr)
        return EXIT_USAGE
    return result.exit_code


def shares_an_arm(a: Result, b: Result) -> bool:
    """Whether two results measured an arm in common (tables.arm_pairs, compare_table's own pairing)."""
    try:
        return bool(arm_pairs(a, b))
    except TypeError:  # an unhashable value: compare_table will say what
        return True
