"""The command line, settled once into a Run: every check that needs no GPU and no Soup setup.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from ..constants import comma_list
from ..errors import UsageError, last_line
from ..tasks import PROTOCOL_TASK, TASKS
from ..record import LORA_ALPHA, LORA_R, MAP_BATCHES, QUANTS, RECORD_DETERMINISM, RECORD_GRID
from ..model.arm import Arm
from ..model.registry import (ALL_FAMILIES, EXPERT_LAYOUTS, FAMILIES, RECOMPUTES, SHAPES, by_hub_id, config_json,
                       max_positions, stream_mode_keys)
from ..model.targets import soup_targets
from ..estimator.cards import parse_context
from ..estimator.soup_number import require_streamed
from ..results.saved import RowFile
from ..constraints.asked import Constraints
from ..measure.shapes import (bitsandbytes_present, config_only, default_map_families, soup_has_stream_modes,
                     soup_loss_chunk_bounds)
from .checks import (
    _shown,
    check_input,
    check_output,
    distinct_choices,
    local_or_hub,
    odd_file,
    no_output_is_an_input,
    one_int,
    parse_ints,
    within_positions,
    writable_folder,
)
from .clashes import check
from .configarm import base_of, config_arguments, config_arm, in_the_files_words
from .grid import plan_arms, plan_map, shard_of
from .parser import build_parser
from .scratch import soup_shard_root
from .userconfig import read_soup_config

@dataclass(frozen=True)
class Outputs:
    """Where the run's outputs go (None: not asked; "-": stdout)."""

    json: Optional[str] = None
    markdown: Optional[str] = None
    plot: Optional[str] = None


@dataclass(frozen=True)
class EstimateInputs:
    """--estimate's inputs: the config read, the cards to fit, soup-cli 0.77.0's streaming modes,
    and how it answers (--exit-code, --card list)."""

    config: Optional[dict] = None  # None only for --card list, which estimates nothing
    cards: tuple = ()  # issue395.estimator.cards.Card
    stream: tuple = ()  # (training key, value) pairs
    fit_exit: bool = False  # --exit-code: --estimate exits 1 when the run does not fit a card
    card_list: bool = False  # --card list: the named cards, nothing estimated
    from_file: Optional[dict] = None  # --config: what the soup.yaml sets beyond the options it replaces


@dataclass(frozen=True)
class Adapter:
    """The LoRA adapter every arm runs: the protocol's, or --config's (or --estimate's --targets, --lora-r)."""

    targets: Optional[tuple] = None
    lora_r: int = LORA_R
    lora_alpha: int = LORA_ALPHA
    soup_config: Optional[str] = None  # --config: the user's soup.yaml (its arm's, or --estimate's)


@dataclass(frozen=True)
class Children:
    """How the run is spread: its GPUs, lanes and shard, and, in a child, that it is one and its repeat."""

    gpus: Optional[tuple] = None
    lanes: Optional[int] = None  # --lanes N (0: bare --lanes, chosen from the host when the run starts)
    shard: Optional[tuple] = None
    child: bool = False  # a child of --gpus, --isolate or --determinism (never the command line)
    repeat_tag: Optional[int] = None  # a child's repeat of --determinism
    card_lock: Optional[str] = None  # a --lanes child's card lock (cardlock.CardLock): its GPU shared between lanes
    whole_card: tuple = ()  # ... and the indices of its arms that hold that card alone


@dataclass(frozen=True)
class FindMaxAsk:
    """--find-max: the axis searched, the card it is searched on (as --card or --emulate-card named it),
    and the checkpoint the probes run (a folder, or the registry model whose synthetic checkpoint this
    tool builds for the file's hub id)."""

    axis: str = "seq"
    card: str = ""
    flag: str = "--card"
    base_folder: Optional[str] = None
    base_key: Optional[str] = None


#: Run's sub-records by field, as a child's job file reads them back.
RUN_RECORDS = {"outputs": Outputs, "estimate": EstimateInputs, "adapter": Adapter, "children": Children,
               "constraints": Constraints, "find_max": FindMaxAsk}


