"""The stack every output carries: the GPU, driver and CUDA, each package's version, the command,
and the kernels Qwen3.5's linear attention runs; `STACK_KEYS`, what must agree for two results to
merge into one table.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import subprocess
from typing import Any, Optional

from ..estimator.stacks import NOT_INSTALLED, PACKAGES, check, package_version


#: What must agree for two results to merge into one table: the same stack and protocol.
STACK_KEYS = ("gpu", "driver", "cuda", "torch", "transformers", "trl", "peft", "bitsandbytes", "soup_cli",
              "python", "weights", "dry_run")


def environment(weights: str, dry_run: bool, arms: str, argv: list[str],
                with_torch: bool = True) -> dict[str, Any]:
    """The stack every output carries. Without torch (a fan-out parent whose children all
    died before reporting theirs) torch's version is read from its package, and no GPU."""
    torch = __import__("torch") if with_torch else None
    cuda = torch is not None and torch.cuda.is_available()
    driver = None
    if cuda:
        with contextlib.suppress(Exception):
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=10).stdout.split()[0]
    props = torch.cuda.get_device_properties(0) if cuda else None
    return {"gpu": torch.cuda.get_device_name(0) if cuda else None, "driver": driver,
            # what bitsandbytes' gemm_4bit heuristic reads of the card (estimator/gemm4bit.py; cards.saved_dispatch)
            "gpu_sms": props.multi_processor_count if props else None,
            "gpu_cc": f"{props.major}.{props.minor}" if props else None,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cuda": torch.version.cuda if torch else None,
            "torch": torch.__version__ if torch else package_version("torch"), **{k.replace("-", "_"): package_version(k) for k in
                                            ("transformers", "trl", "peft", "bitsandbytes", "soup-cli")},
            "python": platform.python_version(), "platform": platform.platform(), "weights": weights,
            "dry_run": dry_run, "arms": arms, "command": " ".join(argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **linear_attention_kernels(), **((measure_context() or {}) if cuda else {})}


def linear_attention_kernels() -> dict[str, str]:
    """Which path a gated delta-net (Qwen3.5's linear attention) runs: the fused kernels of
    flash-linear-attention and causal-conv1d where installed, else transformers' torch fallback.
    The two save different tensors for backward, so the peak depends on it; recorded only where a
    package is there, so a stack without them reads as it always did."""
    found = {k: package_version(k) for k in ("flash-linear-attention", "causal-conv1d")}
    found = {k: v for k, v in found.items() if v != NOT_INSTALLED}
    return {"linear_attention_kernels": ", ".join(f"{k} {v}" for k, v in found.items())} if found else {}


def stack_check(env: dict[str, Any], nf4: bool = True):
    """A result's stack (its environment: saved, or this run's) against the stacks the physics was
    verified on (``estimator.stacks``); a package it did not record is left out and said so."""
    return check({p: env.get(p.replace("-", "_")) for p in PACKAGES}, nf4)


def measure_context(device: int = 0) -> Optional[dict[str, int]]:
    """The CUDA context this process leaves outside the caching allocator on ``device``, measured
    after CUDA init and the first cuBLAS handle, before Soup's setup: mem_get_info's total minus
    its free, less what the caching allocator itself reserved (the handle's workspace). The
    figure issue395.estimator.cards' verdict subtracts from a card's total; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    torch.cuda.current_blas_handle()
    torch.cuda.synchronize(device)
    free, total = (int(n) for n in torch.cuda.mem_get_info(device))
    reserved = int(torch.cuda.memory_reserved(device))
    return {"context_bytes": total - free - reserved, "cuda_total_bytes": total, "cuda_free_bytes": free,
            "allocator_reserved_bytes": reserved}
