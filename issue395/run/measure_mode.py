"""The measured arms on the GPU (the sweep, the map, --determinism's repeats) and the modes beside them
(--measure, --sdpa), each arm under the constraint asked: settled once into a ``MeasureRequest`` (the
sweep's models, the map's families, or a soup.yaml's one arm, read once: issue395.run.configarm) and
executed here, in this process or spread over children (issue395.host.spread, issue395.host.probes);
rows are printed and saved whatever stops the run.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import replace
from typing import Optional

from ..constants import comma_list
from ..errors import EXIT_USAGE, UsageError, last_line
from ..record import MAP_BATCHES, QUANTS, RECORD_GRID
from ..model.arm import Arm
from ..model.registry import ALL_FAMILIES, FAMILIES, SHAPES, max_positions, stream_mode_keys
from ..model.streaming import Streaming, family_of
from ..estimator.cards import parse_context
from ..estimator.soup_number import require_streamed
from ..results.merge import merge
from ..results.result import Result, row_order
from ..results.row import Row
from ..results.saved import RowFile
from ..results.stack import environment
from ..constraints.asked import Constraints
from ..measure.console import Progress, Stop
from ..measure.cuda import control_step, positive_control
from ..measure.modes import measure_mode, sdpa_mode
from ..measure.probe import probe_missing
from ..measure.shapes import (bitsandbytes_present, config_only, default_map_families, family_shape,
                              load_custom_shape, registry_shape, soup_has_stream_modes, soup_loss_chunk_bounds,
                              with_modes)
from ..report.outputs import write_outputs
from ..report.tables import render_text
from ..host.arms import STACK_OF_PARENT, Protocol, run_timings, stack_notes, sweep
from ..host.checkpoints import Checkpoints, shard_tag
from .checks import (ARM_NEEDS, context_within_cards, distinct_choices, local_or_hub, no_output_is_an_input, one_card, one_int,
                     parse_ints, require_installed, settle_tasks, within, within_positions)
from .clashes import check
from .configarm import config_arm
from ..host.grid import PROTOCOL_RUN, shard_of
from .parser import NO_CUDA
from ..host.probes import min_free_arms
from ..host.measured import Children, MeasureRequest, Outputs
from ..host.cardlock import DiskLedger
from ..host.scratch import Scratch, cache_dir_of, shard_dir_of, writable_folder
from ..host.spread import Job, Lanes, gpu_total_bytes, plan_lanes, spread, visible_gpu_count
from .userconfig import read_soup_config


def chosen(args: argparse.Namespace) -> bool:
    return True  # what the command line asks when it asks no other mode


def settle(args: argparse.Namespace, argv: list[str]) -> MeasureRequest:
    """The grid (the sweep's models, the map's families, or --config's one arm), then what every
    measured run settles: its spread, its constraint, its folders."""
    require_installed("--dry-run" if args.dry_run else "a run of arms", ARM_NEEDS)  # before any work
    arm = config_arm(read_soup_config(args.config), args.weights, args.dry_run) if args.config is not None else None
    check("estimate only", args)
    if args.map:
        models, quants, seqs, batches = map_grid(args)
    else:
        check("sweep", args)
        models, quants, seqs, batches = sweep_grid(args, arm)
    tasks = (arm.task,) if arm else settle_tasks(args.task)
    gpus = parse_ints("--gpus", args.gpus, minimum=0)
    repeats = None
    if args.determinism is not None:
        counts = parse_ints("--determinism", args.determinism, minimum=2) or ()
        if len(counts) != 1:
            raise UsageError(f"--determinism {args.determinism}: give one repeat count")
        repeats = counts[0]
    shard = None
    if args.shard is not None:
        k, _, n = args.shard.partition("/")
        if not (re.fullmatch("[0-9]{1,18}", k) and re.fullmatch("[0-9]{1,18}", n) and 1 <= int(k) <= int(n)):
            raise UsageError(f"--shard {args.shard}: give K/N with 1 <= K <= N, e.g. --shard 2/4")
        shard = (int(k), int(n))
    model = arm.checkpoint if arm else args.model
    check("shard", args, model=model, shard=shard, gpus=gpus, repeats=repeats, seqs=seqs)
    if model is not None:  # a path that is not there is one line here, not a hub lookup
        model = local_or_hub(model)
        no_output_is_an_input({**{f: getattr(args, f.strip("-")) for f in ("--json", "--markdown", "--plot")},
                               "--json's row file": args.json and str(RowFile.path_for(args.json))},
                              [("--model", model)])
    for m in () if args.map or arm else (m for m in models if m in SHAPES):
        within_positions(SHAPES[m].name, SHAPES[m].max_positions, seqs or RECORD_GRID[m])
    check("cap", args)
    if args.emulate_card is not None:  # a card this tool knows or a size, that leaves a step free memory
        context_within_cards("--emulate-card", [one_card("--emulate-card", args.emulate_card)],
                             parse_context(args.context))
    check("constraints", args, repeats=repeats)
    for flag, folder in (("--log-dir", args.log_dir), ("--snapshot-dir", args.snapshot_dir),
                         ("--cache-dir", args.cache_dir)):
        if folder is not None:
            writable_folder(flag, folder)
    cache = cache_dir_of(args.cache_dir, args.shard_dir)
    constraints = Constraints.of(args)
    any_mode = args.measure or args.sdpa or repeats is not None
    run_arms = args.map or args.sweep or not any_mode
    context, steps = parse_context(args.context), one_int("--steps", args.steps, 1)
    lanes = None
    if args.lanes is not None:  # arms side by side on one card, so never an arm that needs the card to itself
        lanes = 0 if args.lanes == "auto" else one_int("--lanes", args.lanes, 1)
        check("lanes run", args, shard=shard, repeats=repeats, run_arms=run_arms)
    run = MeasureRequest(
        run_arms=run_arms, map=args.map, quants=quants, measure=args.measure, sdpa=args.sdpa, repeats=repeats,
        models=models, seqs=seqs, batches=batches, tasks=tasks,
        weights=("synthetic" if config_only(model) else "local") if model else args.weights,
        dry_run=args.dry_run, verbose=args.verbose, snapshot=args.snapshot or bool(args.snapshot_dir),
        snapshot_dir=args.snapshot_dir, log_dir=args.log_dir, cache_dir=cache, shard_dir=shard_dir_of(args.shard_dir),
        isolate=args.isolate or constraints.fresh, constraints=constraints, context=context,
        children=Children(gpus=gpus, lanes=lanes, shard=shard), outputs=Outputs.of(args),
        argv=tuple(argv), arm=replace(arm or PROTOCOL_RUN, steps=steps, checkpoint=model))
    if shard:
        not_an_empty_shard(run)
    return run


def sweep_grid(args: argparse.Namespace, arm: Optional[Arm]) -> tuple:
    """The sweep's models, quantization, seqs and batches (--config: its one arm's)."""
    if arm is not None:  # the file's values, as Soup's loader read them (the bounds every seq and batch has)
        path = arm.adapter.soup_config
        seq = within("--seq", arm.seq, minimum=64, named=f"--config {path}: data.max_length") if arm.checkpoint else arm.seq
        return (arm.key,), (arm.quant,), (seq,), (within("--batch", arm.batch, named=f"--config {path}: training.batch_size"),)
    if args.model is not None and not args.model.strip():
        raise UsageError("--model needs a checkpoint folder or a hub id")
    models = (("custom",) if args.model else tuple(SHAPES) if args.models is None
              else comma_list(args.models))
    if not all(models):
        raise UsageError(f"--models {args.models!r}: empty name; choose from {','.join(SHAPES)}")
    unknown = [m for m in models if m not in SHAPES and not args.model]
    if unknown:
        raise UsageError(f"--models: unknown model {unknown[0]!r}; choose from {','.join(SHAPES)}")
    if len(set(models)) != len(models):
        raise UsageError(f"--models {args.models}: a model is named twice")
    # Soup's config schema refuses a data.max_length under 64: one line here, not a FAILED row.
    return models, ("none",), parse_ints("--seq", args.seq, minimum=64), parse_ints("--batch", args.batch) or (1,)


def map_grid(args: argparse.Namespace) -> tuple:
    """--map's families (under each streaming mode asked), quantizations, seqs within max positions, batches."""
    check("map", args)
    known = ALL_FAMILIES
    families = (default_map_families() + ("llama31-8b",) if args.families is None
                else comma_list(args.families))
    unknown = [f for f in families if f not in known]
    if unknown or not all(families) or len(set(families)) != len(families):
        raise UsageError(f"--families: {'unknown family ' + repr(unknown[0]) if unknown else 'empty or repeated name'}; "
                         f"choose from {','.join(known)}")
    families = stream_mode_families(args, families)
    for fam in dict.fromkeys(family_of(k) for k in families if not Streaming.parse(k)[1].resident):
        # a resident arm streams nothing: only a family the map streams needs the installed Soup to stream it
        require_streamed(FAMILIES[fam].model_type if fam in FAMILIES else "llama", f"--families {fam}")
    quants = QUANTS if args.quant is None else distinct_choices("--quant", args.quant, QUANTS, "quantization")
    if args.quant is not None and "nf4" in quants and not args.dry_run and not bitsandbytes_present():
        raise UsageError("--quant nf4 needs bitsandbytes, which is not installed here")
    seqs, batches = parse_ints("--seq", args.seq, minimum=64), parse_ints("--batch", args.batch)
    # a seq past one family's positions is left out for that family (and named); one past every
    # named family's is one line: it would run nowhere
    widest = max(families, key=max_positions)
    within_positions(widest if len(families) == 1 else f"every named family (the widest, {widest})",
                     max_positions(widest), seqs or ())
    return families, quants, seqs, batches or MAP_BATCHES


