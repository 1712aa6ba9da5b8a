"""--estimate (and --card list): the config's peak from the config alone, on CPU, against the cards to
fit. Settled once into an ``Estimate`` from the options (``FromOptions``) or from the user's soup.yaml,
read once (``FromFile``: each value off the UserRun, an error naming the file's key where it is read);
--find-max settles its file's estimate by the same ``settle_values``. Executed here: the table, the
verdicts and --json."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Optional

from ..constants import comma_list
from ..errors import EXIT_OK, EXIT_USAGE, UsageError, last_line
from ..record import LORA_ALPHA, LORA_DROPOUT, LORA_R, QUANTS
from ..tasks import TASKS
from ..model.arm import Adapter
from ..model.registry import ALL_FAMILIES, by_hub_id, config_json, hub_id_of, variant_of
from ..model.streaming import EXPERT_LAYOUTS, RECOMPUTES, Streaming
from ..model.targets import soup_targets
from ..measure.shapes import soup_loss_chunk_bounds
from ..report.outputs import write_json
from .checks import (_shown, context_within_cards, distinct_choices, no_output_is_an_input, odd_file, one_int,
                     parse_ints, settle_tasks, within, within_positions)
from .clashes import check
from .configarm import STEADY_STEPS, base_is_no_family_key
from ..host.measured import Outputs
from .request import CardListRequest, EstimateRequest
from .userconfig import UserRun, hub_config, read_soup_config


def chosen(args: argparse.Namespace) -> bool:
    return bool(args.estimate)


class FromOptions:
    """--estimate's values from its options, each parsed where it is read, an error naming its option."""

    MODEL, SEQ, TARGETS, BATCH = "--model", "--seq", "--targets", "--batch"
    STREAM = {"expert_layout": "--expert-layout", "loss_chunk": "--loss-chunk", "recompute": "--recompute"}

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def model(self) -> Optional[str]:
        return self.args.model

    def quants(self) -> tuple:
        return ("none",) if self.args.quant is None else distinct_choices("--quant", self.args.quant, QUANTS,
                                                                           "quantization")

    def seqs(self) -> Optional[tuple]:
        return parse_ints("--seq", self.args.seq, minimum=64)

    def targets(self) -> tuple[Optional[tuple], Optional[str]]:
        """The targets and their spelling as given."""
        given = self.args.targets
        return (None if given is None else comma_list(given)), given

    def stream(self) -> dict:
        return {k: getattr(self.args, k) for k in self.STREAM}

    def tasks(self) -> tuple:
        return settle_tasks(self.args.task)

    def batches(self) -> tuple:
        return parse_ints("--batch", self.args.batch) or (1,)

    def lora(self) -> tuple[int, int]:
        return one_int("--lora-r", self.args.lora_r, LORA_R), LORA_ALPHA

    def steps(self) -> tuple[int, Optional[str]]:
        return one_int("--steps", self.args.steps, 1), None

    def streaming(self, stream: dict) -> Streaming:
        """The run's Streaming: the modes settled (``settled_stream``'s Soup keys)."""
        return Streaming.of_training(stream)


