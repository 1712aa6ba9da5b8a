"""Running what a Run asks for: the arms in this process or spread over children, the modes,
and saved results re-rendered.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

from ..tasks import PROTOCOL_TASK
from ..errors import EXIT_FINDING, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError, last_line
from ..model.arm import Arm
from ..model.registry import SHAPES, Shape, family_of
from ..results.merge import merge
from ..results.result import Result, row_order
from ..results.row import Row
from ..results.saved import RowFile, load_result
from ..results.schema import SCHEMA, TOOL
from ..results.stack import environment
from ..measure.console import Progress, Stop
from ..measure.cuda import control_step, positive_control
from ..measure.margin import margin_arms, margin_breakdown
from ..measure.measurement import Measurement, run_arm
from ..measure.modes import measure_mode, sdpa_mode
from ..measure.shapes import family_shape, load_custom_shape, not_on_map, registry_shape, with_modes
from ..report.outputs import render_markdown, render_plot, write_output
from ..report.tables import compare_table, render_text
from .cardlock import CardHold, CardLock, lane_order
from .checkpoints import Checkpoints, quant_base
from .checks import within_positions
from .search import find_max_run
from .grid import past_positions, plan_arms, shard_of
from .options import Run, grid_arms, settle
from .parser import NO_CUDA, build_parser
from .probes import min_free_arms
from .scratch import Scratch
from .spread import (CHILD_JOB, Job, Lanes, die_with_parent, gpu_total_bytes, plan_lanes, read_job, spread,
                     visible_gpu_count)


@dataclass(frozen=True)
class Protocol:
    """What the entry script hands the package: its measured arm, the device its step runs on
    (the CPU tests set "cpu"), the script itself, which every child process runs, and its task rows
    (--find-max's probes train on the protocol's rows)."""

    measure_arm: Callable[..., Measurement]
    step_device: str
    script: str
    task_rows: Optional[Callable[..., list]] = None

    def run_arm(self, arm: Arm, shape: Shape, base: str, work: Path, **options: Any) -> Row:
        """One arm measured by the protocol and judged into its row."""
        return run_arm(self.measure_arm, self.step_device, arm, shape, base, work, **options)


def cli(argv: list[str], protocol: Protocol) -> int:
    """The command line (or, in a child, its job file) settled and executed; bad input is one line."""
    argv = list(argv)
    tolerant_streams()
    try:
        job_file = os.environ.pop(CHILD_JOB, None)
        if job_file:
            die_with_parent()
            run, job = read_job(job_file)
            return execute(run, protocol, job)
        run = settle(build_parser().parse_args(argv), argv)
        # --json -: the JSON is stdout's, so every human line (tables, progress) goes to stderr
        with contextlib.redirect_stdout(sys.stderr) if run.outputs.json == "-" else contextlib.nullcontext():
            return execute(run, protocol)
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


def sweep(arms: list[Arm], shapes: dict[str, Shape], bases: Checkpoints, scratch: Scratch,
          run: Run, run_arm: Callable[..., Row], on_row: Callable[[Row], None],
          on_margin: Optional[Callable[[dict[str, Any]], None]] = None) -> None:
    """Every arm, in grid order, in this process; Ctrl-C stops after the arm in flight. With
    ``on_margin`` (the map), a model's tightest arm and any UNDER run again under the allocator
    history once its arms are done, to say where the margin goes."""
    checked: set[tuple[str, str]] = set()
    done: list[Row] = []
    lock = CardLock(run.children.card_lock) if run.children.card_lock else None
    hold = CardHold(lock)
    whole = set(run.children.whole_card)
    if lock is not None:  # a family's whole-card arms back to back: one drain of the other lanes, not one each
        arms = lane_order(arms, whole, family_of)

    def card(a: Arm, following: Optional[Arm] = None) -> Any:
        """A lane of the map holds its GPU's card for the arm, alone for a whole-card arm, from before
        Soup's setup to after the teardown, which frees the allocator, and on to ``following`` when it
        needs the card alone too. Taken outside Stop.arm: a Ctrl-C while it waits for the card stops now."""
        return hold.arm(a.index in whole, following is not None and following.index in whole)

    for i, arm in enumerate(arms):
        if Stop.requested:
            break
        # A family's streaming modes share its checkpoint: it is built once, released after the last.
        family = family_of(arm.model)
        base = quant_base(scratch, bases.get(family), arm.quant, shapes[arm.model].stream)
        first = (arm.model, arm.quant) not in checked
        if (run.cache_dir or run.shard_dir) and first:
            scratch.repair_shards(base)
        checked.add((arm.model, arm.quant))
        log = (Path(run.log_dir) / f"soup-{arm.index:03d}-{arm.model}-{arm.seq}-b{arm.batch}{task_tag(arm)}.log"
               if run.log_dir else None)
        following = arms[i + 1] if i + 1 < len(arms) and family_of(arms[i + 1].model) == family else None
        with card(arm, following), scratch.sharding(base) if first else contextlib.nullcontext(), Stop.arm():
            row = run_arm(arm, shapes[arm.model], base, scratch.path("arms", f"{arm.index:03d}"),
                          dry_run=run.dry_run, snapshot=run.snapshot, snapshot_dir=run.snapshot_dir,
                          log=log, verbose=run.verbose, repeat=run.children.repeat_tag, steps=run.steps,
                          constraint=run.constraints.for_arm(run.context),
                          **({"soup_config": run.adapter.soup_config} if run.adapter.soup_config else {}))
        on_row(row)
        done.append(row)
        if any(family_of(a.model) == family for a in arms[i + 1:]):
            continue
        if on_margin is not None:
            mine = [r for r in done if family_of(r.model_key) == family]
            again = mine if run.snapshot else []
            for a in [] if run.snapshot else margin_arms(mine):
                if Stop.requested:
                    break
                with card(a), Stop.arm():
                    again.append(run_arm(a, shapes[a.model], quant_base(scratch, bases.get(family), a.quant,
                                                                         shapes[a.model].stream),
                                         scratch.path("arms", f"{a.index:03d}-margin"), snapshot=True,
                                         log=log, verbose=run.verbose, steps=run.steps))
            for r in again:
                if r.attribution and r.measured and r.soup_predicted:
                    on_margin(margin_breakdown(r))
        bases.release(family)
    hold.release()  # a stop between two whole-card arms: the other lanes get the card back


def task_tag(arm: Arm) -> str:
    """A file name's mark of a task other than SFT (the protocol's names stay as they were)."""
    return "" if arm.task == PROTOCOL_TASK else f"-{arm.task}"


def execute(run: Run, protocol: Protocol, job: Optional[Job] = None) -> int:
    """Every mode asked for. Rows are printed and saved whatever stops the run."""
    started = time.perf_counter()
    if run.from_json:
        return rerender(run)
    if run.find_max:
        return find_max_run(run, protocol)
    if run.estimate:
        return estimate_run(run)
    Stop.install(quiet=run.children.child)
    lanes = None
    if run.children.lanes is not None and run.run_arms:  # the card's total, from the driver: no torch in a parent
        gpu = run.children.gpus[0] if run.children.gpus else None
        lanes = plan_lanes(run, grid_arms(run), None if run.dry_run else gpu_total_bytes(gpu))
    fan_out = run.run_arms and bool(run.children.gpus or run.isolate or (lanes and lanes.count > 1))
    local = (run.run_arms and not fan_out) or ((run.measure or run.sdpa) and not fan_out and not run.repeats)
    if run.children.gpus is None and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"  # Soup refuses to stream with several GPUs visible
    if (fan_out or run.repeats) and not run.dry_run:
        count = visible_gpu_count()
        if count == 0:
            raise UsageError(NO_CUDA)
        missing = [g for g in run.children.gpus or () if g >= count]
        if missing:
            raise UsageError(f"--gpus: GPU {missing[0]} is not there ({count} CUDA device(s) visible)")
    with Scratch(run.cache_dir, run.shard_dir) as scratch:
        return measure_all(run, protocol, job, scratch, started, local, fan_out, lanes)


def measure_all(run: Run, protocol: Protocol, job: Optional[Job], scratch: Scratch, started: float,
                local: bool, fan_out: bool, lanes: Optional[Lanes] = None) -> int:
    imports_s = 0.0
    if job is not None:  # a child: exactly the arms its parent dealt it
        arms = list(job.arms)
    else:
        arms = grid_arms(run)
        arms = shard_of(arms, run.children.shard, whole_models=run.map) if run.children.shard else arms
    shapes = dict(SHAPES)
    if local:
        t = time.perf_counter()
        import torch

        if not run.dry_run and protocol.step_device == "cuda" and not torch.cuda.is_available():
            raise UsageError(NO_CUDA)
        scratch.verify_shard_root()
        # the LoRA adapter a --config file names, else the protocol's (targets None: the model's own)
        adapter = dict(targets=run.adapter.targets, lora_r=run.adapter.lora_r, lora_alpha=run.adapter.lora_alpha)
        if run.custom_model:
            shapes["custom"] = load_custom_shape(run.custom_model, **adapter)
            within_positions(run.custom_model, shapes["custom"].max_positions, run.seqs,
                             f"--config {run.adapter.soup_config}: data.max_length" if run.adapter.soup_config else "--seq")
        families = [f for f in dict.fromkeys(family_of(a.model) for a in arms) if f != "custom"]
        if run.map:  # this shard's families only, each derived once, then each streaming mode of it
            shapes.update({f: family_shape(f) for f in families})
        if run.adapter.soup_config:  # the file's base under the file's adapter (the record's two are no record here)
            shapes.update({f: registry_shape(f, **adapter) for f in families})
        if run.map or run.adapter.soup_config:
            shapes.update({a.model: with_modes(shapes[family_of(a.model)], a.model) for a in arms})
        imports_s = time.perf_counter() - t
    det_models, det_seqs, det_batches = run.determinism_grid
    det_arms = plan_arms(*run.determinism_grid, run.quants[0], run.tasks) if run.repeats else []
    how = ("--min-free: a bisection over capped fresh processes (expandable segments)" if run.constraints.min_free else
           f"capped at {run.constraints.cap} (expandable segments), one fresh process per arm" if run.constraints.cap else
           f"as {run.constraints.emulate_card} (a ballast outside the allocator, expandable segments), one fresh process "
           "per arm" if run.constraints.emulate_card else
           lanes.label(run) if lanes and fan_out else
           "isolated, one fresh process per arm" if run.isolate else
           f"one process per GPU ({','.join(map(str, run.children.gpus))}), merged" if run.children.gpus else
           f"shard {run.children.shard[0]}/{run.children.shard[1]} in one process" if run.children.shard else
           f"1 lane, in one process ({lanes.why})" if lanes else "in one process")
    if run.adapter.soup_config:  # the user's config, not the protocol: said where every table's header is
        how += (f"; the arm is --config {run.adapter.soup_config}'s ({run.quants[0]}, LoRA r {run.adapter.lora_r} alpha "
                f"{run.adapter.lora_alpha} on {','.join(run.adapter.targets or ())})")
    arms_label = how if run.run_arms else ("determinism: one fresh process per repeat" if run.repeats
                                        else "none (modes only)")
    command = [os.path.basename(protocol.script), *run.argv]
    result = Result(environment=environment(run.weights, run.dry_run, arms_label, command) if local else {},
                    kind="map" if run.map else "sweep")
    # The row file's header: the stack known now, so a run stopped before its JSON still renders.
    # A parent's children report their stacks only in their final JSONs: it records its own, said so.
    stack = result.environment or dict(environment(run.weights, run.dry_run, arms_label, command, with_torch=False),
                                       stack_of=STACK_OF_PARENT)
    rows_file = RowFile(run.outputs.json, dict(stack, **stack_notes(run)), result.kind)
    rows: list[Row] = []
    children: list[Result] = []
    usage_error = None
    total = (len(arms) if run.run_arms else 0) + len(det_arms) * (run.repeats or 0)
    progress = Progress(total if not run.children.child else 0, started)

    def on_row(row: Row) -> None:
        rows.append(row)  # kept first: nothing after this may lose a finished row
        rows_file.add(row)
        if not run.children.child:
            progress.arm(row)

    checkpoints = None
    try:
        if run.run_arms and run.constraints.min_free:
            with Stop.arm():  # each probe is a fresh capped child
                children += min_free_arms(run, arms, scratch, on_row, protocol.script)
        elif run.run_arms and fan_out:
            with Stop.arm():  # the children's arms are in flight
                children += spread(replace(run, repeats=None), arms, scratch, on_row, protocol.script,
                                   **({"lanes": lanes} if lanes else {}))
        elif run.run_arms:
            checkpoints = Checkpoints(list(dict.fromkeys(family_of(a.model) for a in arms)), shapes, run, scratch)
            sweep(arms, shapes, checkpoints, scratch, run, protocol.run_arm, on_row,
                  result.margins.append if run.map and not run.dry_run and not run.constraints.cap and not run.constraints.emulate_card
                  else None)
            if run.snapshot and not Stop.requested:
                with Stop.arm():
                    result.control = positive_control(control_step(False), control_step(True))
        if run.repeats and not Stop.requested:
            det_run = replace(run, isolate=True, models=det_models, seqs=det_seqs, batches=det_batches,
                              measure=run.measure and not local, sdpa=run.sdpa and not local)
            with Stop.arm():
                children += spread(det_run, det_arms, scratch, on_row, protocol.script)
        if local and run.measure and not Stop.requested:
            with Stop.arm():
                result.measure = measure_mode(run.dry_run)
        if local and run.sdpa and not Stop.requested:
            with Stop.arm():
                result.sdpa = sdpa_mode(run.dry_run)
    except KeyboardInterrupt:
        Stop.requested = True
    except UsageError as exc:
        if not rows:
            rows_file.finish()
            raise
        usage_error = str(exc)  # e.g. the hub unreachable for a later model: keep the rows
        result.error = f"usage: {usage_error}"
    except Exception as exc:  # a harness bug still prints and saves what was measured
        result.error = last_line(exc)
        print(f"error: the harness failed after {len(rows)} row(s): {result.error}", file=sys.stderr)
    finally:
        progress.close()
        if checkpoints is not None:
            checkpoints.close()
    # A stop asked from here on is told the run is complete and changes nothing it reports: the
    # message, the exit code and the JSON agree (interrupted only if a stop cut the arms short).
    interrupted = Stop.requested
    Stop.finish()
    if children:
        merged = merge(children + ([result] if local else []), arms_label)
        for name in ("environment", "measure", "sdpa", "control", "error"):
            setattr(result, name, getattr(result, name) or getattr(merged, name))
        if not local:  # the stack is a child's; the command is the one the user typed, not the child's
            result.environment = dict(result.environment,
                                      command=" ".join(command))
        result.margins = merged.margins
    if not result.environment:
        result.environment = environment(run.weights, run.dry_run, arms_label, command, with_torch=False)
    result.environment.update(stack_notes(run))
    result.rows = sorted(rows, key=row_order)
    result.interrupted = interrupted
    result.timings = run_timings(rows, imports_s, time.perf_counter() - started,
                                 checkpoints.build_s if checkpoints else {}, children)
    if lanes is not None:
        result.timings.update(lanes=lanes.count, threads_per_lane=lanes.threads,
                              whole_card_arms=len(lanes.whole_card) if fan_out else 0,
                              whole_card_in_lanes=len(lanes.in_lane) if fan_out else 0)
    print(render_text(result), end="", flush=True)
    if lanes is not None and not run.children.child:  # the benchmark: lanes 1 against N, read off two runs
        t = result.timings
        print(f"wall (measured by this run): {t['total_s']} s for {t['arms']} arm(s), {t['arms_per_minute']} arms "
              f"per minute, {lanes.count} lane(s) x {lanes.threads} thread(s)", flush=True)
    unwritten = write_outputs(result, run, rows_file)
    for line in (usage_error, unwritten):
        if line:
            print(f"error: {line}", file=sys.stderr)
    return EXIT_USAGE if usage_error or unwritten else result.exit_code


#: The row file's header of a parent of children (lanes, --gpus, --isolate): the stack is its own.
STACK_OF_PARENT = ("the parent process, which runs no arm: its children's stacks (GPU, driver, CUDA) were to be "
                   "merged into the JSON it did not write")


def stack_notes(run: Run) -> dict[str, Any]:
    """What the stack says of the run beyond the packages: the steps, and the map's arms left out."""
    notes: dict[str, Any] = {}
    if run.steps != 1:  # the protocol's one step is implied; anything else is named (the stack settled)
        notes["steps"] = run.steps
    left_out = not_on_map() + past_positions(run.models, run.seqs) if run.map else []
    if left_out and not run.children.child:  # never skipped silently: named with the reason
        notes["not_on_map"] = " | ".join(left_out)
    return notes


