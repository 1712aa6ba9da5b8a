"""--cap: what an arm's caching allocator is capped at, so a prediction is tested the way a card
tests it. Capped at Soup's own pre-flight, an arm Soup under-predicts should die with OOM (the run
Soup's gate admits dies: issue #395's failure); capped at the corrected needs-free, it should
complete; 'off' is the control, the same fresh process and allocator with no cap."""

from __future__ import annotations

from typing import Optional

from ..record import LORA_R
from ..model.registry import stream_mode
from ..estimator.estimate import estimate, estimate_key


def cap_bytes(cap: str, key: str, *, quant: str, seq: int, batch: int, targets: tuple, lora_r: int = LORA_R,
              steps: int = 1, release: Optional[str] = None, config: Optional[dict] = None) -> Optional[int]:
    """The cap in bytes for one arm of a family (or the record's models), from its public config,
    at the arm's LoRA r: Soup's own number is Soup's estimator fed what its setup computes (exact
    on every map arm)."""
    if cap == "off":
        return None
    if cap.startswith("bytes:"):  # --min-free's probes: a number, not a prediction
        return int(cap.partition(":")[2])
    # Soup's number only where it is the cap: it needs the release's own code, the physics does not
    kw = dict(quant=quant, seq=seq, batch=batch, targets=targets, lora_r=lora_r, steps=steps, release=release,
              soup=cap == "soup")
    # a streaming mode is capped at its own estimate; a --model arm at its checkpoint's config
    e = estimate_key(key, **kw) if config is None else estimate(config, stream=stream_mode(key)[1], **kw)
    return {"soup": e.soup_predicted, "corrected": e.corrected_predicted, "needs-free": e.needs_free}[cap]


def apply_cap(limit: Optional[int]) -> Optional[float]:
    """Cap this process's caching allocator at ``limit`` bytes of the card (before Soup's setup
    moves anything there); returns the fraction set."""
    if limit is None:
        return None
    import torch

    fraction = min(1.0, limit / torch.cuda.get_device_properties(0).total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return fraction