class FromFile(FromOptions):
    """--estimate's values off the soup.yaml's UserRun (Soup's own loader validated them), an error naming
    the file's key; --steps and the card stay the command line's (the file's run: its steady state)."""

    MODEL, SEQ, TARGETS, BATCH = "base", "data.max_length", "training.lora.target_modules", "training.batch_size"
    STREAM = {"expert_layout": "training.stream_expert_layout", "loss_chunk": "training.stream_loss_chunk",
              "recompute": "training.stream_recompute"}

    def __init__(self, args: argparse.Namespace, user: UserRun) -> None:
        super().__init__(args)
        self.user = user

    def model(self) -> str:
        base_is_no_family_key(self.user)  # --model mistral-7b is a family; a soup.yaml's base is soup train's
        return self.user.base

    def quants(self) -> tuple:
        return (self.user.arm.quant,)

    def seqs(self) -> tuple:
        return (within("--seq", self.user.arm.seq, minimum=64, named=self.SEQ),)

    def targets(self) -> tuple[Optional[tuple], Optional[str]]:
        return self.user.arm.adapter.targets, ",".join(self.user.arm.adapter.targets)

    def stream(self) -> dict:
        s = self.user.arm.streaming
        return {"expert_layout": s.layout, "recompute": s.recompute,
                "loss_chunk": None if s.loss_chunk is None else str(s.loss_chunk)}

    def streaming(self, stream: dict) -> Streaming:
        """The file's Streaming whole: a resident run and its checkpointing, Soup's probe (issue 50, F: every
        estimate of a probed file takes the probe's backward at setup, as the map's ``+probe`` arm does)."""
        return self.user.arm.streaming

    def tasks(self) -> tuple:
        return (self.user.arm.task,)

    def batches(self) -> tuple:
        return (within("--batch", self.user.arm.batch, named=self.BATCH),)

    def lora(self) -> tuple[int, int]:
        a = self.user.arm.adapter
        # r 0 is Soup's full fine-tuning, a resident run's (its loader refuses it streamed)
        return (within("--lora-r", a.lora_r, minimum=0 if self.user.resident else 1, named="training.lora.r"),
                a.lora_alpha or LORA_ALPHA)

    def steps(self) -> tuple[int, Optional[str]]:
        given = self.args.steps
        return (one_int("--steps", given, 1) if given is not None else STEADY_STEPS,
                "--steps" if given is not None else "--config's run")


def settle(args: argparse.Namespace, argv: list[str]) -> EstimateRequest:
    """--estimate's checks; with --config, the file read once and an error said under its name."""
    if args.model and args.model not in ALL_FAMILIES:
        no_output_is_an_input({f: getattr(args, f.strip("-")) for f in ("--json", "--markdown", "--plot")},
                              [("--model", os.path.expanduser(args.model))])
    with under_the_file(args.config) if args.config is not None else contextlib.nullcontext():
        check("estimate", args)
        given = FromOptions(args) if args.config is None else FromFile(args, read_soup_config(args.config))
        request = settle_values(args, given, args.card)
    check("lanes", args)
    check("shard dir", args)
    return replace(request, fit_exit=args.exit_code, verbose=args.verbose, outputs=Outputs(json=args.json),
                   argv=tuple(argv), stack=settle_stack(args.stack))


def settle_stack(given: Optional[str]) -> tuple:
    """--stack PKG=VERSION,...: the training box's packages whose code decides the peak (issue 53 item 16),
    each named once; soup-cli is not among them: Soup's number is computed from the installed release's source."""
    from ..estimator.stacks import PACKAGES

    if given is None:
        return ()
    takes = [p for p in PACKAGES if p != "soup-cli"]
    pairs: dict = {}
    for part in comma_list(given):
        name, eq, version = (x.strip() for x in part.partition("="))
        name = name.lower().replace("_", "-")
        if name == "soup-cli":
            raise UsageError(f"--stack {given}: soup-cli is not named here: Soup's own number is computed from the "
                             "installed soup-cli's source, so install the training box's release here")
        if not eq or name not in takes or not re.fullmatch(r"\d+(?:\.\d+)*(?:[.+\-\w]*)", version):
            raise UsageError(f"--stack {given}: {part!r} is not PACKAGE=VERSION with a package among "
                             f"{', '.join(takes)} (e.g. --stack transformers=5.25.0,torch=2.11.0+cu130)")
        if name in pairs:
            raise UsageError(f"--stack {given}: {name} is named twice")
        pairs[name] = version
    return tuple(pairs.items())


#: The options beside --config that a soup.yaml never sets: an error about one is the option's, not the file's.
OWN_OPTIONS = ("--card ", "--context ", "--steps ", "--exit-code")


@contextlib.contextmanager
def under_the_file(path: str) -> Iterator[None]:
    """An error settling a soup.yaml's values, said under --config PATH (one already about it as it is, or about
    an option of the command line beside it: the card, the context)."""
    try:
        yield
    except UsageError as exc:
        if str(exc).startswith(("--config ", *OWN_OPTIONS)):
            raise
        raise UsageError(f"--config {path}: {exc}") from None


