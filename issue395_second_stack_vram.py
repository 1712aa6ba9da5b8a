#!/usr/bin/env python3
"""Re-measure Soup's second-stack VRAM record (issue #395) on any CUDA box.

Requirements
    A CUDA GPU with 13 GB free for the full sweep (the largest arm, Qwen2.5-0.5B
    at seq 6144, peaks at 11.85 GB on the record's A10G 23 GB); Python 3.11 and
    requirements.txt: torch, transformers, trl, peft, soup-cli (0.73.3 is the
    record's; 0.77.0 is tested too), pyyaml, matplotlib (--plot) and jinja2>=3.1.0
    (Soup's chat template fails to render on older jinja2). No network: every
    model is built here. On an H200 a full run (--sweep --measure --sdpa) took
    39-49 s warm and 57-62 s cold, and the whole margin map (--map) 12.4 minutes
    with every checkpoint built cold, 5.6 minutes with --gpus 0,1 on two H200s
    (results/README.md has each run's time). The map's NF4 arms need bitsandbytes;
    its 7B and 8B families ran on a box with 128 GiB of RAM and a 64 GB disk (one
    family's checkpoint and shards are kept at a time in each process).

Usage
    issue395_second_stack_vram.py                          the sweep: 10 arms
    issue395_second_stack_vram.py --sweep --measure --sdpa the full record
    issue395_second_stack_vram.py --dry-run --seq 256      CPU: Soup's setup and the guard, no peak
    issue395_second_stack_vram.py --map --plot map.png     the margin map: every family Soup streams
    issue395_second_stack_vram.py --gpus 0,1               one shard per GPU, merged
    issue395_second_stack_vram.py --shard 2/4 --json s2.json   one shard of four (cluster array jobs)
    issue395_second_stack_vram.py --from-json s1.json s2.json  merge shards into one set of tables

The claim under test
    Before a layer-streamed LoRA run, Soup predicts its peak VRAM with
    ``soup_cli.utils.layer_stream.estimate_stream_peak_vram`` and refuses the run
    if it will not fit. The contract: the prediction NEVER under-predicts
    ``torch.cuda.max_memory_allocated()`` of a real step. On an RTX 3050 Laptop
    it did (issue #395); the A10G record re-measured it and found a flat ~1.16x
    over-prediction instead. This harness re-measures that record here.

The protocol (one arm = one row)
    SmolLM2-135M at seq 2048, 3072, 4096, 4352, 5120, 6144 and Qwen2.5-0.5B at
    seq 2048, 4096, 5120, 6144, batch 1. Each arm is one real Soup setup
    (``SFTTrainerWrapper(config).setup``) with ``training.stream_layers: true``,
    LoRA r=8 on q_proj/v_proj, bf16, and ONE optimizer step. Its real peak is
    ``max_memory_allocated()`` around exactly that step, after emptying the cache
    and resetting the peak stats. The prediction is Soup's own estimator, fed the
    grid's shape figures.

The trap
    ``data.max_length`` truncates; it never pads. A row that tokenizes short runs
    at its own length, the real peak stops following seq, and the table shows a
    clean, growing over-prediction that is pure artifact. Two guards, always on:
    every row is 3x longer than seq (``"word "`` x 3 x seq, one token a word), and
    the realised length is read off the first collated batch into its own column.
    A row whose realised length differs from the requested seq is VOID: it has no
    ratio, by construction, and the process exits 1.

What the tool adds to the record
    Architecture-exact synthetic checkpoints (peak VRAM depends on shapes and
    dtypes, not weight values; ``--weights hub`` uses the real ones); --batch;
    --model (any streamable causal LM, or just its config.json); --snapshot (which
    blocks are live at the peak, with a positive control); --determinism; --isolate;
    shards (--shard, --gpus, --from-json merges); JSON, markdown and a plot; and the
    margin map (--map): Soup's contract on every family it streams, bf16 and NF4,
    judged against Soup's own pre-flight number as its setup computes it, with the
    estimator term that eats the thinnest margins.

Every number printed is measured here, computed by Soup, or quoted from the
record, and labelled as such. Exit codes: 0 every row ok (a dry run: every row
realised as requested; REFUSED and SKIPPED rows are not findings); 1 any row VOID,
OOM, FAILED or UNDER; 2 usage error; 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import hashlib
import importlib.util
import io
import json
import logging
import math
import os
import platform
import re
import shutil
import signal
import socket
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

# ---------------------------------------------------------------------------
# The record, as data
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One model as the published grid records it, and its public architecture."""

    key: str
    name: str
    hub_id: str
    model_type: str
    pool: int  # bytes of the 2 layer buffers
    extras: int  # bytes resident beside the pool (embedding, final norm, untied head)
    adapter: int  # the grid's adapter count
    vocab: int
    hidden: int
    intermediate: int
    n_layers: int
    max_positions: int
    arch: dict = field(default_factory=dict)  # the other public config.json fields
    record: bool = True  # False for --model and the map's families: no published figures
    targets: tuple = ("q_proj", "v_proj")  # the protocol's LoRA targets, or the family's own


SHAPES: dict[str, Shape] = {
    "smol": Shape("smol", "SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M", "llama",
                  pool=14160384, extras=56624256, adapter=921600, vocab=49152, hidden=576,
                  intermediate=1536, n_layers=30, max_positions=8192,
                  arch={"num_attention_heads": 9, "num_key_value_heads": 3,
                        "rope_theta": 100000.0, "rms_norm_eps": 1e-5}),
    "qwen": Shape("qwen", "Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B", "qwen2",
                  pool=59649536, extras=272271104, adapter=1081344, vocab=151936, hidden=896,
                  intermediate=4864, n_layers=24, max_positions=32768,
                  arch={"num_attention_heads": 14, "num_key_value_heads": 2,
                        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                        "use_sliding_window": False, "sliding_window": None}),
}
RECORD_GRID: dict[str, tuple[int, ...]] = {
    "smol": (2048, 3072, 4096, 4352, 5120, 6144),
    "qwen": (2048, 4096, 5120, 6144),
}
LORA_R, LORA_ALPHA, LORA_TARGETS = 8, 16, ("q_proj", "v_proj")
SOUP_QUANT = {"none": "none", "nf4": "4bit"}  # the harness's name: Soup config's spelling
#: The grid's adapter count is twice the LoRA A+B parameters (921,600 = 2 x 460,800).
GRID_ADAPTER_FACTOR = 2
DATA_ROWS, OVERSHOOT = 4, 3

A10G_STACK = ("NVIDIA A10G 23 GB (AWS g5.xlarge), Ubuntu 22.04, driver 580.126.09, "
              "torch 2.13.0+cu130, transformers 5.16.1, trl 0.29.1, peft 0.20.0, "
              "Python 3.10, Soup 0.73.3")
#: The A10G record's real peaks, bytes, and its published (predicted GB, pred/real).
RECORD_A10G_PEAK: dict[tuple[str, int], int] = {
    ("smol", 2048): 1365200000, ("smol", 3072): 2016700000, ("smol", 4096): 2657800000,
    ("smol", 4352): 2818400000, ("smol", 5120): 3303000000, ("smol", 6144): 3943000000,
    ("qwen", 2048): 4177000000, ("qwen", 4096): 8012300000, ("qwen", 5120): 9929400000,
    ("qwen", 6144): 11848100000,
}
RECORD_A10G_PREDICTED: dict[tuple[str, int], tuple[float, float]] = {
    ("smol", 2048): (1.596, 1.169), ("smol", 3072): (2.345, 1.163), ("smol", 4096): (3.094, 1.164),
    ("smol", 4352): (3.281, 1.164), ("smol", 5120): (3.842, 1.163), ("smol", 6144): (4.591, 1.164),
    ("qwen", 2048): (4.854, 1.162), ("qwen", 4096): (9.346, 1.166), ("qwen", 5120): (11.592, 1.167),
    ("qwen", 6144): (13.837, 1.168),
}
RECORD_A10G_OVERESTIMATE = {"mean": 1.152, "pstdev": 0.0249}
#: The first stack (RTX 3050 Laptop), SmolLM2: (predicted GB, real GB).
RECORD_RTX3050 = {("smol", 4352): (3.282, 3.036), ("smol", 5120): (3.844, 4.118),
                  ("smol", 6144): (4.590, 5.830)}
RECORD_MEASURE = {"repeat": 12.0, "spread": 0.0,
                  "vocab": {8192: 12.0, 32768: 12.0, 49152: 12.0, 151936: 12.01010951979781}}
MEASURE_VOCABS = (8192, 32768, 49152, 151936)
SDPA_SEQS, SDPA_HEADS, SDPA_HEAD_DIM = (2048, 3072, 4096, 5120, 6144), 9, 64
SDPA_BACKENDS = ("flash", "mem_efficient", "math", "default")
RECORD_SDPA_MB = {"flash": (2.4, 3.7, 4.9, 6.1, 7.3), "mem_efficient": (2.4, 3.5, 4.7, 5.9, 7.1),
                  "math": (383.9, 831.5, 1463.8, 2279.7, 3267.4)}
#: SmolLM2 repeated in a fresh process: (GB, GB, spread %).
RECORD_DETERMINISM = {("smol", 4096): (2.6578, 2.6493, 0.32), ("smol", 6144): (3.9430, 3.9439, 0.02)}

EXIT_OK, EXIT_FINDING, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
GB = 1e9
SCHEMA = 2  # the JSON this version writes; it also reads schema 1


class UsageError(Exception):
    """Bad input: one line on stderr, exit 2."""


# ---------------------------------------------------------------------------
# The prediction (computed by Soup)
# ---------------------------------------------------------------------------


def predicted_bytes(shape: Shape, seq: int, batch: int = 1) -> int:
    """Soup's estimator fed the grid's figures, exactly as the record did."""
    from soup_cli.utils.layer_stream import estimate_stream_peak_vram

    return int(estimate_stream_peak_vram(
        layer_bytes=shape.pool // 2, buffers=2, extras_bytes=shape.extras,
        adapter_params=shape.adapter, vocab_size=shape.vocab, hidden_size=shape.hidden,
        intermediate_size=shape.intermediate, n_layers=shape.n_layers,
        seq_len=seq, batch_size=batch))


def logits_charge(shape: Shape, seq: int, batch: int) -> tuple[int, float]:
    """14 x E (Soup's logits charge, bytes; E = seq x vocab x batch) and the 12 bytes per element
    its loss really holds: 14 is 12 of loss arithmetic plus a retained bf16 copy the record found absent."""
    from soup_cli.utils.layer_stream import LOGITS_LOSS_BYTES_PER_ELEMENT, estimate_logits_bytes

    return (int(estimate_logits_bytes(vocab_size=shape.vocab, seq_len=seq, batch_size=batch)),
            float(LOGITS_LOSS_BYTES_PER_ELEMENT))


# ---------------------------------------------------------------------------
# One arm: data, config, guard, the measured step, teardown
# ---------------------------------------------------------------------------


#: Where Soup builds an arm whose step is measured. The CPU tests set "cpu" and fake the
#: step itself (only the CUDA peak cannot run there); nothing else changes for them.
STEP_DEVICE = "cuda"


@dataclass(frozen=True)
class Arm:
    """One point of the grid: a model at one seq and batch; index is its grid position."""

    model: str
    seq: int
    batch: int = 1
    index: int = 0
    quant: str = "none"


def chat_rows(seq: int, rows: int = DATA_ROWS) -> list[dict[str, Any]]:
    """The protocol's rows: a 3x overshoot, so truncation, never padding, sets the length."""
    content = "word " * (OVERSHOOT * seq)
    return [{"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": content}]}] * rows


def rows_for_batch(batch: int, val_split: float = 0.1) -> int:
    """The protocol's 4 rows, or more where Soup's validation split would leave a short batch."""
    n = DATA_ROWS
    while int(n * (1 - val_split)) < batch:
        n += 1
    return n


def soup_config_yaml(base: str, data_path: Path, output: Path, seq: int, batch: int,
                     quant: str = "none", targets: Iterable[str] = ("q_proj", "v_proj")) -> str:
    """The protocol's Soup config, verbatim but for the paths, seq and batch (and, on the
    margin map, the quantization and the family's own LoRA targets). Soup spells NF4 "4bit"."""
    import yaml

    return yaml.safe_dump({
        "base": base, "task": "sft", "backend": "transformers", "modality": "text",
        "data": {"train": str(data_path), "max_length": seq, "chat_template": "chatml"},
        "output": str(output),
        "training": {"batch_size": batch, "gradient_accumulation_steps": 1, "epochs": 1,
                     "quantization": SOUP_QUANT[quant], "stream_layers": True, "logging_steps": 1,
                     "save_steps": 100000,
                     "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "target_modules": list(targets)}},
    }, sort_keys=False)


def realised_lengths(trainer: Any) -> tuple[int, list[int]]:
    """The first collated batch's width (what the step runs at) and each row's token count (the
    second guard): with batch > 1 a short row would hide behind its neighbours' padding."""
    batch = next(iter(trainer.get_train_dataloader()))
    ids, mask = batch["input_ids"], batch.get("attention_mask")
    width = int(ids.shape[-1])
    if mask is not None and mask.dim() == 2:
        return width, [int(v) for v in mask.sum(dim=-1).tolist()]
    return width, [width] * int(ids.shape[0])


def realised_as_requested(seq: int, batch: int, width: Optional[int], rows: Iterable[int]) -> bool:
    """The guard: the batch is exactly seq wide, and so is every one of its rows."""
    rows = list(rows)
    return width == seq and len(rows) == batch and all(n == seq for n in rows)


def real_peak(trainer: Any, snapshot: bool = False) -> dict[str, Any]:
    """Empty the cache, reset the peak, run exactly ONE optimizer step, read the peak; with
    ``snapshot``, the allocator's history around the same step, to attribute the peak."""
    import torch

    trainer.args.max_steps = 1
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated()
    history = allocator_history(2_000_000) if snapshot else contextlib.nullcontext({})
    started = time.perf_counter()
    with history as taken:
        trainer.train()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started  # the step, not the snapshot's collection
    return {"real_peak": int(torch.cuda.max_memory_allocated()), "resident": int(resident),
            "reserved": int(torch.cuda.max_memory_reserved()), "step_s": round(seconds, 3),
            "snapshot": taken.get("snapshot")}


def teardown(wrapper: Any) -> Optional[str]:
    """Release the stream runtime and the model. An error here is reported beside the
    measurement, never raised: teardown must never mask a measurement."""
    error = None
    try:
        if wrapper is not None:
            wrapper._close_stream_runtime()
    except Exception as exc:
        error = last_line(exc)
    try:
        if wrapper is not None:
            wrapper.trainer = wrapper.model = None
        # bitsandbytes caches its 256-entry dynamic map on the GPU the first time Soup
        # quantizes NF4 shards, and keeps it: 1,024 bytes every later arm carried (the map's
        # Qwen2.5 bf16 peaks were 1 KiB over the sweep's; found by bench/carried.py).
        qmap = getattr(sys.modules.get("bitsandbytes.functional"), "name2qmap", {})
        if getattr(qmap.get("dynamic"), "is_cuda", False):
            del qmap["dynamic"]
        gc.collect()
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            # Each thread's cuBLAS handle keeps a workspace (32 MiB on Hopper) in the
            # caching allocator. The autograd thread's appears after the first step's
            # peak, so a fresh process never has it at the peak, but the next arm in
            # this process would: +32 MiB on every later arm, measured, before this.
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            torch.cuda.empty_cache()
    except Exception as exc:
        error = error or last_line(exc)
    return error


def last_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}".strip()[:300]


def oom_request(exc: BaseException) -> Optional[int]:
    """The size an OOM asked for, off torch's message ("Tried to allocate 1.20 GiB")."""
    m = re.search(r"Tried to allocate ([0-9.]+) ([KMGT]i?B)", str(exc))
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
             "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
    return int(float(m.group(1)) * units[m.group(2)]) if m else None