@dataclass(frozen=True)
class Run:
    """Everything the command line asked for, validated once; nothing changes it afterwards."""

    run_arms: bool = True  # run the grid's arms (the sweep's or, with map, the map's)
    map: bool = False  # --map: models are families, with a quantization axis
    quants: tuple = ("none",)
    measure: bool = False
    sdpa: bool = False
    repeats: Optional[int] = None  # --determinism N
    models: tuple = tuple(SHAPES)
    seqs: Optional[tuple] = None  # None: the record's grid per model
    batches: tuple = (1,)
    tasks: tuple = (PROTOCOL_TASK,)  # Soup's tasks: an axis of the grid, or --estimate's (issue395.tasks)
    custom_model: Optional[str] = None
    weights: str = "synthetic"
    dry_run: bool = False
    verbose: bool = False
    snapshot: bool = False
    snapshot_dir: Optional[str] = None
    log_dir: Optional[str] = None
    cache_dir: Optional[str] = None
    shard_dir: Optional[str] = None  # --shard-dir: Soup's layer shards, apart from the checkpoints
    isolate: bool = False
    constraints: Constraints = Constraints()  # --cap, --emulate-card, --min-free
    children: Children = Children()
    outputs: Outputs = Outputs()
    from_json: tuple = ()
    compare: Optional[str] = None
    steps: int = 1  # optimizer steps per arm (the protocol's 1)
    estimate: Optional[EstimateInputs] = None  # --estimate: the config, not a GPU
    context: Optional[int] = None  # --context, bytes (--estimate's cards, --emulate-card's card)
    adapter: Adapter = Adapter()
    find_max: Optional[FindMaxAsk] = None  # --find-max: the real client's limit, probe by probe
    argv: tuple = ()

    @property
    def determinism_grid(self) -> tuple[tuple, Optional[tuple], tuple]:
        """The record's two repeated arms, unless the command line chose others."""
        if self.custom_model or self.seqs or self.models != tuple(SHAPES) or self.batches != (1,):
            return self.models, self.seqs, self.batches
        return tuple(dict.fromkeys(m for m, _ in RECORD_DETERMINISM)), tuple(s for _, s in RECORD_DETERMINISM), (1,)


def run_from_json(data: dict[str, Any]) -> Run:
    """A Run as ``dataclasses.asdict`` wrote it (a child's job file): JSON lists back to tuples, its
    sub-records back to theirs."""
    def plain(d: dict) -> dict:
        return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}

    return Run(**{k: RUN_RECORDS[k](**plain(v)) if k in RUN_RECORDS and isinstance(v, dict) else v
                  for k, v in plain(data).items()})


def not_an_empty_shard(run: Run) -> None:
    """--shard K/N that owns no arm is one line before anything runs, not a header alone."""
    arms = grid_arms(run)
    if not shard_of(arms, run.children.shard, whole_models=run.map):
        k, n = run.children.shard
        what = (f"{len(arms)} arm(s) in {len(set(a.model for a in arms))} families, dealt whole"
                if run.map else f"{len(arms)} arm(s)")
        raise UsageError(f"--shard {k}/{n} is empty: the grid has {what}, so shard {k} of {n} runs nothing")


def settle(args: argparse.Namespace, argv: list[str]) -> Run:
    """Every check that needs no GPU and no Soup setup, before anything runs or prints."""
    listed = card_list_run(args, argv)
    if listed is not None:
        return listed
    check("settle", args)
    try:
        run = settle_shard_dir(args, settle_lanes(args, _settle(args, argv)))
        if run.children.shard and not run.estimate and not run.from_json:
            not_an_empty_shard(run)
    except OSError as exc:  # a path no filesystem takes (a name too long, a loop): one line naming it
        raise UsageError(f"{path_flag(args, exc.filename)} {_shown(str(exc.filename))}: "
                         f"{(exc.strerror or 'cannot be used').lower()}") from None
    return run