def settle_values(args: argparse.Namespace, given: FromOptions, cards_given: Optional[str]) -> EstimateRequest:
    """An EstimateRequest of the values ``given`` reads (the options', or a soup.yaml's), against ``cards_given``
    (--card, or --find-max's card): a config, seqs, and nothing that needs a GPU or Soup's setup."""
    from ..estimator.cards import parse_cards, parse_context
    from ..estimator.arch import arch_from_config
    from ..estimator.soup_number import arch_of, stream_refused

    name, config = estimate_config(given.model(), given.MODEL)
    quants = given.quants()
    seqs = given.seqs()
    if not seqs:
        raise UsageError("--estimate needs --seq: a comma list of sequence lengths")
    targets, spelled = given.targets()
    if targets is not None and not all(targets):
        raise UsageError(f"{given.TARGETS} {spelled!r}: empty name")
    if targets is not None and len(set(targets)) != len(targets):
        raise UsageError(f"{given.TARGETS} {spelled}: a target is named twice")
    resident = getattr(given, "user", None) is not None and given.user.resident is not None
    try:  # the config's own sizes, heads and positions: one line here, before any table (streamed: Soup streams it)
        arch = arch_from_config(config) if resident else arch_of(config)
    except UsageError as exc:
        raise UsageError(f"{given.MODEL} {name}: {exc}") from None
    except Exception as exc:  # a value of the wrong kind deeper in the config
        raise UsageError(f"{given.MODEL} {name}: its config cannot be read as a model ({last_line(exc)})") from None
    within_positions(name, arch.max_pos, seqs, given.SEQ)
    (lora_r, lora_alpha), (steps, steps_from) = given.lora(), given.steps()
    if lora_r:  # checked here; kept as spelled: Soup counts its own (a full fine-tuning, r 0, never reaches peft)
        soup_targets(targets, config, arch, spelled, given.TARGETS)
    try:
        cards = tuple(parse_cards(cards_given)) if cards_given is not None else ()
    except (OverflowError, ValueError) as exc:
        raise UsageError(f"--card {_shown(cards_given)!r} is not a size like 24GB or 80GiB ({last_line(exc)})") from None
    context = parse_context(args.context)
    check("estimate cards", args, context=context, cards=cards)
    context_within_cards("--card", cards, context)
    stream = settled_stream(given.stream(), given.STREAM)
    tasks = given.tasks()
    batches = given.batches()
    for t, b in ((t, b) for t in tasks for b in batches):  # KTO needs both labels in a batch: one line
        if TASKS[t].batch_refused(b):
            raise UsageError(f"--task {t} {given.BATCH} {b}: {TASKS[t].batch_refused(b)}")
    if stream:  # Soup's own refusals of the streaming modes, in one line before any table
        stream_refused(config, stream)
    check("estimate answer", args, cards=cards)
    user = getattr(given, "user", None)
    return EstimateRequest(name, config, quants, seqs, batches, tasks,
                    Adapter(targets, lora_r, lora_alpha, args.config, user.arm.adapter.dropout if user else LORA_DROPOUT),
                    cards, context,
                    given.streaming(stream), steps, user=user, steps_from=steps_from)


def settled_stream(given: dict, named: dict) -> dict:
    """--estimate's soup-cli 0.77.0 streaming modes, one value each: Soup's training keys (a mode at
    its default is left out)."""
    stream: dict = {}
    for flag, key, allowed in (("expert_layout", "stream_expert_layout", EXPERT_LAYOUTS),
                               ("recompute", "stream_recompute", RECOMPUTES)):
        value = given[flag]
        if value is not None and value not in allowed:
            raise UsageError(f"{named[flag]} {value!r}: with --estimate, one of {', '.join(allowed)}")
        if value is not None and value != allowed[0]:
            stream[key] = value
    if given["loss_chunk"] not in (None, "off"):
        low, high = soup_loss_chunk_bounds()
        stream["stream_loss_chunk"] = one_int("--loss-chunk", given["loss_chunk"], None, minimum=low,
                                              named=named["loss_chunk"])
        if stream["stream_loss_chunk"] > high:
            raise UsageError(f"{named['loss_chunk']} {given['loss_chunk']}: Soup's schema takes {low} to {high} tokens")
    return stream


