"""Which options clash, as one table: each rule a flag (or a flag=value), what it excludes (or the
option it needs, its absence excluded), and why, in the words its one-line message uses.

A rule is checked where settle reads what it tests, so a command line with several faults is told
the same first one as always: each rule names its `stage`, the point in settle that applies it
(`check`), and within a stage the rules run in the table's order. Value parsing, bounds and paths
are not clashes and stay with settle.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import UsageError
from .configarm import CONFIG_GIVES
from .parser import build_parser


@dataclass(frozen=True)
class Flag:
    """An option as a rule reads it: its name in the message and whether the command line gives it
    (each rule keeps the test it has always used: set, on, or a value)."""

    name: str
    on: Callable[[object], object]

    def shown(self, facts: object) -> str:
        return self.name.format(**vars(facts)) if "{" in self.name else self.name


def _attr(name: str) -> str:
    return name.split()[0].strip("-").replace("-", "_")


def is_set(name: str) -> Flag:
    """Given at all: its value is not None."""
    return Flag(name, lambda f, a=_attr(name): getattr(f, a) is not None)


def truthy(name: str) -> Flag:
    """Given as something: a switch on, a value not empty."""
    return Flag(name, lambda f, a=_attr(name): getattr(f, a))


def named(name: str) -> Flag:
    """Given, an empty value too: neither None nor a switch off."""
    return Flag(name, lambda f, a=_attr(name): getattr(f, a) not in (None, False))


def valued(name: str, value: str) -> Flag:
    """Given as this value (flag=value), named with it."""
    return Flag(f"{name} {value}", lambda f, a=_attr(name): getattr(f, a) == value)


def without(name: str, test: Optional[Callable[[object], object]] = None) -> Flag:
    """The absence of an option another needs (named as the one needed)."""
    return Flag(name, (lambda f: not test(f)) if test else (lambda f, a=_attr(name): not getattr(f, a)))


SNAPSHOT = Flag("--snapshot", lambda f: f.snapshot or f.snapshot_dir)  # --snapshot-dir implies it
REPEATS = Flag("--determinism", lambda f: f.repeats)  # the repeat count settled


@dataclass(frozen=True)
class Others:
    """Every option the command line changed from its default, but these (read from the parser)."""

    kept: frozenset

    def __call__(self, facts: object) -> tuple:
        defaults = vars(build_parser().parse_args([]))
        return tuple(Flag("--" + k.replace("_", "-"), lambda f: True) for k, v in vars(facts.args).items()
                     if k not in self.kept and v != defaults.get(k))


#: What --from-json takes beside the saved results: the outputs and --steps (the corrected column).
FROM_JSON_OPTIONS = frozenset({"from_json", "compare", "json", "markdown", "plot", "steps"})

#: How a message reads: {flag} the rule's, {other} the first excluded one given, {all} and {any}
#: every one the rule excludes, {why} the reason.
EXCLUSIVE = "{flag} and {other} are exclusive: {why}"
GOES_WITH = "{flag} goes with {other}"
NOT_WITH = "{flag} {why}: not with {any}"


@dataclass(frozen=True)
class Clash:
    stage: str  # where settle applies it (check)
    flag: Flag
    excludes: object  # a tuple of Flag, or Others
    why: str = ""
    says: str = EXCLUSIVE

    def first(self, facts: object) -> Optional[str]:
        """The one line this rule says of the command line, or None where it does not clash."""
        if not self.flag.on(facts):
            return None
        excluded = self.excludes(facts) if callable(self.excludes) else self.excludes
        given = [x for x in excluded if x.on(facts)]
        if not given:
            return None
        names = [x.name for x in excluded]
        listed = lambda last: ", ".join(names[:-1]) + f" {last} " + names[-1] if len(names) > 1 else names[0]
        return self.says.format(flag=self.flag.shown(facts), other=given[0].shown(facts), why=self.why,
                                all=listed("and"), any=listed("or"))


_ESTIMATES_NOTHING = "an estimate runs nothing"
_SHARD = "is one shard of the grid"

#: Every clash, in the order settle meets them (settle, _settle, its --estimate, sweep and map
#: branches, then --lanes and --shard-dir on the settled run).
CLASHES = (
    Clash("card list", Flag("--card list", lambda f: f.card is not None and f.card.strip().lower() == "list"),
          Others(frozenset({"card", "estimate"})), "it lists the named cards"),
    Clash("settle", truthy("--exit-code"), (without("--estimate"),), "its exit code says whether the run fits",
          "{flag} goes with {other} ({why})"),
    Clash("settle", is_set("--stack"), (without("--estimate"),), "it names the training box's stack for an estimate",
          "{flag} goes with {other} ({why})"),
    Clash("options", truthy("--from-json"), Others(FROM_JSON_OPTIONS),
          "--from-json re-renders saved results and runs nothing"),
    Clash("options", is_set("--config"), tuple(is_set(f) for f in CONFIG_GIVES), "the file gives it"),
    Clash("options", is_set("--config"), (truthy("--map"),), "the file is one arm"),
    *(Clash("options", is_set(mode), (without("--map (an axis) or --estimate", lambda f: f.map or f.estimate),),
            says=GOES_WITH)  # never measured as if the mode were asked and absent
      for mode in ("--expert-layout", "--loss-chunk", "--recompute")),
    *(Clash("options", is_set(mode), (without("--map (an axis)", lambda f: f.map),), says=GOES_WITH)
      for mode in ("--stream-layers", "--gradient-checkpointing", "--stream-vram-probe")),  # a soup.yaml says it with stream_layers
    Clash("options", truthy("--estimate"), (Flag("--weights", lambda f: f.weights != "synthetic"),),
          "an estimate reads the config, no weights"),
    Clash("compare", truthy("--compare"), (without("--from-json"),), says=GOES_WITH),
    # (--map and --exit-code beside it are refused above, with --config and --estimate's own rules)
    Clash("find max", is_set("--find-max"), (without("--config"),), "it finds the limit of your soup.yaml's run",
          "{flag} needs {other}: {why}"),
    Clash("find max", is_set("--find-max"),
          (without("--card or --emulate-card", lambda f: f.card is not None or f.emulate_card is not None),),
          "the card it finds the limit on", "{flag} needs {other}: {why}"),
    Clash("find max", Flag("--card", lambda f: f.find_max is not None and f.card is not None),
          (is_set("--emulate-card"),), "--find-max searches one card, named once"),
    Clash("find max", is_set("--find-max"),
          (*(named(f) for f in ("--estimate", "--sweep", "--measure", "--sdpa", "--determinism", "--isolate", "--gpus", "--shard", "--lanes", "--snapshot",
                                "--snapshot-dir", "--markdown", "--plot", "--cap", "--min-free")),
           Flag("--weights hub", lambda f: f.weights != "synthetic")),
          "runs your soup.yaml's own run, probe by probe, each `soup train` in a fresh process", NOT_WITH),
    Clash("estimate", truthy("--estimate"),
          tuple(named(f) for f in ("--sweep", "--measure", "--sdpa", "--map", "--determinism", "--models",
                                   "--families", "--dry-run", "--isolate", "--gpus", "--shard", "--snapshot",
                                   "--snapshot-dir", "--markdown", "--plot", "--log-dir", "--cache-dir", "--cap",
                                   "--emulate-card", "--min-free")), _ESTIMATES_NOTHING),
    Clash("estimate cards", is_set("--context"), (without("--card", lambda f: f.cards),),
          "it is the context of the card to fit", "{flag} goes with {other}: {why}"),
    Clash("estimate answer", truthy("--exit-code"), (without("--card", lambda f: f.cards),),
          "it says whether the run fits a card", "{flag} needs {other}: {why}"),
    *(Clash("estimate only", is_set(flag), (without("--estimate"),), says=GOES_WITH)
      for flag in ("--card", "--targets", "--lora-r")),
    Clash("estimate only", Flag("--context", lambda f: f.context is not None and not f.emulate_card),
          (without("--estimate or --emulate-card", lambda f: f.estimate or f.emulate_card),), says=GOES_WITH),
    Clash("map", truthy("--map"),
          (*(named(f) for f in ("--models", "--model", "--determinism")),
           Flag("--isolate", lambda f: f.isolate not in (None, False) and not (
               f.cap is not None or f.emulate_card is not None or f.min_free))),  # a constraint's own
          says="{flag} and {other} are exclusive"),
    *(Clash("sweep", is_set(flag), (without("--map"),), says=GOES_WITH) for flag in ("--families", "--quant")),
    Clash("sweep", is_set("--model"), (truthy("--models"),), "one brings its own model"),
    Clash("shard", is_set("--shard"), (truthy("--gpus"), truthy("--isolate"), REPEATS), _SHARD,
          "{flag} {why}; {all} make their own"),
    Clash("shard", truthy("--model"), (without("--seq", lambda f: f.seqs is not None),),
          "there is no record grid for it", "{flag} needs {other} ({why})"),
    Clash("cap", is_set("--cap"), (truthy("--measure"), truthy("--sdpa"), SNAPSHOT),
          "runs each arm under a capped allocator",
          "{flag} {why}; {all} would run under it too: run them without {flag}"),
    Clash("constraints", is_set("--emulate-card"),
          (truthy("--dry-run"), is_set("--cap"), REPEATS, truthy("--measure"), truthy("--sdpa"), SNAPSHOT),
          "holds CUDA memory outside the allocator for each arm in a fresh process", NOT_WITH),
    Clash("constraints", truthy("--min-free"),
          (truthy("--dry-run"), is_set("--cap"), truthy("--emulate-card"), REPEATS, truthy("--measure"),
           truthy("--sdpa"), SNAPSHOT), "runs each arm in capped fresh processes on a GPU", NOT_WITH),
    Clash("constraints", is_set("--cap"), (truthy("--dry-run"), REPEATS),
          "re-runs arms on a GPU, each in a fresh process", NOT_WITH),
    Clash("constraints", SNAPSHOT, (truthy("--dry-run"),), "attributes the CUDA step's peak",
          "{flag} {why}; a {other} has no step"),
    Clash("lanes", truthy("--estimate"), (is_set("--lanes"),), _ESTIMATES_NOTHING),
    Clash("lanes run", is_set("--lanes"), (truthy("--cap"), truthy("--emulate-card"), truthy("--min-free")),
          "shares the card between arms",
          "{flag} {why}; {all} arms need the whole card: run them without {flag} (one at a time, as they always run)"),
    Clash("lanes run", is_set("--lanes"), (REPEATS,), "each repeat is a fresh process of its own"),
    Clash("lanes run", truthy("--shard"), (is_set("--lanes"),), _SHARD, "{flag} {why}; {all} makes its own"),
    Clash("lanes run", is_set("--lanes"), (without("--measure and --sdpa alone", lambda f: f.run_arms),),
          "spreads the arms", "{flag} {why}; {other} run none (add --sweep)"),
    Clash("shard dir", truthy("--estimate"), (is_set("--shard-dir"),), "nothing is sharded"),  # --from-json's above
)

STAGES = tuple(dict.fromkeys(c.stage for c in CLASHES))


def check(stage: str, args: Optional[argparse.Namespace] = None, **settled: object) -> None:
    """The stage's first clash as one line (UsageError); nothing where none clashes. A rule reads
    the command line's options (args) and what settle has settled by then (settled: a value parsed,
    or the settled run's)."""
    assert stage in STAGES, stage
    facts = argparse.Namespace(**{**(vars(args) if args is not None else {}), **settled}, args=args)
    for clash in CLASHES:
        if clash.stage == stage:
            line = clash.first(facts)
            if line is not None:
                raise UsageError(line)
