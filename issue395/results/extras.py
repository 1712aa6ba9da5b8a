"""What a row holds beyond the arm and its measurement, each as its own typed record: where it ran
(``Ran``), what Soup's gate read (``Gate``), a resident run's gate as Soup's CLI runs it (``ResidentGate``),
Soup's measured-fit probe where the arm asked for it (``SoupProbe``),
the user's soup.yaml it is (``UserConfig``), this tool's corrected estimate for its arm as the result was written
(``Corrected``), and the constraint it ran under, one at most (``Capped``, ``Emulated``, ``MinFreeFound``: each
constraint's record, written under its ``KIND``). Each record reads itself back from JSON, checking what it holds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, ClassVar, Optional

from ..constants import is_whole
from ..record import LORA_DROPOUT

_STR = (lambda v: v is None or isinstance(v, str), "a string or null")
_PRINTABLE = (lambda v: isinstance(v, str) and v.isprintable(), "a printable string")
_BYTES = (lambda v: v is None or is_whole(v, 1), "a whole number >= 1 or null")
_OBJECT = (lambda v: v is None or isinstance(v, dict), "an object or null")
_BOOL = (lambda v: v is None or isinstance(v, bool), "true, false or null")


class Record:
    """A row's sub-record: its JSON is its fields; ``CHECKS`` says what each must be."""

    CHECKS: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_json(cls, data: Any, where: str) -> Any:
        if not isinstance(data, dict):
            raise ValueError(f"row field {where!r} is {data!r:.60}, not an object")
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = set(data) - known - {"kind"}
        if unknown:
            raise ValueError(f"unknown row field {where + '.' + sorted(unknown)[0]!r}")
        for name, (ok, what) in cls.CHECKS.items():
            if not ok(data.get(name)):
                raise ValueError(f"row field {where + '.' + name!r} is {data.get(name)!r:.60}, not {what}")
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class Ran(Record):
    """Where and how the arm ran: the checkpoint, the GPU's label, the process, Soup's log, the timings,
    and what its teardown raised."""

    base: Optional[str] = None
    gpu: Optional[str] = None
    pid: Optional[int] = None
    log: Optional[str] = None
    timings: dict = field(default_factory=dict)
    teardown_error: Optional[str] = None  # the arm's teardown raised (its measurement is kept)

    CHECKS: ClassVar = {"base": _STR, "gpu": _STR, "log": _STR, "teardown_error": _STR,
                        "pid": (lambda v: v is None or is_whole(v, 0), "a whole number or null"),
                        "timings": _OBJECT}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "Ran":
        ran = super().from_json(data, where)
        return cls(ran.base, ran.gpu, ran.pid, ran.log, ran.timings or {}, ran.teardown_error)


@dataclass(frozen=True)
class Gate(Record):
    """What Soup's own pre-flight read (read by Soup): the arguments it passed its estimator, and the
    free memory its gate compared its number with (mem_get_info at its gate, on a CUDA arm)."""

    terms: Optional[dict] = None
    free: Optional[int] = None

    CHECKS: ClassVar = {"terms": _OBJECT,
                        "free": _BYTES}