def estimate_config(model: Optional[str], named: str = "--model") -> tuple[str, dict]:
    """--estimate's model: a family's public config, or a config.json (or a folder holding one);
    ``named``: where it was given (--model, or a soup.yaml's base)."""
    if not model or not model.strip():
        raise UsageError(f"--estimate needs {named}" + (" or --config SOUP_YAML (the soup.yaml `soup train` takes)"
                                                        if named == "--model" else "")
                         + f": --model takes a config.json, a folder holding one, or a family ({','.join(ALL_FAMILIES)})")
    if model in ALL_FAMILIES:
        if os.path.lexists(model):  # a folder or file of the same name here is not what was read
            print(f"note: --model {model}: the family {model}'s public config was used, not ./{model} here "
                  f"(give ./{model} for that)", file=sys.stderr)
        return model, config_json(model)
    family = by_hub_id(model)
    if family is not None:  # a registry model's hub id (a soup.yaml's base): its committed public config
        return model, config_json(family)
    if variant_of(model) is not None:  # its instruct, chat or base variant: the same shapes, offline (shape_line)
        return model, config_json(variant_of(model))
    path = Path(model).expanduser()
    path = path / "config.json" if path.is_dir() else path
    odd = odd_file(str(path))
    if odd:
        raise UsageError(f"{named} {model}: {odd}" if str(path) == os.path.expanduser(model)
                         else f"{named} {model}: its config.json is {odd}")
    if not path.is_file() and not path.exists() and "/" in model and not model.startswith(("/", ".", "~")):
        return model, hub_config(model, named)  # a hub id: its config.json alone, from the cache or the hub
    if not path.is_file():
        raise UsageError(f"{named} {model}: no such config.json (nor a family: {','.join(ALL_FAMILIES)})")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise UsageError(f"{named} {model}: {path.name} cannot be read ({type(exc).__name__})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{named} {model}: {path.name} is not a JSON object")
    return model, config


def execute(request: EstimateRequest, protocol: object = None) -> int:
    """--estimate: each (task, quant, seq, batch) from the config alone, on CPU; the table, and --json, under
    the training box's stack where --stack names it."""
    from ..estimator.attention import training_box
    from ..estimator.stacks import check, installed_stack

    e, a = request, request.adapter
    if e.user is not None and e.user.resident is not None:  # every layer on the card: Soup's resident gate
        from .resident_estimate import answer_resident

        return answer_resident(e)
    gate, optimizer, stream = e.gate, e.settings.optimizer, dict(e.stream)
    kw = {"targets": a.targets, "lora_r": a.lora_r}
    box = dict(e.stack)  # --stack: the training box's packages, in place of this machine's
    with training_box(box.get("transformers")):
        return answered(e, a, gate, optimizer, stream, kw, box,
                        check({**installed_stack(), **box}, nf4="nf4" in e.quants) if box else None)