def path_flag(args: argparse.Namespace, filename: object) -> str:
    """The option whose value an OSError's path came from (or the generic 'a path')."""
    name = str(filename or "")
    for key, value in vars(args).items():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str) and v and (v in name or os.path.expanduser(v) in name):
                return "--" + key.replace("_", "-")
    return "a path:"


def settle_tasks(args: argparse.Namespace) -> tuple:
    """--task: Soup's streamed tasks, each once (the protocol's SFT where none is named)."""
    return (PROTOCOL_TASK,) if args.task is None else distinct_choices("--task", args.task, tuple(TASKS), "task")


def _settle(args: argparse.Namespace, argv: list[str]) -> Run:
    for key in ("json", "markdown", "plot", "log_dir", "snapshot_dir", "compare"):  # as --model is
        if getattr(args, key) not in (None, "-"):
            setattr(args, key, os.path.expanduser(getattr(args, key)))
    if args.from_json:
        args.from_json = [os.path.expanduser(p) for p in args.from_json]
    check("options", args)
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
    check("compare", args)
    if args.from_json:
        for path in args.from_json + ([args.compare] if args.compare else []):
            check_input("--compare" if path == args.compare else "--from-json", path)
        inputs = [("--from-json", p) for p in args.from_json] + ([("--compare", args.compare)] if args.compare else [])
        no_output_is_an_input(outputs, inputs)
        return Run(from_json=tuple(args.from_json), compare=args.compare, outputs=outputs_of(args),
                   steps=one_int("--steps", args.steps, 1), argv=tuple(argv))
    if args.find_max is not None:
        return settle_find_max(args, argv)
    if args.estimate:
        if args.model and args.model not in ALL_FAMILIES:
            no_output_is_an_input(outputs, [("--model", os.path.expanduser(args.model))])
        return settle_estimate(args, argv)
    if args.config is not None:
        return settle_config(args, argv)
    check("estimate only", args)
    if args.map:
        return settle_map(args, argv)
    check("sweep", args)
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
    seqs, batches = parse_ints("--seq", args.seq, minimum=64), parse_ints("--batch", args.batch) or (1,)
    tasks = settle_tasks(args)
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
    check("shard", args, shard=shard, gpus=gpus, repeats=repeats, seqs=seqs)
    if args.model is not None:  # a path that is not there is one line here, not a hub lookup
        args = argparse.Namespace(**dict(vars(args), model=local_or_hub(args.model)))
        no_output_is_an_input({**outputs, "--json's row file": args.json and str(RowFile.path_for(args.json))},
                              [("--model", args.model)])
    for m in (m for m in models if m in SHAPES):
        within_positions(SHAPES[m].name, SHAPES[m].max_positions, seqs or RECORD_GRID[m])
    check("cap", args)
    emulate_card(args)
    check("constraints", args, repeats=repeats)
    for flag, folder in (("--log-dir", args.log_dir), ("--snapshot-dir", args.snapshot_dir),
                         ("--cache-dir", args.cache_dir)):
        if folder is not None:
            writable_folder(flag, folder)
    cache = os.path.abspath(os.path.expanduser(args.cache_dir)) if args.cache_dir else None
    if cache and getattr(args, "shard_dir", None) is None:  # with --shard-dir Soup never reads it
        check_cache_dir_bounds(args.cache_dir, cache)
    any_mode = args.measure or args.sdpa or repeats is not None
    return Run(run_arms=args.sweep or not any_mode, measure=args.measure, sdpa=args.sdpa, repeats=repeats,
               models=models, seqs=seqs, batches=batches, tasks=tasks, custom_model=args.model,
               weights=("synthetic" if config_only(args.model) else "local") if args.model else args.weights,
               dry_run=args.dry_run, verbose=args.verbose, snapshot=args.snapshot or bool(args.snapshot_dir),
               snapshot_dir=args.snapshot_dir, log_dir=args.log_dir, cache_dir=cache,
               isolate=args.isolate or args.cap is not None or bool(args.emulate_card) or args.min_free,
               constraints=Constraints(cap=args.cap, emulate_card=args.emulate_card, min_free=args.min_free),
               context=parse_context(args.context), children=Children(gpus=gpus, shard=shard),
               outputs=outputs_of(args), steps=one_int("--steps", args.steps, 1), argv=tuple(argv))