@dataclass(frozen=True)
class ResidentGate(Record):
    """A resident run's (stream_layers off) pre-flight as `soup train` runs it (computed by Soup: commands/
    train.py's _build_hardware_fit_input on the arm's config, hardware_fit's estimate_peak_vram_gb and
    decide_hardware_fit): the input its CLI built (None where it builds none and skips its gate), Soup's peak in
    bytes and its five classes in GB, the peak with its 10% margin, the card's total it compares with (None
    without CUDA: Soup's gate does not run there) and its verdict (admits: None where it did not decide)."""

    input: Optional[dict] = None
    peak: Optional[int] = None
    breakdown: Optional[dict] = None
    required: Optional[int] = None
    card_total: Optional[int] = None
    admits: Optional[bool] = None

    CHECKS: ClassVar = {"input": _OBJECT,
                        "breakdown": _OBJECT,
                        "peak": _BYTES, "required": _BYTES, "card_total": _BYTES,
                        "admits": _BOOL}

    @staticmethod
    def input_of(config: Any) -> Optional[dict]:
        """The input Soup's resident gate takes, as `soup train`'s CLI builds it from a config Soup's loader read
        (computed by Soup); None where it builds none, and skips its gate."""
        from soup_cli.commands.train import _build_hardware_fit_input

        inp = _build_hardware_fit_input(config)
        return None if inp is None else {k: getattr(inp, k) for k in inp.__dataclass_fields__}

    @classmethod
    def computed(cls, soup_input: Optional[dict], card_total: int = 0) -> "ResidentGate":
        """Soup's number on that input and its verdict against a card's total memory as CUDA reports it (computed
        by Soup: hardware_fit); no verdict without a card (0), nothing without an input."""
        if soup_input is None:
            return cls()
        from soup_cli.utils.hardware_fit import HardwareFitInput, decide_hardware_fit, estimate_peak_vram_gb

        inp = HardwareFitInput(**soup_input)
        b = estimate_peak_vram_gb(inp)
        verdict = decide_hardware_fit(inp, available_vram_gb=card_total / 1e9) if card_total > 0 else None
        return cls(input=soup_input, peak=round(b.total_gb * 1e9), breakdown={k: getattr(b, k) for k in b.__dataclass_fields__},
                   required=round(verdict.required_with_margin_gb * 1e9) if verdict else None,
                   card_total=card_total or None, admits=verdict.ok if verdict else None)

    @property
    def admitted(self) -> bool:
        """Whether `soup train` goes on: its verdict, or, where its CLI built no input, yes (it skips its gate)."""
        return self.admits is not False

    #: the input's field each axis sets: Soup's CLI copies data.max_length and training.batch_size into it as
    #: they are (_build_hardware_fit_input), so a file differing only there gives this input with that one changed
    AXIS_FIELD: ClassVar = {"seq": "seq_len", "batch": "batch_size"}

    @classmethod
    def at(cls, soup_input: Optional[dict], axis: str, value: int, card_total: int = 0) -> "ResidentGate":
        """Soup's resident gate on the file's run with only ``axis`` set to ``value`` (computed by Soup)."""
        return cls.computed(None if soup_input is None else dict(soup_input, **{cls.AXIS_FIELD[axis]: int(value)}),
                            card_total)

    @classmethod
    def longest(cls, soup_input: Optional[dict], axis: str, card_total: int, low: int, step: int,
                top: int) -> Optional[int]:
        """The largest seq (or batch) on the axis's grid that Soup's resident gate admits on a card whose total
        CUDA reports as ``card_total`` (computed by Soup: decide_hardware_fit at each value; its number grows
        with both); None where it admits not even ``low``, or its CLI builds no input (it skips its gate)."""
        from ..estimator.fits import largest

        if soup_input is None:
            return None
        return largest(lambda v: bool(cls.at(soup_input, axis, v, card_total).admits), low, step, top)

    @staticmethod
    def profile_of(config: Any) -> Optional[dict]:
        """`soup profile`'s memory estimate of a config Soup's loader read, as that command computes it (computed
        by Soup: commands/profile.py's model_size_from_name on the base, batch auto as 4, utils/profiler's
        estimate_total): its total in bytes, the parameters it took in billions, and its classes in GB. None where
        the installed Soup has no such command."""
        try:
            from soup_cli.utils.gpu import model_size_from_name
            from soup_cli.utils.profiler import estimate_total
        except ImportError:
            return None
        t = config.training
        params = model_size_from_name(config.base)
        out = estimate_total(model_name=config.base, model_params_b=params, quantization=t.quantization,
                             lora_r=t.lora.r, lora_alpha=t.lora.alpha,
                             batch_size=4 if t.batch_size == "auto" else int(t.batch_size),
                             seq_len=config.data.max_length, optimizer=t.optimizer,
                             gradient_checkpointing=t.gradient_checkpointing)
        return {"total_bytes": round(out["total_memory_gb"] * 1e9), "model_params_b": params,
                **{k: v for k, v in out.items() if k.endswith("_gb") and k != "total_memory_gb"}}


@dataclass(frozen=True)
class SoupProbe(Record):
    """training.stream_vram_probe (Soup's measured-fit gate, its #349; #840 asks for it on DPO, ORPO, SimPO and
    KTO): who ran it (``path``: SOUP, Soup's own setup with the key set, which decides the run on it; CALLED,
    Soup's schema refuses the key for the task, so this tool called Soup's probe function, measure_step_peak_bytes,
    on the task's streamed model at the rows Soup's setup counts for it, after Soup's setup, and Soup's
    decide_measured_fit on it, as #840's extension would), what Soup's function measured on this card (its peak
    allocated and reserved, its seconds, at its rows x seq), the free memory Soup's gate read and Soup's verdict
    on the probe's peak (``admits``), and the formula's overshoot Soup defers to the probe within
    (``ceiling``: stream_setup._PROBE_DEFERRAL_CEILING, read from Soup). ``outcome`` says why there is no peak:
    "not run" (off CUDA Soup's function returns None), "oom", "failed: <error>"."""

    PATHS: ClassVar = ("soup", "called")
    SOUP, CALLED = PATHS

    path: str
    peak: Optional[int] = None
    reserved: Optional[int] = None
    seconds: Optional[float] = None
    rows: Optional[int] = None
    seq: Optional[int] = None
    available: Optional[int] = None
    admits: Optional[bool] = None
    ceiling: Optional[float] = None
    outcome: Optional[str] = None

    CHECKS: ClassVar = {"path": (PATHS.__contains__, " or ".join(PATHS)),
                        "peak": _BYTES, "reserved": _BYTES, "available": _BYTES,
                        "rows": _BYTES, "seq": _BYTES, "outcome": _STR,
                        "seconds": (lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                            and v >= 0), "a number >= 0 or null"),
                        "ceiling": (lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                            and v > 0), "a number > 0 or null"),
                        "admits": _BOOL}