def run_timings(rows: list[Row], imports_s: float, total_s: float, build_s: dict[str, float],
                children: list[Result]) -> dict[str, Any]:
    """The harness's own cost: imports, builds, and per arm setup, step and teardown."""
    t: dict[str, Any] = {"total_s": round(total_s, 2), "imports_s": round(imports_s, 2), "arms": len(rows),
                         "arms_per_minute": round(len(rows) * 60 / total_s, 2) if total_s > 0 else None,
                         "build_s": build_s}
    for key in ("setup_s", "step_s", "teardown_s"):
        t[f"sum_{key}"] = round(sum(r.ran.timings.get(key) or 0 for r in rows), 2)
    overhead = [r.ran.timings["setup_s"] + r.ran.timings["teardown_s"] for r in rows
                if r.ran.timings.get("setup_s") is not None and r.ran.timings.get("teardown_s") is not None]
    if overhead:
        t["median_arm_overhead_s"] = round(statistics.median(overhead), 3)
    if children:
        t["children"] = [c.timings for c in children]
    return t


def estimate_run(run: Run) -> int:
    """--estimate: each (quant, seq, batch) from the config alone, on CPU; the table, and --json."""
    from ..estimator.cards import workspace_env
    from ..estimator.arch import protocol_targets
    from ..estimator.estimate import estimate
    from ..estimator.soup_number import arch_of
    from ..estimator.fits import (Gate, budgets_for, card_answers, card_list, estimate_for, estimate_table,
                                  steps_words, verdict_lines)
    from ..estimator.releases import UnknownRelease, installed_release, release_label
    from ..model.targets import soup_targets

    if run.estimate.card_list:
        print(card_list(), end="")
        return EXIT_OK
    user = run.estimate.from_file or {}
    gate, optimizer = Gate(user.get("gate_override"), bool(user.get("probe"))), user.get("optimizer")
    kw = {"targets": run.adapter.targets, "lora_r": run.adapter.lora_r}
    try:
        rows = [estimate_for(run.estimate.config, quant=q, seq=s, batch=b, targets=run.adapter.targets, lora_r=run.adapter.lora_r,
                             steps=run.steps, stream=dict(run.estimate.stream), task=t, optimizer=optimizer,
                             accumulation=user.get("gradient_accumulation_steps"))
                for t in run.tasks for q in run.quants for s in run.seqs for b in run.batches]
        budgets = budgets_for(run.estimate.cards, run.context)
        answers = [card_answers(run.estimate.config, e, budgets, env=workspace_env(), stream=dict(run.estimate.stream),
                                gate=gate, optimizer=optimizer, **kw)
                   for e in rows]
        installed = installed_release()
        table = estimate_table(rows, run.estimate.cards, run.estimate.config, answers=answers,
                               release_label=release_label(installed), verbose=run.verbose, **kw)
    except UnknownRelease:  # the release's fault, not the model's: said without naming the model
        raise
    except UsageError as exc:
        raise UsageError(f"--estimate {estimated_as(run)}: {exc}") from None
    except Exception as exc:  # a config value of a kind no real config has
        raise UsageError(f"--estimate {estimated_as(run)}: cannot be estimated ({last_line(exc)})") from None
    notes = estimate_notes(run.estimate.config, run.quants)
    named = f"{run.custom_model}, from --config {run.adapter.soup_config}" if run.adapter.soup_config else run.custom_model
    answer = steps_words(run.steps, user.get("steps_from"))
    text = (f"--estimate: {named}: {answer}\n" + "".join(f"  {v}\n" for v in verdict_lines(rows, run.estimate.cards, answers))
            + "".join(f"  from the file: {k}\n" for k in user.get("keys", ()))
            + "(Soup's pre-flight: computed by Soup's own estimator code; corrected and needs free: this tool's "
            "estimator, from the config alone)\n" + table + "".join(f"note: {n}\n" for n in notes))
    print(text, end="")
    fits_all = all(a["fits"] for per in answers for a in per)
    if run.outputs.json:
        arch = arch_of(run.estimate.config)
        targets = soup_targets(run.adapter.targets, run.estimate.config, arch, None) or protocol_targets(arch)
        data = {"tool": TOOL, "schema": SCHEMA, "kind": "estimate",
                "model": run.custom_model, "soup_cli": installed, "tasks": list(run.tasks),
                "targets": list(targets),
                **({"soup_targets": run.adapter.targets[0]} if run.adapter.targets and tuple(targets) != tuple(run.adapter.targets) else {}),
                "config": run.adapter.soup_config, "lora_alpha": run.adapter.lora_alpha,
                "stream": dict(run.estimate.stream), "steps": run.steps, "answer": answer,
                "soup_gate": {"rule": gate.rule, "override_bytes": gate.override},
                "config_keys": list(user.get("keys", ())), "fits_every_card": fits_all if run.estimate.cards else None,
                "lora_r": run.adapter.lora_r, "cards": [{"card": c.name, "bytes": c.total_bytes} for c in run.estimate.cards],
                "notes": notes, "rows": [dict(r.to_json(), cards=a) for r, a in zip(rows, answers)]}
        try:
            write_output(run.outputs.json, (json.dumps(data, indent=2) + "\n").encode("utf-8"))
        except OSError as exc:
            print(f"error: --json {run.outputs.json} could not be written ({exc.strerror or exc})", file=sys.stderr)
            return EXIT_USAGE
    return EXIT_FINDING if run.estimate.fit_exit and not fits_all else EXIT_OK