def is_oom(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")
    return (torch is not None and isinstance(exc, torch.OutOfMemoryError)) or \
        "out of memory" in str(exc).lower()


#: What stops an arm short of a measurement. OOM and FAILED are findings; REFUSED (Soup's
#: pre-flight said the run will not fit: the gate working) and SKIPPED are not.
FAILURES = ("OOM", "FAILED", "REFUSED", "SKIPPED")


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
    soup_terms: Optional[dict] = None  # the arguments Soup's pre-flight passed its estimator
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
    teardown_error: Optional[str] = None
    record_peak: Optional[int] = None  # quoted: the A10G record's peak for this arm
    attribution: Optional[dict] = None
    base: Optional[str] = None
    gpu: Optional[str] = None
    pid: Optional[int] = None
    log: Optional[str] = None
    timings: dict = field(default_factory=dict)

    @property
    def realised(self) -> Optional[int]:
        """The one number the table shows: the length that strays furthest from seq."""
        seen = list(self.realised_rows) + ([self.realised_width] if self.realised_width else [])
        return max(seen, key=lambda n: (abs(n - self.seq), -n)) if seen else None

    @property
    def status(self) -> str:
        if self.failure:
            return self.failure
        if not realised_as_requested(self.seq, self.batch, self.realised_width, self.realised_rows):
            return "VOID"
        if self.real_peak is None:
            return "dry-run" if self.dry_run else "FAILED"
        return "UNDER" if self.lowest_prediction < self.real_peak else "ok"

    @property
    def lowest_prediction(self) -> Optional[int]:
        """The lower of the record's convention and Soup's own pre-flight (where captured)."""
        return min((p for p in (self.predicted, self.soup_predicted) if p), default=None)

    @property
    def measured(self) -> bool:
        return self.status in ("ok", "UNDER")

    @property
    def elements(self) -> int:
        return self.seq * self.vocab * self.batch

    @property
    def nonlogits_modelled(self) -> Optional[int]:
        return None if self.predicted is None else self.predicted - self.logits14

    @property
    def pred_over_real(self) -> Optional[float]:
        return self.predicted / self.real_peak if self.measured else None

    @property
    def margin_ratio(self) -> Optional[float]:
        """The lower of the two predictions (the record's convention, Soup's own) over the peak."""
        return self.lowest_prediction / self.real_peak if self.measured else None

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
    def vs_record(self) -> Optional[float]:
        return self.real_peak / self.record_peak if self.measured and self.record_peak else None

    def to_json(self) -> dict[str, Any]:
        derived = {k: getattr(self, k) for k in (
            "status", "realised", "pred_over_real", "nonlogits_modelled",
            "nonlogits_overestimate", "retained_copy_would_fit", "vs_record")}
        return dict(asdict(self), realised_rows=list(self.realised_rows), targets=list(self.targets),
                    derived=derived)  # "derived" is for readers; it is never read back

    @classmethod
    def from_json(cls, data: Any) -> "Row":
        """The one way back from JSON: known fields only, measurements sane, verdicts re-derived."""
        if not isinstance(data, dict):
            raise ValueError("a row is not an object")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known - {"derived"}
        if unknown:
            raise ValueError(f"unknown row field {sorted(unknown)[0]!r}")
        data = {k: v for k, v in data.items() if k in known}
        for key in ("seq", "batch", "vocab"):
            if not _whole(data.get(key), minimum=1):
                raise ValueError(f"row field {key!r} must be a whole number >= 1")
        for key in ("index", "predicted", "logits14", "realised_width", "real_peak", "resident",
                    "carried", "reserved", "oom_request", "record_peak", "repeat"):
            value = data.get(key)
            if value is not None and not _whole(value, minimum=1 if key == "real_peak" else 0):
                raise ValueError(f"row field {key!r} is {value!r}: not a finite measurement")
        if data.get("quant", "none") not in SOUP_QUANT:
            raise ValueError(f"row field 'quant' is {data['quant']!r}")
        if data.get("soup_predicted") is not None and not _whole(data["soup_predicted"], minimum=1):
            raise ValueError(f"row field 'soup_predicted' is {data['soup_predicted']!r}")
        rows = data.get("realised_rows") or []
        if not isinstance(rows, list) or not all(_whole(n, minimum=0) for n in rows):
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
        return cls(**dict(data, realised_rows=tuple(rows), targets=tuple(data.get("targets") or ())))


def _whole(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def arm_row(arm: Arm, shape: Shape, **measured: Any) -> Row:
    """An arm's row: its inputs, Soup's prediction and the record's figure, plus what was measured."""
    logits14, bpe = logits_charge(shape, arm.seq, arm.batch)
    record = (RECORD_A10G_PEAK.get((shape.key, arm.seq))
              if shape.record and arm.batch == 1 and arm.quant == "none" else None)
    return Row(model=shape.name, model_key=arm.model, seq=arm.seq, batch=arm.batch,
               index=arm.index, predicted=predicted_bytes(shape, arm.seq, arm.batch),
               logits14=logits14, loss_bytes_per_element=bpe, vocab=shape.vocab, quant=arm.quant,
               targets=tuple(shape.targets), record_peak=record, pid=os.getpid(), **measured)


def run_arm(arm: Arm, shape: Shape, base: str, work: Path, *, dry_run: bool = False,
            snapshot: bool = False, snapshot_dir: Optional[str] = None,
            log: Optional[Path] = None, verbose: bool = False, repeat: Optional[int] = None) -> Row:
    """One real Soup setup and, on CUDA, the one measured step. Always returns a row.

    A failure anywhere is the row's finding (OOM with the size it asked for,
    FAILED with the error's last line); a teardown error sits beside the
    measurement and never replaces it. A row that fails the guard is never
    measured: its peak would be an artifact.
    """
    work.mkdir(parents=True, exist_ok=True)
    data_path = work / "train.jsonl"
    data_path.write_text("".join(json.dumps(r) + "\n"
                                 for r in chat_rows(arm.seq, rows_for_batch(arm.batch))))
    got: dict[str, Any] = {"timings": {}, "carried": carried_bytes(dry_run)}
    wrapper = None
    t0 = time.perf_counter()
    if arm.quant == "nf4" and not bitsandbytes_present():
        return arm_row(arm, shape, base=base, dry_run=dry_run, repeat=repeat, failure="SKIPPED",
                       error="NF4 needs bitsandbytes, which is not installed here")
    preflight: dict[str, Any] = {}
    snap = None
    try:
        with soup_console(log or work / "soup.log", verbose), soup_preflight(preflight):
            from soup_cli.config.loader import load_config_from_string
            from soup_cli.data.loader import load_dataset
            from soup_cli.trainer.sft import SFTTrainerWrapper

            config = load_config_from_string(soup_config_yaml(
                base, data_path, work / "out", arm.seq, arm.batch, arm.quant, shape.targets))
            wrapper = SFTTrainerWrapper(config, device="cpu" if dry_run else STEP_DEVICE)
            wrapper.setup(load_dataset(config.data))
            width, lengths = realised_lengths(wrapper.trainer)
            got.update(realised_width=width, realised_rows=tuple(lengths))
            got["timings"]["setup_s"] = round(time.perf_counter() - t0, 3)
            if not dry_run and realised_as_requested(arm.seq, arm.batch, width, lengths):
                step = real_peak(wrapper.trainer, snapshot=snapshot)
                got["timings"]["step_s"] = step.pop("step_s")
                snap = step.pop("snapshot")
                got.update(step)
                if snap is not None:
                    got["attribution"] = attribute_peak(snap, step["resident"],
                                                        arm.seq * shape.vocab * arm.batch,
                                                        step["real_peak"],
                                                        shape_classes(shape, arm.seq, arm.batch))
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure becomes the row's finding
        got["timings"].setdefault("setup_s", round(time.perf_counter() - t0, 3))
        fit = preflight.get("fit")
        refused = fit is not None and not fit.fits and str(exc).startswith(fit.reason)
        oom = is_oom(exc)
        got.update(failure="REFUSED" if refused else "OOM" if oom else "FAILED",
                   error=last_line(exc), oom_request=oom_request(exc) if oom else None)
    finally:
        t1 = time.perf_counter()
        got["teardown_error"] = teardown(wrapper)
        wrapper = None
        got["timings"]["teardown_s"] = round(time.perf_counter() - t1, 3)
    got.update(soup_predicted=preflight.get("predicted"), soup_terms=preflight.get("kwargs"))
    if snap is not None and snapshot_dir:
        import pickle

        rep = f"-r{repeat}" if repeat is not None else ""
        out = Path(snapshot_dir) / f"snapshot-{arm.index:03d}-{arm.model}-{arm.seq}-b{arm.batch}{rep}.pickle"
        out.write_bytes(pickle.dumps(snap))
        got["attribution"]["snapshot_file"] = str(out)
    if not dry_run and STEP_DEVICE == "cuda":
        import torch

        if torch.cuda.is_available():
            got["gpu"] = f"{os.environ.get('CUDA_VISIBLE_DEVICES', '0')}: {torch.cuda.get_device_name(0)}"
    return arm_row(arm, shape, base=base, dry_run=dry_run, repeat=repeat,
                   log=str(log) if log else None, **got)


def carried_bytes(dry_run: bool) -> Optional[int]:
    """What earlier arms in this process left allocated: a fresh process has 0, and anything
    more is inside this arm's peak too."""
    if dry_run or STEP_DEVICE != "cuda":
        return None
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.memory_allocated())


@contextlib.contextmanager
def soup_preflight(seen: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Soup's own pre-flight for this setup: the number its gate compares with free VRAM. Soup
    keeps it nowhere, but its setup imports its estimator and fit decision from the module
    inside the method (0.73.3 and 0.77.0 alike), so wrapping them sees every call."""
    from soup_cli.utils import layer_stream

    estimate, decide = layer_stream.estimate_stream_peak_vram, layer_stream.decide_stream_fit

    def estimate_seen(*args: Any, **kwargs: Any) -> Any:
        result = estimate(*args, **kwargs)
        if sys._getframe(1).f_code.co_name == "_stream_budget_lines" or "predicted" not in seen:
            seen.update(predicted=int(result), kwargs={k: v for k, v in kwargs.items()
                                                      if isinstance(v, (int, float, str, type(None)))})
        return result

    def decide_seen(*args: Any, **kwargs: Any) -> Any:
        seen["fit"] = decide(*args, **kwargs)
        return seen["fit"]

    layer_stream.estimate_stream_peak_vram, layer_stream.decide_stream_fit = estimate_seen, decide_seen
    try:
        yield seen
    finally:
        layer_stream.estimate_stream_peak_vram, layer_stream.decide_stream_fit = estimate, decide


def bitsandbytes_present() -> bool:
    """NF4 needs bitsandbytes; without it Soup's setup fails deep inside transformers."""
    return importlib.util.find_spec("bitsandbytes") is not None


# ---------------------------------------------------------------------------
# The three modes: the sweep, --measure, --sdpa
# ---------------------------------------------------------------------------


def sweep(arms: list[Arm], shapes: dict[str, Shape], bases: "Checkpoints", scratch: "Scratch",
          run: "Run", on_row: Callable[[Row], None],
          on_margin: Optional[Callable[[dict[str, Any]], None]] = None) -> None:
    """Every arm, in grid order, in this process; Ctrl-C stops after the arm in flight. With
    ``on_margin`` (the map), a model's tightest arm and any UNDER run again under the allocator
    history once its arms are done, to say where the margin goes."""
    checked: set[tuple[str, str]] = set()
    done: list[Row] = []
    for i, arm in enumerate(arms):
        if Stop.requested:
            break
        base = quant_base(scratch, bases.get(arm.model), arm.quant)
        first = (arm.model, arm.quant) not in checked
        if run.cache_dir and first:
            scratch.repair_shards(base)
        checked.add((arm.model, arm.quant))
        log = (Path(run.log_dir) / f"soup-{arm.index:03d}-{arm.model}-{arm.seq}-b{arm.batch}.log"
               if run.log_dir else None)
        with scratch.sharding(base) if first else contextlib.nullcontext():
            row = run_arm(arm, shapes[arm.model], base, scratch.path("arms", f"{arm.index:03d}"),
                          dry_run=run.dry_run, snapshot=run.snapshot, snapshot_dir=run.snapshot_dir,
                          log=log, verbose=run.verbose, repeat=run.repeat_tag)
        on_row(row)
        done.append(row)
        if any(a.model == arm.model for a in arms[i + 1:]):
            continue
        if on_margin is not None:
            mine = [r for r in done if r.model_key == arm.model]
            again = mine if run.snapshot else [
                run_arm(a, shapes[a.model], quant_base(scratch, bases.get(a.model), a.quant),
                        scratch.path("arms", f"{a.index:03d}-margin"), snapshot=True, log=log,
                        verbose=run.verbose) for a in margin_arms(mine) if not Stop.requested]
            for r in again:
                if r.attribution and r.measured and r.soup_predicted:
                    on_margin(margin_breakdown(r))
        bases.release(arm.model)


def quant_alias(scratch: "Scratch", base: str, quant: str) -> Path:
    return (scratch.shard_root.parent / "quant-aliases"
            / f"{Path(base).name}-{hashlib.sha256(base.encode()).hexdigest()[:8]}.{quant}")


def quant_base(scratch: "Scratch", base: str, quant: str) -> str:
    """Soup keys its shard folder by the base path alone (re-sharding in place on a new quantization),
    so an NF4 arm gets its own path: a symlink beside the shard cache, shared by all who share it."""
    if quant == "none":
        return base
    alias = quant_alias(scratch, base, quant)
    alias.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        alias.symlink_to(Path(base).resolve(), target_is_directory=True)
    return str(alias)


def measure_mode(dry_run: bool) -> dict[str, Any]:
    """The shipped constants; Soup's probe three times with the spread, then by vocab."""
    from soup_cli.utils.layer_stream import (LOGITS_BYTES_PER_ELEMENT,
                                             LOGITS_LOSS_BYTES_PER_ELEMENT,
                                             measure_logits_loss_bytes_per_element)

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
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with sdpa_kernel(kinds[backend]) if backend in kinds else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        torch.cuda.synchronize()
        del out
        return round((torch.cuda.max_memory_allocated() - before) / 1e6, 1)
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
    if not dry_run:
        for backend in SDPA_BACKENDS:
            sdpa_extra_mb(min(seqs), backend)
    return {"seqs": seqs, "extra_mb": {b: ["n/a (dry run)" if dry_run else sdpa_extra_mb(q, b)
                                           for q in seqs] for b in SDPA_BACKENDS}}


# ---------------------------------------------------------------------------
# Past the record: peak attribution with its positive control, determinism, --model
# ---------------------------------------------------------------------------

ALLOC_ROUND = 512  # the caching allocator rounds every block up to 512 bytes
SIZE_GROUPS = ((100_000_000, ">= 100 MB"), (10_000_000, "10-100 MB"), (1_000_000, "1-10 MB"),
               (0, "< 1 MB"))


@contextlib.contextmanager
def allocator_history(max_entries: int) -> Iterator[dict[str, Any]]:
    """Record the caching allocator's history; the snapshot lands in the yielded dict."""
    import torch

    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                             max_entries=max_entries)
    taken: dict[str, Any] = {}
    try:
        yield taken
    finally:
        taken["snapshot"] = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)


def block_bytes(requested: int) -> int:
    """What the allocator counts for a request (the history records the requested size)."""
    return max(ALLOC_ROUND, -(-requested // ALLOC_ROUND) * ALLOC_ROUND)


def logits_kind(size: int, elements: int) -> Optional[str]:
    """'bf16' or 'fp32' when a block is exactly one logits tensor (seq x vocab x batch)."""
    return {elements * 2: "bf16", elements * 4: "fp32"}.get(size)


def attribute_peak(snapshot: dict[str, Any], resident: int, elements: int,
                   measured_peak: Optional[int] = None,
                   classify: Optional[Callable[[int], str]] = None) -> dict[str, Any]:
    """Replay the allocator's history and name what is live at the peak. ``resident`` was
    allocated before recording began (a block freed but never seen allocated comes out of it).
    A replayed peak off the measured one means the history was incomplete, and it says so."""
    traces = snapshot.get("device_traces") or []
    trace = max(traces, key=len) if traces else []
    frees = ({"free_requested"} if any(e.get("action") == "free_requested" for e in trace)
             else {"free", "free_completed"})

    def replay(events: list) -> Iterator[tuple[int, int, int, dict[int, int]]]:
        live: dict[int, int] = {}
        base, total = resident, 0
        for i, event in enumerate(events):
            action, addr, size = event.get("action"), int(event.get("addr", 0)), int(event.get("size", 0))
            if action == "alloc":
                live[addr] = size
                total += block_bytes(size)
            elif action in frees:
                if addr in live:
                    total -= block_bytes(live.pop(addr))
                else:
                    base -= block_bytes(size)
            else:
                continue
            yield i, base, total, live

    # Copying the live blocks at every new high is quadratic while memory climbs: find the
    # peak's event first, then replay up to it once.
    best, best_base, at = resident, resident, -1
    for i, base, total, _ in replay(trace):
        if base + total > best:
            best, best_base, at = base + total, base, i
    best_live: dict[int, int] = {}
    for _, _, _, best_live in replay(trace[:at + 1]):
        pass
    groups: dict[str, dict[str, int]] = {}
    logits = {"bf16": {"count": 0, "bytes": 0}, "fp32": {"count": 0, "bytes": 0}}
    classes: dict[str, int] = {}
    for size in best_live.values():
        if classify is not None:
            c = classify(size)
            classes[c] = classes.get(c, 0) + block_bytes(size)
        kind = logits_kind(size, elements)
        label = next(lbl for floor, lbl in SIZE_GROUPS if size >= floor)
        g = logits[kind] if kind else groups.setdefault(label, {"count": 0, "bytes": 0})
        g["count"] += 1
        g["bytes"] += block_bytes(size)
    # A split block keeps an unseen remainder under 1 MiB; a lost event shows far beyond that.
    complete = measured_peak is None or abs(best - measured_peak) <= (1 << 20) + measured_peak * 1e-3
    return {"elements": elements, "replayed_peak": best, "measured_peak": measured_peak,
            "complete": bool(trace) and complete, "events": len(trace),
            "resident_at_peak": best_base, "logits_bf16": logits["bf16"],
            "logits_fp32": logits["fp32"], "classes": classes,
            "other_groups": {k: groups[k] for _, k in SIZE_GROUPS if k in groups}}


def control_step(hold_copy: bool, tokens: int = 2048, vocab: int = 32768,
                 hidden: int = 256) -> dict[str, Any]:
    """The positive control's loss step; with ``hold_copy`` one extra bf16 copy of the logits is held
    across backward (the retention the record found absent): the attribution must see it."""
    import torch
    from transformers.loss.loss_utils import ForCausalLMLoss

    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen,
                    requires_grad=True)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, generator=gen,
                    requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens), device="cuda", generator=gen)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated()
    with allocator_history(200_000) as taken:
        logits = h @ w.t()
        held = logits.detach().clone() if hold_copy else None
        ForCausalLMLoss(logits, labels, vocab).backward()
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del held, logits, h, w, labels
    torch.cuda.empty_cache()
    return attribute_peak(taken["snapshot"], resident, tokens * vocab, peak)


def positive_control(without: dict[str, Any], with_copy: dict[str, Any]) -> dict[str, Any]:
    """Passes only if holding one extra bf16 copy shows exactly one more bf16 logits block."""
    extra = with_copy["logits_bf16"]["count"] - without["logits_bf16"]["count"]
    return {"without_copy": without, "with_copy": with_copy, "extra_bf16_blocks": extra,
            "passed": extra == 1 and without["complete"] and with_copy["complete"]}