@dataclass(frozen=True)
class UserConfig(Record):
    """--config: the user's soup.yaml this arm is, and the LoRA r, alpha and dropout it ran with from it (r 0:
    Soup's full fine-tuning, no adapter). The dropout's key is absent at Soup's default (LORA_DROPOUT), so every
    row saved before it re-renders alike."""

    path: str
    lora_r: int
    lora_alpha: int
    lora_dropout: float = LORA_DROPOUT

    CHECKS: ClassVar = {"path": (lambda v: isinstance(v, str), "a string"),
                        "lora_r": (lambda v: is_whole(v, 0), "a whole number >= 0 (0: a full fine-tuning)"),
                        "lora_alpha": (lambda v: is_whole(v, 1), "a whole number >= 1"),
                        "lora_dropout": (lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                                 and v <= 1), f"a number up to 1 (absent: {LORA_DROPOUT})")}

    def to_json(self) -> dict[str, Any]:
        data = super().to_json()
        if self.lora_dropout == LORA_DROPOUT:
            del data["lora_dropout"]
        return data


@dataclass(frozen=True)
class Corrected(Record):
    """This tool's corrected estimate for the row's arm (computed by the estimator: the allocated peak, and
    the free memory a card must have for it, its needs-free: allocated plus the allocator's reserve), the
    figures the text renders beside the row. Written with the row on every save by
    issue395.results.corrected, from the arm and the run's environment; a render recomputes them, so a saved
    row's figure is the one its own save rendered, and a re-save writes the estimator's of the day."""

    allocated: Optional[int] = None
    needs_free: Optional[int] = None

    CHECKS: ClassVar = {"allocated": _BYTES, "needs_free": _BYTES}


@dataclass(frozen=True)
class Capped(Record):
    """--cap: which prediction capped the allocator ("off": the control) and the cap in bytes."""

    KIND: ClassVar = "cap"
    at: str
    bytes: Optional[int] = None

    CHECKS: ClassVar = {"at": (lambda v: isinstance(v, str), "a string"), "bytes": _BYTES}


@dataclass(frozen=True)
class Emulated(Record):
    """--emulate-card: the card the arm ran as, its free memory (total - context, computed), the
    free memory measured with the ballast held, and this tool's needs-free for the arm (computed)."""

    KIND: ClassVar = "emulate-card"
    card: str
    card_free: Optional[int] = None
    free: Optional[int] = None
    needs_free: Optional[int] = None

    CHECKS: ClassVar = {"card": (_PRINTABLE[0], "a printable string"),
                        "card_free": _BYTES, "free": _BYTES, "needs_free": _BYTES}


@dataclass(frozen=True)
class MinFreeFound(Record):
    """--min-free, measured: the lowest cap the step completed under, the highest it raised OOM
    under, the bracket's width when it stopped, every probe (cap bytes, completed) in the order
    run; beside this tool's needs-free for the arm (computed)."""

    KIND: ClassVar = "min-free"
    completes: Optional[int] = None
    oom: Optional[int] = None
    resolution: Optional[int] = None
    probes: tuple = ()
    needs_free: Optional[int] = None

    CHECKS: ClassVar = {"completes": _BYTES, "oom": _BYTES, "resolution": _BYTES, "needs_free": _BYTES,
                        "probes": (lambda v: v is None or (isinstance(v, (list, tuple)) and all(
                            isinstance(p, (list, tuple)) and len(p) == 2 and is_whole(p[0], 1)
                            and isinstance(p[1], bool) for p in v)),
                            "a list of [cap bytes, completed] pairs")}

    def to_json(self) -> dict[str, Any]:
        return dict(asdict(self), probes=[list(p) for p in self.probes])

    @classmethod
    def from_json(cls, data: Any, where: str) -> "MinFreeFound":
        found = super().from_json(data, where)
        return cls(found.completes, found.oom, found.resolution, tuple(map(tuple, found.probes or ())),
                   found.needs_free)


#: Each constraint's record by the kind its JSON names.
CONSTRAINT_RECORDS = {r.KIND: r for r in (Capped, Emulated, MinFreeFound)}


def constraint_to_json(record: Optional[Record]) -> Optional[dict[str, Any]]:
    return None if record is None else {"kind": type(record).KIND, **record.to_json()}


def constraint_from_json(data: Any) -> Optional[Record]:
    if data is None:
        return None
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind not in CONSTRAINT_RECORDS:
        raise ValueError(f"row field 'constraint' is {data!r:.60}, not a constraint's record "
                         f"(kind one of {', '.join(CONSTRAINT_RECORDS)})")
    return CONSTRAINT_RECORDS[kind].from_json(data, "constraint")
