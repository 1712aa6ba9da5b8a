"""An arm of the grid, the run settings it carries, and Soup's prediction for it: ``SETTINGS``, each soup.yaml
``training`` key that changes the step declared once (its Soup key, the estimator's keyword, the protocol's value),
and ``Settings``, a run's values of them, which every mode, the estimator and the row take; Soup's own estimator
and logits charge, fed the arm's shape exactly as the record fed them (computed by Soup)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..constants import is_whole
from ..record import LORA_ALPHA, LORA_DROPOUT, LORA_R
from ..tasks import PROTOCOL_TASK
from .registry import FAMILIES, SHAPES, Shape
from .streaming import SEP, Streaming


#: Soup's default ``training.optimizer`` (its schema's), the protocol's: the one its step runs.
DEFAULT_OPTIMIZER = "adamw_torch"


@dataclass(frozen=True)
class Setting:
    """One soup.yaml ``training`` key that changes the step beyond the arm's model, quantization, seq, batch
    and task, declared once: the Settings field (the row's JSON key too), the key Soup's loader reads, the
    estimator's keyword, the protocol's own value (an arm at it is the protocol's), the type Soup's loader
    gives, how the estimator models a value other than the protocol's (said under --estimate, ``how``), its name in a run's
    header (``words``), and whether
    only a streamed step reads it (a resident run, stream_layers false, has no use for it: its estimate
    does not take it). A new setting is one line here and one field of ``Settings``; the estimator takes
    its keyword (docs/LAYOUT.md)."""

    field: str
    soup: str
    estimator: str
    protocol: Any
    kind: type
    modelled: str
    words: str
    streamed_only: bool = False

    def how(self, arm: "Arm") -> str:
        """How the estimator models a value of this setting on ``arm``'s run (``modelled``), its gradients the
        adapter's or, a full fine-tuning's, the trained parameters' (``GRADIENTS_OF``)."""
        return self.modelled.format(gradients=GRADIENTS_OF[arm.full])

    def valid(self, value: Any) -> bool:
        """A value a saved row may hold: a printable name, or a whole number >= 1."""
        if self.kind is int:
            return is_whole(value, 1)
        return isinstance(value, str) and value.isprintable() and bool(value)


#: Whose gradients a step holds, as a setting's words say it: a LoRA run's adapter's, a full fine-tuning's (``Arm.full``)
#: every trained parameter's.
GRADIENTS_OF = {False: "the adapter's gradients", True: "the trained parameters' gradients"}

SETTINGS = (
    Setting("optimizer", "optimizer", "optimizer", DEFAULT_OPTIMIZER, str,
            "its states from step 2 on, by the estimator's optimizer table (one it has no entry for is charged "
            "as an upper bound, said as one)", "optimizer"),
    Setting("accumulation", "gradient_accumulation_steps", "accumulation", 1, int,
            "each micro-batch is training.batch_size rows, the step's batch, and from micro-batch 2 on every "
            "phase holds {gradients} (held_gradients)", "gradient accumulation"),
    Setting("buffers", "stream_buffers", "buffers", 2, int,
            "Soup's pool pre-allocates that many slots of one layer each (LayerBufferPool: a torch.empty per "
            "tensor a slot), so the pool and its rounding are charged that many times; Soup's own number "
            "takes it as its setup passes it", "stream buffers", streamed_only=True),
)


@dataclass(frozen=True)
class Settings:
    """The run's SETTINGS as a soup.yaml gives them (Soup's loader's values, its defaults too: the run `soup train`
    runs), or None each where the protocol's arm names none. Every mode takes the arm's: the Soup config its
    measured arm runs (``soup_keys``), every estimate of it (``estimator``), the row's JSON (``to_json``)."""

    optimizer: Optional[str] = None
    accumulation: Optional[int] = None
    buffers: Optional[int] = None

    @classmethod
    def read(cls, training: Any) -> "Settings":
        """Each setting off Soup's loaded ``cfg.training``, as its loader normalised it; a resident run's
        (stream_layers false) has none a streamed step alone reads."""
        resident = not getattr(training, "stream_layers", False)
        return cls(**{s.field: s.kind(getattr(training, s.soup)) for s in SETTINGS
                      if not (resident and s.streamed_only)})

    def given(self) -> list[tuple[Setting, Any]]:
        return [(s, getattr(self, s.field)) for s in SETTINGS if getattr(self, s.field) is not None]

    def soup_keys(self) -> dict[str, Any]:
        """The ``training`` keys a Soup config gets beyond the protocol's (none for the protocol's arm)."""
        return {s.soup: v for s, v in self.given()}

    def estimator(self) -> dict[str, Any]:
        """The estimator's keywords (issue395.estimator.estimate), those the run sets; a resident run's hold none a
        streamed step alone reads (``read``), and ``resident.estimate_run`` leaves such a one out of its estimate."""
        return {s.estimator: v for s, v in self.given()}

    def to_json(self) -> dict[str, Any]:
        """The row's keys, each absent where the arm sets none (so rows saved before re-render alike)."""
        return {s.field: v for s, v in self.given()}

    def said(self) -> str:
        """The settings the run sets, as a header names them (``optimizer adamw_8bit, gradient accumulation 4``)."""
        return ", ".join(f"{s.words} {v}" for s, v in self.given())

    @property
    def identity(self) -> tuple:
        """What the run set beyond the protocol's, as an arm's identity carries it: empty at the protocol's
        own values (named or not), else every setting's value."""
        values = tuple(getattr(self, s.field) for s in SETTINGS)
        if all(v in (None, s.protocol) for s, v in zip(SETTINGS, values)):
            return ()
        return tuple(s.protocol if v is None else v for s, v in zip(SETTINGS, values))

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step: the data one step reads is batch x this."""
        return self.accumulation or 1


@dataclass(frozen=True)
class Adapter:
    """The LoRA adapter a run trains, read once: the protocol's, a soup.yaml's ``training.lora`` (its targets as
    Soup's config holds them, r, alpha, dropout; ``soup_config``: the file), or --estimate's --targets and --lora-r.
    ``targets`` None: the family's own (the protocol's q_proj, v_proj where it has them). ``dropout``: peft's
    LoRA dropout p, Soup's default (LORA_DROPOUT) but for a --config file's own: no option spells it."""

    targets: Optional[tuple] = None
    lora_r: int = LORA_R
    lora_alpha: int = LORA_ALPHA
    soup_config: Optional[str] = None
    dropout: float = LORA_DROPOUT

    def soup_lora(self) -> dict[str, Any]:
        """The ``training.lora`` keys a Soup config gets beyond r, alpha and targets: the dropout where it is not
        Soup's default (the protocol's config stays as it was)."""
        return {} if self.dropout == LORA_DROPOUT else {"dropout": self.dropout}


def lora_dropout(training: Any) -> float:
    """``training.lora.dropout`` off Soup's loaded ``cfg.training`` (its schema's default where a release has
    none): the one reading of it, a --config file's Adapter's and the patched gates' alike."""
    return float(getattr(training.lora, "dropout", LORA_DROPOUT))


