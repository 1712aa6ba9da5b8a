"""An arm of the grid, and Soup's prediction for it: Soup's own estimator and logits charge, fed
the arm's shape exactly as the record fed them (computed by Soup)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..tasks import PROTOCOL_TASK
from .registry import Shape


@dataclass(frozen=True)
class Arm:
    """One point of the grid: a model at one seq and batch, under one of Soup's tasks; index is its
    grid position. ``optimizer`` and ``accumulation``: Soup's ``training.optimizer`` and
    ``training.gradient_accumulation_steps`` where a --config file names the run (its values as Soup's
    loader read them, its defaults too: the run `soup train` runs); None: the protocol's arm, which names
    neither (Soup's default optimizer, one micro-batch a step)."""

    model: str
    seq: int
    batch: int = 1
    index: int = 0
    quant: str = "none"
    task: str = PROTOCOL_TASK  # Soup's task (issue395.tasks), the protocol's SFT unless asked
    optimizer: Optional[str] = None  # training.optimizer (None: the protocol's, Soup's default)
    accumulation: Optional[int] = None  # training.gradient_accumulation_steps (None: the protocol's 1)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step: the data one step reads is batch x this."""
        return self.accumulation or 1

    @property
    def training(self) -> dict[str, Any]:
        """The Soup ``training`` keys this arm sets beyond the protocol's config (none for the protocol's arm)."""
        return {k: v for k, v in (("optimizer", self.optimizer),
                                  ("gradient_accumulation_steps", self.accumulation)) if v is not None}

    @property
    def run(self) -> dict[str, Any]:
        """The estimator's keywords for this arm's run beyond its shape (issue395.estimator.estimate: its
        ``optimizer`` and ``accumulation``), those the arm sets: one estimate for the run every mode runs."""
        return {k: v for k, v in (("optimizer", self.optimizer), ("accumulation", self.accumulation))
                if v is not None}


def predicted_bytes(shape: Shape, seq: int, batch: int = 1) -> int:
    """Soup's estimator fed the grid's figures, exactly as the record did."""
    from soup_cli.utils.layer_stream import estimate_stream_peak_vram

    return int(estimate_stream_peak_vram(
        layer_bytes=shape.pool // 2, buffers=2, extras_bytes=shape.extras,
        adapter_params=shape.grid_adapter, vocab_size=shape.vocab, hidden_size=shape.hidden,
        intermediate_size=shape.intermediate, n_layers=shape.n_layers,
        seq_len=seq, batch_size=batch))


def logits_charge(shape: Shape, seq: int, batch: int) -> tuple[int, float]:
    """14 x E (Soup's logits charge, bytes; E = seq x vocab x batch) and the 12 bytes per element
    its loss really holds: 14 is 12 of loss arithmetic plus a retained bf16 copy the record found absent."""
    from soup_cli.utils.layer_stream import LOGITS_LOSS_BYTES_PER_ELEMENT, estimate_logits_bytes

    return (int(estimate_logits_bytes(vocab_size=shape.vocab, seq_len=seq, batch_size=batch)),
            float(LOGITS_LOSS_BYTES_PER_ELEMENT))