def outputs_of(args: argparse.Namespace) -> Outputs:
    return Outputs(args.json, args.markdown, args.plot)



def card_list_run(args: argparse.Namespace, argv: list[str]) -> Optional[Run]:
    """--card list, alone (or beside --estimate): the named cards and their sources, nothing else."""
    if args.card is None or args.card.strip().lower() != "list":
        return None
    check("card list", args)
    return Run(run_arms=False, estimate=EstimateInputs(card_list=True), argv=tuple(argv))


def no_output_overwrites_the_config(args: argparse.Namespace, outputs: dict) -> None:
    """--config's soup.yaml is an input as --model's config is: no output (nor --json's row
    file) may be it under any spelling (../, a symlink, a hard link), in any mode."""
    if args.config is None:
        return
    rows = {"--json's row file": str(RowFile.path_for(args.json))} if args.json not in (None, "-") else {}
    no_output_is_an_input({**outputs, **rows}, [("--config", os.path.expanduser(args.config))])


def settle_config(args: argparse.Namespace, argv: list[str]) -> Run:
    """--config without --estimate: the file's one arm, settled as the sweep settles --model PATH's or a
    family's, at the file's quantization and adapter (issue395.run.configarm)."""
    arm = config_arm(args)
    plain = _settle(argparse.Namespace(**dict(vars(args), config=None, model=arm.model, batch=str(arm.batch),
                                              seq=str(arm.seq) if arm.model else None, task=arm.task)), argv)
    return replace(plain, models=(arm.key,), seqs=(arm.seq,), quants=(arm.quant,),
                   adapter=Adapter(arm.targets, arm.lora_r, arm.lora_alpha, arm.path))


def settle_find_max(args: argparse.Namespace, argv: list[str]) -> Run:
    """--find-max: the file's arm as --config settles it (its base, without a download), and this tool's
    answer for the card by --estimate's own settle of the same file and card (its steps: the run's
    steady state unless --steps)."""
    from ..estimator.cards import parse_card

    check("find max", args)
    flag, given = ("--card", args.card) if args.card is not None else ("--emulate-card", args.emulate_card)
    if len(comma_list(given)) != 1:
        raise UsageError(f"{flag} {given}: --find-max searches one card")
    try:
        card = parse_card(given)
    except UsageError as exc:
        raise UsageError(str(exc).replace("--card", flag, 1)) from None
    arm = config_arm(args)
    folder, key = base_of(read_soup_config(args.config), args.weights)
    words = ["--estimate", "--config", args.config, "--card", given]
    for option in ("steps", "context"):
        if getattr(args, option) is not None:
            words += [f"--{option}", getattr(args, option)]
    estimated = settle(build_parser().parse_args(words), words)
    for option, folder_given in (("--log-dir", args.log_dir), ("--cache-dir", args.cache_dir)):
        if folder_given is not None:
            writable_folder(option, folder_given)
    cache = os.path.abspath(os.path.expanduser(args.cache_dir)) if args.cache_dir else None
    if cache and args.shard_dir is None:
        check_cache_dir_bounds(args.cache_dir, cache)
    return replace(estimated, find_max=FindMaxAsk(args.find_max, card.name, flag,
                                                  os.path.abspath(folder) if folder else None, key),
                   models=(arm.key,), dry_run=args.dry_run, verbose=args.verbose, log_dir=args.log_dir,
                   cache_dir=cache, outputs=outputs_of(args), argv=tuple(argv))


def emulate_card(args: argparse.Namespace) -> None:
    """--emulate-card's own checks: a card this tool knows or a size (its clashes: clashes, "constraints")."""
    if args.emulate_card is None:
        return
    from ..estimator.cards import parse_card

    try:
        card = parse_card(args.emulate_card)
    except UsageError as exc:
        raise UsageError(str(exc).replace("--card", "--emulate-card", 1)) from None
    context_within_cards("--emulate-card", [card], parse_context(args.context))