def estimated_as(run: Run) -> str:
    """What the user named: --config's file and its base, else --model."""
    return f"--config {run.adapter.soup_config} (base {run.custom_model})" if run.adapter.soup_config else f"--model {run.custom_model}"


def estimate_notes(config: dict, quants) -> list[str]:
    """What the estimate leaves out, said where its numbers are read."""
    notes = []
    q = config.get("quantization_config")
    if q is not None:
        method = q.get("quant_method", "unnamed") if isinstance(q, dict) else type(q).__name__
        notes.append(f"the config's quantization_config ({method}) is NOT modelled: these figures are Soup's "
                     f"--quant {','.join(quants)} of the full-precision shapes the config describes")
    notes.append("needs free assumes the allocator's expandable segments, as `soup train` sets them "
                 "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)")
    notes.append("not estimated: host RAM and disk for the streamed layers' store (Soup's other gate)")
    return notes


def rerender(run: Run) -> int:
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
        if not common_arms(result, other):
            raise UsageError(f"--compare {run.compare}: no arm in common with {named} (no measured arm "
                             "with the same model, quant, seq, batch and repeat in both)")
        try:
            text += "\n" + compare_table(result, other, (", ".join(run.from_json), run.compare)) + "\n"
        except Exception as exc:
            raise UsageError(f"--compare {run.compare}: cannot be compared with {named} ({last_line(exc)})") from None
    print(text, end="")
    try:
        unwritten = write_outputs(result, run, RowFile(None), parts)
    except Exception as exc:  # rendering the markdown or plot of a hand-edited result
        unwritten = f"{named}: an output cannot be rendered from it ({last_line(exc)})"
    if unwritten:
        print(f"error: {unwritten}", file=sys.stderr)
        return EXIT_USAGE
    return result.exit_code