def answered(e: EstimateRequest, a: Adapter, gate, optimizer, stream: dict, kw: dict, box: dict, boxed) -> int:
    """--estimate's rows, text and JSON, under the stack they answer for (``boxed``: --stack's check)."""
    from ..estimator.cards import workspace_env
    from ..estimator.arch import protocol_targets
    from ..estimator.soup_number import arch_of
    from ..estimator.fits import (budgets_for, card_answers, estimate_table, first_line, runs_exit_code, steps_words,
                                  verdict_lines)
    from ..estimator.resident import estimate_run
    from ..estimator.releases import UnknownRelease, installed_release, release_label
    from ..estimator.stacks import check_installed
    from ..estimator.steady import bound_words, is_bounded
    from ..estimator.terms import phases_of

    try:
        arms = e.arms()
        rows = [estimate_run(arm, e.config) for arm in arms]
        budgets = budgets_for(e.cards, e.context)
        answers = [card_answers(e.config, r, budgets, arm, env=workspace_env(), gate=gate) for r, arm in zip(rows, arms)]
        installed = installed_release()
        table = estimate_table(rows, e.cards, e.config, answers=answers, release_label=release_label(installed),
                               verbose=e.verbose)
    except UnknownRelease:  # the release's fault, not the model's: said without naming the model
        raise
    except UsageError as exc:
        raise UsageError(f"--estimate {estimated_as(e)}: {exc}") from None
    except Exception as exc:  # a config value of a kind no real config has
        raise UsageError(f"--estimate {estimated_as(e)}: cannot be estimated ({last_line(exc)})") from None
    notes = estimate_notes(e.config, e.quants)
    named = f"{e.model}, from --config {a.soup_config}" if a.soup_config else e.model
    answer = steps_words(e.steps, e.steps_from)
    stack = boxed or check_installed(nf4="nf4" in e.quants)
    stack_line = stack.line() if not box else stack.line().replace(
        "stack: ", f"stack (the training box's, by --stack {','.join(f'{p}={v}' for p, v in box.items())}; the rest "
        "this machine's): ", 1)
    # a bounded optimizer's figure is the bound's where its states count: from step 2, or where step 1's step binds
    charged = e.steps > 1 or any(r.phase == "optimizer" for r in rows)
    bound = bound_words(optimizer) if optimizer and charged and is_bounded(optimizer) else None
    verdict = first_line(rows, e.cards, answers)
    if bound:  # every figure is the bound's: said on the verdict's line and on its own
        verdict = verdict.replace("verdict (", f"verdict (an UPPER BOUND: training.optimizer {optimizer} is not modelled; ", 1)
    text = (verdict + f"\n--estimate: {named}: {answer}\n" + "".join(f"  {v}\n" for v in verdict_lines(rows, e.cards, answers))
            + f"  {stack_line}\n" + (f"  {shape_line(e.model)}\n" if variant_of(e.model) else "")
            + f"  {lora_line(e)}\n" + (f"  {bound}\n" if bound else "")
            + "".join(f"  {c}\n" for c in config_caveats(e.config, e.quants))
            + "".join(f"  from the file: {k}\n" for k in e.keys)
            + "(Soup's pre-flight: computed by Soup's own estimator code; corrected and needs free: this tool's "
            "estimator, from the config alone)\n" + table + "".join(f"note: {n}\n" for n in notes if not n.startswith("config: ")))
    print(text, end="")
    fits_all = all(x["fits"] for per in answers for x in per)
    if e.outputs.json:
        arch = arch_of(e.config)
        targets = soup_targets(a.targets, e.config, arch, None) or protocol_targets(arch)
        if not write_json(e.outputs.json, "estimate", {
                "model": e.model, **({"shape": {"family": variant_of(e.model), "hub_id": hub_id_of(variant_of(e.model)),
                                                "said": shape_line(e.model)}} if variant_of(e.model) else {}),
                "soup_cli": installed, "stack": {**stack.to_json(), **({"given": box} if box else {})}, "tasks": list(e.tasks),
                "targets": list(targets),
                **({"soup_targets": a.targets[0]} if a.targets and tuple(targets) != tuple(a.targets) else {}),
                "config": a.soup_config, "lora_alpha": a.lora_alpha, **{f"lora_{k}": v for k, v in a.soup_lora().items()},
                "stream": stream, "steps": e.steps,
                "answer": answer, "soup_gate": {"rule": gate.rule, "override_bytes": gate.override},
                "config_keys": list(e.keys), "upper_bound": bound, "fits_every_card": fits_all if e.cards else None,
                "runs_on_every_card": runs_exit_code(answers) == EXIT_OK if e.cards else None, "lora_r": a.lora_r,
                "cards": [{"card": c.name, "bytes": c.total_bytes} for c in e.cards], "notes": notes,
                "term_phases": {k: list(phases_of(k)) for r in rows for k in r.terms},
                "rows": [dict(r.to_json(), cards=x) for r, x in zip(rows, answers)]}):
            return EXIT_USAGE
    return runs_exit_code(answers) if e.fit_exit else EXIT_OK