def context_within_cards(flag: str, cards, context: Optional[int]) -> None:
    """A --context that leaves a card nothing once the runtime's growth is out (cards.step_free) is
    one line, never a table of negative free memory."""
    from ..estimator.cards import step_free

    short = next((c for c in cards if context is not None and step_free(c.total_bytes - context) <= 0), None)
    if short is not None:
        raise UsageError(f"--context {context / 1e9:g} GB leaves {flag} {short.name} ({short.total_bytes / 1e9:.2f} GB "
                         "total) no free memory for a step: the context is part of the card's total; give the "
                         "context your card leaves, as an idle process sees it")


def settle_map(args: argparse.Namespace, argv: list[str]) -> Run:
    """--map's own checks (families, quantizations, max positions); the rest as for the sweep."""
    check("map", args)
    known = ALL_FAMILIES
    families = (default_map_families() + ("llama31-8b",) if args.families is None
                else comma_list(args.families))
    unknown = [f for f in families if f not in known]
    if unknown or not all(families) or len(set(families)) != len(families):
        raise UsageError(f"--families: {'unknown family ' + repr(unknown[0]) if unknown else 'empty or repeated name'}; "
                         f"choose from {','.join(known)}")
    for fam in families:
        require_streamed(FAMILIES[fam].model_type if fam in FAMILIES else "llama", f"--families {fam}")
    families = stream_mode_families(args, families)
    quants = QUANTS if args.quant is None else distinct_choices("--quant", args.quant, QUANTS, "quantization")
    if args.quant is not None and "nf4" in quants and not args.dry_run and not bitsandbytes_present():
        raise UsageError("--quant nf4 needs bitsandbytes, which is not installed here")
    seqs, batches = parse_ints("--seq", args.seq, minimum=64), parse_ints("--batch", args.batch)
    # a seq past one family's positions is left out for that family (and named); one past every
    # named family's is one line: it would run nowhere
    widest = max(families, key=max_positions)
    within_positions(widest if len(families) == 1 else f"every named family (the widest, {widest})",
                     max_positions(widest), seqs or ())
    axes = dict(expert_layout=None, loss_chunk=None, recompute=None)  # the map's own, settled above
    plain = _settle(argparse.Namespace(**dict(vars(args), map=False, families=None, quant=None,
                                             models=None, seq=None, batch=args.batch, **axes)), argv)
    return replace(plain, map=True, run_arms=True, models=families, quants=quants, seqs=seqs,
                       batches=batches or MAP_BATCHES)


def stream_mode_families(args: argparse.Namespace, families: list) -> tuple:
    """Each family under every streaming mode asked for (the map's soup-cli 0.77.0 axes)."""
    asked = args.expert_layout or args.loss_chunk or args.recompute
    if asked and not soup_has_stream_modes():
        raise UsageError("--expert-layout, --loss-chunk and --recompute need soup-cli 0.77.0, "
                         "whose training config has them; the installed one does not")
    chunks = comma_list(args.loss_chunk) if args.loss_chunk else ["off"]
    low, high = soup_loss_chunk_bounds()
    return stream_mode_keys(families, comma_list(args.expert_layout) if args.expert_layout else ["fused"],
                            [None if c == "off" else parse_ints("--loss-chunk", c, minimum=low, maximum=high)[0]
                             for c in chunks],
                            comma_list(args.recompute) if args.recompute else ["on"])