def stream_mode_families(args: argparse.Namespace, families: list) -> tuple:
    """Each family under every streaming mode asked for (the map's soup-cli 0.77.0 axes)."""
    asked = args.expert_layout or args.loss_chunk or args.recompute
    if asked and not soup_has_stream_modes():
        raise UsageError("--expert-layout, --loss-chunk and --recompute need soup-cli 0.77.0, "
                         "whose training config has them; the installed one does not")
    chunks = comma_list(args.loss_chunk) if args.loss_chunk else ["off"]
    low, high = soup_loss_chunk_bounds()
    missing = "on" in comma_list(args.stream_vram_probe or "") and probe_missing()
    if missing:
        raise UsageError(missing)
    return stream_mode_keys(families, comma_list(args.expert_layout) if args.expert_layout else ["fused"],
                            [None if c == "off" else parse_ints("--loss-chunk", c, minimum=low, maximum=high)[0]
                             for c in chunks],
                            comma_list(args.recompute) if args.recompute else ["on"],
                            tuple(comma_list(args.stream_layers)) if args.stream_layers else ("on",),
                            tuple(comma_list(args.gradient_checkpointing)) if args.gradient_checkpointing else ("off",),
                            tuple(comma_list(args.stream_vram_probe)) if args.stream_vram_probe else ("off",))


