"""What the command line asks for, as one typed request per mode, each settled once (issue395.run.options
picks the mode; the mode's own module settles its request and executes it): ``MeasureRequest`` (the
sweep, the map, --determinism, --measure and --sdpa: issue395.host.measured, beside the machinery that runs
it), ``EstimateRequest`` and ``CardListRequest`` (--estimate, --card list), ``FindMaxRequest``
(--find-max) and ``RerenderRequest`` (--from-json). Nothing changes a request once settled. A new mode
is one request here and one ``<mode>_mode`` module (docs/LAYOUT.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..tasks import PROTOCOL_TASK
from ..model.arm import Adapter, Arm, Settings
from ..model.streaming import Streaming
from ..host.measured import Outputs
from .userconfig import UserRun


@dataclass(frozen=True)
class EstimateRequest:
    """--estimate: the config read, each (task, quant, seq, batch) of it against the cards to fit, from
    the options or from a soup.yaml (``user``: the file, read once, whose values these are)."""

    model: str  # as the user named it: a family, a config.json, a hub id, or the file's base
    config: dict
    quants: tuple = ("none",)
    seqs: tuple = ()
    batches: tuple = (1,)
    tasks: tuple = (PROTOCOL_TASK,)
    adapter: Adapter = Adapter()
    cards: tuple = ()  # issue395.estimator.cards.Card
    context: Optional[int] = None  # --context, bytes
    streaming: Streaming = Streaming()  # how the run streams (a file's: resident, its checkpointing, Soup's probe)
    steps: int = 1
    fit_exit: bool = False  # --exit-code: exits 1 when the run does not fit a card
    user: Optional[UserRun] = None  # --config: the soup.yaml these values are read from
    steps_from: Optional[str] = None  # where the steps came from, with --config ("--steps", or the file's run)
    verbose: bool = False
    outputs: Outputs = Outputs()
    argv: tuple = ()
    stack: tuple = ()  # --stack: the training box's (package, version) pairs, in place of this machine's

    @property
    def gate(self) -> Any:
        """Soup's gate as the file sets it (issue395.estimator.fits.Gate: its override, its probe)."""
        from ..estimator.fits import Gate

        return Gate(self.user.gate_override, self.streaming.probe) if self.user else Gate()

    @property
    def stream(self) -> tuple:
        """soup-cli 0.77.0's streaming modes as (training key, value) pairs, Soup's probe aside (the gate's)."""
        return tuple(sorted((k, v) for k, v in self.streaming.stream().items() if k != "stream_vram_probe"))

    @property
    def settings(self) -> Settings:
        """The file's run settings (Soup's defaults where it sets none; none for --model: the estimator's
        defaults, Soup's default optimizer and one micro-batch a step)."""
        return self.user.arm.settings if self.user else Settings()

    def arms(self) -> list[Arm]:
        """Each (task, quant, seq, batch) asked, in the table's order, as one Arm: the model's registry key where it
        has one (else "custom", the config named), the streaming modes, adapter, settings, steps and stack asked."""
        from ..model.registry import ALL_FAMILIES, by_hub_id

        key = self.model if self.model in ALL_FAMILIES else by_hub_id(self.model)
        run = dict(base=key or "custom", streaming=self.streaming, adapter=self.adapter,
                   settings=self.settings, steps=self.steps, checkpoint=None if key else self.model, stack=self.stack)
        return [Arm(seq=s, batch=b, quant=q, task=t, **run)
                for t in self.tasks for q in self.quants for s in self.seqs for b in self.batches]

    @property
    def keys(self) -> tuple:
        """How each key of the file that changes the peak or Soup's gate is read, one line each."""
        return self.user.keys if self.user else ()


@dataclass(frozen=True)
class CardListRequest:
    """--card list: the named cards and their sources, nothing estimated."""

    argv: tuple = ()
    outputs: Outputs = Outputs()  # none: the list is its own output


@dataclass(frozen=True)
class SoupPatchRequest:
    """--soup-patch: the diff's path, and the installed soup_cli it is made against."""

    path: str
    soup_cli: str
    argv: tuple = ()
    outputs: Outputs = Outputs()  # none: the diff is its own output


@dataclass(frozen=True)
class FindMaxRequest:
    """--find-max: the axis searched on one card (as --card or --emulate-card named it), for the file's run:
    its Arm (``arm``: config_arm's, its base resolved to a registry key or "custom" with the checkpoint folder the
    probes run, absolute; at the steps settled) and its answers on the card as --estimate settles them (``estimate``:
    the card, its context, the file's keys and gate)."""

    estimate: EstimateRequest
    arm: Arm
    axis: str = "seq"
    flag: str = "--card"
    dry_run: bool = False
    log_dir: Optional[str] = None
    cache_dir: Optional[str] = None
    shard_dir: Optional[str] = None
    outputs: Outputs = Outputs()
    argv: tuple = ()


@dataclass(frozen=True)
class RerenderRequest:
    """--from-json: saved results (one, or shards of one run) rendered again, maybe beside --compare's."""

    from_json: tuple
    compare: Optional[str] = None
    outputs: Outputs = Outputs()
    argv: tuple = ()
