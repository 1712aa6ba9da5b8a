"""The record's two other modes: --measure (Soup's logits probe) and --sdpa (attention's extra
allocation per backend, with the math path as the positive control).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Iterable

from ..record import MEASURE_VOCABS, SDPA_BACKENDS, SDPA_HEAD_DIM, SDPA_HEADS, SDPA_SEQS
from .cuda import peak_window


def measure_mode(dry_run: bool) -> dict[str, Any]:
    """The shipped constants; Soup's probe three times with the spread, then by vocab."""
    from soup_cli.utils.layer_stream import (
        LOGITS_BYTES_PER_ELEMENT,
        LOGITS_LOSS_BYTES_PER_ELEMENT,
        measure_logits_loss_bytes_per_element,
    )

    def probe(**kw: Any) -> Any:
        if dry_run:
            return "n/a (dry run)"
        v = measure_logits_loss_bytes_per_element(**kw)
        return "n/a (probe failed)" if v is None else float(v)

    repeats = [probe() for _ in range(3)]
    nums = [v for v in repeats if not isinstance(v, str)]
    return {"constants": {"LOGITS_BYTES_PER_ELEMENT": LOGITS_BYTES_PER_ELEMENT,
                          "LOGITS_LOSS_BYTES_PER_ELEMENT": LOGITS_LOSS_BYTES_PER_ELEMENT},
            "repeats": repeats, "spread": (max(nums) - min(nums)) if len(nums) == 3 else "-",
            "by_vocab": {v: probe(vocab_size=v) for v in MEASURE_VOCABS}}


def sdpa_extra_mb(seq: int, backend: str) -> Any:
    """Extra allocation of one causal self-attention over its input, in MB (1e6 bytes).
    A backend that raises is data ("n/a (ErrorName)"), not a crash."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = {"flash": SDPBackend.FLASH_ATTENTION, "mem_efficient": SDPBackend.EFFICIENT_ATTENTION,
             "math": SDPBackend.MATH}
    q = torch.randn(1, SDPA_HEADS, seq, SDPA_HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    try:
        with peak_window() as window, \
                sdpa_kernel(kinds[backend]) if backend in kinds else contextlib.nullcontext():
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return round((window.peak - window.before) / 1e6, 1)
    except Exception as exc:
        return f"n/a ({type(exc).__name__})"
    finally:
        del q
        torch.cuda.empty_cache()


def sdpa_mode(dry_run: bool, seqs: Iterable[int] = SDPA_SEQS) -> dict[str, Any]:
    """Each backend first runs once untimed: a first call also allocates library workspace
    (cuBLAS, for the math path), which is not the attention's own cost. The math arm is
    the positive control: it shows the seq^2 cost is real, so the others' absence is too."""
    seqs = list(seqs)
    # Each probe's peak window collects garbage first; the stack's own objects, frozen here, need
    # no scan 24 times over (it cost 9 s of a 70 s record run on the H200, and moved no byte).
    gc.freeze()
    try:
        if not dry_run:
            for backend in SDPA_BACKENDS:
                sdpa_extra_mb(min(seqs), backend)
        return {"seqs": seqs, "extra_mb": {b: ["n/a (dry run)" if dry_run else sdpa_extra_mb(q, b)
                                               for q in seqs] for b in SDPA_BACKENDS}}
    finally:
        gc.unfreeze()