def not_an_empty_shard(run: MeasureRequest) -> None:
    """--shard K/N that owns no arm is one line before anything runs, not a header alone."""
    arms = run.arms()
    if not shard_of(arms, run.children.shard, whole_models=run.map):
        k, n = run.children.shard
        what = (f"{len(arms)} arm(s) in {len(set(a.model for a in arms))} families, dealt whole"
                if run.map else f"{len(arms)} arm(s)")
        raise UsageError(f"--shard {k}/{n} is empty: the grid has {what}, so shard {k} of {n} runs nothing")


def execute(run: MeasureRequest, protocol: Protocol, job: Optional[Job] = None) -> int:
    """The arms and the modes asked for (a child: its job's). Rows are printed and saved whatever stops the run."""
    started = time.perf_counter()
    Stop.install(quiet=run.children.child)
    lanes = None
    if run.children.lanes is not None and run.run_arms:  # the card's total, from the driver: no torch in a parent
        gpu = run.children.gpus[0] if run.children.gpus else None
        lanes = plan_lanes(run, run.arms(), None if run.dry_run else gpu_total_bytes(gpu))
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


def measure_all(run: MeasureRequest, protocol: Protocol, job: Optional[Job], scratch: Scratch, started: float,
                local: bool, fan_out: bool, lanes: Optional[Lanes] = None) -> int:
    """Every arm and mode of the run, here or in children; the rows printed and saved whatever stops it."""
    arms = arms_to_run(run, job)
    shapes, imports_s = local_shapes(run, protocol, scratch, arms) if local else (dict(SHAPES), 0.0)
    det_models, det_seqs, det_batches = run.determinism_grid
    det_arms = run.determinism_arms()
    arms_label = how_arms_ran(run, lanes, fan_out)
    command = [os.path.basename(protocol.script), *run.argv]
    result, rows_file = started_result(run, local, arms_label, command)
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
        if run.run_arms and run.constraints.probes:
            with Stop.arm():  # each probe is a fresh capped child
                children += min_free_arms(run, arms, scratch, on_row, protocol.script)
        elif run.run_arms and fan_out:
            with Stop.arm():  # the children's arms are in flight
                children += spread(replace(run, repeats=None), arms, scratch, on_row, protocol.script,
                                   **({"lanes": lanes} if lanes else {}))
        elif run.run_arms:
            checkpoints = local_checkpoints(run, arms, shapes, scratch)
            sweep(arms, shapes, checkpoints, scratch, run, protocol.run_arm, on_row,
                  result.margins.append if run.map and not run.dry_run and not run.constraints.fresh else None)
            if run.snapshot and not Stop.requested:
                with Stop.arm():
                    result.control = positive_control(control_step(False), control_step(True))
        if run.repeats and not Stop.requested:
            det_run = replace(run, isolate=True, models=det_models, seqs=det_seqs, batches=det_batches,
                              measure=run.measure and not local, sdpa=run.sdpa and not local)
            with Stop.arm():
                children += spread(det_run, det_arms, scratch, on_row, protocol.script)
        if local:
            local_modes(run, result)
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
    finish_result(result, run, children, local, arms_label, command)
    result.rows = sorted(rows, key=row_order)
    result.interrupted = interrupted
    result.timings = run_timings(rows, imports_s, time.perf_counter() - started,
                                 checkpoints.build_s if checkpoints else {}, children)
    return report_run(result, run, rows_file, lanes, fan_out, usage_error)