def estimate_config(model: Optional[str]) -> tuple[str, dict]:
    """--estimate's model: a family's public config, or a config.json (or a folder holding one)."""
    if not model or not model.strip():
        raise UsageError("--estimate needs --model: a config.json, a folder holding one, or a family "
                         f"({','.join(ALL_FAMILIES)})")
    if model in ALL_FAMILIES:
        if os.path.lexists(model):  # a folder or file of the same name here is not what was read
            print(f"note: --model {model}: the family {model}'s public config was used, not ./{model} here "
                  f"(give ./{model} for that)", file=sys.stderr)
        return model, config_json(model)
    family = by_hub_id(model)
    if family is not None:  # a registry model's hub id (a soup.yaml's base): its committed public config
        return model, config_json(family)
    path = Path(model).expanduser()
    path = path / "config.json" if path.is_dir() else path
    odd = odd_file(str(path))
    if odd:
        raise UsageError(f"--model {model}: {odd}" if str(path) == os.path.expanduser(model)
                         else f"--model {model}: its config.json is {odd}")
    if not path.is_file() and not path.exists() and "/" in model and not model.startswith(("/", ".", "~")):
        from .userconfig import hub_config

        return model, hub_config(model)  # a hub id: its config.json alone, from the cache or the hub
    if not path.is_file():
        raise UsageError(f"--model {model}: no such config.json (nor a family: {','.join(ALL_FAMILIES)})")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise UsageError(f"--model {model}: {path.name} cannot be read ({type(exc).__name__})") from None
    if not isinstance(config, dict):
        raise UsageError(f"--model {model}: {path.name} is not a JSON object")
    return model, config


def settle_estimate(args: argparse.Namespace, argv: list[str]) -> Run:
    """--estimate's checks; from --config, an error names the file's keys (configarm.in_the_files_words)."""
    if args.config is None:
        return settle_estimate_options(args, argv)
    try:
        return settle_estimate_options(args, argv)
    except UsageError as exc:
        raise UsageError(in_the_files_words(str(exc), args.config)) from None


def settle_estimate_options(args: argparse.Namespace, argv: list[str]) -> Run:
    """--estimate's own checks: a config, seqs, and nothing that needs a GPU or Soup's setup."""
    check("estimate", args)
    if args.config is not None:
        args = config_arguments(args)
    name, config = estimate_config(args.model)
    quants = ("none",) if args.quant is None else distinct_choices("--quant", args.quant, QUANTS, "quantization")
    seqs = parse_ints("--seq", args.seq, minimum=64)
    if not seqs:
        raise UsageError("--estimate needs --seq: a comma list of sequence lengths")
    targets = None if args.targets is None else comma_list(args.targets)
    if targets is not None and not all(targets):
        raise UsageError(f"--targets {args.targets!r}: empty name")
    if targets is not None and len(set(targets)) != len(targets):
        raise UsageError(f"--targets {args.targets}: a target is named twice")
    from ..estimator.cards import parse_cards, parse_context
    from ..estimator.estimate import estimate
    from ..estimator.soup_number import arch_of

    try:  # the config's own sizes, heads and positions: one line here, before any table
        arch = arch_of(config)
    except UsageError as exc:
        raise UsageError(f"--model {name}: {exc}") from None
    except Exception as exc:  # a value of the wrong kind deeper in the config
        raise UsageError(f"--model {name}: its config cannot be read as a model ({last_line(exc)})") from None
    within_positions(name, arch.max_pos, seqs)
    soup_targets(targets, config, arch, args.targets)  # checked here; kept as spelled: Soup counts its own spelling
    try:
        cards = tuple(parse_cards(args.card)) if args.card is not None else ()
    except (OverflowError, ValueError) as exc:
        raise UsageError(f"--card {_shown(args.card)!r} is not a size like 24GB or 80GiB ({last_line(exc)})") from None
    context = parse_context(args.context)
    check("estimate cards", args, context=context, cards=cards)
    context_within_cards("--card", cards, context)
    stream = estimate_stream(args)
    tasks = settle_tasks(args)
    batches = parse_ints("--batch", args.batch) or (1,)
    for t in tasks:  # Soup's schema refuses it (KTO needs both labels in a batch): one line
        low = [b for b in batches if b < TASKS[t].min_batch]
        if low:
            raise UsageError(f"--task {t} --batch {low[0]}: Soup's schema refuses a {t} batch under "
                             f"{TASKS[t].min_batch}")
    if stream:  # Soup's own refusals and the modes' physics, in one line before any table
        estimate(config, quant=quants[0], seq=seqs[0], targets=targets, stream=stream)
    check("estimate answer", args, cards=cards)
    return Run(run_arms=False, estimate=EstimateInputs(config, cards, tuple(sorted(stream.items())),
                                                       fit_exit=args.exit_code,
                                                       from_file=getattr(args, "from_file", None)),
               custom_model=name, quants=quants, seqs=seqs, tasks=tasks, batches=batches,
               adapter=Adapter(targets, one_int("--lora-r", args.lora_r, LORA_R),
                               getattr(args, "lora_alpha", None) or LORA_ALPHA, soup_config=args.config),
               steps=one_int("--steps", args.steps, 1), verbose=args.verbose, context=context,
               outputs=Outputs(json=args.json), argv=tuple(argv))