def determinism_spread(rows: list[Row]) -> list[dict[str, Any]]:
    """Each repeated arm's peaks, one per fresh process, and their spread in percent."""
    out = []
    for index in sorted({r.index for r in rows}):
        mine = sorted((r for r in rows if r.index == index), key=lambda r: r.repeat or 0)
        peaks = [r.real_peak if r.measured else None for r in mine]
        nums = [p for p in peaks if p]
        out.append({"row": mine[0], "peaks": peaks, "pids": [r.pid for r in mine],
                    "statuses": [r.status for r in mine],
                    "spread_pct": (max(nums) - min(nums)) / min(nums) * 100 if len(nums) >= 2 else None})
    return out


def derive_shape(config: Any, name: str, key: str = "custom", hub_id: Optional[str] = None,
                 arch: Optional[dict] = None) -> Shape:
    """pool, extras, adapter and dims of any streamable config, by the grid's conventions, on a
    meta skeleton: a bf16 layer is half the pool; extras every other unique parameter (a tied
    head once); ``arch`` keeps the other public fields, so the exact shape can be built."""
    import torch
    from soup_cli.utils.layer_stream import SUPPORTED_STREAM_ARCHS
    from transformers import AutoModelForCausalLM

    model_type = getattr(config, "model_type", "")
    if model_type not in SUPPORTED_STREAM_ARCHS:
        raise UsageError(f"{name}: architecture {model_type!r} cannot be layer-streamed by Soup "
                         f"(it streams {', '.join(SUPPORTED_STREAM_ARCHS)})")
    for attr in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads"):
        value = getattr(config, attr, None)
        if not _whole(value, minimum=1) or value >= 2**31:
            raise UsageError(f"{name}: config {attr} is {value!r}; it must be a whole number from 1 "
                             f"to {2**31 - 1}")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    except Exception as exc:  # a config transformers accepts but cannot build: still one line
        raise UsageError(f"{name}: its config does not build a model ({last_line(exc)})") from None
    layers = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)
                   and len(m) == config.num_hidden_layers), None)
    if layers is None:
        raise UsageError(f"{name}: could not find its {config.num_hidden_layers} decoder layers")
    targets = lora_targets(model_type)
    in_layers = {id(p) for p in layers.parameters()}
    extras = sum(p.numel() * 2 for p in model.parameters() if id(p) not in in_layers)
    adapter = sum(LORA_R * (m.in_features + m.out_features) for n, m in layers.named_modules()
                  if n.split(".")[-1] in targets and isinstance(m, torch.nn.Linear))
    return Shape(key=key, name=name, hub_id=hub_id or name, model_type=model_type,
                 pool=2 * sum(p.numel() for p in layers[0].parameters()) * 2, extras=extras,
                 adapter=adapter * GRID_ADAPTER_FACTOR, vocab=int(config.vocab_size),
                 hidden=int(config.hidden_size), intermediate=int(config.intermediate_size),
                 n_layers=int(config.num_hidden_layers),
                 max_positions=int(getattr(config, "max_position_embeddings", 0) or 0),
                 arch={k: v for k, v in (arch or {}).items() if k not in NOT_ARCH},
                 record=False, targets=targets)


# ---------------------------------------------------------------------------
# The margin map: Soup's contract on every family it streams, bf16 and NF4
# ---------------------------------------------------------------------------

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
#: One public checkpoint per family Soup streams (../shared/FAMILIES.md): its config.json
#: fields and its public parameter count (a tied head once). smol and qwen are the record's.
FAMILIES: dict[str, tuple[str, str, str, dict, int]] = {
    "llama32-1b": ("Llama-3.2-1B", "meta-llama/Llama-3.2-1B", "llama", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
        rms_norm_eps=1e-5, hidden_act="silu"), 1_235_814_400),
    "qwen3-0.6b": ("Qwen3-0.6B", "Qwen/Qwen3-0.6B", "qwen3", dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu",
        attention_bias=False, use_sliding_window=False, sliding_window=None), 596_049_920),
    "mistral-7b": ("Mistral-7B-v0.3", "mistralai/Mistral-7B-v0.3", "mistral", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=32768, tie_word_embeddings=False,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5, hidden_act="silu",
        sliding_window=None), 7_248_023_552),
    "gemma-2b": ("gemma-2b", "google/gemma-2b", "gemma", dict(
        hidden_size=2048, intermediate_size=16384, num_hidden_layers=18, num_attention_heads=8,
        num_key_value_heads=1, head_dim=256, vocab_size=256000, tie_word_embeddings=True,
        max_position_embeddings=8192, rope_theta=10000.0, rms_norm_eps=1e-6,
        hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh"), 2_506_172_416),
    "gemma2-2b": ("gemma-2-2b", "google/gemma-2-2b", "gemma2", dict(
        hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=256000, tie_word_embeddings=True,
        max_position_embeddings=8192, rope_theta=10000.0, rms_norm_eps=1e-6,
        hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, sliding_window=4096,
        query_pre_attn_scalar=256), 2_614_341_888),
    "gemma3-1b": ("gemma-3-1b-pt", "google/gemma-3-1b-pt", "gemma3_text", dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=262144, tie_word_embeddings=True,
        max_position_embeddings=32768, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", sliding_window=512,
        sliding_window_pattern=6, query_pre_attn_scalar=256, final_logit_softcapping=None,
        attn_logit_softcapping=None), 999_885_952),
    "phi-2": ("phi-2", "microsoft/phi-2", "phi", dict(
        hidden_size=2560, intermediate_size=10240, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=51200, tie_word_embeddings=False,
        max_position_embeddings=2048, rope_theta=10000.0, partial_rotary_factor=0.4,
        layer_norm_eps=1e-5, hidden_act="gelu_new", qk_layernorm=False), 2_779_683_840),
    "phi3-mini": ("Phi-3-mini-4k-instruct", "microsoft/Phi-3-mini-4k-instruct", "phi3", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, tie_word_embeddings=False,
        max_position_embeddings=4096, original_max_position_embeddings=4096, rope_theta=10000.0,
        rms_norm_eps=1e-5, hidden_act="silu", sliding_window=2047), 3_821_079_552),
    "llama31-8b": ("Llama-3.1-8B", "meta-llama/Llama-3.1-8B", "llama", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE, factor=8.0),
        rms_norm_eps=1e-5, hidden_act="silu"), 8_030_261_248),
}
MAP_FAMILIES = ("smol", "qwen", "llama32-1b", "qwen3-0.6b", "mistral-7b", "gemma-2b", "gemma2-2b",
                "gemma3-1b", "phi-2", "phi3-mini")
#: Every family --families takes, in the map's order: the default ten, then those only asked for.
ALL_FAMILIES = MAP_FAMILIES + tuple(k for k in FAMILIES if k not in MAP_FAMILIES)
MAP_SEQS, MAP_BATCHES, QUANTS = (2048, 4096, 8192, 16384), (1, 4), ("none", "nf4")
#: Soup's published streamed NF4 peak (Llama-3.1-8B, batch 1 x seq 512; FAMILIES.md): bytes
#: allocated, from its v0.73.1 test docstring (issue #349). The map holds one arm against it.
PUBLISHED_NF4 = {("llama31-8b", "nf4", 512, 1): 3_411_600_000}
#: Fields of a config.json that are not its architecture (the builder sets its own token ids).
NOT_ARCH = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "model_type",
            "architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
            "auto_map", "quantization_config", "use_cache"}


def lora_targets(model_type: str) -> tuple:
    """The protocol's q_proj and v_proj where they exist; Phi-3 fuses them into qkv_proj."""
    return ("qkv_proj",) if model_type == "phi3" else LORA_TARGETS


def family_shape(key: str) -> Shape:
    """A family's shape from its public config alone (the record's two are the record's)."""
    if key in SHAPES:
        return SHAPES[key]
    name, hub_id, model_type, fields_, _ = FAMILIES[key]
    from transformers import AutoConfig

    with quiet_libraries():
        config = AutoConfig.for_model(model_type, **fields_)
    return derive_shape(config, name, key=key, hub_id=hub_id, arch=fields_)


def max_positions(key: str) -> int:
    return SHAPES[key].max_positions if key in SHAPES else FAMILIES[key][3]["max_position_embeddings"]


def plan_map(families: Iterable[str], quants: Iterable[str], seqs: Optional[Iterable[int]],
             batches: Iterable[int]) -> list[Arm]:
    """The map's grid, in order: family, quantization, seq (within the family's max
    positions), batch. Llama-3.1-8B is there for its published NF4 arm, batch 1 x seq 512."""
    arms: list[Arm] = []
    for fam in families:
        published = [k for k in PUBLISHED_NF4 if k[0] == fam]
        for quant in quants:
            grid = seqs or (tuple(sorted({k[2] for k in published if k[1] == quant})) if published
                            else MAP_SEQS)
            for seq in (q for q in grid if q <= max_positions(fam)):
                for batch in (batches if seqs or not published else (1,)):
                    arms.append(Arm(fam, seq, batch, len(arms), quant))
    return arms


def shape_classes(shape: Shape, seq: int, batch: int) -> Callable[[int], str]:
    """Names a block live at the peak by its shape, for the estimator term meant to charge it:
    logits, activations (attention scores, small multiples of hidden or intermediate), rest."""
    elements, tokens = seq * shape.vocab * batch, seq * batch

    def classify(size: int) -> str:
        if logits_kind(size, elements):
            return "logits"
        if size % (seq * seq) == 0 and size // (seq * seq) <= 4 * batch * 64:
            return "activations"  # attention scores: batch x heads x seq^2
        for dim in (shape.intermediate, shape.hidden):
            if size % (tokens * dim) == 0 and size // (tokens * dim) <= 16:
                return "activations"
        return "rest"

    return classify


def estimator_terms(kwargs: dict[str, Any], predicted: int) -> dict[str, int]:
    """Soup's prediction split into its terms, by Soup's own term functions, from the exact
    arguments its pre-flight passed; "rest" is its fixed slack and any term a later Soup adds."""
    from soup_cli.utils import layer_stream as ls

    kw = kwargs
    terms = {
        "weights": kw["layer_bytes"] * kw["buffers"] + kw["extras_bytes"] + kw.get("large_layer_bytes", 0)
        + kw.get("persistent_bytes", 0),
        "logits": int(ls.estimate_logits_bytes(vocab_size=kw["vocab_size"], seq_len=kw["seq_len"],
                                               batch_size=kw.get("batch_size", 1),
                                               bytes_per_element=kw.get("logits_bytes_per_element"))),
        "activations": int(ls.estimate_activation_bytes(
            hidden_size=kw["hidden_size"], intermediate_size=kw["intermediate_size"],
            n_layers=kw["n_layers"], seq_len=kw["seq_len"], batch_size=kw.get("batch_size", 1),
            dtype=kw.get("dtype", "bfloat16"))),
    }
    terms["rest"] = predicted - sum(terms.values())  # optimizer state, slack, anything newer
    return terms


def margin_breakdown(row: Row) -> dict[str, Any]:
    """Where one arm's margin goes: each estimator term against the blocks live at the peak
    that it is meant to charge, and, where the margin is thin, which term misses what."""
    a = row.attribution
    classes, tokens = a.get("classes") or {}, row.seq * row.batch
    measured = {"weights": a["resident_at_peak"], "logits": classes.get("logits", 0),
                "activations": classes.get("activations", 0), "rest": classes.get("rest", 0)}
    charged = estimator_terms(row.soup_terms, row.soup_predicted)
    per = {"logits": (row.elements, "per logits element"), "activations": (tokens, "per token")}
    terms = [{"term": t, "charged": charged[t], "measured": measured[t],
              "missed": measured[t] - charged[t], "per": per.get(t)} for t in charged]
    ratio = row.soup_predicted / row.real_peak
    worst = max(terms, key=lambda t: t["missed"])
    note = None
    if ratio < 1.05 and worst["missed"] > 0:
        unit = worst["per"]
        note = (f"{row.model} {row.quant} seq {row.seq} batch {row.batch}: margin {ratio - 1:+.1%}; the "
                f"{worst['term']} term misses {worst['missed'] / 1e6:.1f} MB"
                + (f" ({worst['missed'] / unit[0]:.2f} bytes {unit[1]}): charging that much more "
                   f"{unit[1]} would cover it" if unit else ""))
    return {"model": row.model, "model_key": row.model_key, "quant": row.quant, "seq": row.seq,
            "batch": row.batch, "real_peak": row.real_peak, "soup_predicted": row.soup_predicted,
            "ratio": ratio, "complete": bool(a.get("complete")), "terms": terms, "note": note}