#: How a full fine-tuning's row is named after its streaming modes ("Llama-3.2-1B [resident+full]"): the label's
#: only, never the map key's (its key is its streaming's: a saved row's model_key parses as ever).
FULL = "full"


@dataclass(frozen=True)
class Arm:
    """One run, typed, as every mode answers it: its base (``base``: a registry key, or "custom" for the checkpoint
    ``checkpoint`` names: a folder, a config.json or a hub id), at one seq and batch, quantization and task, how it
    streams (``streaming``: issue395.model.streaming.Streaming), the LoRA adapter it trains (``adapter``), its run
    settings (``settings``: a --config file's optimizer, accumulation, stream buffers; none for the protocol's arm),
    its optimizer steps, and the stack it is answered for where that is not this machine's (``stack``: --estimate's
    --stack). ``index`` is its grid position. Its key (``model``), its row's name (``label``) and its files' stem
    (``stem``) are derived here, once; ``Arm.at`` builds one from a map key."""

    base: str
    seq: int
    batch: int = 1
    index: int = 0
    quant: str = "none"
    task: str = PROTOCOL_TASK  # Soup's task (issue395.tasks), the protocol's SFT unless asked
    settings: Settings = Settings()
    streaming: Streaming = Streaming()
    adapter: Adapter = Adapter()
    steps: int = 1
    checkpoint: Optional[str] = None  # a custom base's checkpoint (None: a registry model's synthetic one)
    stack: tuple = ()  # (package, version) pairs the arm is answered for (none: this machine's)

    def __post_init__(self) -> None:
        if SEP in self.base:  # a map key is parsed once, by Arm.at: its modes are the streaming record's
            raise ValueError(f"Arm base {self.base!r} is a map key: build it with Arm.at")

    @classmethod
    def at(cls, key: str, seq: int, batch: int = 1, index: int = 0, quant: str = "none", task: str = PROTOCOL_TASK,
           settings: Settings = Settings(), **fields: Any) -> "Arm":
        """The arm of map key ``key`` (its streaming modes after its family), the rest as given."""
        base, streaming = Streaming.parse(key)
        return cls(base, seq, batch, index, quant, task, settings, streaming, **fields)

    @property
    def model(self) -> str:
        """The arm's map key: its base and its streaming modes ("llama32-1b+resident+gc"), as rows save it."""
        return self.streaming.key(self.base)

    key = model

    def label(self, name: Optional[str] = None) -> str:
        """The row's name for the arm: its base's (``name``, else the registry's) and its modes in brackets
        ("Llama-3.2-1B [resident+gc]")."""
        if name is None:
            name = FAMILIES[self.base].label if self.base in FAMILIES else SHAPES[self.base].name
        return self.streaming.label(name, *((FULL,) if self.full else ()))

    @property
    def full(self) -> bool:
        """A full fine-tuning: Soup's ``training.lora.r: 0`` (no adapter, every parameter trains; a resident
        SFT run's, Soup's loader refuses it elsewhere). Its key is its streaming's, its label says it (``FULL``)."""
        return self.adapter.lora_r == 0

    def adapter_words(self) -> str:
        """The adapter as a run's header says it: LoRA r, alpha and targets, or a full fine-tuning's words."""
        a = self.adapter
        if self.full:
            return "full fine-tuning (training.lora.r 0: no adapter, every parameter trains)"
        return f"LoRA r {a.lora_r} alpha {a.lora_alpha} on {','.join(a.targets or ())}"

    def stem(self, repeat: Optional[int] = None) -> str:
        """What the arm's files are named by (its Soup log, its snapshot): index, key, seq, batch, --determinism's
        repeat, and a task other than SFT (the protocol's names stay as they were)."""
        rep = f"-r{repeat}" if repeat is not None else ""
        task = "" if self.task == PROTOCOL_TASK else f"-{self.task}"
        return f"{self.index:03d}-{self.model}-{self.seq}-b{self.batch}{rep}{task}"

    @property
    def micro_batches(self) -> int:
        return self.settings.micro_batches

    @property
    def training(self) -> dict[str, Any]:
        """The Soup ``training`` keys this arm sets beyond the protocol's config (none for the protocol's arm)."""
        return self.settings.soup_keys()

    @property
    def run(self) -> dict[str, Any]:
        """The estimator's keywords for this arm's run beyond its shape: one estimate for the run every mode runs."""
        return self.settings.estimator()

    def estimator(self) -> dict[str, Any]:
        """The estimator's keywords for this arm (issue395.estimator.estimate's, a streamed one's ``stream`` aside):
        its shape, its adapter (None: the family's own targets; its dropout), its steps, task and settings; every estimate of an
        arm takes these, so no mode lists them again."""
        return dict(quant=self.quant, seq=self.seq, batch=self.batch, targets=self.adapter.targets or None,
                    lora_r=self.adapter.lora_r, lora_dropout=self.adapter.dropout, steps=self.steps, task=self.task,
                    **self.run)

    @classmethod
    def from_json(cls, data: dict) -> "Arm":
        """An Arm as ``dataclasses.asdict`` wrote it (a child's job file)."""
        adapter = dict(data.get("adapter") or {})
        if adapter.get("targets") is not None:
            adapter["targets"] = tuple(adapter["targets"])
        return cls(**dict(data, settings=Settings(**data.get("settings", {})),
                          streaming=Streaming(**data.get("streaming", {})), adapter=Adapter(**adapter),
                          stack=tuple(map(tuple, data.get("stack", ())))))