def common_arms(a: Result, b: Result) -> int:
    """How many measured arms two results share (tables.compare_table's pairing)."""
    try:
        keys = {(r.model, r.quant, r.seq, r.batch, r.task, r.repeat) for r in b.rows if r.measured}
        return sum(1 for r in a.rows if r.measured and (r.model, r.quant, r.seq, r.batch, r.task, r.repeat) in keys)
    except TypeError:  # an unhashable value: compare_table will say what
        return 1


def write_outputs(result: Result, run: Run, rows_file: RowFile,
                  parts: Optional[list[tuple[str, dict]]] = None) -> Optional[str]:
    """--json, --markdown and --plot (``parts``: each merged saved result's file and stack, for
    the markdown's commands). Every output that can be written is; returns one line naming each
    that could not and the one place the rows are kept, or None."""
    failed = []
    for flag, path, render in (
            ("--json", run.outputs.json, lambda: json.dumps(result.to_json(), indent=2, default=str) + "\n"),
            ("--markdown", run.outputs.markdown, lambda: render_markdown(result, parts)),
            ("--plot", run.outputs.plot, lambda: render_plot(result))):
        if not path:
            continue
        try:
            data = render()
            write_output(path, data.encode("utf-8") if isinstance(data, str) else data)
        except OSError as exc:
            failed.append(f"{flag} {path} could not be written ({exc.strerror or exc})")
    if failed:
        keep = (f"the rows are kept in {rows_file.path}" if rows_file.path and rows_file.ok
                and rows_file.path.exists() else "the rows are in the tables printed above")
        return "; ".join(failed) + f"; {keep}"
    rows_file.finish()
    return None