def lora_line(e: EstimateRequest) -> str:
    """The adapter the figures are at (issue 53 item 9): its rank and alpha, and its targets as Soup's LoraConfig
    resolves them (auto: peft's table for the model type; all-linear: every linear module of a layer; none
    given: the protocol's), with where they came from."""
    from ..estimator.arch import protocol_targets
    from ..estimator.soup_number import arch_of

    a, arch = e.adapter, arch_of(e.config)
    targets = soup_targets(a.targets, e.config, arch, None) or protocol_targets(arch)
    source = "training.lora" if a.soup_config else "--lora-r and --targets, or their defaults"
    spelled = (f" (target_modules {a.targets[0]}, resolved as Soup's LoraConfig does)" if a.targets
               and tuple(targets) != tuple(a.targets) else "" if a.targets else " (the protocol's; --targets names others)")
    return (f"LoRA (the figures' adapter, from {source}): r {a.lora_r}, alpha {a.lora_alpha}, on {len(targets)} "
            f"module(s) a layer: {','.join(targets)}{spelled}")


def shape_line(model: str) -> str:
    """Which shape answered for a registry model's instruct, chat or base variant (issue 53 item 12)."""
    key = variant_of(model)
    return (f"shape: {model} is answered by {hub_id_of(key)}'s public config (the family {key}, committed here, "
            "offline): its variant of the same architecture and sizes; give its own config.json with --model for "
            "any difference")


def estimated_as(e: EstimateRequest) -> str:
    """What the user named: --config's file and its base, else --model."""
    return f"--config {e.adapter.soup_config} (base {e.model})" if e.adapter.soup_config else f"--model {e.model}"


def config_caveats(config: dict, quants) -> list[str]:
    """What of the config itself the figures do not follow, said under the verdict, where it is read (issue 53
    item 11: a quantization_config and a hidden size no head count divides were answered without a word)."""
    lines = []
    q = config.get("quantization_config")
    if q is not None:
        method = q.get("quant_method", "unnamed") if isinstance(q, dict) else type(q).__name__
        lines.append(f"config: its quantization_config ({method}) is NOT modelled: these figures are Soup's "
                     f"--quant {','.join(quants)} of the full-precision shapes the config describes")
    h, nh = config.get("hidden_size"), config.get("num_attention_heads")
    if config.get("head_dim") is None and all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                              for v in (h, nh)) and h % nh:
        lines.append(f"config: hidden_size {h} is not a multiple of num_attention_heads {nh}, and no head_dim is "
                     f"given: each head is taken {h // nh} wide (hidden_size // heads, as transformers takes it), the "
                     f"attention {nh * (h // nh)} wide, not {h}; no released model is shaped so: check the config")
    return lines


def estimate_notes(config: dict, quants) -> list[str]:
    """What the estimate leaves out, said where its numbers are read."""
    notes = config_caveats(config, quants)
    notes.append("needs free assumes the allocator's expandable segments, as `soup train` sets them "
                 "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)")
    notes.append("not estimated: the disk Soup's store overflows to where the free RAM is short of its RAM tier "
                 "(the host RAM line under the verdict)")
    return notes


def card_list_chosen(args: argparse.Namespace) -> bool:
    return args.card is not None and args.card.strip().lower() == "list"


def settle_card_list(args: argparse.Namespace, argv: list[str]) -> CardListRequest:
    """--card list, alone (or beside --estimate): the named cards and their sources, nothing else."""
    check("card list", args)
    return CardListRequest(tuple(argv))


def list_cards(request: CardListRequest, protocol: object = None) -> int:
    from ..estimator.fits import card_list

    print(card_list(), end="")
    return EXIT_OK