def arms_to_run(run: MeasureRequest, job: Optional[Job]) -> list:
    """The arms this process runs: a child exactly the ones its parent dealt it, else the grid's (its shard's)."""
    if job is not None:
        return list(job.arms)
    arms = run.arms()
    return shard_of(arms, run.children.shard, whole_models=run.map) if run.children.shard else arms


def local_shapes(run: MeasureRequest, protocol: Protocol, scratch: Scratch, arms: list) -> tuple[dict, float]:
    """Each arm's shape, for arms run in this process (a custom model's, the map's families, a --config
    file's base under its adapter), and the seconds its imports took; CUDA checked first where the step needs it."""
    shapes = dict(SHAPES)
    t = time.perf_counter()
    import torch

    if not run.dry_run and protocol.step_device == "cuda" and not torch.cuda.is_available():
        raise UsageError(NO_CUDA)
    scratch.verify_shard_root()
    # the LoRA adapter a --config file names, else the protocol's (targets None: the model's own)
    a, checkpoint = run.arm.adapter, run.arm.checkpoint
    adapter = dict(targets=a.targets, lora_r=a.lora_r, lora_alpha=a.lora_alpha)
    if checkpoint:
        shapes["custom"] = load_custom_shape(checkpoint, streamed=not run.arm.streaming.resident, **adapter)
        within_positions(checkpoint, shapes["custom"].max_positions, run.seqs,
                         f"--config {a.soup_config}: data.max_length" if a.soup_config else "--seq")
    families = [f for f in dict.fromkeys(family_of(a.model) for a in arms) if f != "custom"]
    if run.map:  # this shard's families only, each derived once, then each streaming mode of it
        shapes.update({f: family_shape(f) for f in families})
    if a.soup_config:  # the file's base under the file's adapter (the record's two are no record here)
        shapes.update({f: registry_shape(f, **adapter) for f in families})
    if run.map or a.soup_config:
        shapes.update({a.model: replace(with_modes(shapes[family_of(a.model)], a.model),  # its name: the Arm's label
                                        name=a.label(shapes[family_of(a.model)].name)) for a in arms})
    return shapes, time.perf_counter() - t