def thinnest(margins: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of margins attributed in several shards: each family's thinnest, and every UNDER."""
    keep = {}
    for m in margins:
        key = (m["model_key"],) if m["ratio"] >= 1 else (m["model_key"], m["quant"], m["seq"], m["batch"])
        if key not in keep or m["ratio"] < keep[key]["ratio"]:
            keep[key] = m
    return list(keep.values())


def margin_arms(rows: list[Row]) -> list[Arm]:
    """The arms worth attributing: the tightest measured row of each family, and every UNDER."""
    picked: dict[int, Row] = {}
    for fam in dict.fromkeys(r.model_key for r in rows):
        measured = [r for r in rows if r.model_key == fam and r.measured and r.soup_predicted]
        if measured:
            tight = min(measured, key=lambda r: r.margin_ratio)
            picked[tight.index] = tight
    picked.update({r.index: r for r in rows if r.status == "UNDER"})
    return [Arm(r.model_key, r.seq, r.batch, r.index, r.quant) for _, r in sorted(picked.items())]


# ===========================================================================
# What follows is not the protocol: the models, the scratch folder, the console,
# the tables, the outputs, spreading arms over processes, and the CLI.
# ===========================================================================

# ---------------------------------------------------------------------------
# The models: architecture-exact checkpoints, built here, verified before use
# ---------------------------------------------------------------------------

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Each becomes one token, with and without its leading space ("Ġ" in byte-level BPE).
TOKEN_WORDS = ("word", "hi", "user", "assistant", "system")
BUILDER_VERSION = 5


def hf_config(shape: Shape, eos_id: int = 2, pad_id: int = 0) -> Any:
    """The transformers config of exactly the grid's shape, with the tokenizer's ids."""
    from transformers import AutoConfig

    kwargs = dict(tie_word_embeddings=True, hidden_act="silu") if shape.record else {}
    kwargs.update({k: v for k, v in shape.arch.items() if k not in NOT_ARCH})
    config = AutoConfig.for_model(
        shape.model_type, vocab_size=shape.vocab, hidden_size=shape.hidden,
        intermediate_size=shape.intermediate, num_hidden_layers=shape.n_layers,
        max_position_embeddings=shape.max_positions, bos_token_id=None, eos_token_id=eos_id,
        pad_token_id=pad_id, **kwargs)
    rope = getattr(config, "rope_parameters", None)  # transformers 5 keeps rope_theta here
    if isinstance(rope, dict) and "rope_theta" in shape.arch:
        rope["rope_theta"] = shape.arch["rope_theta"]
    config.dtype = "bfloat16"
    return config


def build_tokenizer(dest: Path) -> dict[str, int]:
    """A byte-level BPE tokenizer in Qwen2's own layout: transformers 5 rebuilds a Qwen2 one with
    its own pre-tokenizer whatever tokenizer.json says, so writing exactly that makes every
    family load it alike, and every ``word`` of a row is one token."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab: dict[str, int] = {}
    for ch in bytes_to_unicode().values():
        vocab.setdefault(ch, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in TOKEN_WORDS:
        acc = word[0]
        for ch in word[1:]:
            if acc + ch not in vocab:
                merges.append((acc, ch))
                vocab[acc + ch] = len(vocab)
            acc += ch
        merges.append(("\u0120", word))  # ranked after the word's chain: " word" is one token
        vocab["\u0120" + word] = len(vocab)
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    regex = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
             r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    tk = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=None, continuing_subword_prefix="",
                       end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    ).save_pretrained(str(dest))
    return {tok: vocab[tok] for tok in SPECIAL_TOKENS}


def prepare_checkpoint(shape: Shape, dest: Path) -> Callable[[], dict[str, Any]]:
    """A bf16 checkpoint of ``shape``: tokenizer and config now; the returned call writes the
    weights and returns their manifest. That call may run in a thread beside a measured arm, so
    it touches no global torch state (from_config sets the default dtype: the skeleton is made
    here). Weights are small random values, never zeros (a zero model can take shortcuts)."""
    import torch
    from transformers import AutoModelForCausalLM

    dest.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(dest)
    config = hf_config(shape, eos_id=ids["<|im_end|>"], pad_id=ids["<|endoftext|>"])
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tied = bool(getattr(config, "tie_word_embeddings", True))
    plan = [(name, tuple(p.shape)) for name, p in skeleton.state_dict().items()
            if not (tied and name == "lm_head.weight")]  # a tied head is the embedding
    # Gemma scales by (1 + weight): its neutral norm is zeros; everyone else's is ones.
    norm_value = 0.0 if shape.model_type.startswith("gemma") else 1.0
    config.save_pretrained(str(dest))
    del skeleton

    def write_weights() -> dict[str, Any]:
        from safetensors.torch import save_file

        gen = torch.Generator().manual_seed(395)
        # One random pool tiled from a moving offset, not half a billion normals one by one.
        size = 1 << 20
        pool = (torch.randn(2 * size, generator=gen, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        tensors: dict[str, Any] = {}
        for i, (name, dims) in enumerate(plan):
            n = math.prod(dims)
            if "norm" in name:
                tensors[name] = torch.full(dims, norm_value, dtype=torch.bfloat16)
            else:
                offset = (i * 7919) % size
                tensors[name] = pool[offset:offset + size].repeat(-(-n // size))[:n].view(dims).contiguous()
        save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
        return {"file_bytes": (dest / "model.safetensors").stat().st_size,
                "tensors": {k: ["BF16", list(t.shape)] for k, t in tensors.items()}}

    return write_weights


def checkpoint_fingerprint(shape: Shape) -> str:
    """Names a built checkpoint by everything that shapes it, so a cache is never stale."""
    fields_ = {k: v for k, v in asdict(shape).items() if k not in ("name", "hub_id")}
    fields_.update(tokenizer_words=TOKEN_WORDS, builder=BUILDER_VERSION)
    return hashlib.sha256(json.dumps(fields_, sort_keys=True).encode()).hexdigest()[:12]


def safetensors_problem(path: Path, manifest: Optional[dict] = None) -> Optional[str]:
    """Why a safetensors file cannot be trusted (None if it holds): its header must parse,
    its tensors must fill the file exactly, and they must match the manifest if given."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if n <= 0 or 8 + n > size:
                return f"{path.name}: truncated header"
            header = json.loads(fh.read(n))
    except (OSError, ValueError) as exc:
        return f"{path.name}: {exc.__class__.__name__}"
    header.pop("__metadata__", None)
    ends = [int(t["data_offsets"][1]) for t in header.values()] or [0]
    if 8 + n + max(ends) != size:
        return f"{path.name}: {size} bytes, its header describes {8 + n + max(ends)}"
    if manifest is not None:
        found = {k: [t["dtype"], list(t["shape"])] for k, t in header.items()}
        if found != manifest["tensors"] or size != manifest["file_bytes"]:
            return f"{path.name}: tensors differ from the shape it was built for"
    return None


def checkpoint_problem(dest: Path) -> Optional[str]:
    """Why a cached synthetic checkpoint cannot be used (None if it can)."""
    try:
        manifest = json.loads((dest / ".complete").read_text())
    except (OSError, ValueError):
        return "no completion marker"
    for name in ("config.json", "tokenizer.json"):
        if not (dest / name).is_file():
            return f"{name} is missing"
    return safetensors_problem(dest / "model.safetensors", manifest)


def synthetic_checkpoint(shape: Shape, root: Path) -> tuple[Path, float]:
    """The built checkpoint of ``shape`` under ``root`` and the seconds spent building it."""
    started = time.perf_counter()
    dest, building = start_checkpoint(shape, root)
    return dest, 0.0 if building is None else time.perf_counter() - started


def start_checkpoint(shape: Shape, root: Path,
                     writer: Any = None) -> tuple[Path, Optional[Callable[[], Path]]]:
    """The checkpoint of ``shape`` under ``root``, and None if it verified, else a call that waits
    for its weights (written by ``writer``, an executor, when given); a damaged one is rebuilt."""
    dest = root / f"{shape.key}-{checkpoint_fingerprint(shape)}"
    problem = checkpoint_problem(dest) if dest.exists() else None
    if dest.exists() and problem is None:
        return dest, None
    if problem:
        print(f"note: cached checkpoint {dest} is damaged ({problem}); rebuilding it",
              file=sys.stderr, flush=True)
    partial = root / f".{dest.name}.partial-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    write = prepare_checkpoint(shape, partial)

    def finish() -> Path:
        (partial / ".complete").write_text(json.dumps(write()))
        if dest.exists() and checkpoint_problem(dest) is not None:
            shutil.rmtree(dest, ignore_errors=True)
        try:
            partial.rename(dest)
        except OSError:  # another process built the same checkpoint first: theirs is as good
            shutil.rmtree(partial, ignore_errors=True)
        return dest

    if writer is None:
        finish()
        return dest, lambda: dest
    return dest, writer.submit(finish).result


class Checkpoints:
    """Where each model's weights come from: synthetic ones built by a thread one model ahead,
    overlapping this model's arms. Without --cache-dir a model's checkpoint and shards go once
    its last arm is done: the map's families would not fit a GPU box's disk together."""

    def __init__(self, keys: list[str], shapes: dict[str, Shape], run: "Run", scratch: "Scratch"):
        self.shapes, self.run, self.scratch, self.keys = shapes, run, scratch, keys
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        self.paths: dict[str, str] = {}
        self.pending: dict[str, tuple[Callable[[], Path], float]] = {}
        self.build_s: dict[str, float] = {}
        reap_dead_partials(scratch.checkpoint_root())
        self.start(keys[0] if keys else None)

    def start(self, key: Optional[str]) -> None:
        if key is not None and key != "custom" and self.run.weights == "synthetic" \
                and key not in self.pending and key not in self.paths:
            started = time.perf_counter()
            dest, building = start_checkpoint(self.shapes[key], self.scratch.checkpoint_root(), self.writer)
            if building is None:
                self.paths[key] = str(dest)  # cached: nothing is built, nothing is timed
            else:
                self.pending[key] = (building, started)

    def release(self, key: str) -> None:
        """A model's built checkpoint and Soup's shards of it, gone (scratch only)."""
        from soup_cli.utils.layer_shard import resolve_shard_dir

        path = self.paths.pop(key, None)
        if path and not self.run.cache_dir and Path(path).is_relative_to(self.scratch.root):
            shutil.rmtree(resolve_shard_dir(path), ignore_errors=True)
            for quant in QUANTS[1:]:  # only the aliases its arms made
                alias = quant_alias(self.scratch, path, quant)
                if os.path.lexists(alias):
                    shutil.rmtree(resolve_shard_dir(str(alias)), ignore_errors=True)
                    alias.unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)
        self.paths[key] = ""  # never rebuilt in this run

    def get(self, key: str) -> str:
        self.start(key)
        following = self.keys[self.keys.index(key) + 1:] if key in self.keys else []
        if following:
            self.start(following[0])  # one model ahead, built while this one's arms run
        if self.paths.get(key):
            return self.paths[key]
        if key in self.pending:
            wait, started = self.pending.pop(key)
            path = wait()
            self.build_s[key] = round(time.perf_counter() - started, 2)
        elif key == "custom" and config_only(self.run.custom_model):
            path, self.build_s[key] = synthetic_checkpoint(self.shapes[key], self.scratch.checkpoint_root())
        elif key == "custom":
            model = self.run.custom_model
            path = Path(model).resolve() if Path(model).exists() else hub_snapshot(model, self.scratch)
        else:
            path = hub_snapshot(self.shapes[key].hub_id, self.scratch)
        self.paths[key] = str(path)
        return self.paths[key]

    def close(self) -> None:
        self.writer.shutdown(wait=True, cancel_futures=True)
        for partial in self.scratch.checkpoint_root().glob(f".*.partial-{socket.gethostname()}-{os.getpid()}"):
            shutil.rmtree(partial, ignore_errors=True)  # a build cancelled before it ran