def predicted_bytes(shape: Shape, seq: int, batch: int = 1, buffers: int = 2) -> int:
    """Soup's estimator fed the grid's figures, exactly as the record did (the pool at the run's ``buffers``
    slots: training.stream_buffers, the record's 2)."""
    from soup_cli.utils.layer_stream import estimate_stream_peak_vram

    return int(estimate_stream_peak_vram(
        layer_bytes=shape.pool // 2, buffers=buffers, extras_bytes=shape.extras,
        adapter_params=shape.grid_adapter, vocab_size=shape.vocab, hidden_size=shape.hidden,
        intermediate_size=shape.intermediate, n_layers=shape.n_layers,
        seq_len=seq, batch_size=batch))


def logits_charge(shape: Shape, seq: int, batch: int) -> tuple[int, float]:
    """14 x E (Soup's logits charge, bytes; E = seq x vocab x batch) and the 12 bytes per element
    its loss really holds: 14 is 12 of loss arithmetic plus a retained bf16 copy the record found absent."""
    from soup_cli.utils.layer_stream import LOGITS_LOSS_BYTES_PER_ELEMENT, estimate_logits_bytes

    return (int(estimate_logits_bytes(vocab_size=shape.vocab, seq_len=seq, batch_size=batch)),
            float(LOGITS_LOSS_BYTES_PER_ELEMENT))