def how_arms_ran(run: MeasureRequest, lanes: Optional[Lanes], fan_out: bool) -> str:
    """How the arms ran (lanes, fresh processes, GPUs, a shard, one process) and, for a --config file, whose arm
    it is: the label every table's header and the stack carry."""
    how = run.constraints.how or (
        lanes.label(run) if lanes and fan_out else
        "isolated, one fresh process per arm" if run.isolate else
        f"one process per GPU ({','.join(map(str, run.children.gpus))}), merged" if run.children.gpus else
        f"shard {run.children.shard[0]}/{run.children.shard[1]} in one process" if run.children.shard else
        f"1 lane, in one process ({lanes.why})" if lanes else "in one process")
    if run.arm.adapter.soup_config:  # the user's config, not the protocol: said where every table's header is
        how += (f"; the arm is --config {run.arm.adapter.soup_config}'s ({run.arm.quant}, {run.arm.adapter_words()}, "
                f"{run.arm.settings.said()})")
    return how if run.run_arms else ("determinism: one fresh process per repeat" if run.repeats
                                     else "none (modes only)")


def started_result(run: MeasureRequest, local: bool, arms_label: str, command: list) -> tuple[Result, RowFile]:
    """The run's result, its stack read here where this process runs arms, and the row file rows are saved to
    as they finish."""
    result = Result(environment=environment(run.weights, run.dry_run, arms_label, command) if local else {},
                    kind="map" if run.map else "sweep")
    # The row file's header: the stack known now, so a run stopped before its JSON still renders.
    # A parent's children report their stacks only in their final JSONs: it records its own, said so.
    stack = result.environment or dict(environment(run.weights, run.dry_run, arms_label, command, with_torch=False),
                                       stack_of=STACK_OF_PARENT)
    return result, RowFile(run.outputs.json, dict(stack, **stack_notes(run)), result.kind)


def local_checkpoints(run: MeasureRequest, arms: list, shapes: dict, scratch: Scratch) -> Checkpoints:
    """The checkpoints the arms of this process stream, each family's shard sets counted, on the disk ledger
    a parent shares with its children (else this run's own), so a full disk is foreseen, not hit."""
    disk = (DiskLedger(run.children.disk_ledger) if run.children.disk_ledger else
            DiskLedger.create(str(scratch.path("disk") / "disk.json"), str(scratch.checkpoint_root())))
    sets: dict[str, set] = {}
    for a in arms:
        sets.setdefault(family_of(a.model), set()).add(shard_tag(a.quant, shapes[a.model].stream))
    return Checkpoints(list(dict.fromkeys(family_of(a.model) for a in arms)), shapes, run, scratch,
                       disk, {k: len(v) for k, v in sets.items()})


def local_modes(run: MeasureRequest, result: Result) -> None:
    """--measure and --sdpa, in this process, each unless a stop was asked."""
    if run.measure and not Stop.requested:
        with Stop.arm():
            result.measure = measure_mode(run.dry_run)
    if run.sdpa and not Stop.requested:
        with Stop.arm():
            result.sdpa = sdpa_mode(run.dry_run)


def finish_result(result: Result, run: MeasureRequest, children: list, local: bool, arms_label: str,
                  command: list) -> None:
    """The children's results merged into this one (what this process lacks: its stack, modes, control, error,
    margins) under the command the user typed, and the run's notes on the stack."""
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


def report_run(result: Result, run: MeasureRequest, rows_file: RowFile, lanes: Optional[Lanes], fan_out: bool,
               usage_error: Optional[str]) -> int:
    """The result printed and written, the lanes' wall time beside it (the benchmark of lanes 1 against N), and
    the exit code: a usage error or an output not written is a usage error, else the rows' verdict."""
    if lanes is not None:
        result.timings.update(lanes=lanes.count, threads_per_lane=lanes.threads,
                              whole_card_arms=len(lanes.whole_card) if fan_out else 0,
                              whole_card_in_lanes=len(lanes.in_lane) if fan_out else 0)
    print(render_text(result), end="", flush=True)
    if lanes is not None and not run.children.child:  # the benchmark: lanes 1 against N, read off two runs
        t = result.timings
        print(f"wall (measured by this run): {t['total_s']} s for {t['arms']} arm(s), {t['arms_per_minute']} arms "
              f"per minute, {lanes.count} lane(s) x {lanes.threads} thread(s)", flush=True)
    unwritten = write_outputs(result, run.outputs, rows_file)
    for line in (usage_error, unwritten):
        if line:
            print(f"error: {line}", file=sys.stderr)
    return EXIT_USAGE if usage_error or unwritten else result.exit_code


