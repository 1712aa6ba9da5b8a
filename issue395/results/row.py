"""One arm's result: a typed row whose verdicts (status, ratios) are derived, never stored, and
the guard on the realised length that makes a row VOID.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterable, Optional

from ..constants import is_whole
from ..record import LORA_DROPOUT, LORA_R, RECORD_A10G_PEAK, SOUP_QUANT
from ..tasks import PROTOCOL_TASK, TASKS, task as task_of
from ..model.arm import SETTINGS, Adapter, Arm, Settings, logits_charge, predicted_bytes
from ..model.registry import Shape
from ..model.streaming import family_of
from ..estimator.cards import emulated_outcome, step_free
from .extras import (Capped, Corrected, Emulated, Gate, Ran, Record, ResidentGate, SoupProbe, UserConfig,
                     constraint_from_json, constraint_to_json)


def realised_as_requested(seq: int, batch: int, width: Optional[int], rows: Iterable[int],
                          task: str = PROTOCOL_TASK) -> bool:
    """The guard: the batch is exactly seq wide, and so is every one of its rows (a task's rows over
    all the keys its guard reads: issue395.tasks.Task.guard_rows)."""
    rows = list(rows)
    return width == seq and len(rows) == task_of(task).guard_rows(batch) and all(n == seq for n in rows)


#: What stops an arm short of a measurement. OOM and FAILED are findings; REFUSED (Soup's
#: pre-flight said the run will not fit: the gate working) and SKIPPED are not.
FAILURES = ("OOM", "FAILED", "REFUSED", "SKIPPED")
#: The statuses that are findings (a run holding one exits 1): the void row, the failures above that
#: are, and the peak past every prediction.
FINDINGS = ("VOID", "OOM", "FAILED", "UNDER")


#: A row's fields that Row.from_json would otherwise take as they are: what each must be.
ROW_FIELDS = {
    # printed as they stand: an escape sequence or a newline in a name would rewrite the terminal
    **{k: (lambda v: isinstance(v, str) and v.isprintable(), "a printable string")
       for k in ("model", "model_key")},
    **{k: (lambda v: v is None or isinstance(v, str), "a string or null") for k in ("error",)},
    "attribution": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "dry_run": (lambda v: v is None or isinstance(v, bool), "true or false"),
    "targets": (lambda v: v is None or (isinstance(v, list) and all(isinstance(t, str) for t in v)),
                "a list of strings"),
    # absent for the protocol's SFT, so every SFT row saved before tasks re-renders to the same bytes
    "task": (lambda v: v is None or (isinstance(v, str) and v in TASKS and v != PROTOCOL_TASK),
             f"one of {', '.join(t for t in TASKS if t != PROTOCOL_TASK)} (absent for {PROTOCOL_TASK})"),
    # a run's settings, absent for the protocol's arm, which names none (issue395.model.arm.SETTINGS)
    **{s.field: (lambda v, s=s: v is None or s.valid(v),
                 "a whole number >= 1" if s.kind is int else "a printable name") for s in SETTINGS},
}

#: Row fields whose JSON key is absent where they are None, so every row saved before them re-renders alike.
ABSENT_WHEN_NONE = ("task", "corrected_custom", "soup_resident", "soup_probe")

#: A row's sub-records (issue395.results.extras) and how each reads back from its JSON.
SUB_RECORDS = {"ran": lambda v: Ran.from_json(v, "ran"),
               "gate": lambda v: None if v is None else Gate.from_json(v, "gate"),
               "config": lambda v: None if v is None else UserConfig.from_json(v, "config"),
               "soup_resident": lambda v: None if v is None else ResidentGate.from_json(v, "soup_resident"),
               "soup_probe": lambda v: None if v is None else SoupProbe.from_json(v, "soup_probe"),
               "corrected": lambda v: None if v is None else Corrected.from_json(v, "corrected"),
               "constraint": constraint_from_json}


@dataclass(frozen=True)
class Row:
    """One arm's result: inputs, Soup's figures and measurements. Ratios and status are derived,
    so a VOID or FAILED row has no ratio by construction and a saved row is re-judged alike."""

    model: str  # the display name
    model_key: str
    seq: int
    batch: int
    index: int
    predicted: Optional[int]  # Soup's estimator (None: the arm's process died first)
    logits14: Optional[int]  # Soup's 14 x E
    loss_bytes_per_element: Optional[float]  # Soup's LOGITS_LOSS_BYTES_PER_ELEMENT
    vocab: int
    quant: str = "none"
    targets: tuple = ()  # the LoRA targets the arm ran with
    soup_predicted: Optional[int] = None  # computed by Soup: its own pre-flight, in this setup
    repeat: Optional[int] = None  # --determinism: which fresh process
    dry_run: bool = False
    realised_width: Optional[int] = None  # measured: input_ids.shape[-1]
    realised_rows: tuple = ()  # measured: each row's tokens
    real_peak: Optional[int] = None  # measured: max_memory_allocated around the step
    resident: Optional[int] = None  # measured: allocated before the step
    carried: Optional[int] = None  # measured: still allocated by earlier arms when this began
    reserved: Optional[int] = None  # measured: max_memory_reserved
    failure: Optional[str] = None  # OOM, FAILED; REFUSED (Soup's gate said no), SKIPPED
    error: Optional[str] = None
    oom_request: Optional[int] = None
    record_peak: Optional[int] = None  # quoted: the A10G record's peak for this arm
    attribution: Optional[dict] = None
    ran: Ran = field(default_factory=Ran)  # where and how it ran (checkpoint, GPU, process, log, timings, teardown)
    gate: Optional[Gate] = None  # read by Soup: what its own pre-flight read (its terms, the free memory)
    config: Optional[UserConfig] = None  # --config: the user's soup.yaml this arm is (else the protocol's)
    #: the constraint the arm ran under (--cap, --emulate-card, --min-free), its own record; at most one
    constraint: Optional[Record] = None
    #: Soup's task (issue395.tasks): the arm's identity, as quant is; None is the protocol's SFT,
    #: and its JSON key is then absent, so every SFT row saved before tasks re-renders alike
    task: Optional[str] = None
    #: this tool's corrected estimate, computed as the arm ran from its checkpoint's own config.json, for
    #: an arm with no public config here to recompute it from (--model, a --config's folder base);
    #: None (its JSON key absent) for a registry model, whose figure is recomputed when rendered
    corrected_custom: Optional[int] = None
    #: a resident run (stream_layers off): Soup's resident gate as its CLI runs it; None (its JSON key absent)
    #: for a streamed run, so every streamed row saved before re-renders alike
    soup_resident: Optional[ResidentGate] = None
    #: a --config arm's run settings, which it ran (issue395.model.arm.Settings: its optimizer and accumulation),
    #: saved as the row's own keys, each absent where the arm sets none (the protocol's arm)
    settings: Settings = Settings()
    #: an arm that asked for training.stream_vram_probe: Soup's probe and its verdict (SoupProbe says who ran it);
    #: None (its JSON key absent) for every other, so every row saved before re-renders alike
    soup_probe: Optional[SoupProbe] = None
    #: computed by this tool: the corrected estimate and needs-free the text renders for the arm, put in the
    #: row as a result is written (issue395.results.corrected.with_corrected); None where the estimator does
    #: not model the arm, or on a row read from a result saved before it was kept. Not the row's identity
    #: (compare=False): one measurement saved under two estimators is one row
    corrected: Optional[Corrected] = field(default=None, compare=False)

    @property
    def arm(self) -> tuple:
        """The arm this row measured, as the map names it: model key (with its streaming modes),
        quantization, seq, batch, and a task other than SFT after them. Repeats of one arm share it.
        Every --model row is keyed "custom" (a --config row's with its modes after it), so there the
        checkpoint's name stands for the key: two checkpoints never share an arm."""
        custom = family_of(self.model_key) == "custom"
        return (self.model if custom else self.model_key, self.quant, self.seq, self.batch) + (
            (self.task,) if self.task else ()) + self.settings.identity

    @property
    def run(self) -> dict[str, Any]:
        """The estimator's keywords for the row's run beyond its shape, as issue395.model.arm.Arm.run gives them."""
        return self.settings.estimator()

    def run_arm(self, steps: int = 1) -> Arm:
        """The typed Arm this row ran (issue395.model.arm.Arm): its map key's base and streaming, shape, task,
        settings and adapter (its targets, r and dropout), at the run's ``steps`` (a saved result's environment keeps
        them, not the row)."""
        dropout = self.config.lora_dropout if self.config else LORA_DROPOUT
        return Arm.at(self.model_key, self.seq, self.batch, self.index, self.quant, self.task or PROTOCOL_TASK,
                      self.settings, adapter=Adapter(tuple(self.targets) or None, self.rank, dropout=dropout),
                      steps=steps)

    @property
    def label(self) -> str:
        """The arm's model as the tables show it: its name, and a task other than SFT after it."""
        return f"{self.model} {self.task}" if self.task else self.model

    @property
    def rank(self) -> int:
        """The LoRA r the arm ran with: a --config row's own, else the protocol's."""
        return self.config.lora_r if self.config else LORA_R

    @property
    def realised(self) -> Optional[int]:
        """The one number the table shows: the length that strays furthest from seq."""
        seen = list(self.realised_rows) + ([self.realised_width] if self.realised_width else [])
        return max(seen, key=lambda n: (abs(n - self.seq), -n)) if seen else None

    @property
    def status(self) -> str:
        if self.failure:
            return self.failure
        if not realised_as_requested(self.seq, self.batch, self.realised_width, self.realised_rows,
                                     self.task or PROTOCOL_TASK):
            return "VOID"
        if self.real_peak is None:
            return "dry-run" if self.dry_run else "FAILED"
        low = self.lowest_prediction  # None: Soup's resident gate built no input, so it predicts nothing
        return "UNDER" if low is not None and low < self.real_peak else "ok"

    @property
    def oom_at_soup_cap(self) -> bool:
        """Capped at Soup's own number, the step raised OOM: its peak is above Soup's prediction,
        the under-prediction itself, though no peak was read."""
        return isinstance(self.constraint, Capped) and self.constraint.at == "soup" and self.status == "OOM"

    @property
    def emulated(self) -> Optional[Emulated]:
        """The emulated card's record, where the arm ran as one (--emulate-card)."""
        return self.constraint if isinstance(self.constraint, Emulated) else None

    @property
    def emulated_fits(self) -> Optional[bool]:
        """This tool's verdict for the emulated card: needs free <= what the step can have of the
        card's free memory (issue395.estimator.cards: the runtime's growth comes out of it)."""
        e = self.emulated
        if e is None or e.needs_free is None or e.card_free is None:
            return None
        return e.needs_free <= step_free(e.card_free)

    @property
    def emulated_outcome(self) -> Optional[str]:
        """What the emulated card did with the arm, in the issue's words (else the row's status)."""
        if self.emulated is None:
            return None
        if self.status in ("REFUSED", "OOM") or self.measured:
            return emulated_outcome(self.status == "REFUSED", self.status == "OOM")
        return self.status

    @property
    def lowest_prediction(self) -> Optional[int]:
        """The lower of the record's convention and Soup's own pre-flight (where captured); for a
        task other than SFT, Soup's own number alone, which its setup computes for the task (the
        record's convention is an SFT grid's)."""
        if self.soup_resident is not None:  # Soup's resident gate's number alone: the grid's is a streamed one
            return self.soup_resident.peak
        if self.task and self.soup_predicted:
            return self.soup_predicted
        return min((p for p in (self.predicted, self.soup_predicted) if p), default=None)

    @property
    def measured(self) -> bool:
        return self.status in ("ok", "UNDER")

    @property
    def elements(self) -> int:
        """E, the logits elements of the rows the model runs (a paired task's 2 x batch)."""
        return self.seq * self.vocab * self.batch * task_of(self.task or PROTOCOL_TASK).rows_per_example

    @property
    def nonlogits_modelled(self) -> Optional[int]:
        return None if self.predicted is None else self.predicted - self.logits14

    @property
    def pred_over_real(self) -> Optional[float]:
        return self.predicted / self.real_peak if self.measured else None

    @property
    def margin_ratio(self) -> Optional[float]:
        """The lower of the two predictions (the record's convention, Soup's own) over the peak."""
        return self.lowest_prediction / self.real_peak if self.measured and self.lowest_prediction else None

    @property
    def nonlogits_overestimate(self) -> Optional[float]:
        """Non-logits modelled over the real non-logits (the peak less the 12 x E the loss holds)."""
        return self.overestimate_at(self.real_peak) if self.measured else None

    def overestimate_at(self, peak: Optional[int]) -> Optional[float]:
        """The same, against any peak (the A10G record's, for the markdown)."""
        if not peak or self.predicted is None:
            return None
        rest = peak - self.loss_bytes_per_element * self.elements
        return self.nonlogits_modelled / rest if rest > 0 else None

    @property
    def retained_copy_would_fit(self) -> Optional[bool]:
        return self.logits14 <= self.real_peak if self.measured else None

    @property
    def corrected_over_real(self) -> Optional[float]:
        """The corrected estimate the row carries over its real peak (the text's corr/real)."""
        c = self.corrected and self.corrected.allocated
        return c / self.real_peak if c and self.measured else None

    @property
    def vs_record(self) -> Optional[float]:
        return self.real_peak / self.record_peak if self.measured and self.record_peak else None

    def to_json(self) -> dict[str, Any]:
        derived = {k: getattr(self, k) for k in (
            "status", "realised", "pred_over_real", "nonlogits_modelled",
            "nonlogits_overestimate", "retained_copy_would_fit", "vs_record", "corrected_over_real")}
        if self.emulated is not None:
            derived.update(emulated_fits=self.emulated_fits, emulated_outcome=self.emulated_outcome)
        data: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "settings":  # the settings' own keys, in the row, each absent where the arm sets none
                data.update(self.settings.to_json())
            elif f.name not in ABSENT_WHEN_NONE or getattr(self, f.name) is not None:
                data[f.name] = getattr(self, f.name)
        # a full fine-tuning (lora.r 0) trains no target: null, never the shape's resolution of "auto"
        return dict(data, realised_rows=list(self.realised_rows), targets=None if self.rank == 0 else list(self.targets),
                    ran=self.ran.to_json(), gate=self.gate and self.gate.to_json(),
                    config=self.config and self.config.to_json(),
                    **({"soup_resident": self.soup_resident.to_json()} if self.soup_resident else {}),
                    **({"soup_probe": self.soup_probe.to_json()} if self.soup_probe else {}),
                    constraint=constraint_to_json(self.constraint), corrected=self.corrected and self.corrected.to_json(),
                    derived=derived)  # "derived" is for readers; it is never read back

    @classmethod
    def from_json(cls, data: Any) -> "Row":
        """The one way back from JSON: known fields only, measurements sane, verdicts re-derived."""
        if not isinstance(data, dict):
            raise ValueError("a row is not an object")
        for name, (ok, what) in ROW_FIELDS.items():
            if (name in data or name in ("model", "model_key")) and not ok(data.get(name)):
                raise ValueError(f"row field {name!r} is {data.get(name)!r:.60}, not {what}")
        setting = {s.field for s in SETTINGS}
        known = {f.name for f in fields(cls)} - {"settings"}
        unknown = set(data) - known - setting - {"derived"}
        if unknown:
            raise ValueError(f"unknown row field {sorted(unknown)[0]!r}")
        settings = Settings(**{k: v for k, v in data.items() if k in setting})
        data = dict({k: v for k, v in data.items() if k in known}, settings=settings)
        for key in ("seq", "batch", "vocab"):
            if not is_whole(data.get(key), minimum=1):
                raise ValueError(f"row field {key!r} must be a whole number >= 1")
        for key in ("index", "predicted", "logits14", "realised_width", "real_peak", "resident",
                    "carried", "reserved", "oom_request", "record_peak", "repeat", "corrected_custom"):
            value = data.get(key)
            if value is not None and not is_whole(value, minimum=1 if key == "real_peak" else 0):
                raise ValueError(f"row field {key!r} is {value!r}: not a finite measurement")
        if data.get("quant", "none") not in SOUP_QUANT:
            raise ValueError(f"row field 'quant' is {data['quant']!r}")
        if data.get("soup_predicted") is not None and not is_whole(data["soup_predicted"], minimum=1):
            raise ValueError(f"row field 'soup_predicted' is {data['soup_predicted']!r}")
        rows = data.get("realised_rows") or []
        if not isinstance(rows, list) or not all(is_whole(n, minimum=0) for n in rows):
            raise ValueError("row field 'realised_rows' must be a list of whole numbers")
        bpe = data.get("loss_bytes_per_element")
        if bpe is not None and (not isinstance(bpe, (int, float)) or not math.isfinite(bpe) or bpe <= 0):
            raise ValueError(f"row field 'loss_bytes_per_element' is {bpe!r}")
        if data.get("failure") not in (None, *FAILURES):
            raise ValueError(f"row field 'failure' is {data['failure']!r}")
        if data.get("index") is None:
            raise ValueError("row field 'index' must be a whole number >= 0")
        if data.get("predicted") is not None and (data["predicted"] < 1 or data.get("logits14") is None):
            raise ValueError("a row with a prediction must carry Soup's logits charge, and a prediction >= 1")
        if data.get("real_peak") is not None and any(
                data.get(k) is None for k in ("predicted", "logits14", "loss_bytes_per_element")):
            raise ValueError("a row with a real peak must carry its prediction and Soup's logits figures")
        subs = {k: read(data.get(k)) for k, read in SUB_RECORDS.items()}
        return cls(**dict(data, realised_rows=tuple(rows), targets=tuple(data.get("targets") or ()), **subs))


def arm_identity(arm: Arm) -> dict[str, Any]:
    """What a row carries of its arm's run beside its model, seq, batch and quantization: its task (other than
    SFT) and a --config arm's settings, each only where the arm sets it."""
    return {k: v for k, v in (("task", None if arm.task == PROTOCOL_TASK else arm.task),
                              ("settings", arm.settings)) if v not in (None, Settings())}


def arm_row(arm: Arm, shape: Shape, **measured: Any) -> Row:
    """An arm's row: its inputs, Soup's prediction and the record's figure, plus what was measured.
    Soup's estimator is fed the rows its setup feeds it for the task (batch x
    _STREAM_ROWS_PER_EXAMPLE); the record's A10G peaks are SFT's."""
    rows = arm.batch * task_of(arm.task).rows_per_example
    logits14, bpe = logits_charge(shape, arm.seq, rows)
    sft = arm.task == PROTOCOL_TASK
    record = (RECORD_A10G_PEAK.get((shape.key, arm.seq))
              if shape.record and arm.batch == 1 and arm.quant == "none" and sft else None)
    return Row(model=shape.name, model_key=arm.model, seq=arm.seq, batch=arm.batch,
               index=arm.index, predicted=predicted_bytes(shape, arm.seq, rows, arm.settings.buffers or 2),
               logits14=logits14, loss_bytes_per_element=bpe, vocab=shape.vocab, quant=arm.quant,
               targets=() if arm.full else tuple(shape.targets), record_peak=record, **arm_identity(arm),
               **dict(measured, ran=replace(measured.get("ran") or Ran(), pid=os.getpid())))
