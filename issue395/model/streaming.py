"""How a run streams, as one typed record: ``Streaming``, soup-cli 0.77.0's streaming modes and the resident run
(layers streamed or kept on the card, the expert layout, the loss chunk, recompute, gradient checkpointing, Soup's
measured-fit probe). It is the one place that spells a mode in a map key (``parse``, ``key``: "moonlight+per_expert
+chunk512"), refuses a combination no run has (``checked``), and gives the Soup ``training`` keys a mode sets
(``training``). A new streaming mode is one field here, its spelling and its Soup key, and the estimator's term."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from ..errors import UsageError

#: The map key's spelling of a resident run and of its gradient checkpointing (both Soup ``training`` keys).
RESIDENT, CHECKPOINTED = "resident", "gc"
#: Whether Soup streams the layers (its default) or keeps them resident: the values of --stream-layers.
STREAM_LAYERS = ("on", "off")
#: training.gradient_checkpointing on a resident run (Soup's default off first): --gradient-checkpointing.
CHECKPOINTING = ("off", "on")
#: The map key's spelling of training.stream_vram_probe (Soup's measured-fit gate, #349: one measured step at
#: setup decides the fit), and the values of --stream-vram-probe (Soup's default off first).
PROBE, PROBES = "probe", ("off", "on")
#: soup-cli 0.77.0's streaming modes as map axes: how a mode is spelled after a family's key
#: ("moonlight+per_expert+chunk512"), and the Soup ``training`` key each one sets.
STREAM_MODES = {"per_expert": ("stream_expert_layout", "per_expert"),
                "recompute-off": ("stream_recompute", "off"),
                # a resident run: Soup keeps every layer on the card (training.stream_layers false), and
                # HF's gradient checkpointing where the file turns it on (Soup's default: off)
                RESIDENT: ("stream_layers", False),
                CHECKPOINTED: ("gradient_checkpointing", True),
                # Soup's measured step at setup (a streamed run's; Soup's schema takes it for SFT only, #840)
                PROBE: ("stream_vram_probe", True)}
LOSS_CHUNK_PREFIX = "chunk"  # chunkN: training.stream_loss_chunk = N tokens
#: The values of the two named axes, Soup's default first (the default adds nothing to a key).
EXPERT_LAYOUTS, RECOMPUTES = ("fused", "per_expert"), ("on", "off")
#: Why gradient checkpointing is a resident run's only (``Streaming.checked``, and --config's line for the key on a
#: streamed file).
STREAMED_CHECKPOINTS = "a streamed run checkpoints every layer itself"
#: What separates a family's key from its modes in a map key.
SEP = "+"


def family_of(key: str) -> str:
    """The family (or record model, or "custom") a map key names, its streaming modes aside
    ("moonlight+per_expert" -> "moonlight")."""
    return key.split(SEP)[0]


@dataclass(frozen=True)
class Streaming:
    """How one run streams, each field at Soup's default unless the run sets it: ``layers`` False is a resident
    run (training.stream_layers false), whose only mode is ``checkpointing`` (HF's gradient checkpointing);
    a streamed run's are ``layout`` (stream_expert_layout), ``loss_chunk`` (stream_loss_chunk, tokens),
    ``recompute`` (stream_recompute) and ``probe`` (stream_vram_probe: Soup's measured step at setup)."""

    layers: bool = True
    layout: str = EXPERT_LAYOUTS[0]
    loss_chunk: Optional[int] = None
    recompute: str = RECOMPUTES[0]
    checkpointing: bool = False
    probe: bool = False

    @property
    def resident(self) -> bool:
        """Every layer kept on the card (stream_layers off)."""
        return not self.layers

    def checked(self, family: str) -> "Streaming":
        """This record, or one line where no run has it: a resident run takes no streaming mode (Soup reads
        none), and gradient checkpointing is a resident run's only."""
        if self.resident and (self.layout != EXPERT_LAYOUTS[0] or self.loss_chunk or
                              self.recompute != RECOMPUTES[0] or self.probe):
            raise UsageError(f"{family}: a resident run (stream_layers off) takes no streaming mode")
        if self.checkpointing and not self.resident:
            raise UsageError(f"{family}: gradient checkpointing is a resident run's ({STREAMED_CHECKPOINTS})")
        return self

    @property
    def modes(self) -> tuple:
        """The modes as a key spells them, in the key's order; Soup's defaults add nothing."""
        return tuple((["per_expert"] if self.layout == "per_expert" else [])
                     + ([f"{LOSS_CHUNK_PREFIX}{self.loss_chunk}"] if self.loss_chunk else [])
                     + (["recompute-off"] if self.recompute == "off" else [])
                     + ([RESIDENT] if self.resident else []) + ([CHECKPOINTED] if self.checkpointing else [])
                     + ([PROBE] if self.probe else []))

    def key(self, family: str) -> str:
        """The map key of ``family`` under these modes."""
        return SEP.join((family,) + self.checked(family).modes)

    def label(self, name: str, *more: str) -> str:
        """A row's name for a run of ``name`` under these modes (and ``more``, the arm's own words after them: a
        full fine-tuning's): in brackets ("Llama-3.2-1B [resident+gc]"); the name alone at Soup's defaults."""
        modes = self.modes + more
        return f"{name} [{SEP.join(modes)}]" if modes else name

    @classmethod
    def parse(cls, key: str) -> tuple[str, "Streaming"]:
        """A map key's family and its modes; an unknown mode or a combination no run has is one line."""
        base, spelled = family_of(key), key.split(SEP)[1:]
        training: dict[str, Any] = {}
        for mode in spelled:
            digits = mode[len(LOSS_CHUNK_PREFIX):]
            if mode in STREAM_MODES:
                training.__setitem__(*STREAM_MODES[mode])
            elif mode.startswith(LOSS_CHUNK_PREFIX) and digits.isdigit() and digits[0] != "0":
                training["stream_loss_chunk"] = int(digits)
            else:
                raise UsageError(f"{key}: unknown streaming mode {mode!r} (modes: "
                                 f"{', '.join(STREAM_MODES)}, {LOSS_CHUNK_PREFIX}N)")
        return base, cls.of_training(training).checked(base)

    @classmethod
    def of_training(cls, training: dict) -> "Streaming":
        """The record of Soup ``training`` keys and values (a loaded soup.yaml's, or ``training``'s); a key
        left out, or None, is Soup's default."""
        given = {f: training.get(soup) for f, soup in _SOUP_KEYS.items() if training.get(soup) is not None}
        return cls(**{f: (bool(v) if f in ("layers", "checkpointing", "probe") else v) for f, v in given.items()})

    def training(self) -> dict[str, Any]:
        """The Soup ``training`` keys these modes set, each only where it is not Soup's default, in the key's order."""
        return {soup: getattr(self, f) for f, soup in _ORDERED if getattr(self, f) != _DEFAULTS[f]}

    def stream(self) -> dict[str, Any]:
        """The streamed step's keys the estimator takes (``estimate``'s ``stream``): ``training`` less the resident
        run's own (a resident run is ``estimate_resident``'s)."""
        return {k: v for k, v in self.training().items() if k not in ("stream_layers", "gradient_checkpointing")}


_SOUP_KEYS = {"layers": "stream_layers", "layout": "stream_expert_layout", "loss_chunk": "stream_loss_chunk",
              "recompute": "stream_recompute", "checkpointing": "gradient_checkpointing", "probe": "stream_vram_probe"}
#: In the key's order (its ``modes``), so ``training`` lists its keys as the key spells them.
_ORDERED = tuple((f, _SOUP_KEYS[f]) for f in ("layout", "loss_chunk", "recompute", "layers", "checkpointing", "probe"))
_DEFAULTS = {f.name: f.default for f in fields(Streaming)}