def estimate_stream(args: argparse.Namespace) -> dict:
    """--estimate's soup-cli 0.77.0 streaming modes, one value each: Soup's training keys."""
    stream: dict = {}
    for flag, key, allowed in (("expert_layout", "stream_expert_layout", EXPERT_LAYOUTS),
                               ("recompute", "stream_recompute", RECOMPUTES)):
        value = getattr(args, flag)
        if value is not None and value not in allowed:
            raise UsageError(f"--{flag.replace('_', '-')} {value!r}: with --estimate, one of {', '.join(allowed)}")
        if value is not None and value != allowed[0]:
            stream[key] = value
    if args.loss_chunk not in (None, "off"):
        low, high = soup_loss_chunk_bounds()
        stream["stream_loss_chunk"] = one_int("--loss-chunk", args.loss_chunk, None, minimum=low)
        if stream["stream_loss_chunk"] > high:
            raise UsageError(f"--loss-chunk {args.loss_chunk}: Soup's schema takes {low} to {high} tokens")
    return stream


def grid_arms(run: Run) -> list[Arm]:
    return (plan_map(run.models, run.quants, run.seqs, run.batches, run.tasks) if run.map
            else plan_arms(run.models, run.seqs, run.batches, run.quants[0], run.tasks))


def settle_lanes(args: argparse.Namespace, run: Run) -> Run:
    """--lanes: arms side by side on one card, so never an arm that needs the card to itself."""
    if getattr(args, "lanes", None) is None:
        return run
    check("lanes", lanes=args.lanes, estimate=run.estimate)
    lanes = 0 if args.lanes == "auto" else one_int("--lanes", args.lanes, 1)
    c = run.constraints
    check("lanes run", lanes=args.lanes, cap=c.cap, emulate_card=c.emulate_card, min_free=c.min_free,
          repeats=run.repeats, shard=run.children.shard, run_arms=run.run_arms)
    return replace(run, children=replace(run.children, lanes=lanes))


def settle_shard_dir(args: argparse.Namespace, run: Run) -> Run:
    """--shard-dir: Soup's shard cache on its own volume; refused where Soup would ignore it."""
    given = getattr(args, "shard_dir", None)
    if given is None:
        return run
    check("shard dir", shard_dir=given, estimate=run.estimate and not run.find_max)  # find-max's probes shard
    writable_folder("--shard-dir", given)
    folder = os.path.abspath(os.path.expanduser(given))
    shards = os.path.join(os.path.realpath(folder), "layer-stream")
    if os.path.realpath(soup_shard_root(shards)) != shards:
        raise UsageError(f"--shard-dir {given} is outside $HOME, the working directory and the temp dir; "
                         "Soup would ignore it and write its shard cache to ~/.soup instead "
                         "(on /dev/shm: set TMPDIR=/dev/shm)")
    return replace(run, shard_dir=folder)


def check_cache_dir_bounds(given: str, cache: str) -> None:
    """Refuse a --cache-dir Soup would silently ignore (it would write to ~/.soup instead).
    Soup's own resolution decides (a light import: neither torch nor the hub client)."""
    shards = os.path.join(os.path.realpath(cache), "layer-stream")
    if os.path.realpath(soup_shard_root(shards)) != shards:
        raise UsageError(f"--cache-dir {given} is outside $HOME, the working directory and the temp "
                         "dir; Soup would ignore it and write its shard cache to ~/.soup instead")