def reap_dead_partials(root: Path) -> None:
    """Half-built checkpoints whose builder is gone (SIGKILL runs no clean-up) are removed."""
    for folder in root.glob(".*.partial-*"):
        m = re.fullmatch(r"\..+?\.partial-(?:(.+)-)?(\d+)", folder.name)
        if not m or m.group(1) not in (None, socket.gethostname()) or not folder.is_dir() \
                or folder.is_symlink():
            continue
        try:
            os.kill(int(m.group(2)), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:
            pass


def hub_snapshot(repo_id: str, scratch: "Scratch") -> Path:
    """A hub checkpoint fetched into scratch (or --cache-dir), so Soup reads a local folder:
    Soup's own hub path would cache the weights under ~/.soup, outside scratch."""
    from huggingface_hub import snapshot_download

    root = (scratch.cache_dir / "hub") if scratch.cache_dir else scratch.path("hub")
    try:
        return Path(snapshot_download(repo_id, local_dir=str(root / repo_id.replace("/", "--")),
                                      allow_patterns=["*.safetensors", "*.json", "*.txt", "*.model",
                                                      "*.jinja"]))
    except Exception as exc:
        raise UsageError(f"cannot fetch {repo_id} from the hub ({last_line(exc)}); "
                         "--weights synthetic builds the same shapes with no network") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def config_only(model: str) -> Optional[Path]:
    """The config.json that --model names when it brings no weights (a config.json, or a
    folder holding one and no safetensors): synthetic weights are built from it."""
    path = Path(model)
    if path.is_file():
        return path
    if path.is_dir() and (path / "config.json").is_file() and not any(path.glob("*.safetensors")):
        return path / "config.json"
    return None


def load_custom_shape(model: str) -> Shape:
    """--model's figures from its config (a checkpoint folder, a config.json, or a hub id); what
    Soup cannot stream or this tool cannot run is refused in one line, before anything is built."""
    from transformers import AutoConfig

    path, config_file = Path(model), config_only(model)
    synthetic = config_file is not None  # weights will be built from this config
    if path.exists() and config_file is None:
        if not path.is_dir() or not (path / "config.json").is_file():
            raise UsageError(f"--model {model}: not a checkpoint folder (no config.json)")
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise UsageError(f"--model {model}: no tokenizer in it (none of "
                             f"{', '.join(TOKENIZER_FILES)}); the protocol's rows need one")
        config_file = path / "config.json"
    if config_file is None:  # a hub id
        with quiet_libraries():
            try:
                config = AutoConfig.from_pretrained(model)
            except Exception as exc:
                raise UsageError(f"--model {model}: cannot read its config ({last_line(exc)})") from None
        return derive_shape(config, name=model)
    try:
        fields_ = json.loads(config_file.read_text(encoding="utf-8"))
        if not isinstance(fields_, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError, RecursionError) as exc:
        raise UsageError(f"--model {model}: {config_file.name} cannot be read ({last_line(exc)})") from None
    from soup_cli.utils.layer_stream import SUPPORTED_STREAM_ARCHS

    model_type = fields_.get("model_type")
    if model_type not in SUPPORTED_STREAM_ARCHS:
        raise UsageError(f"--model {model}: architecture {model_type!r} cannot be layer-streamed by Soup "
                         f"(it streams {', '.join(SUPPORTED_STREAM_ARCHS)})")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if not _whole(fields_.get(key), minimum=1):
            raise UsageError(f"--model {model}: {config_file.name} has {key} {fields_.get(key)!r}; it must "
                             "be a whole number >= 1")
    with quiet_libraries():
        try:
            config = AutoConfig.for_model(model_type, **{k: v for k, v in fields_.items() if k != "model_type"})
        except Exception as exc:
            raise UsageError(f"--model {model}: {config_file.name} is not a {model_type} config "
                             f"({last_line(exc)})") from None
    shape = derive_shape(config, name=model, arch=fields_)
    if synthetic and shape.vocab < 300:
        raise UsageError(f"--model {model}: vocab_size {shape.vocab} is smaller than the synthetic "
                         "tokenizer's 300 tokens")
    return shape


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """A config's warnings and the hub client's retries are not this tool's one line."""
    from transformers.utils import logging as hf_logging

    verbosity, hub = hf_logging.get_verbosity(), logging.getLogger("huggingface_hub")
    level = hub.level
    hf_logging.set_verbosity_error()
    hub.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hub.setLevel(level)


# ---------------------------------------------------------------------------
# Scratch: everything the tool writes outside its outputs, removed at exit
# ---------------------------------------------------------------------------

SCRATCH_PREFIX = "issue395-scratch-"


def process_start(pid: int) -> Optional[str]:
    """A process's start time (Linux), so a reused pid is not taken for the owner."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_alive(folder: Path) -> bool:
    """Whether the run that made a scratch folder still runs: its pid is in the name, its
    start time in the folder's owner file."""
    m = re.match(rf"{SCRATCH_PREFIX}(\d+)-", folder.name)
    if not m:
        return True  # not ours to judge
    pid = int(m.group(1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        started = (folder / "owner").read_text().split()[1]
    except (OSError, IndexError):
        return True  # still being made
    return process_start(pid) in (None, started)


def reap_dead_scratch(tmp: Path) -> None:
    """Remove scratch left by killed runs (SIGKILL runs no clean-up); a running run's stays."""
    for folder in tmp.glob(SCRATCH_PREFIX + "*"):
        if folder.is_dir() and not folder.is_symlink() and not owner_alive(folder):
            shutil.rmtree(folder, ignore_errors=True)


class Scratch:
    """One folder for data, Soup output, shards and checkpoints; removed at exit. Soup ignores
    its cache variable outside $HOME, the working directory and $TMPDIR, so the root it really
    resolves is checked: a shard cache escaped to ~/.soup would outlive the run."""

    def __init__(self, cache_dir: Optional[str] = None):
        self.cache_dir = Path(cache_dir).resolve() if cache_dir else None
        self.root: Optional[Path] = None
        self._saved: dict[str, Optional[str]] = {}

    def __enter__(self) -> "Scratch":
        tmp = Path(tempfile.gettempdir())
        reap_dead_scratch(tmp)
        self.root = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=tmp))
        (self.root / "owner").write_text(f"{os.getpid()} {process_start(os.getpid())}\n")
        self.shard_root = (self.cache_dir or self.root) / "layer-stream"
        self.shard_root.mkdir(parents=True, exist_ok=True)
        env = {"SOUP_LAYER_STREAM_CACHE_DIR": str(self.shard_root),
               "SOUP_AUDIT_LOG_PATH": str(self.root / "soup-audit.jsonl"),
               "HF_HOME": str(self.root / "hf"), "HF_DATASETS_CACHE": str(self.root / "hf" / "datasets"),
               "XDG_CACHE_HOME": str(self.root / "xdg"), "TRITON_CACHE_DIR": str(self.root / "triton"),
               "TORCHINDUCTOR_CACHE_DIR": str(self.root / "inductor"),
               "MPLCONFIGDIR": str(self.root / "mpl"),
               # An unreachable hub should fail fast, not retry for half a minute.
               "HF_HUB_ETAG_TIMEOUT": os.environ.get("HF_HUB_ETAG_TIMEOUT", "10"),
               "HF_HUB_DOWNLOAD_TIMEOUT": os.environ.get("HF_HUB_DOWNLOAD_TIMEOUT", "20")}
        self._saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        return self

    def __exit__(self, *exc: Any) -> None:
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    def path(self, *parts: str) -> Path:
        assert self.root is not None
        p = self.root.joinpath(*parts)
        p.mkdir(parents=True, exist_ok=True)
        return p

    def checkpoint_root(self) -> Path:
        root = (self.cache_dir or self.root) / "checkpoints"
        root.mkdir(parents=True, exist_ok=True)
        return root

    def verify_shard_root(self) -> None:
        """Fail loudly if Soup would put its shard cache anywhere but here."""
        real = os.path.realpath(soup_shard_root())
        if real != os.path.realpath(self.shard_root):
            raise UsageError(f"Soup would write its layer-stream shard cache to {real}, not "
                             f"{self.shard_root}: --cache-dir must lie under $HOME, the working "
                             "directory or the temp dir")

    @contextlib.contextmanager
    def sharding(self, base: str) -> Iterator[None]:
        """Processes sharing a shard cache must not shard one model at once: until its shards are
        cached, a model's first arm holds a lock on them; once they are, nobody waits."""
        import fcntl

        from soup_cli.utils.layer_shard import resolve_shard_dir

        folder = Path(resolve_shard_dir(base))
        if (folder / "index.json").exists():
            yield
            return
        with open(self.shard_root / f".{folder.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def repair_shards(self, base: str) -> None:
        """A cached shard set that cannot be read is removed, so Soup re-shards it: Soup itself
        checks only that its shard files exist."""
        from soup_cli.utils.layer_shard import resolve_shard_dir

        folder = Path(resolve_shard_dir(base))
        if not (folder / "index.json").exists():
            return  # nothing cached, or another process is sharding it now (Soup writes index.json last)
        problems = [p for p in (safetensors_problem(f) for f in sorted(folder.glob("*.safetensors"))) if p]
        try:
            json.loads((folder / "index.json").read_text())
        except (OSError, ValueError):
            problems.append("index.json cannot be read")
        if problems:
            print(f"note: Soup's cached shards in {folder} are damaged ({problems[0]}); "
                  "removing them so Soup shards again", file=sys.stderr, flush=True)
            shutil.rmtree(folder, ignore_errors=True)


def soup_shard_root(override: Optional[str] = None) -> str:
    """Where Soup will really put its shard cache, by Soup's own resolution; with
    ``override``, where it would were SOUP_LAYER_STREAM_CACHE_DIR that folder."""
    from soup_cli.utils import layer_shard
    from soup_cli.utils.paths import is_under

    key = "SOUP_LAYER_STREAM_CACHE_DIR"
    saved = os.environ.get(key)
    if override is not None:
        os.environ[key] = override
    try:
        return layer_shard._resolve_cache_root(None, is_under)
    finally:
        if override is not None:
            os.environ.pop(key, None) if saved is None else os.environ.__setitem__(key, saved)


# ---------------------------------------------------------------------------
# Soup's console: its panels and bars go to a per-arm log, so stdout holds the tables
# ---------------------------------------------------------------------------


class StampedLog:
    """A log whose lines carry seconds since the arm began: where setup time goes."""

    def __init__(self, raw: Any):
        self.raw, self.t0, self.at_line_start = raw, time.perf_counter(), True

    def write(self, text: str) -> int:
        for piece in text.splitlines(keepends=True):
            if self.at_line_start:
                self.raw.write(f"[{time.perf_counter() - self.t0:8.3f}s] ")
            self.raw.write(piece)
            self.at_line_start = piece.endswith(("\n", "\r"))
        return len(text)

    def flush(self) -> None:
        self.raw.flush()

    def isatty(self) -> bool:
        return False


LIBRARY_LOGGERS = ("transformers", "trl", "peft", "datasets", "accelerate", "soup_cli",
                   "huggingface_hub", "torch", "py.warnings")
SOUP_MODULES = ("datasets", "peft", "trl", "soup_cli.config.loader", "soup_cli.data.loader", "soup_cli.trainer.sft",
                "soup_cli.trainer.stream_setup", "soup_cli.utils.layer_stream",
                "soup_cli.utils.layer_stream_runtime", "soup_cli.data.sft_format")


@contextlib.contextmanager
def soup_console(log_path: Path, verbose: bool) -> Iterator[None]:
    """Rich consoles and logging handlers bind their stream when created, so a plain stdout
    redirect would miss them: each is pointed at the log too."""
    for name in SOUP_MODULES:  # imported first, so their consoles exist to be redirected
        importlib.import_module(name)
    if verbose:
        yield
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as raw:
        fh = StampedLog(raw)
        consoles = {id(c): (c, c._file) for m, mod in list(sys.modules.items())
                    if m.startswith("soup_cli") and hasattr(c := getattr(mod, "console", None), "_file")}
        handler = logging.StreamHandler(fh)
        saved = []
        for name in ("",) + LIBRARY_LOGGERS:
            lg = logging.getLogger(name)
            saved.append((lg, lg.handlers[:], lg.propagate))
            lg.handlers, lg.propagate = [handler], not name
        try:
            for con, _ in consoles.values():
                con.file = fh
            with contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
                yield
        finally:
            for con, original in consoles.values():
                con._file = original  # rich keeps None ("stdout at print time") here
            for lg, handlers, propagate in saved:
                lg.handlers, lg.propagate = handlers, propagate


class Stop:
    """Ctrl-C stops after the arm in flight; a second Ctrl-C, or SIGTERM, stops now (by
    KeyboardInterrupt, so the scratch folder is removed and the rows so far are kept)."""

    requested = False

    @classmethod
    def install(cls, quiet: bool = False) -> None:
        def on_int(signum: int, frame: Any) -> None:
            if cls.requested:
                raise KeyboardInterrupt
            cls.requested = True
            if not quiet:  # sys.stderr may be an arm's Soup log now; the user must see this
                print("\ninterrupt: stopping after the arm in flight (Ctrl-C again to stop now)",
                      file=sys.__stderr__, flush=True)

        def on_term(signum: int, frame: Any) -> None:
            cls.requested = True
            raise KeyboardInterrupt

        with contextlib.suppress(ValueError):  # not the main thread
            signal.signal(signal.SIGINT, on_int)
            signal.signal(signal.SIGTERM, on_term)


class Progress:
    """A live bar with the time left on stderr when it is a terminal (rich comes with Soup);
    otherwise one line per finished arm: i/n, the arm, its status and peak, time left."""

    def __init__(self, total: int, started: float):
        self.total, self.started, self.done, self.bar = total, started, 0, None
        if sys.stderr.isatty() and total > 1:
            with contextlib.suppress(ImportError):
                from rich.console import Console
                from rich.progress import (BarColumn, MofNCompleteColumn, Progress as Bar,
                                           TextColumn, TimeElapsedColumn, TimeRemainingColumn)

                self.bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TimeElapsedColumn(), TimeRemainingColumn(),
                               console=Console(file=sys.__stderr__), transient=True)
                self.task = self.bar.add_task("arms", total=total)
                self.bar.start()

    def arm(self, row: Row) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.started
        peak = f"{row.real_peak / GB:.4f} GB" if row.measured else "no peak"
        what = f"{row.model} {row.quant + ' ' if row.quant != 'none' else ''}seq {row.seq} batch {row.batch}"
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done, description=f"{what}: {row.status}, {peak}")
            return
        left = elapsed / max(self.done, 1) * max(self.total - self.done, 0)
        print(f"[arm {self.done}/{self.total}] {what}: {row.status}, {peak}; elapsed {elapsed:.1f} s, "
              f"~{left:.0f} s left", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# ---------------------------------------------------------------------------
# A run's result: rows and mode results, one JSON round trip, one way to merge
# ---------------------------------------------------------------------------

#: What must agree for two results to merge into one table: the same stack and protocol.
STACK_KEYS = ("gpu", "driver", "cuda", "torch", "transformers", "trl", "peft", "soup_cli", "python",
              "weights", "dry_run")


@dataclass
class Result:
    environment: dict
    rows: list = field(default_factory=list)  # Row, in grid order
    measure: Optional[dict] = None
    sdpa: Optional[dict] = None
    control: Optional[dict] = None
    interrupted: bool = False
    error: Optional[str] = None
    timings: dict = field(default_factory=dict)
    kind: str = "sweep"  # or "map"
    margins: list = field(default_factory=list)  # the map: where the thinnest margins go

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return EXIT_INTERRUPTED
        if any(r.status in ("VOID", "OOM", "FAILED", "UNDER") for r in self.rows):
            return EXIT_FINDING
        if self.error or (self.control is not None and not self.control.get("passed")):
            return EXIT_FINDING
        return EXIT_OK

    def to_json(self) -> dict[str, Any]:
        return {"tool": "issue395_second_stack_vram", "schema": SCHEMA,
                **{f.name: getattr(self, f.name) for f in fields(self)},
                "rows": [r.to_json() for r in self.rows], "exit_code": self.exit_code}

    @classmethod
    def from_json(cls, data: Any) -> "Result":
        if not isinstance(data, dict) or not isinstance(data.get("environment"), dict) \
                or not isinstance(data.get("rows"), list):
            raise ValueError("not a result this tool wrote")
        if data.get("schema") not in (1, SCHEMA):
            raise ValueError(f"schema {data.get('schema')!r} is not one this version reads "
                             f"(1 or {SCHEMA})")
        rows = [Row.from_json(r if data["schema"] == SCHEMA else schema1_row(r)) for r in data["rows"]]
        if data["schema"] == 1 and data.get("determinism"):
            rows += [Row.from_json(schema1_row(dict(r, repeat=r.get("repeat", 0) + 1)))
                     for a in data["determinism"].get("arms", []) for r in a.get("rows", [])]
        env = data["environment"]
        if data["schema"] == 1:
            env = dict(env, arms=env.get("isolation"), dry_run=any(r.dry_run for r in rows))
        missing = [k for k in ("torch", "transformers", "trl", "peft", "soup_cli", "weights") if k not in env]
        if missing:
            raise ValueError(f"its environment has no {missing[0]!r}")
        return cls(environment=env, rows=sorted(rows, key=row_order),
                   measure=data.get("measure"), sdpa=data.get("sdpa"), control=data.get("control"),
                   interrupted=bool(data.get("interrupted")), error=data.get("error"),
                   timings=data.get("timings") or {}, kind=data.get("kind") or "sweep",
                   margins=data.get("margins") or [])


def row_order(row: Row) -> tuple[int, int, int]:
    return (row.repeat is not None, row.index, row.repeat or 0)


def schema1_row(old: dict[str, Any]) -> dict[str, Any]:
    """A row as schema 1 (the first H200 results) stored it, in this version's fields."""
    if not isinstance(old, dict):
        return old
    elements = old.get("elements") or 0
    per = old["seq"] * old["batch"] if _whole(old.get("seq"), 1) and _whole(old.get("batch"), 1) else 0
    repeat = old.get("repeat") if old.get("repeat") else None
    return {"model": old.get("model"), "model_key": old.get("model_key"), "seq": old.get("seq"),
            "batch": old.get("batch"), "index": old.get("index"), "predicted": old.get("predicted"),
            "logits14": old.get("logits14_bytes"), "vocab": elements // per if per else None,
            "loss_bytes_per_element": (old["logits12_bytes"] / elements) if elements else None,
            "repeat": repeat, "dry_run": bool(old.get("dry_run")),
            "realised_width": old.get("realised_width", old.get("realised")),
            "realised_rows": old.get("realised_rows") or [], "real_peak": old.get("real_peak"),
            "resident": old.get("resident_before_step"), "reserved": old.get("max_reserved"),
            "failure": old.get("error_kind"), "error": old.get("error"),
            "oom_request": old.get("oom_request_bytes"), "teardown_error": old.get("teardown_error"),
            "record_peak": old.get("record_a10g_peak"), "attribution": old.get("attribution"),
            "base": old.get("base"), "gpu": old.get("gpu"), "pid": old.get("pid"),
            "log": old.get("log"), "timings": old.get("timings") or {}}


def merge(results: list[Result], arms_label: Optional[str] = None) -> Result:
    """Shards of one run into one result, in grid order. Two stacks or protocols never merge:
    a table mixing them would compare what cannot be compared."""
    first = results[0].environment
    if len({r.kind for r in results}) > 1:
        raise UsageError("cannot merge a map with a sweep")
    for other in results[1:]:
        for key in STACK_KEYS:
            if other.environment.get(key) != first.get(key):
                raise UsageError(f"cannot merge results of different stacks or protocols: {key} is "
                                 f"{first.get(key)!r} in one and {other.environment.get(key)!r} in another")
    rows = [r for res in results for r in res.rows]
    if results[0].kind == "map":  # maps of different families merge too: by the map's own order
        order = {f: i for i, f in enumerate(ALL_FAMILIES)}
        rows.sort(key=lambda r: (order.get(r.model_key, len(order)), QUANTS.index(r.quant), r.seq, r.batch))
        seen = [(r.model_key, r.quant, r.seq, r.batch) for r in rows]
    else:
        rows.sort(key=row_order)
        seen = [(r.index, r.repeat) for r in rows]
    if len(set(seen)) != len(seen):
        raise UsageError("cannot merge: the same arm appears in two results (overlapping shards?)")
    one = lambda name: next((getattr(r, name) for r in results if getattr(r, name)), None)  # noqa: E731
    controls = [r.control for r in results if r.control]
    env = dict(first, arms=arms_label or first.get("arms"))
    return Result(environment=env, rows=rows, measure=one("measure"), sdpa=one("sdpa"),
                  control=next((c for c in controls if not c.get("passed")), one("control")),
                  interrupted=any(r.interrupted for r in results), error=one("error"),
                  timings={"parts": [r.timings for r in results]}, kind=results[0].kind,
                  margins=thinnest([m for r in results for m in r.margins]) if results[0].kind == "map"
                  else [m for r in results for m in r.margins])


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
    return {"gpu": torch.cuda.get_device_name(0) if cuda else None, "driver": driver,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cuda": torch.version.cuda if torch else None,
            "torch": torch.__version__ if torch else package_version("torch"), **{k.replace("-", "_"): package_version(k) for k in
                                            ("transformers", "trl", "peft", "soup-cli")},
            "python": platform.python_version(), "platform": platform.platform(), "weights": weights,
            "dry_run": dry_run, "arms": arms, "command": " ".join(argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


# ---------------------------------------------------------------------------
# Tables: plain rows of cells, printed through one fixed-width helper
# ---------------------------------------------------------------------------


def table(columns: list[tuple[str, int]], rows: list[list[str]], indent: str = "") -> list[str]:
    """Fixed-width lines; a negative width left-aligns that column."""
    def line(cells: list[str]) -> str:
        return indent + "  ".join(f"{c:<{-w}}" if w < 0 else f"{c:>{w}}"
                                  for c, (_, w) in zip(cells, columns, strict=True))
    head = line([name for name, _ in columns])
    return [head, indent + "-" * (len(head) - len(indent))] + [line(r) for r in rows]


def gb(v: Optional[float], places: int = 4) -> str:
    return "-" if v is None else f"{v / GB:.{places}f}"


def ratio(v: Optional[float], places: int = 3) -> str:
    return "-" if v is None else f"{v:.{places}f}x"


def models_in(rows: list[Row]) -> list[str]:
    return list(dict.fromkeys(r.model for r in rows))


SWEEP_COLUMNS = [("seq", 6), ("realised", 8), ("batch", 5), ("predicted GB", 12), ("real peak GB", 13),
                 ("pred/real", 9), ("A10G peak GB", 12), ("vs A10G", 8), ("14xE GB", 8),
                 ("non-logits GB", 13), ("over-est", 8), ("copy fits", 9), ("status", 7)]
SWEEP_LEGEND = ("14xE: Soup's logits charge (E = seq x vocab x batch); non-logits: predicted - 14xE; "
                "over-est: non-logits / (real peak - 12xE); copy fits: would a retained bf16 logits "
                "copy fit under the real peak (14xE <= real peak)")


def peak_cell(r: Row) -> str:
    """The real peak, or why there is none: a row with no measurement never shows a figure."""
    return gb(r.real_peak) if r.measured else r.status if r.failure else "n/a (dry run)" if r.dry_run else "-"


def sweep_cells(r: Row) -> list[str]:
    void = "VOID" if r.status == "VOID" else None
    real = peak_cell(r)
    flag = r.retained_copy_would_fit
    return [str(r.seq), "-" if r.realised is None else str(r.realised), str(r.batch), gb(r.predicted),
            real, void or ratio(r.pred_over_real), gb(r.record_peak), void or ratio(r.vs_record),
            gb(r.logits14, 3), gb(r.nonlogits_modelled, 3), void or ratio(r.nonlogits_overestimate),
            "-" if flag is None else ("yes" if flag else "no"), r.status]


def sweep_table(rows: list[Row]) -> str:
    """One section per model; seq and realised lead, as in the record."""
    out = []
    for model in models_in(rows):
        out.append(f"{model}  (predicted: Soup's estimator; real peak: measured here; A10G: the record)")
        out += table(SWEEP_COLUMNS, [sweep_cells(r) for r in rows if r.model == model]) + [""]
    out += [SWEEP_LEGEND, overestimate_line(rows)]
    notes = [f"  {r.model} seq {r.seq} batch {r.batch}: {r.status} - {r.error or ''}"
             + (f" (asked for {r.oom_request / GB:.2f} GB)" if r.oom_request else "")
             for r in rows if r.failure]
    notes += [f"  {r.model} seq {r.seq} batch {r.batch}: UNDER by Soup's own pre-flight in this setup "
              f"({gb(r.soup_predicted)} GB, {ratio(r.margin_ratio)} of the real peak); pred/real above "
              f"is the grid-convention estimate ({ratio(r.pred_over_real)})"
              for r in rows if r.status == "UNDER" and r.pred_over_real >= 1]
    notes += [f"  {r.model} seq {r.seq}: teardown error (measurement kept): {r.teardown_error}"
              for r in rows if r.teardown_error]
    notes += [f"  {r.model} seq {r.seq} batch {r.batch}: VOID - realised {list(r.realised_rows)} "
              f"(width {r.realised_width}) != requested {r.seq}; no ratio is printed for it"
              for r in rows if r.status == "VOID"]
    return "\n".join(out + (["notes:"] + notes if notes else []))


def overestimate_summary(rows: list[Row]) -> Optional[dict[str, Any]]:
    vals = [r.nonlogits_overestimate for r in rows if r.nonlogits_overestimate is not None]
    return {"n": len(vals), "mean": statistics.fmean(vals),
            "pstdev": statistics.pstdev(vals)} if vals else None


def overestimate_line(rows: list[Row]) -> str:
    s, rec = overestimate_summary(rows), RECORD_A10G_OVERESTIMATE
    if s is None:
        return (f"non-logits over-estimate: no measured rows (record: mean {rec['mean']:.3f}x, "
                f"pstdev {rec['pstdev']:.4f})")
    return (f"non-logits over-estimate over {s['n']} measured rows: mean {s['mean']:.3f}x, population "
            f"stdev {s['pstdev']:.4f} (record, 10 rows: mean {rec['mean']:.3f}x, pstdev {rec['pstdev']:.4f})")


def attribution_table(rows: list[Row], control: Optional[dict[str, Any]]) -> str:
    out = ["peak attribution (allocator history around the one step; measured here)"]
    if control is not None:
        out.append(f"positive control: {'PASSED' if control.get('passed') else 'FAILED'} - holding one "
                   f"extra bf16 logits copy across backward showed {control.get('extra_bf16_blocks')} "
                   "more bf16 logits-shaped block(s) at the peak (exactly 1 expected)")
    cells = []
    for r in rows:
        a = r.attribution
        if not a:
            continue
        share = (a["logits_bf16"]["bytes"] + a["logits_fp32"]["bytes"]) / (a["replayed_peak"] or 1)
        other = ", ".join(f"{k}: {v['count']}/{v['bytes'] / GB:.3f}" for k, v in a["other_groups"].items())
        caveat = ("history incomplete" if not a.get("complete") else "no positive control ran"
                  if control is None else "control failed" if not control.get("passed") else None)
        cells.append([r.model, str(r.seq), str(r.batch), str(a["logits_bf16"]["count"]),
                      gb(a["logits_bf16"]["bytes"], 3), str(a["logits_fp32"]["count"]),
                      gb(a["logits_fp32"]["bytes"], 3), f"{share:.1%}", gb(a["resident_at_peak"], 3),
                      (f"{caveat}: not a finding; " if caveat else "") + other])
    cols = [("model", 13), ("seq", 5), ("batch", 5), ("bf16 logits", 11), ("bf16 GB", 8),
            ("fp32 logits", 11), ("fp32 GB", 8), ("logits share", 12), ("resident GB", 11),
            ("other (count, GB)", -40)]
    return "\n".join(out + table(cols, cells))


def measure_table(m: dict[str, Any]) -> str:
    rec = RECORD_MEASURE
    fmt = lambda v: v if isinstance(v, str) else ("-" if v is None else repr(float(v)))  # noqa: E731
    c = m["constants"]
    cells = [[f"default, run {i}", fmt(v), fmt(rec["repeat"])] for i, v in enumerate(m["repeats"], 1)]
    cells.append(["spread (max - min)", fmt(m["spread"]), fmt(rec["spread"])])
    cells += [[f"vocab {v}", fmt(x), fmt(rec["vocab"].get(int(v)))] for v, x in m["by_vocab"].items()]
    return "\n".join([
        "--measure: bytes per logit element (Soup's constants; Soup's probe measured here; the A10G record)",
        f"  LOGITS_BYTES_PER_ELEMENT      (Soup, shipped) {c['LOGITS_BYTES_PER_ELEMENT']}",
        f"  LOGITS_LOSS_BYTES_PER_ELEMENT (Soup, shipped) {c['LOGITS_LOSS_BYTES_PER_ELEMENT']}",
    ] + table([("probe", -22), ("measured", 20), ("A10G record", 20)], cells, indent="  "))


def sdpa_table(s: dict[str, Any]) -> str:
    seqs = [int(x) for x in s["seqs"]]
    cells = []
    for backend in SDPA_BACKENDS:
        rec = RECORD_SDPA_MB.get(backend)
        row = [backend]
        for q, v in zip(seqs, s["extra_mb"][backend]):
            mine = v if isinstance(v, str) else f"{v:.1f}"
            row.append(f"{mine} | {rec[SDPA_SEQS.index(q)]:.1f}" if rec and q in SDPA_SEQS else f"{mine} | -")
        cells.append(row)
    return "\n".join(
        ["--sdpa: extra allocation over the baseline, MB (measured here | A10G record); "
         f"bf16 query (1, {SDPA_HEADS}, seq, {SDPA_HEAD_DIM}), causal self-attention"]
        + table([("backend", -14)] + [(f"seq {q}", 20) for q in seqs], cells, indent="  ")
        + ["  record: default 2.4 to 7.3 MB, never the math path; math is the positive control "
           "(the seq^2 cost is real)"])


def determinism_table(rows: list[Row]) -> str:
    out = ["--determinism: the same arm in fresh processes (measured here | A10G record)"]
    for entry in determinism_spread(rows):
        r = entry["row"]
        peaks = ", ".join("-" if p is None else f"{p / GB:.4f}" for p in entry["peaks"])
        rec = RECORD_DETERMINISM.get((r.model_key, r.seq)) if r.batch == 1 else None
        findings = [f"repeat {i} {st}" for i, st in enumerate(entry["statuses"], 1)
                    if st not in ("ok", "dry-run")]
        out.append(f"  {r.model} seq {r.seq} batch {r.batch}: peaks {peaks} GB (pids "
                   f"{','.join(str(p) for p in entry['pids'])}); spread "
                   + ("-" if entry["spread_pct"] is None else f"{entry['spread_pct']:.2f}%")
                   + " | record " + (f"{rec[0]:.4f}, {rec[1]:.4f} GB, spread {rec[2]:.2f}%" if rec else "-")
                   + (f"; {', '.join(findings)}" if findings else ""))
    return "\n".join(out)


MAP_COLUMNS = [("family", -22), ("quant", 5), ("seq", 6), ("batch", 5), ("realised", 8),
               ("LoRA targets", -15), ("record-conv GB", 14), ("Soup's own GB", 13), ("own - conv MB", 13),
               ("real peak GB", 13), ("pred/real", 9), ("status", 8)]
MAP_LEGEND = ("record-conv: Soup's estimator fed the grid's figures (the record's convention); Soup's own: "
              "the number Soup's pre-flight computed in this very setup (the one its gate uses; on a "
              "CPU dry run it budgets float32 weights); pred/real: the lower of the two over the real "
              "peak; UNDER: either is below it")


def map_table(rows: list[Row]) -> str:
    """The margin map, one row per arm, with the same guard and statuses as the sweep."""
    cells = []
    for r in rows:
        diff = (f"{(r.soup_predicted - r.predicted) / 1e6:+.1f}" if r.soup_predicted and r.predicted else "-")
        cells.append([r.model, r.quant, str(r.seq), str(r.batch), "-" if r.realised is None else str(r.realised),
                      ",".join(r.targets) or "-", gb(r.predicted), gb(r.soup_predicted), diff, peak_cell(r),
                      "VOID" if r.status == "VOID" else ratio(r.margin_ratio), r.status])
    notes = [f"  {r.model} {r.quant} seq {r.seq} batch {r.batch}: {r.status} - {r.error}"
             for r in rows if r.failure and r.error]
    return "\n".join(["margin map (record-conv and Soup's own: computed by Soup; real peak: measured here)"]
                     + table(MAP_COLUMNS, cells) + [MAP_LEGEND] + (["notes:"] + notes if notes else []))


def map_summary(rows: list[Row]) -> str:
    """Per family and quantization: rows, the thinnest and widest margin and where, UNDERs."""
    cells = []
    for fam in models_in(rows):
        for quant in QUANTS:
            mine = [r for r in rows if r.model == fam and r.quant == quant]
            if not mine:
                continue
            measured = [r for r in mine if r.measured]
            lo = min(measured, key=lambda r: r.margin_ratio, default=None)
            hi = max(measured, key=lambda r: r.margin_ratio, default=None)
            where = lambda r: f"{ratio(r.margin_ratio)} @ {r.seq}x{r.batch}" if r else "-"  # noqa: E731
            others = {st: sum(1 for r in mine if r.status == st) for st in ("REFUSED", "SKIPPED", "OOM",
                                                                            "FAILED", "VOID", "dry-run")}
            cells.append([fam, quant, ",".join(mine[0].targets), f"{len(measured)}/{len(mine)}", where(lo),
                          where(hi), str(sum(1 for r in mine if r.status == "UNDER")),
                          ", ".join(f"{n} {st}" for st, n in others.items() if n) or "-"])
    return "\n".join(["summary per family and quantization (pred/real @ seq x batch)"] + table(
        [("family", -22), ("quant", 5), ("LoRA targets", -15), ("measured", 8), ("min pred/real", 18),
         ("max pred/real", 18), ("UNDER", 5), ("not measured", -30)], cells))


def map_verdict(rows: list[Row]) -> str:
    published = [f"published figure: {name} {quant} batch {b} x seq {q}: {gb(peak)} GB allocated (Soup v0.73.1, "
                 f"issue #349); here {gb(r.real_peak)} GB ({r.real_peak / peak:.3f}x), Soup's own prediction "
                 f"{gb(r.soup_predicted)} GB ({ratio(r.margin_ratio)} of the peak here)"
                 for (name, quant, q, b), peak in PUBLISHED_NF4.items() for r in rows
                 if (r.model_key, r.quant, r.seq, r.batch) == (name, quant, q, b) and r.measured]
    return "\n".join(published + [verdict_line(rows)])


def verdict_line(rows: list[Row]) -> str:
    under = [r for r in rows if r.status == "UNDER"]
    measured = [r for r in rows if r.measured]
    if under:
        return (f"verdict: Soup UNDER-predicts {len(under)} of {len(measured)} measured row(s); the contract "
                "fails at " + "; ".join(f"{r.model} {r.quant} seq {r.seq} batch {r.batch} "
                                        f"({ratio(r.margin_ratio)})" for r in under))
    if not measured:
        return f"verdict: nothing measured ({len(rows)} row(s), none with a real peak): no verdict"
    thin = min(measured, key=lambda r: r.margin_ratio)
    return (f"verdict: Soup never under-predicts on the {len(measured)} measured row(s); the thinnest "
            f"margin is {ratio(thin.margin_ratio)} ({thin.model} {thin.quant} seq {thin.seq} batch {thin.batch})")


def margins_table(margins: list[dict[str, Any]]) -> str:
    """Each attributed arm: estimator term against the blocks live at the peak it charges."""
    out = ["where the margin goes (allocator history of the tightest arm per family and every UNDER; "
           "charged: Soup's terms; live at the peak: measured here)"]
    cells = []
    for m in margins:
        for t in m["terms"]:
            per = f"{t['missed'] / t['per'][0]:+.2f} B {t['per'][1]}" if t["per"] else "-"
            cells.append([f"{m['model']} {m['quant']} {m['seq']}x{m['batch']}", ratio(m["ratio"]), t["term"],
                          gb(t["charged"]), gb(t["measured"]), f"{t['missed'] / 1e6:+.1f}", per,
                          "" if m["complete"] else "history incomplete: not a finding"])
    out += table([("arm", -34), ("pred/real", 9), ("term", -11), ("charged GB", 10), ("live GB", 9),
                  ("missed MB", 10), ("missed per unit", -28), ("", -10)], cells)
    out += [f"  {m['note']}" for m in margins if m.get("note") and m["complete"]]
    return "\n".join(out)


def compare_table(a: Result, b: Result) -> str:
    """The same arms' measured peaks in two saved results (e.g. before and after a change)."""
    index = {(r.model, r.quant, r.seq, r.batch, r.repeat): r for r in b.rows if r.measured}
    pairs = [(r, index.get((r.model, r.quant, r.seq, r.batch, r.repeat))) for r in a.rows if r.measured]
    pairs = [(r, o) for r, o in pairs if o]
    quant = any(r.quant != "none" for r, _ in pairs)  # a sweep's compare keeps its columns
    cells = [[r.model] + ([r.quant] if quant else []) + [
        str(r.seq), str(r.batch), gb(r.real_peak), gb(o.real_peak), str(o.real_peak - r.real_peak),
        f"{(o.real_peak - r.real_peak) / r.real_peak:.3%}"] for r, o in pairs]
    same = sum(1 for r, o in pairs if o.real_peak == r.real_peak)
    width = max([13] + [len(r.model) for r, _ in pairs])
    return "\n".join(
        [f"compare: A = {a.environment.get('arms')} ({a.environment.get('date')}), "
         f"B = {b.environment.get('arms')} ({b.environment.get('date')}); measured peaks"]
        + table([("model", width)] + ([("quant", 5)] if quant else []) + [
            ("seq", 5), ("batch", 5), ("A GB", 9), ("B GB", 9), ("B - A bytes", 12), ("diff", 8)],
            cells, indent="  ")
        + [f"  {same} of {len(cells)} shared arm(s) equal to the byte"])


def header_line(env: dict[str, Any]) -> str:
    return (f"stack: torch {env['torch']} (CUDA {env.get('cuda') or 'none'}) | GPU {env.get('gpu') or 'none'}"
            + (f" (driver {env['driver']})" if env.get("driver") else "")
            + f" | transformers {env['transformers']} | trl {env['trl']} | peft {env['peft']}"
            f" | soup-cli {env['soup_cli']} | weights {env['weights']} | arms {env.get('arms')}")


def render_text(result: Result) -> str:
    """The header and every table the result holds, as the console shows them."""
    sweep_rows = [r for r in result.rows if r.repeat is None]
    repeats = [r for r in result.rows if r.repeat is not None]
    parts = [header_line(result.environment)]
    if result.kind == "map":
        parts += ["", map_table(sweep_rows), "", map_summary(sweep_rows)]
        if result.margins:
            parts += ["", margins_table(result.margins)]
        parts += ["", map_verdict(sweep_rows)]
        sweep_rows = []
    if sweep_rows:
        parts += ["", sweep_table(sweep_rows)]
        if any(r.attribution for r in sweep_rows):
            parts += ["", attribution_table(sweep_rows, result.control)]
    if repeats:
        parts += ["", determinism_table(repeats)]
    if result.measure:
        parts += ["", measure_table(result.measure)]
    if result.sdpa:
        parts += ["", sdpa_table(result.sdpa)]
    carried = [r for r in result.rows if r.carried]
    if carried:
        parts += ["", f"carried: {len(carried)} row(s) began with bytes earlier arms left allocated "
                      f"(up to {max(r.carried for r in carried):,}); their peaks include them"]
    if result.interrupted:
        parts += ["", f"interrupted: {len(result.rows)} row(s) measured before the stop"]
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------------------
# Outputs: JSON, a markdown record, a plot; rows saved as they finish
# ---------------------------------------------------------------------------


def render_markdown(result: Result) -> str:
    """The run as a record in the #395 record's style, ready to paste."""
    env, rows = result.environment, [r for r in result.rows if r.repeat is None]
    md = [f"# Second-stack VRAM record: {env.get('gpu') or 'no GPU'} ({str(env.get('date'))[:10]})", "",
          f"Stack: {env.get('gpu') or 'no GPU'}, driver {env.get('driver') or '-'}, CUDA "
          f"{env.get('cuda') or '-'}, torch {env['torch']}, transformers {env['transformers']}, "
          f"trl {env['trl']}, peft {env['peft']}, Python {env.get('python')}, Soup {env['soup_cli']}, "
          f"{env.get('platform')}. Weights: {env['weights']}. Arms: {env.get('arms')}.", "",
          f"Command: `{env.get('command')}`", "",
          f"Compared against the A10G record: {A10G_STACK}. Predicted = Soup's "
          "`estimate_stream_peak_vram`; real peak = `torch.cuda.max_memory_allocated()` around one "
          "optimizer step, measured by this run.", ""]
    if result.kind == "map":  # the map's own table: quant, Soup's own, the lower of the two
        md += ["```", map_table(rows), "", map_summary(rows), "", map_verdict(rows), "```", ""]
        rows = []
    for model in models_in(rows):
        md += [f"## {model}", "", "| seq | realised | batch | predicted GB | real peak GB | pred/real "
               "| A10G real GB | vs A10G | verdict |", "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in (x for x in rows if x.model == model):
            c = sweep_cells(r)
            verdict = {"ok": "over-predicts, safe", "UNDER": "UNDER-predicts"}.get(r.status, r.status)
            md.append("| " + " | ".join(c[:8] + [verdict]) + " |")
        md.append("")
    if rows:
        md += ["## 14 x E against the real peak", "", SWEEP_LEGEND + ".", "",
               "| model | seq | batch | 14 x E GB | real peak GB | retained copy would fit | A10G real "
               "peak GB | A10G: would fit | non-logits modelled GB | over-estimate | A10G over-estimate "
               "(from its published peak) |", "|---|---:|---:|---:|---:|---|---:|---|---:|---:|---:|"]
        for r in rows:
            c, rec = sweep_cells(r), r.record_peak
            rec_over = r.overestimate_at(rec)
            rec_fit = "-" if rec is None or r.logits14 is None else ("yes" if r.logits14 <= rec else "no")
            md.append(f"| {r.model} | {r.seq} | {r.batch} | {c[8]} | {c[4]} | {c[11]} | {c[6]} | "
                      f"{rec_fit} | {gb(r.nonlogits_modelled)} | {c[10]} | {ratio(rec_over)} |")
        md += ["", overestimate_line(rows), ""]
        if any(r.attribution for r in rows):
            md += ["## Peak attribution", "", "```", attribution_table(rows, result.control), "```", ""]
    repeats = [r for r in result.rows if r.repeat is not None]
    for title, text in (("Determinism", repeats and determinism_table(repeats)),
                        ("--measure", result.measure and measure_table(result.measure)),
                        ("--sdpa", result.sdpa and sdpa_table(result.sdpa))):
        if text:
            md += [f"## {title}", "", "```", text, "```", ""]
    if result.timings:
        md += ["## Harness cost", "", "```", json.dumps(result.timings, indent=2), "```", ""]
    return "\n".join(md)


def render_plot(result: Result) -> bytes:
    """pred/real against seq: this run, the A10G and RTX 3050 records, and the 1.0 line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    env = result.environment
    here = env.get("gpu") or "this run"
    if result.kind == "map":
        return render_heatmap(result, plt)
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    colours = {SHAPES["smol"].name: "tab:blue", SHAPES["qwen"].name: "tab:orange"}
    series: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for r in result.rows:
        if r.pred_over_real is not None and r.repeat is None:
            series.setdefault((r.model, r.batch), []).append((r.seq, r.pred_over_real))
    for (model, batch), pts in series.items():
        pts.sort()
        ax.plot(*zip(*pts), marker="o", linewidth=2, color=colours.get(model) if batch == 1 else None,
                label=f"{model}, {here} (this run)" + (f", batch {batch}" if batch != 1 else ""))
    for key in ("smol", "qwen"):
        pts = sorted((seq, v[1]) for (k, seq), v in RECORD_A10G_PREDICTED.items() if k == key)
        ax.plot(*zip(*pts), marker="s", linestyle="--", alpha=0.7, color=colours[SHAPES[key].name],
                label=f"{SHAPES[key].name}, A10G record")
    pts = sorted((seq, p / r) for (_, seq), (p, r) in RECORD_RTX3050.items())
    ax.plot(*zip(*pts), marker="^", linestyle=":", color="crimson", label="SmolLM2-135M, RTX 3050 record")
    ax.axhline(1.0, color="black", linewidth=1)
    ax.text(ax.get_xlim()[0], 0.99, " below 1.0: the prediction under-predicts (the #395 failure)",
            va="top", fontsize=8)
    ax.set(xlabel="sequence length (tokens)", ylabel="predicted / real peak VRAM",
           title=f"Soup stream pre-flight: predicted / real peak ({here}, {str(env.get('date'))[:10]})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def render_heatmap(result: Result, plt: Any) -> bytes:
    """The map as a heatmap of pred/real: family x seq, one panel per quantization and batch;
    a blank cell was not measured (its status says why in the table)."""
    rows = [r for r in result.rows if r.repeat is None]
    families, seqs = models_in(rows), sorted({r.seq for r in rows})
    panels = [(q, b) for q in QUANTS for b in sorted({r.batch for r in rows}) if any(
        r.quant == q and r.batch == b for r in rows)] or [("none", 1)]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels) + 2, 0.45 * len(families) + 2),
                             dpi=110, squeeze=False)
    for ax, (quant, batch) in zip(axes[0], panels):
        grid = [[next((r.margin_ratio for r in rows if r.model == f and r.seq == q and r.quant == quant
                       and r.batch == batch and r.measured), float("nan")) for q in seqs] for f in families]
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0.8, vmax=1.4, aspect="auto")
        for i, line in enumerate(grid):
            for j, v in enumerate(line):
                if v == v:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set(title=f"{quant}, batch {batch}", xticks=range(len(seqs)), xticklabels=seqs,
               yticks=range(len(families)), yticklabels=families if ax is axes[0][0] else [])
        ax.tick_params(labelsize=7)
    fig.colorbar(im, ax=list(axes[0]), label="pred / real (below 1.0: under-predicts)")
    fig.suptitle(f"Soup's pre-flight margin map ({result.environment.get('gpu') or 'this run'})")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def write_output(path: str, data: bytes) -> None:
    """Write an output without ever replacing what is not ours: a symlink is written
    through to its target, a device or FIFO is written to directly, and a regular file
    (or a new one) is replaced atomically through a temp file that never outlives a failure."""
    target = os.path.realpath(path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        with open(target, "wb") as fh:
            fh.write(data)
        return
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(target)}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)  # mkstemp makes 0600; an output gets the mode any new file would
        os.chmod(tmp, stat.S_IMODE(mode) if mode is not None else 0o666 & ~umask)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class RowFile:
    """Rows appended as JSON lines as they finish, beside --json, so nothing measured is
    lost to a crash; removed once the final JSON holds them."""

    def __init__(self, json_path: Optional[str]):
        self.path = self.path_for(json_path) if json_path else None
        self.ok = True
        if self.path:
            self.path.unlink(missing_ok=True)

    @staticmethod
    def path_for(json_path: str) -> Path:
        return Path(os.path.realpath(json_path) + ".rows.jsonl")

    def add(self, row: Row) -> None:
        if self.path and self.ok:
            try:
                with open(self.path, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(row.to_json(), default=str) + "\n")
            except OSError as exc:  # the tables and the final JSON still hold the row
                self.ok = False
                print(f"warning: cannot save rows to {self.path} ({exc.strerror}); "
                      "they are in the tables", file=sys.stderr)
                self.path.unlink(missing_ok=True)

    def finish(self) -> None:
        if self.path:
            self.path.unlink(missing_ok=True)


def write_outputs(result: Result, run: "Run", rows_file: RowFile) -> Optional[str]:
    """--json, --markdown and --plot. Returns one line naming an output that could not be
    written and the one place the rows are kept, or None."""
    for flag, path, render in (
            ("--json", run.json, lambda: json.dumps(result.to_json(), indent=2, default=str) + "\n"),
            ("--markdown", run.markdown, lambda: render_markdown(result)),
            ("--plot", run.plot, lambda: render_plot(result))):
        if not path:
            continue
        try:
            data = render()
            write_output(path, data.encode("utf-8") if isinstance(data, str) else data)
        except OSError as exc:
            keep = (f"the rows are kept in {rows_file.path}" if rows_file.path and rows_file.ok
                    and rows_file.path.exists() else "the rows are in the tables printed above")
            return f"{flag} {path} could not be written ({exc.strerror or exc}); {keep}"
    rows_file.finish()
    return None


# ---------------------------------------------------------------------------
# Spreading arms: shards, run here (--gpus, --isolate, --determinism) or anywhere
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One child process: a shard of the grid on one GPU (or none), maybe one repeat."""

    shard: tuple[int, int]
    arms: tuple  # the Arms it owes
    gpu: Optional[int] = None
    repeat: Optional[int] = None
    extra_modes: bool = False  # also --measure/--sdpa, after its arms


def shard_of(arms: list[Arm], shard: tuple[int, int], whole_models: bool = False) -> list[Arm]:
    """--shard K/N: every arm whose grid index is K-1 modulo N.

    On the map a shard is whole families instead, dealt heaviest first to the lightest
    shard: a family's checkpoint (up to 16 GB) and Soup's shards of it are the map's
    largest cost, and modulo would build every family once per shard."""
    k, n = shard
    if not whole_models:
        return [a for a in arms if a.index % n == k - 1]
    cost: dict[str, float] = {}
    for a in arms:
        cost[a.model] = cost.get(a.model, 0.0) + arm_seconds(a)
    load, owner = [0.0] * n, {}
    for model in sorted(cost, key=lambda m: (-cost[m], m)):
        owner[model] = min(range(n), key=lambda j: (load[j], j))
        load[owner[model]] += cost[model]
    return [a for a in arms if owner[a.model] == k - 1]


def arm_seconds(arm: Arm) -> float:
    """A map arm's rough cost, only to deal families evenly: on the H200 map each arm took
    about 3 s of setup and teardown plus 0.7 s per billion parameters."""
    if arm.model in FAMILIES:
        params = FAMILIES[arm.model][4]
    else:  # the record's two: bf16 bytes of the layers and the extras, over 2
        shape = SHAPES[arm.model]
        params = (shape.pool // 2 * shape.n_layers + shape.extras) // 2
    return 3.0 + 0.7e-9 * params


def visible_ids() -> Optional[list[str]]:
    """CUDA_VISIBLE_DEVICES as a list, or None when it is not set (every GPU is visible)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if visible is None else [v.strip() for v in visible.split(",") if v.strip()]


def visible_gpu(ordinal: int) -> str:
    """--gpus counts the GPUs this process sees; a child needs the id behind it."""
    ids = visible_ids() or []
    return ids[ordinal] if ordinal < len(ids) else str(ordinal)


def plan_jobs(run: "Run", arms: list[Arm]) -> list[Job]:
    if run.repeats:
        gpu = run.gpus[0] if run.gpus else None
        return [Job((a.index + 1, len(arms)), (a,), gpu, rep, extra_modes=(rep == 1 and a.index == 0))
                for rep in range(1, run.repeats + 1) for a in arms]
    if run.isolate:
        gpus = run.gpus or (None,)
        return [Job((a.index + 1, len(arms)), (a,), gpus[i % len(gpus)],
                    extra_modes=i == 0) for i, a in enumerate(arms)]
    n = len(run.gpus)
    jobs = [Job((k, n), tuple(shard_of(arms, (k, n), whole_models=run.map)), g, extra_modes=k == 1)
            for k, g in enumerate(run.gpus, 1)]
    return [j for j in jobs if j.arms or j.extra_modes]  # one family, two GPUs: one child


def spread(run: "Run", arms: list[Arm], scratch: Scratch, on_row: Callable[[Row], None]) -> list[Result]:
    """Each job in a fresh process, one GPU's jobs in turn, GPUs at once, rows taken up as each child
    saves them; a child that dies leaves a FAILED row for each arm it did not report, never a gap."""
    lanes: dict[Optional[int], list[Job]] = {}
    for job in plan_jobs(run, arms):
        lanes.setdefault(job.gpu, []).append(job)
    running: dict[Optional[int], dict[str, Any]] = {}
    results: list[Result] = []
    count = 0
    # Children share one cache so a model is built and sharded once; but the map's families would
    # not fit a disk together, so there each child keeps its own and frees each family after it.
    cache = run.cache_dir or (None if run.map else str(scratch.path("cache")))
    folder = Path(tempfile.mkdtemp(dir=scratch.path("children")))  # one per spread: no stale files
    # Each child would take a thread per core; side by side they stall each other's parallel
    # copies into Soup's pinned store (measured on CPU: 0.06-0.15 s alone, up to 1.9 s beside
    # a busy twin). A share of the cores each; host-side only.
    threads = str(max(1, min(8, (os.cpu_count() or 2) // max(1, len(lanes)) - 2)))

    def launch(gpu: Optional[int]) -> None:
        nonlocal count
        job = lanes[gpu].pop(0)
        count += 1
        out = folder / f"{count:04d}.json"
        env = dict(os.environ)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible_gpu(gpu)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
            env.setdefault(var, threads)
        argv = child_argv(run, job, str(out), cache)
        with open(out.with_suffix(".stdout"), "w") as fh:
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env, stdout=fh)
        running[gpu] = {"proc": proc, "job": job, "out": out, "seen": set(), "read": 0}

    def take(entry: dict[str, Any], rows: Iterable[Row]) -> None:
        for row in rows:
            if (row.index, row.repeat) not in entry["seen"]:
                entry["seen"].add((row.index, row.repeat))
                on_row(row)

    def new_rows(entry: dict[str, Any]) -> list[Row]:
        """The rows a child saved since the last look: whole lines only (the last may be
        half-written); a line that does not parse is left for the child's final JSON."""
        try:
            with open(RowFile.path_for(str(entry["out"])), "rb") as fh:
                fh.seek(entry["read"])
                chunk = fh.read()
            done = chunk.rfind(b"\n") + 1
            rows = [Row.from_json(json.loads(line)) for line in chunk[:done].splitlines()]
        except (OSError, ValueError):
            return []
        entry["read"] += done
        return rows

    def settle(gpu: Optional[int]) -> None:
        entry = running.pop(gpu)
        job, code = entry["job"], entry["proc"].returncode
        take(entry, new_rows(entry))
        with contextlib.suppress(OSError, ValueError):
            res = Result.from_json(json.loads(entry["out"].read_text()))
            take(entry, res.rows)
            results.append(res)
        if not Stop.requested:
            for arm in job.arms:
                if (arm.index, job.repeat) not in entry["seen"]:
                    take(entry, [lost_row(arm, run, job.repeat, code)])

    try:
        for gpu in lanes:
            launch(gpu)
        while running:
            time.sleep(0.2)
            for gpu in list(running):
                entry = running[gpu]
                take(entry, new_rows(entry))
                if entry["proc"].poll() is not None:
                    settle(gpu)
                    if lanes[gpu] and not Stop.requested:
                        launch(gpu)
    finally:
        for entry in running.values():  # a second Ctrl-C, SIGTERM or an error here
            if entry["proc"].poll() is None:
                entry["proc"].send_signal(signal.SIGTERM)
        for gpu in list(running):
            try:
                running[gpu]["proc"].wait(timeout=30)
            except subprocess.TimeoutExpired:
                running[gpu]["proc"].kill()
                running[gpu]["proc"].wait()
            settle(gpu)
    return results


def child_argv(run: "Run", job: Job, out: str, cache: Optional[str]) -> list[str]:
    """The command line of one child: the same arms' settings, one shard, its own JSON."""
    argv = ["--_child", "--shard", f"{job.shard[0]}/{job.shard[1]}", "--json", out,
            "--batch", ",".join(map(str, run.batches))] + (["--cache-dir", cache] if cache else [])
    if not run.custom_model:  # --model's weights ("local" or "synthetic") follow from --model
        argv += ["--weights", run.weights]
    if run.map:
        argv += ["--map", "--families", ",".join(run.models)]
        if run.quants != QUANTS:  # the default both: a child without bitsandbytes SKIPs NF4, as here
            argv += ["--quant", ",".join(run.quants)]
    else:
        argv += ["--model", run.custom_model] if run.custom_model else ["--models", ",".join(run.models)]
    if run.seqs:
        argv += ["--seq", ",".join(map(str, run.seqs))]
    if job.repeat is not None:
        argv += ["--_repeat", str(job.repeat)]
    if job.extra_modes:
        argv += [flag for flag, on in (("--measure", run.measure), ("--sdpa", run.sdpa)) if on]
    for flag, value in (("--log-dir", run.log_dir), ("--snapshot-dir", run.snapshot_dir)):
        if value:
            argv += [flag, value]
    argv += [flag for flag, on in (("--sweep", True), ("--dry-run", run.dry_run),
                                   ("--snapshot", run.snapshot), ("--verbose", run.verbose)) if on]
    return argv


def lost_row(arm: Arm, run: "Run", repeat: Optional[int], code: Optional[int]) -> Row:
    """A FAILED row for an arm whose process died before reporting it (no prediction: this
    process does not import Soup)."""
    shape = SHAPES.get(arm.model)
    family = FAMILIES.get(arm.model)
    name = shape.name if shape else family[0] if family else (run.custom_model or arm.model)
    vocab = shape.vocab if shape else family[3]["vocab_size"] if family else 1
    return Row(model=name, model_key=arm.model, seq=arm.seq, batch=arm.batch, index=arm.index,
               predicted=None, logits14=None, loss_bytes_per_element=None, vocab=vocab,
               quant=arm.quant, repeat=repeat,
               dry_run=run.dry_run, failure="FAILED",
               error=f"its process exited with code {code} before this arm reported")


# ---------------------------------------------------------------------------
# The CLI: the command line settled once into a Run, then executed
# ---------------------------------------------------------------------------

EPILOG = f"""defaults:
  arms       SmolLM2-135M at seq {','.join(map(str, RECORD_GRID['smol']))} and Qwen2.5-0.5B at seq
             {','.join(map(str, RECORD_GRID['qwen']))}, batch 1 (the record's grid)
  weights    synthetic: architecture-exact checkpoints built here, no network
  cache-dir  none: everything is built in a scratch folder removed at exit. A --cache-dir
             must lie under $HOME, the working directory or the temp dir, where Soup honours
             it; every folder an option names is created when missing.

exit codes:
  0    every row ok (prediction at or above the real peak, realised == requested); in a
       dry run, every row realised as requested. REFUSED (Soup's gate said the run will not
       fit) and SKIPPED (NF4 without bitsandbytes) rows are not findings
  1    any row VOID (realised != requested), OOM, FAILED or UNDER (prediction below the
       real peak), the snapshot's positive control failed, or the harness failed
  2    usage error, or an output that could not be written (one line on stderr)
  130  interrupted (rows measured so far are printed and saved)
"""


@dataclass(frozen=True)
class Run:
    """Everything the command line asked for, validated once; nothing changes it afterwards."""

    sweep: bool = True
    map: bool = False  # --map: models are families, with a quantization axis
    quants: tuple = ("none",)
    measure: bool = False
    sdpa: bool = False
    repeats: Optional[int] = None  # --determinism N
    models: tuple = tuple(SHAPES)
    seqs: Optional[tuple] = None  # None: the record's grid per model
    batches: tuple = (1,)
    custom_model: Optional[str] = None
    weights: str = "synthetic"
    dry_run: bool = False
    verbose: bool = False
    snapshot: bool = False
    snapshot_dir: Optional[str] = None
    log_dir: Optional[str] = None
    cache_dir: Optional[str] = None
    isolate: bool = False
    gpus: Optional[tuple] = None
    shard: Optional[tuple] = None
    json: Optional[str] = None
    markdown: Optional[str] = None
    plot: Optional[str] = None
    from_json: tuple = ()
    compare: Optional[str] = None
    child: bool = False  # a child of --gpus, --isolate or --determinism
    repeat_tag: Optional[int] = None
    argv: tuple = ()

    @property
    def determinism_grid(self) -> tuple[tuple, Optional[tuple], tuple]:
        """The record's two repeated arms, unless the command line chose others."""
        if self.custom_model or self.seqs or self.models != tuple(SHAPES) or self.batches != (1,):
            return self.models, self.seqs, self.batches
        return ("smol",), (4096, 6144), (1,)


NO_CUDA = ("CUDA is required for the real peak and no CUDA GPU is visible; --dry-run runs the whole "
           "Soup setup and the guard on CPU")


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="issue395_second_stack_vram.py", epilog=EPILOG,
               description="Re-measure Soup's stream peak-VRAM pre-flight (the issue #395 record).",
               formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("modes (default: the sweep)")
    m.add_argument("--sweep", action="store_true", help="run the sweep alongside other modes")
    m.add_argument("--measure", action="store_true", help="Soup's logits bytes-per-element probe")
    m.add_argument("--sdpa", action="store_true", help="attention's extra allocation per backend")
    m.add_argument("--map", action="store_true",
                   help="the margin map: every family Soup streams x {none, nf4} x seq {2048, 4096, "
                        "8192, 16384} (within max positions) x batch {1, 4}, and where the margin goes")
    m.add_argument("--determinism", nargs="?", const="2", default=None, metavar="N",
                   help="repeat arms in N fresh processes (default 2; default arms: SmolLM2 at 4096 and 6144)")
    a = p.add_argument_group("arms")
    a.add_argument("--models", default=None, help="comma list of smol,qwen (default both)")
    a.add_argument("--families", default=None, help="with --map: comma list of families (default "
                   "all: " + ",".join(ALL_FAMILIES) + ")")
    a.add_argument("--quant", default=None, help="with --map: comma list of none,nf4 (default both; "
                   "nf4 needs bitsandbytes)")
    a.add_argument("--seq", default=None, help="comma list of seq lengths for every chosen model "
                   "(default: the record's grid)")
    a.add_argument("--batch", default=None, help="comma list of batch sizes (default 1; --map: 1,4)")
    a.add_argument("--model", default=None, metavar="ID_OR_PATH",
                   help="any causal LM Soup can stream, instead of the record's models (needs --seq): "
                        "a checkpoint folder, a hub id, or a config.json (synthetic weights built from it)")
    a.add_argument("--weights", choices=("synthetic", "hub"), default="synthetic",
                   help="synthetic (default): build architecture-exact checkpoints here; hub: download")
    a.add_argument("--cache-dir", default=None, help="keep built checkpoints and Soup's shards here "
                   "(under $HOME, the working directory or the temp dir)")
    r = p.add_argument_group("running")
    r.add_argument("--dry-run", action="store_true", help="everything but the CUDA step, on CPU")
    r.add_argument("--isolate", action="store_true", help="each arm in its own fresh process")
    r.add_argument("--gpus", default=None, help="comma list of GPU ids: one shard per GPU, merged")
    r.add_argument("--shard", default=None, metavar="K/N",
                   help="run only the arms whose grid index is K-1 modulo N (on the map: whole "
                        "families, dealt evenly); merge with --from-json")
    r.add_argument("--snapshot", action="store_true",
                   help="attribute each peak from the allocator history (+ positive control)")
    r.add_argument("--snapshot-dir", default=None, help="also write each raw snapshot here (implies --snapshot)")
    r.add_argument("--verbose", action="store_true", help="show Soup's own console output live")
    r.add_argument("--log-dir", default=None, help="keep Soup's per-arm console logs here")
    o = p.add_argument_group("outputs")
    o.add_argument("--json", default=None, metavar="PATH", help="every row, result and timing")
    o.add_argument("--markdown", default=None, metavar="PATH", help="a record ready to paste")
    o.add_argument("--plot", default=None, metavar="PATH", help="PNG of pred/real against seq")
    o.add_argument("--from-json", nargs="+", default=None, metavar="PATH",
                   help="re-render saved results, merging shards (no GPU, no Soup setup)")
    o.add_argument("--compare", default=None, metavar="PATH",
                   help="with --from-json: the same arms' peaks in another saved result")
    p.add_argument("--_repeat", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    return p


def parse_ints(flag: str, text: Optional[str], minimum: int = 1) -> Optional[tuple]:
    if text is None:
        return None
    items = [i.strip() for i in text.split(",")]
    if not all(items):
        raise UsageError(f"{flag} {text!r}: empty item; give a comma list of whole numbers")
    out: list[int] = []
    for item in items:
        if not (item.isascii() and item.lstrip("-").isdigit()):
            raise UsageError(f"{flag} {item!r} is not a whole number")
        if int(item) < minimum:
            raise UsageError(f"{flag} {int(item)} must be at least {minimum}")
        if int(item) in out:
            raise UsageError(f"{flag} {text}: {int(item)} is named twice")
        out.append(int(item))
    return tuple(out)


def within_positions(name: str, limit: int, seqs: Iterable[int]) -> None:
    """A seq beyond a model's positions is one line here, not a FAILED row (0: no limit known)."""
    beyond = [s for s in seqs if limit and s > limit]
    if beyond:
        raise UsageError(f"--seq {beyond[0]} is beyond {name}'s maximum positions ({limit})")


def writable_folder(flag: str, folder: str) -> None:
    """A folder the tool may write into: it exists, or the nearest one above it is writable."""
    p = Path(folder).expanduser().absolute()
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {folder}: not a folder")
    while not p.exists():
        p = p.parent
    if not p.is_dir() or not os.access(p, os.W_OK):
        raise UsageError(f"{flag} {folder}: {p} cannot be written")


def check_output(flag: str, path: str) -> None:
    if flag == "--plot" and Path(path).suffix.lower() != ".png":
        raise UsageError(f"--plot {path}: the plot is a PNG; give a path ending in .png")
    if Path(path).is_dir():
        raise UsageError(f"{flag} {path} is a folder; give a file path")
    if not Path(os.path.realpath(path)).exists():
        writable_folder(flag, os.path.dirname(os.path.realpath(path)))


def check_input(flag: str, path: str) -> None:
    """A saved result to read: a regular file (a FIFO would hang, /dev/zero never ends)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: {exc.strerror.lower() if exc.strerror else 'cannot be read'}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{flag} {path}: not a regular file")
    if st.st_size > 256 * 2**20:
        raise UsageError(f"{flag} {path}: {st.st_size} bytes is too large for a saved result")


def settle(args: argparse.Namespace, argv: list[str]) -> Run:
    """Every check that needs no GPU and no Soup setup, before anything runs or prints."""
    outputs = {f: getattr(args, f.strip("-").replace("-", "_")) for f in ("--json", "--markdown", "--plot")}
    for flag, path in outputs.items():
        if path is not None:
            check_output(flag, path)
    named = [(f, os.path.realpath(p)) for f, p in outputs.items() if p]
    named += [("--json's row file", str(RowFile.path_for(args.json)))] if args.json else []
    for i, (f, p) in enumerate(named):
        twin = next((g for g, q in named[i + 1:] if q == p), None)
        if twin:
            raise UsageError(f"{f} and {twin} name the same file {p}; each output needs its own path")
    if args.compare and not args.from_json:
        raise UsageError("--compare goes with --from-json")
    if args.from_json:
        for path in args.from_json + ([args.compare] if args.compare else []):
            check_input("--compare" if path == args.compare else "--from-json", path)
        return Run(from_json=tuple(args.from_json), compare=args.compare, json=args.json,
                   markdown=args.markdown, plot=args.plot, argv=tuple(argv))
    if args.map:
        return settle_map(args, argv)
    for flag in ("--families", "--quant"):
        if getattr(args, flag.strip("-")) is not None:
            raise UsageError(f"{flag} goes with --map")
    if args.model is not None and args.models:
        raise UsageError("--model and --models are exclusive: one brings its own model")
    if args.model is not None and not args.model.strip():
        raise UsageError("--model needs a checkpoint folder or a hub id")
    models = (("custom",) if args.model else tuple(SHAPES) if args.models is None
              else tuple(m.strip() for m in args.models.split(",")))
    if not all(models):
        raise UsageError(f"--models {args.models!r}: empty name; choose from {','.join(SHAPES)}")
    unknown = [m for m in models if m not in SHAPES and not args.model]
    if unknown:
        raise UsageError(f"--models: unknown model {unknown[0]!r}; choose from {','.join(SHAPES)}")
    if len(set(models)) != len(models):
        raise UsageError(f"--models {args.models}: a model is named twice")
    # Soup's config schema refuses a data.max_length under 64: one line here, not a FAILED row.
    seqs, batches = parse_ints("--seq", args.seq, minimum=64), parse_ints("--batch", args.batch) or (1,)
    gpus = parse_ints("--gpus", args.gpus, minimum=0)
    repeats = None
    if args.determinism is not None:
        counts = parse_ints("--determinism", args.determinism, minimum=2) or ()
        if len(counts) != 1:
            raise UsageError(f"--determinism {args.determinism}: give one repeat count")
        repeats = counts[0]
    shard = None
    if args.shard is not None:
        k, _, n = args.shard.partition("/")
        if not (k.isascii() and k.isdigit() and n.isascii() and n.isdigit() and 1 <= int(k) <= int(n)):
            raise UsageError(f"--shard {args.shard}: give K/N with 1 <= K <= N, e.g. --shard 2/4")
        shard = (int(k), int(n))
        if (gpus or args.isolate or repeats) and not args._child:
            raise UsageError("--shard is one shard of the grid; --gpus, --isolate and --determinism "
                             "make their own")
    if args.model and seqs is None:
        raise UsageError("--model needs --seq (there is no record grid for it)")
    for m in (m for m in models if m in SHAPES):
        within_positions(SHAPES[m].name, SHAPES[m].max_positions, seqs or RECORD_GRID[m])
    if args.dry_run and (args.snapshot or args.snapshot_dir):
        raise UsageError("--snapshot attributes the CUDA step's peak; a --dry-run has no step")
    for flag, folder in (("--log-dir", args.log_dir), ("--snapshot-dir", args.snapshot_dir),
                         ("--cache-dir", args.cache_dir)):
        if folder is not None:
            writable_folder(flag, folder)
    cache = os.path.abspath(os.path.expanduser(args.cache_dir)) if args.cache_dir else None
    if cache:
        check_cache_dir_bounds(args.cache_dir, cache)
    if args._repeat is not None and not (args._repeat.isascii() and args._repeat.isdigit()):
        raise UsageError(f"--_repeat {args._repeat!r} is not a whole number")
    any_mode = args.measure or args.sdpa or repeats is not None
    return Run(sweep=args.sweep or not any_mode, measure=args.measure, sdpa=args.sdpa, repeats=repeats,
               models=models, seqs=seqs, batches=batches, custom_model=args.model,
               weights=("synthetic" if config_only(args.model) else "local") if args.model else args.weights,
               dry_run=args.dry_run, verbose=args.verbose, snapshot=args.snapshot or bool(args.snapshot_dir),
               snapshot_dir=args.snapshot_dir, log_dir=args.log_dir, cache_dir=cache,
               isolate=args.isolate, gpus=gpus, shard=shard, json=args.json,
               markdown=args.markdown, plot=args.plot, child=args._child,
               repeat_tag=int(args._repeat) if args._repeat else None, argv=tuple(argv))


def settle_map(args: argparse.Namespace, argv: list[str]) -> Run:
    """--map's own checks (families, quantizations, max positions); the rest as for the sweep."""
    for flag in ("--models", "--model", "--determinism", "--isolate"):
        if getattr(args, flag.strip("-")) not in (None, False):
            raise UsageError(f"--map and {flag} are exclusive")
    known = ALL_FAMILIES
    families = known if args.families is None else tuple(f.strip() for f in args.families.split(","))
    unknown = [f for f in families if f not in known]
    if unknown or not all(families) or len(set(families)) != len(families):
        raise UsageError(f"--families: {'unknown family ' + repr(unknown[0]) if unknown else 'empty or repeated name'}; "
                         f"choose from {','.join(known)}")
    quants = QUANTS if args.quant is None else tuple(q.strip() for q in args.quant.split(","))
    if any(q not in QUANTS for q in quants) or len(set(quants)) != len(quants):
        raise UsageError(f"--quant {args.quant!r}: choose from {','.join(QUANTS)}")
    if args.quant is not None and "nf4" in quants and not args.dry_run and not bitsandbytes_present():
        raise UsageError("--quant nf4 needs bitsandbytes, which is not installed here")
    seqs, batches = parse_ints("--seq", args.seq, minimum=64), parse_ints("--batch", args.batch)
    for fam in families:
        within_positions(fam, max_positions(fam), seqs or ())
    plain = settle(argparse.Namespace(**dict(vars(args), map=False, families=None, quant=None,
                                             models=None, seq=None, batch=args.batch)), argv)
    return replace(plain, map=True, sweep=True, models=families, quants=quants, seqs=seqs,
                       batches=batches or MAP_BATCHES)


def check_cache_dir_bounds(given: str, cache: str) -> None:
    """Refuse a --cache-dir Soup would silently ignore (it would write to ~/.soup instead).
    Soup's own resolution decides (a light import: neither torch nor the hub client)."""
    shards = os.path.join(os.path.realpath(cache), "layer-stream")
    if os.path.realpath(soup_shard_root(shards)) != shards:
        raise UsageError(f"--cache-dir {given} is outside $HOME, the working directory and the temp "
                         "dir; Soup would ignore it and write its shard cache to ~/.soup instead")


def grid_arms(run: Run) -> list[Arm]:
    return (plan_map(run.models, run.quants, run.seqs, run.batches) if run.map
            else plan_arms(run.models, run.seqs, run.batches))


def plan_arms(models: Iterable[str], seqs: Optional[Iterable[int]], batches: Iterable[int]) -> list[Arm]:
    """Grid order: model, then seq, then batch (the record's order)."""
    arms: list[Arm] = []
    for model in models:
        for seq in (seqs or RECORD_GRID.get(model, ())):
            for batch in batches:
                arms.append(Arm(model, seq, batch, len(arms)))
    return arms


def visible_gpu_count() -> int:
    """GPUs this process may use, without importing torch (a fan-out parent never does)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        count = len([ln for ln in out.stdout.splitlines() if ln.startswith("GPU ")]) if out.returncode == 0 else 0
    except (OSError, subprocess.TimeoutExpired):
        count = 0
    ids = visible_ids()
    return count if ids is None else min(count, len(ids))


def execute(run: Run) -> int:
    """Every mode asked for. Rows are printed and saved whatever stops the run."""
    started = time.perf_counter()
    if run.from_json:
        return rerender(run)
    Stop.install(quiet=run.child)
    fan_out = run.sweep and bool(run.gpus or run.isolate)
    local = (run.sweep and not fan_out) or ((run.measure or run.sdpa) and not fan_out and not run.repeats)
    if run.gpus is None and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"  # Soup refuses to stream with several GPUs visible
    if (fan_out or run.repeats) and not run.dry_run:
        count = visible_gpu_count()
        if count == 0:
            raise UsageError(NO_CUDA)
        missing = [g for g in run.gpus or () if g >= count]
        if missing:
            raise UsageError(f"--gpus: GPU {missing[0]} is not there ({count} CUDA device(s) visible)")
    with Scratch(run.cache_dir) as scratch:
        return measure_all(run, scratch, started, local, fan_out)


def measure_all(run: Run, scratch: Scratch, started: float, local: bool, fan_out: bool) -> int:
    imports_s = 0.0
    arms = grid_arms(run)
    arms = shard_of(arms, run.shard, whole_models=run.map) if run.shard else arms
    shapes = dict(SHAPES)
    if local:
        t = time.perf_counter()
        import torch

        if not run.dry_run and STEP_DEVICE == "cuda" and not torch.cuda.is_available():
            raise UsageError(NO_CUDA)
        scratch.verify_shard_root()
        if run.custom_model:
            shapes["custom"] = load_custom_shape(run.custom_model)
            within_positions(run.custom_model, shapes["custom"].max_positions, run.seqs)
        if run.map:  # this shard's families only
            shapes.update({f: family_shape(f) for f in dict.fromkeys(a.model for a in arms)})
        imports_s = time.perf_counter() - t
    det_models, det_seqs, det_batches = run.determinism_grid
    det_arms = plan_arms(*run.determinism_grid) if run.repeats else []
    how = ("isolated, one fresh process per arm" if run.isolate else
           f"one process per GPU ({','.join(map(str, run.gpus))}), merged" if run.gpus else
           f"shard {run.shard[0]}/{run.shard[1]} in one process" if run.shard else "in one process")
    arms_label = how if run.sweep else ("determinism: one fresh process per repeat" if run.repeats
                                        else "none (modes only)")
    result = Result(environment=environment(run.weights, run.dry_run, arms_label,
                                            [os.path.basename(__file__), *run.argv]) if local else {},
                    kind="map" if run.map else "sweep")
    rows_file = RowFile(run.json)
    rows: list[Row] = []
    children: list[Result] = []
    usage_error = None
    total = (len(arms) if run.sweep else 0) + len(det_arms) * (run.repeats or 0)
    progress = Progress(total if not run.child else 0, started)

    def on_row(row: Row) -> None:
        rows.append(row)  # kept first: nothing after this may lose a finished row
        rows_file.add(row)
        if not run.child:
            progress.arm(row)

    checkpoints = None
    try:
        if run.sweep and fan_out:
            children += spread(replace(run, repeats=None), arms, scratch, on_row)
        elif run.sweep:
            checkpoints = Checkpoints(list(dict.fromkeys(a.model for a in arms)), shapes, run, scratch)
            sweep(arms, shapes, checkpoints, scratch, run, on_row,
                  result.margins.append if run.map and not run.dry_run else None)
            if run.snapshot and not Stop.requested:
                result.control = positive_control(control_step(False), control_step(True))
        if run.repeats and not Stop.requested:
            det_run = replace(run, isolate=True, models=det_models, seqs=det_seqs, batches=det_batches,
                              measure=run.measure and not local, sdpa=run.sdpa and not local)
            children += spread(det_run, det_arms, scratch, on_row)
        if local and run.measure and not Stop.requested:
            result.measure = measure_mode(run.dry_run)
        if local and run.sdpa and not Stop.requested:
            result.sdpa = sdpa_mode(run.dry_run)
    except KeyboardInterrupt:
        Stop.requested = True
    except UsageError as exc:
        if not rows:
            rows_file.finish()
            raise
        usage_error = str(exc)  # e.g. the hub unreachable for a later model: keep the rows
        result.error = f"usage: {usage_error}"
    except Exception as exc:  # a harness bug still prints and saves what was measured
        result.error = last_line(exc)
        print(f"error: the harness failed after {len(rows)} row(s): {result.error}", file=sys.stderr)
    finally:
        progress.close()
        if checkpoints is not None:
            checkpoints.close()
    if children:
        merged = merge(children + ([result] if local else []), arms_label)
        for name in ("environment", "measure", "sdpa", "control", "error"):
            setattr(result, name, getattr(result, name) or getattr(merged, name))
        result.margins = merged.margins
    if not result.environment:
        result.environment = environment(run.weights, run.dry_run, arms_label,
                                         [os.path.basename(__file__), *run.argv], with_torch=False)
    result.rows = sorted(rows, key=row_order)
    result.interrupted = Stop.requested
    result.timings = run_timings(rows, imports_s, time.perf_counter() - started,
                                 checkpoints.build_s if checkpoints else {}, children)
    print(render_text(result), end="", flush=True)
    unwritten = write_outputs(result, run, rows_file)
    for line in (usage_error, unwritten):
        if line:
            print(f"error: {line}", file=sys.stderr)
    return EXIT_USAGE if usage_error or unwritten else result.exit_code


def run_timings(rows: list[Row], imports_s: float, total_s: float, build_s: dict[str, float],
                children: list[Result]) -> dict[str, Any]:
    """The harness's own cost: imports, builds, and per arm setup, step and teardown."""
    t: dict[str, Any] = {"total_s": round(total_s, 2), "imports_s": round(imports_s, 2), "arms": len(rows),
                         "build_s": build_s}
    for key in ("setup_s", "step_s", "teardown_s"):
        t[f"sum_{key}"] = round(sum(r.timings.get(key) or 0 for r in rows), 2)
    overhead = [r.timings["setup_s"] + r.timings["teardown_s"] for r in rows
                if r.timings.get("setup_s") is not None and r.timings.get("teardown_s") is not None]
    if overhead:
        t["median_arm_overhead_s"] = round(statistics.median(overhead), 3)
    if children:
        t["children"] = [c.timings for c in children]
    return t


def load_result(path: str, flag: str = "--from-json") -> Result:
    try:
        return Result.from_json(json.loads(Path(path).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, KeyError, RecursionError, MemoryError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else last_line(exc)
        raise UsageError(f"{flag} {path}: not a result this tool can read ({reason})") from None


def rerender(run: Run) -> int:
    """Saved results (one, or shards of one run) re-judged, merged and rendered; no GPU."""
    results = [load_result(p) for p in run.from_json]
    result = merge(results, f"merged from {len(results)} result(s)") if len(results) > 1 else results[0]
    try:
        text = render_text(result)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise UsageError(f"--from-json: a saved block cannot be rendered ({last_line(exc)})") from None
    if run.compare:
        text += "\n" + compare_table(result, load_result(run.compare, "--compare")) + "\n"
    print(text, end="")
    unwritten = write_outputs(result, run, RowFile(None))
    if unwritten:
        print(f"error: {unwritten}", file=sys.stderr)
        return EXIT_USAGE
    return result.exit_code


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return execute(settle(build_parser().parse_args(argv), argv))
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # stopped before any arm ran: nothing to print or save
        print("interrupted before any arm ran", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
