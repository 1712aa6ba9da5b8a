#!/usr/bin/env python3
"""Re-measure Soup's second-stack VRAM record (issue #395) on any CUDA box.

The claim under test
    Before a layer-streamed LoRA run, Soup predicts its peak VRAM with
    ``soup_cli.utils.layer_stream.estimate_stream_peak_vram`` and refuses the run
    if it will not fit. The contract is that the prediction NEVER under-predicts
    ``torch.cuda.max_memory_allocated()`` of a real step. On an RTX 3050 Laptop it
    did (issue #395); the A10G record re-measured it and found a flat ~1.16x
    over-prediction instead. This harness re-measures that record here, so it can
    be checked rather than trusted.

The protocol (one arm = one row)
    SmolLM2-135M at seq 2048..6144 and Qwen2.5-0.5B at seq 2048..6144, batch 1.
    Each arm is one real Soup setup (``SFTTrainerWrapper(config).setup``) with
    ``training.stream_layers: true``, LoRA r=8 on q_proj/v_proj, bf16, and ONE
    optimizer step. Its real peak is ``max_memory_allocated()`` after emptying the
    cache and resetting the peak stats, around exactly that one step. The
    prediction is Soup's own estimator, fed the grid's shape figures.

The trap
    ``data.max_length`` truncates; it never pads. A row that tokenizes short runs
    at its own length, the real peak stops following seq, and the table shows a
    clean, growing over-prediction that is pure artifact. Two guards, both
    always on: every row's content is 3x longer than seq (``"word "`` x 3 x seq,
    one token a word), and the realised length is read off the first collated
    batch into its own column. A row whose realised length differs from the
    requested seq is VOID: it prints no ratio and the process exits 1.

Models are built locally as architecture-exact synthetic checkpoints: peak VRAM
depends on shapes and dtypes, not on weight values, so an air-gapped box
reproduces the record's pool and extras to the byte. ``--weights hub`` uses the
real hub ids instead.

Every number printed is measured here, computed by Soup, or quoted from the
record and labelled as such. Exit codes: 0 all rows ok; 1 any row VOID, OOM,
FAILED or UNDER; 2 usage error; 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import io
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

# ---------------------------------------------------------------------------
# The record: model shapes and published figures, as data
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One model as the published grid records it, plus its public architecture."""

    key: str
    name: str
    hub_id: str
    model_type: str
    pool: int  # bytes, 2 buffers
    extras: int  # bytes resident beside the pool (embedding + final norm)
    adapter: int  # the grid's adapter count
    vocab: int
    hidden: int
    intermediate: int
    n_layers: int
    heads: int
    kv_heads: int
    max_positions: int
    rope_theta: float
    rms_eps: float
    qkv_bias: bool
    record: bool = True  # False for a --model shape: no published figures


SHAPES: dict[str, Shape] = {
    "smol": Shape(
        key="smol", name="SmolLM2-135M", hub_id="HuggingFaceTB/SmolLM2-135M",
        model_type="llama", pool=14160384, extras=56624256, adapter=921600,
        vocab=49152, hidden=576, intermediate=1536, n_layers=30, heads=9, kv_heads=3,
        max_positions=8192, rope_theta=100000.0, rms_eps=1e-5, qkv_bias=False,
    ),
    "qwen": Shape(
        key="qwen", name="Qwen2.5-0.5B", hub_id="Qwen/Qwen2.5-0.5B",
        model_type="qwen2", pool=59649536, extras=272271104, adapter=1081344,
        vocab=151936, hidden=896, intermediate=4864, n_layers=24, heads=14, kv_heads=2,
        max_positions=32768, rope_theta=1000000.0, rms_eps=1e-6, qkv_bias=True,
    ),
}

#: The record's grid, in the record's order.
RECORD_GRID: dict[str, tuple[int, ...]] = {
    "smol": (2048, 3072, 4096, 4352, 5120, 6144),
    "qwen": (2048, 4096, 5120, 6144),
}

#: The protocol's LoRA. The grid's adapter count is twice the LoRA A+B
#: parameters on these targets (921,600 = 2 x 460,800 for SmolLM2); the
#: derivation for --model reproduces the grid's convention.
LORA_R = 8
LORA_ALPHA = 16
LORA_TARGETS = ("q_proj", "v_proj")
GRID_ADAPTER_FACTOR = 2

#: Rows per arm and the trap's overshoot.
DATA_ROWS = 4
OVERSHOOT = 3

A10G_STACK = (
    "NVIDIA A10G 23 GB (AWS g5.xlarge), Ubuntu 22.04, driver 580.126.09, "
    "torch 2.13.0+cu130, transformers 5.16.1, trl 0.29.1, peft 0.20.0, "
    "Python 3.10, Soup 0.73.3"
)

#: A10G record: real peak in bytes per (model, seq).
RECORD_A10G_PEAK: dict[tuple[str, int], int] = {
    ("smol", 2048): 1365200000, ("smol", 3072): 2016700000,
    ("smol", 4096): 2657800000, ("smol", 4352): 2818400000,
    ("smol", 5120): 3303000000, ("smol", 6144): 3943000000,
    ("qwen", 2048): 4177000000, ("qwen", 4096): 8012300000,
    ("qwen", 5120): 9929400000, ("qwen", 6144): 11848100000,
}
#: A10G record: predicted GB and pred/real ratio, as published.
RECORD_A10G_PREDICTED: dict[tuple[str, int], tuple[float, float]] = {
    ("smol", 2048): (1.596, 1.169), ("smol", 3072): (2.345, 1.163),
    ("smol", 4096): (3.094, 1.164), ("smol", 4352): (3.281, 1.164),
    ("smol", 5120): (3.842, 1.163), ("smol", 6144): (4.591, 1.164),
    ("qwen", 2048): (4.854, 1.162), ("qwen", 4096): (9.346, 1.166),
    ("qwen", 5120): (11.592, 1.167), ("qwen", 6144): (13.837, 1.168),
}
RECORD_A10G_OVERESTIMATE = {"mean": 1.152, "pstdev": 0.0249}
#: RTX 3050 (the first stack), SmolLM2: predicted GB, real GB.
RECORD_RTX3050: dict[tuple[str, int], tuple[float, float]] = {
    ("smol", 4352): (3.282, 3.036),
    ("smol", 5120): (3.844, 4.118),
    ("smol", 6144): (4.590, 5.830),
}
RECORD_MEASURE = {"repeat": 12.0, "spread": 0.0,
                  "vocab": {8192: 12.0, 32768: 12.0, 49152: 12.0, 151936: 12.01010951979781}}
SDPA_SEQS = (2048, 3072, 4096, 5120, 6144)
SDPA_HEADS, SDPA_HEAD_DIM = 9, 64
SDPA_BACKENDS = ("flash", "mem_efficient", "math", "default")
RECORD_SDPA_MB: dict[str, tuple[float, ...]] = {
    "flash": (2.4, 3.7, 4.9, 6.1, 7.3),
    "mem_efficient": (2.4, 3.5, 4.7, 5.9, 7.1),
    "math": (383.9, 831.5, 1463.8, 2279.7, 3267.4),
}
RECORD_SDPA_DEFAULT_NOTE = "record: default 2.4 to 7.3 MB, never the math path"
#: Determinism, SmolLM2 repeated in a fresh process: GB, GB, spread %.
RECORD_DETERMINISM: dict[tuple[str, int], tuple[float, float, float]] = {
    ("smol", 4096): (2.6578, 2.6493, 0.32),
    ("smol", 6144): (3.9430, 3.9439, 0.02),
}
MEASURE_VOCABS = (8192, 32768, 49152, 151936)

EXIT_OK, EXIT_FINDING, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
GB = 1e9


class UsageError(Exception):
    """Bad input: one line on stderr, exit 2."""


# ---------------------------------------------------------------------------
# Building the models: architecture-exact checkpoints, no download
# ---------------------------------------------------------------------------

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Words the chat rows use; each becomes one token, with and without its
#: leading space (byte-level BPE marks that space as "Ġ", newline as "Ċ").
TOKEN_WORDS = ("word", "hi", "user", "assistant", "system")


def hf_config(shape: Shape, eos_id: int = 2, pad_id: int = 0):
    """The transformers config of exactly the grid's shape, with the tokenizer's ids."""
    from transformers import AutoConfig

    kwargs = dict(
        vocab_size=shape.vocab, hidden_size=shape.hidden,
        intermediate_size=shape.intermediate, num_hidden_layers=shape.n_layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions, rms_norm_eps=shape.rms_eps,
        tie_word_embeddings=True, hidden_act="silu",
        rope_theta=shape.rope_theta, bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id,
    )
    if shape.model_type == "qwen2":
        kwargs.update(use_sliding_window=False, sliding_window=None)
    config = AutoConfig.for_model(shape.model_type, **kwargs)
    # transformers 5 keeps rope_theta inside rope_parameters; older keep the attribute.
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict):
        rope["rope_theta"] = shape.rope_theta
    config.dtype = "bfloat16"
    return config


def build_tokenizer(dest: Path) -> dict[str, int]:
    """A byte-level BPE tokenizer in Qwen2's own layout, for both model types.

    transformers 5 rebuilds a Qwen2 tokenizer from vocab + merges with its own
    pre-tokenizer, whatever tokenizer.json says, while a Llama one loads
    tokenizer.json as written. Writing Qwen2's pipeline exactly makes both load
    identically: every ``word`` of a row is one token either way.
    """
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = list(bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for ch in byte_chars:
        vocab.setdefault(ch, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in TOKEN_WORDS:
        acc = word[0]
        for ch in word[1:]:
            if acc + ch not in vocab:
                merges.append((acc, ch))
                vocab[acc + ch] = len(vocab)
            acc += ch
        # Ranked after the word's own chain, so " word" is "Ġ" + "word" -> one token.
        merges.append(("\u0120", word))
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
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=None, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.save_pretrained(str(dest))
    return {tok: vocab[tok] for tok in SPECIAL_TOKENS}


def build_checkpoint(shape: Shape, dest: Path) -> Path:
    """Write a bf16 safetensors checkpoint, config and tokenizer of ``shape``.

    Weights are small random values (never zeros: a zero model can take
    shortcuts a real one cannot); norms are ones. Values do not move the peak.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    dest.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(dest)
    config = hf_config(shape, eos_id=ids["<|im_end|>"], pad_id=ids["<|endoftext|>"])
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(395)
    # One random pool, tiled from a moving offset, instead of drawing half a
    # billion normals one by one (the 0.5B build fell from 7.9 s to 3.0 s here).
    size = 1 << 20
    pool = (torch.randn(2 * size, generator=gen) * 0.02).to(torch.bfloat16)
    tensors: dict[str, Any] = {}
    for i, (name, param) in enumerate(skeleton.state_dict().items()):
        if name == "lm_head.weight":  # tied to the embedding
            continue
        n = math.prod(param.shape)
        if "norm" in name:
            t = torch.ones(param.shape, dtype=torch.bfloat16)
        else:
            offset = (i * 7919) % size
            t = pool[offset:offset + size].repeat(-(-n // size))[:n].view(param.shape)
        tensors[name] = t.contiguous()
    del skeleton
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(dest))
    return dest


def checkpoint_fingerprint(shape: Shape) -> str:
    """Names a built checkpoint by everything that shapes it, so a cache is never stale."""
    import hashlib

    fields = asdict(shape)
    fields.pop("record", None)
    fields["tokenizer_words"] = TOKEN_WORDS
    fields["builder"] = 4
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def synthetic_checkpoint(shape: Shape, root: Path) -> tuple[Path, float]:
    """The built checkpoint for ``shape`` under ``root``, built once; returns (path, build s)."""
    dest = root / f"{shape.key}-{checkpoint_fingerprint(shape)}"
    if (dest / ".complete").exists():
        return dest, 0.0
    started = time.perf_counter()
    partial = root / f".{dest.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    build_checkpoint(shape, partial)
    (partial / ".complete").write_text("ok\n")
    try:
        partial.rename(dest)
    except OSError:
        if (dest / ".complete").exists():  # another process won the race; same copy
            shutil.rmtree(partial, ignore_errors=True)
        else:  # a stale, unmarked folder (an interrupted build): replace it
            shutil.rmtree(dest, ignore_errors=True)
            partial.rename(dest)
    return dest, time.perf_counter() - started


# ---------------------------------------------------------------------------
# --model: derive the grid's figures from any streamable config
# ---------------------------------------------------------------------------


def derive_shape(config: Any, name: str, key: str = "custom") -> Shape:
    """pool, extras, adapter and dims from a config, by the grid's conventions.

    Built on a meta skeleton (no weights allocated): a decoder layer in bf16 is
    half the pool; extras are every other unique parameter (a tied head counted
    once); the adapter is the grid's count for LoRA r=8 on q_proj and v_proj.
    """
    import torch
    from soup_cli.utils.layer_stream import SUPPORTED_STREAM_ARCHS
    from transformers import AutoModelForCausalLM

    model_type = getattr(config, "model_type", "")
    if model_type not in SUPPORTED_STREAM_ARCHS:
        raise UsageError(f"{name}: architecture {model_type!r} cannot be layer-streamed by "
                         f"Soup (it streams {', '.join(SUPPORTED_STREAM_ARCHS)})")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    layers = None
    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == config.num_hidden_layers:
            layers = mod
            break
    if layers is None:
        raise UsageError(f"{name}: could not find its {config.num_hidden_layers} decoder layers")
    layer_params = sum(p.numel() for p in layers[0].parameters())
    layer_ids = {id(p) for p in layers.parameters()}
    seen: set[int] = set()
    extras = 0
    for p in model.parameters():  # parameters() yields a tied weight once
        if id(p) in layer_ids or id(p) in seen:
            continue
        seen.add(id(p))
        extras += p.numel() * 2
    adapter = 0
    for mname, mod in layers.named_modules():
        if mname.split(".")[-1] in LORA_TARGETS and isinstance(mod, torch.nn.Linear):
            adapter += LORA_R * (mod.in_features + mod.out_features)
    adapter *= GRID_ADAPTER_FACTOR
    rope = getattr(config, "rope_parameters", None) or {}
    return Shape(
        key=key, name=name, hub_id=name, model_type=model_type, pool=2 * layer_params * 2,
        extras=extras, adapter=adapter, vocab=int(config.vocab_size),
        hidden=int(config.hidden_size), intermediate=int(config.intermediate_size),
        n_layers=int(config.num_hidden_layers), heads=int(config.num_attention_heads),
        kv_heads=int(getattr(config, "num_key_value_heads", config.num_attention_heads)),
        max_positions=int(getattr(config, "max_position_embeddings", 0) or 0),
        rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 0.0)) or 0.0),
        rms_eps=float(getattr(config, "rms_norm_eps", 0.0) or 0.0),
        qkv_bias=bool(getattr(config, "attention_bias", model_type == "qwen2")), record=False,
    )


def load_custom_shape(model: str) -> Shape:
    """Read --model's config (a local checkpoint or a hub id); refuse what cannot stream."""
    from transformers import AutoConfig

    path = Path(model)
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise UsageError(f"--model {model}: not a checkpoint folder (no config.json)")
        if not any(path.glob("*.safetensors")):
            raise UsageError(f"--model {model}: no .safetensors weights in it; Soup streams "
                             "safetensors checkpoints only")
    import logging

    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a config's warnings are not this tool's one line
    hub_logger = logging.getLogger("huggingface_hub")
    hub_level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)  # its retry warnings neither
    try:
        config = AutoConfig.from_pretrained(model)
    except Exception as exc:
        raise UsageError(f"--model {model}: cannot read its config ({last_line(exc)})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        hub_logger.setLevel(hub_level)
    return derive_shape(config, name=model)


# ---------------------------------------------------------------------------
# The prediction and the derived columns (computed by Soup's own functions)
# ---------------------------------------------------------------------------


def predicted_bytes(shape: Shape, seq: int, batch: int = 1) -> int:
    """Soup's estimator fed the grid's figures, exactly as the record did."""
    from soup_cli.utils.layer_stream import estimate_stream_peak_vram

    return int(estimate_stream_peak_vram(
        layer_bytes=shape.pool // 2, buffers=2, extras_bytes=shape.extras,
        adapter_params=shape.adapter, vocab_size=shape.vocab, hidden_size=shape.hidden,
        intermediate_size=shape.intermediate, n_layers=shape.n_layers,
        seq_len=seq, batch_size=batch,
    ))


def derived_columns(shape: Shape, seq: int, batch: int, predicted: int,
                    real_peak: Optional[int]) -> dict[str, Any]:
    """14 x E, non-logits modelled, the over-estimate and the retained-copy flag.

    E = seq x vocab x batch logits elements. 14 x E is Soup's charged logits
    term (12 bytes of loss arithmetic + a 2-byte retained bf16 copy); the
    over-estimate compares the rest of the prediction with the rest of the
    real peak once the 12 x E the loss path really holds is taken out.
    """
    from soup_cli.utils.layer_stream import LOGITS_LOSS_BYTES_PER_ELEMENT, estimate_logits_bytes

    elements = seq * shape.vocab * batch
    logits14 = int(estimate_logits_bytes(vocab_size=shape.vocab, seq_len=seq, batch_size=batch))
    logits12 = int(LOGITS_LOSS_BYTES_PER_ELEMENT * elements)
    nonlogits = predicted - logits14
    out: dict[str, Any] = {
        "elements": elements, "logits14_bytes": logits14, "logits12_bytes": logits12,
        "nonlogits_modelled_bytes": nonlogits, "pred_over_real": None,
        "nonlogits_overestimate": None, "retained_copy_would_fit": None,
    }
    if real_peak:
        out["pred_over_real"] = predicted / real_peak
        denom = real_peak - logits12
        out["nonlogits_overestimate"] = nonlogits / denom if denom > 0 else None
        out["retained_copy_would_fit"] = logits14 <= real_peak
    return out


# ---------------------------------------------------------------------------
# Scratch: everything the tool writes outside its outputs lives here
# ---------------------------------------------------------------------------


class Scratch:
    """One folder for data, Soup output, shards and checkpoints; removed at exit.

    Soup's shard cache goes here through ``SOUP_LAYER_STREAM_CACHE_DIR`` (or under
    ``--cache-dir``). Soup silently ignores that variable outside ``$HOME``, the
    working directory and ``$TMPDIR``, so the root Soup really resolves is
    checked, not assumed: a shard cache that escaped to ``~/.soup`` would
    outlive the run.
    """

    _ENV = ("SOUP_LAYER_STREAM_CACHE_DIR", "SOUP_AUDIT_LOG_PATH", "HF_HOME",
            "HF_DATASETS_CACHE", "XDG_CACHE_HOME", "TRITON_CACHE_DIR",
            "TORCHINDUCTOR_CACHE_DIR", "MPLCONFIGDIR", "HF_HUB_ETAG_TIMEOUT",
            "HF_HUB_DOWNLOAD_TIMEOUT")

    def __init__(self, cache_dir: Optional[str] = None):
        self.cache_dir = Path(cache_dir).resolve() if cache_dir else None
        self.root: Optional[Path] = None
        self._saved_env: dict[str, Optional[str]] = {}

    def __enter__(self) -> "Scratch":
        self.root = Path(tempfile.mkdtemp(prefix="issue395-scratch-"))
        base = self.cache_dir if self.cache_dir else self.root
        self.shard_root = base / "layer-stream"
        self.shard_root.mkdir(parents=True, exist_ok=True)
        env = {
            "SOUP_LAYER_STREAM_CACHE_DIR": str(self.shard_root),
            "SOUP_AUDIT_LOG_PATH": str(self.root / "soup-audit.jsonl"),
            "HF_HOME": str(self.root / "hf"),
            "HF_DATASETS_CACHE": str(self.root / "hf" / "datasets"),
            "XDG_CACHE_HOME": str(self.root / "xdg"),
            "TRITON_CACHE_DIR": str(self.root / "triton"),
            "TORCHINDUCTOR_CACHE_DIR": str(self.root / "inductor"),
            "MPLCONFIGDIR": str(self.root / "mpl"),
            # An unreachable hub should fail fast, not retry for half a minute.
            "HF_HUB_ETAG_TIMEOUT": os.environ.get("HF_HUB_ETAG_TIMEOUT", "10"),
            "HF_HUB_DOWNLOAD_TIMEOUT": os.environ.get("HF_HUB_DOWNLOAD_TIMEOUT", "20"),
        }
        for key in self._ENV:
            self._saved_env[key] = os.environ.get(key)
        os.environ.update(env)
        return self

    def __exit__(self, *exc: Any) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    def verify_shard_root(self) -> None:
        """Fail loudly if Soup would put its shard cache anywhere but here."""
        real = os.path.realpath(soup_shard_root())
        if real != os.path.realpath(self.shard_root):
            raise UsageError(
                f"Soup would write its layer-stream shard cache to {real}, not "
                f"{self.shard_root}: --cache-dir must lie under $HOME, the working "
                "directory or the temp dir")

    def path(self, *parts: str) -> Path:
        assert self.root is not None
        p = self.root.joinpath(*parts)
        p.mkdir(parents=True, exist_ok=True)
        return p

    def checkpoint_root(self) -> Path:
        if self.cache_dir:
            p = self.cache_dir / "checkpoints"
            p.mkdir(parents=True, exist_ok=True)
            return p
        return self.path("checkpoints")


def soup_shard_root(override: Optional[str] = None) -> str:
    """Where Soup will really put its shard cache, by Soup's own resolution.

    With ``override``, where it would put it were SOUP_LAYER_STREAM_CACHE_DIR that
    folder (a light import: neither torch nor the hub client is loaded).
    """
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
            if saved is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = saved


def check_cache_dir_bounds(cache_dir: str) -> None:
    """Refuse a --cache-dir that Soup would silently ignore (it writes to ~/.soup then)."""
    shards = os.path.join(os.path.realpath(os.path.expanduser(cache_dir)), "layer-stream")
    if os.path.realpath(soup_shard_root(shards)) != shards:
        raise UsageError(
            f"--cache-dir {cache_dir} is outside $HOME, the working directory and the temp "
            "dir; Soup would ignore it and write its shard cache to ~/.soup instead")


# ---------------------------------------------------------------------------
# One measured arm
# ---------------------------------------------------------------------------


@dataclass
class Arm:
    """One row of the grid: a model at one seq and batch."""

    model: str  # a SHAPES key, or "custom" for --model
    seq: int
    batch: int = 1
    index: int = 0  # position in grid order


def rows_for_batch(batch: int, val_split: float = 0.1) -> int:
    """The protocol's 4 rows, or more when Soup's val split would leave a short batch."""
    n = DATA_ROWS
    while int(n * (1 - val_split)) < batch:
        n += 1
    return n


def chat_rows(seq: int, rows: int = DATA_ROWS) -> list[dict[str, Any]]:
    """The protocol's rows: 3x overshoot so truncation, never padding, sets the length."""
    content = "word " * (OVERSHOOT * seq)
    return [{"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": content}]} for _ in range(rows)]


def soup_config_yaml(base: str, data_path: Path, output: Path, seq: int, batch: int) -> str:
    """The protocol's Soup config, verbatim but for the paths, seq and batch."""
    import yaml

    config = {
        "base": base, "task": "sft", "backend": "transformers", "modality": "text",
        "data": {"train": str(data_path), "max_length": seq, "chat_template": "chatml"},
        "output": str(output),
        "training": {
            "batch_size": batch, "gradient_accumulation_steps": 1, "epochs": 1,
            "quantization": "none", "stream_layers": True, "logging_steps": 1,
            "save_steps": 100000,
            "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "target_modules": list(LORA_TARGETS)},
        },
    }
    return yaml.safe_dump(config, sort_keys=False)


def realised_lengths(trainer: Any) -> tuple[int, list[int]]:
    """The first collated batch's width and each row's token count (the second guard).

    ``input_ids.shape[-1]`` is what the step runs at; with batch > 1 a short row
    would hide behind its neighbours' padding, so every row is also read through
    its attention mask when the collator provides one. Both must equal seq.
    """
    batch = next(iter(trainer.get_train_dataloader()))
    ids = batch["input_ids"]
    width = int(ids.shape[-1])
    mask = batch.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        return width, [int(v) for v in mask.sum(dim=-1).tolist()]
    return width, [width] * int(ids.shape[0])


def realised_length(lengths: list[int], seq: int) -> int:
    """The one number the table shows: the row that strays furthest from seq."""
    return max(lengths, key=lambda n: (abs(n - seq), -n)) if lengths else 0


@contextlib.contextmanager
def allocator_history(max_entries: int):
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


def real_peak(trainer: Any, snapshot: bool = False) -> dict[str, Any]:
    """Empty the cache, reset the peak, run exactly ONE optimizer step, read the peak.

    With ``snapshot``, the allocator's history is recorded around the same step
    so the peak can be attributed to live blocks afterwards.
    """
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
    return {"peak": int(torch.cuda.max_memory_allocated()), "resident": int(resident),
            "reserved": int(torch.cuda.max_memory_reserved()), "step_s": seconds,
            "snapshot": taken.get("snapshot")}


def oom_request_bytes(exc: BaseException) -> Optional[int]:
    """The size an OOM asked for, read off torch's message ("Tried to allocate 1.20 GiB")."""
    import re

    m = re.search(r"Tried to allocate ([0-9.]+) ([KMGT]i?B)", str(exc))
    if not m:
        return None
    unit = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
            "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}.get(m.group(2), 1)
    return int(float(m.group(1)) * unit)


def is_oom(exc: BaseException) -> bool:
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except Exception:  # pragma: no cover - torch import failure
        pass
    return "out of memory" in str(exc).lower()


def last_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}".strip()[:300]


def teardown(wrapper: Any) -> Optional[str]:
    """Release the stream runtime and the model; an error here is reported, never raised."""
    error = None
    try:
        if wrapper is not None:
            wrapper._close_stream_runtime()
    except Exception as exc:  # teardown must never mask a measurement
        error = last_line(exc)
    try:
        if wrapper is not None:
            wrapper.trainer = None
            wrapper.model = None
        gc.collect()
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            # Each thread's cuBLAS handle keeps a workspace (32 MiB on Hopper) in
            # the caching allocator. The autograd thread's is created after the
            # first step's peak, so a fresh process never has it at the peak, but
            # the next arm in this process would: measured +32 MiB on every arm
            # after the first before this line. Clearing it makes an in-process
            # arm start as a fresh process does.
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            torch.cuda.empty_cache()
    except Exception as exc:
        error = error or last_line(exc)
    return error


class StampedLog(io.TextIOBase):
    """A log file whose lines carry seconds since the arm began: where setup time goes."""

    def __init__(self, raw: Any):
        self.raw = raw
        self.t0 = time.perf_counter()
        self.at_line_start = True

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

    def writable(self) -> bool:
        return True


LIBRARY_LOGGERS = ("transformers", "trl", "peft", "datasets", "accelerate", "soup_cli",
                   "huggingface_hub", "torch", "py.warnings")


@contextlib.contextmanager
def soup_console(log_path: Optional[Path], verbose: bool):
    """Soup's panels, bars and warnings go to a per-arm log, so stdout holds the tables.

    Rich consoles and logging handlers bind their stream when created, so a
    plain stdout redirect would miss them: each is pointed at the log too.
    """
    if verbose or log_path is None:
        yield
        return
    import logging

    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as raw:
        fh = StampedLog(raw)
        consoles: list[tuple[Any, Any]] = []
        for mod_name in list(sys.modules):
            if mod_name.startswith("soup_cli"):
                con = getattr(sys.modules[mod_name], "console", None)
                # Rich's console keeps None (meaning "sys.stdout at print time") in
                # _file; restoring that, not the stream .file resolves to now.
                if hasattr(con, "_file") and all(con is not c for c, _ in consoles):
                    consoles.append((con, con._file))
        handler = logging.StreamHandler(fh)
        saved = []
        for name in ("",) + LIBRARY_LOGGERS:
            lg = logging.getLogger(name)
            saved.append((lg, lg.handlers[:], lg.propagate))
            lg.handlers = [handler]
            if name:
                lg.propagate = False
        try:
            for con, _ in consoles:
                con.file = fh
            with contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
                yield
        finally:
            for con, original in consoles:
                con._file = original
            for lg, handlers, propagate in saved:
                lg.handlers = handlers
                lg.propagate = propagate


def import_soup() -> None:
    """Import every Soup module the arm touches, so their consoles can be redirected."""
    import soup_cli.config.loader  # noqa: F401
    import soup_cli.data.loader  # noqa: F401
    import soup_cli.trainer.sft  # noqa: F401
    import soup_cli.trainer.stream_setup  # noqa: F401
    import soup_cli.utils.layer_stream  # noqa: F401
    import soup_cli.utils.layer_stream_runtime  # noqa: F401
    import soup_cli.data.sft_format  # noqa: F401


def realised_as_requested(row: dict[str, Any]) -> bool:
    """The guard: the batch's width and every one of its rows is exactly the requested seq."""
    lengths = row.get("realised_rows") or []
    width = row.get("realised_width", row.get("realised"))
    return (row.get("realised") == row["seq"] and width == row["seq"]
            and len(lengths) == row["batch"] and all(n == row["seq"] for n in lengths))


def row_status(row: dict[str, Any]) -> str:
    """ok, or the first finding: FAILED, OOM, VOID, UNDER (a dry run is 'dry-run')."""
    if row.get("error_kind") in ("OOM", "FAILED"):
        return row["error_kind"]
    if not realised_as_requested(row):
        return "VOID"
    if row.get("real_peak") is None:
        return "dry-run" if row.get("dry_run") else "FAILED"
    if row["predicted"] < row["real_peak"]:
        return "UNDER"
    return "ok"


def record_columns(shape: Shape, seq: int, batch: int, real: Optional[int]) -> dict[str, Any]:
    """The A10G figure for this (model, seq), and this run's peak as a ratio of it."""
    rec = RECORD_A10G_PEAK.get((shape.key, seq)) if shape.record and batch == 1 else None
    return {"record_a10g_peak": rec,
            "vs_record": (real / rec) if (rec and real) else None}


def new_row(arm: Arm, shape: Shape, *, base: str, weights: str, dry_run: bool,
            build_s: float = 0.0) -> dict[str, Any]:
    """A row before anything is measured: the arm's inputs and Soup's prediction."""
    return {
        "model": shape.name, "model_key": arm.model, "seq": arm.seq, "batch": arm.batch,
        "weights": weights, "base": base, "index": arm.index, "dry_run": dry_run,
        "realised": None, "realised_width": None, "realised_rows": None,
        "predicted": predicted_bytes(shape, arm.seq, arm.batch), "real_peak": None,
        "resident_before_step": None, "max_reserved": None, "error_kind": None, "error": None,
        "oom_request_bytes": None, "teardown_error": None, "gpu": None, "pid": os.getpid(),
        "timings": {"build_s": round(build_s, 3), "setup_s": None, "step_s": None,
                    "teardown_s": None},
    }


def run_arm(arm: Arm, shape: Shape, base: str, scratch: "Scratch", *, device: str,
            dry_run: bool, weights: str, build_s: float = 0.0, snapshot: bool = False,
            verbose: bool = False, log_dir: Optional[Path] = None,
            step: Optional[Callable[..., dict[str, Any]]] = None) -> dict[str, Any]:
    """One real Soup setup and, on CUDA, one measured step. Always returns a row.

    A failure anywhere is recorded on the row (OOM with the size it asked for,
    FAILED with the error's last line); a teardown error is recorded beside the
    measurement and never replaces it.
    """
    step = step or real_peak
    row = new_row(arm, shape, base=base, weights=weights, dry_run=dry_run, build_s=build_s)
    work = scratch.path("arms", f"{arm.index:03d}-{arm.model}-{arm.seq}-{arm.batch}")
    data_path = work / "train.jsonl"
    with open(data_path, "w", encoding="utf-8") as fh:
        for r in chat_rows(arm.seq, rows_for_batch(arm.batch)):
            fh.write(json.dumps(r) + "\n")
    wrapper = None
    log_path = (log_dir or work) / f"soup-{arm.index:03d}-{arm.model}-{arm.seq}-b{arm.batch}.log"
    row["log"] = str(log_path) if log_dir else None
    t0 = time.perf_counter()
    try:
        import_soup()
        with soup_console(log_path, verbose):
            from soup_cli.config.loader import load_config_from_string
            from soup_cli.data.loader import load_dataset
            from soup_cli.trainer.sft import SFTTrainerWrapper

            config = load_config_from_string(
                soup_config_yaml(base, data_path, work / "out", arm.seq, arm.batch))
            wrapper = SFTTrainerWrapper(config, device=device)
            wrapper.setup(load_dataset(config.data))
            width, lengths = realised_lengths(wrapper.trainer)
            row["realised_width"] = width
            row["realised_rows"] = lengths
            row["realised"] = realised_length(lengths + [width], arm.seq)
            row["timings"]["setup_s"] = round(time.perf_counter() - t0, 3)
            if not dry_run and realised_as_requested(row):
                measured = step(wrapper.trainer, snapshot=snapshot)
                row["real_peak"] = measured["peak"]
                row["resident_before_step"] = measured.get("resident")
                row["max_reserved"] = measured.get("reserved")
                row["timings"]["step_s"] = round(measured.get("step_s") or 0.0, 3)
                if measured.get("snapshot") is not None:
                    row["_snapshot"] = measured["snapshot"]
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a row
        if row["timings"]["setup_s"] is None:
            row["timings"]["setup_s"] = round(time.perf_counter() - t0, 3)
        if is_oom(exc):
            row["error_kind"] = "OOM"
            row["oom_request_bytes"] = oom_request_bytes(exc)
        else:
            row["error_kind"] = "FAILED"
        row["error"] = last_line(exc)
    finally:
        t1 = time.perf_counter()
        row["teardown_error"] = teardown(wrapper)
        wrapper = None
        row["timings"]["teardown_s"] = round(time.perf_counter() - t1, 3)
    return finish_row(row, shape)


def finish_row(row: dict[str, Any], shape: Shape) -> dict[str, Any]:
    """The derived and record columns, the status, and no ratio on a void row."""
    row.update(derived_columns(shape, row["seq"], row["batch"], row["predicted"], row["real_peak"]))
    row.update(record_columns(shape, row["seq"], row["batch"], row["real_peak"]))
    row["status"] = row_status(row)
    if row["status"] == "VOID":  # a void row never passes as a measurement
        for key in ("pred_over_real", "nonlogits_overestimate", "retained_copy_would_fit",
                    "vs_record"):
            row[key] = None
    return row


# ---------------------------------------------------------------------------
# Peak attribution: which blocks are live when the peak is reached
# ---------------------------------------------------------------------------

ALLOC_ROUND = 512  # the caching allocator rounds every block up to 512 bytes


def block_bytes(requested: int) -> int:
    """What the allocator counts for a request: the history records the requested size."""
    return max(ALLOC_ROUND, -(-requested // ALLOC_ROUND) * ALLOC_ROUND)


SIZE_GROUPS = ((100_000_000, ">= 100 MB"), (10_000_000, "10-100 MB"),
               (1_000_000, "1-10 MB"), (0, "< 1 MB"))


def logits_kind(size: int, elements: int) -> Optional[str]:
    """'bf16' or 'fp32' when a block is exactly one logits tensor (seq x vocab x batch)."""
    for name, per in (("bf16", 2), ("fp32", 4)):
        if size == elements * per:
            return name
    return None


def device_trace(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    traces = snapshot.get("device_traces") or []
    return max(traces, key=len) if traces else []


def attribute_peak(snapshot: dict[str, Any], resident: int, elements: int,
                   measured_peak: Optional[int] = None) -> dict[str, Any]:
    """Replay the allocator's history and name what is live at the peak.

    ``resident`` is what was allocated when recording began (the model's
    extras, the pool, the adapter); blocks freed in the trace that were
    allocated before it came out of that figure. The replayed peak is checked
    against the measured one: if they disagree, the history was incomplete and
    the attribution says so rather than presenting a guess as an observation.
    """
    trace = device_trace(snapshot)
    has_requested = any(e.get("action") == "free_requested" for e in trace)
    free_actions = {"free_requested"} if has_requested else {"free", "free_completed"}

    def replay() -> Iterable[tuple[int, int, int, dict[int, int]]]:
        """After each alloc or free: (event index, allocated, pre-existing part, live blocks)."""
        live: dict[int, int] = {}
        base, total = resident, 0
        for i, event in enumerate(trace):
            action = event.get("action")
            addr, size = int(event.get("addr", 0)), int(event.get("size", 0))
            if action == "alloc":
                live[addr] = size
                total += block_bytes(size)
            elif action in free_actions:
                if addr in live:
                    total -= block_bytes(live.pop(addr))
                else:
                    base -= block_bytes(size)
            else:
                continue
            yield i, base + total, base, live

    best, best_at = resident, -1
    for i, allocated, _, _ in replay():
        if allocated > best:
            best, best_at = allocated, i
    live: dict[int, int] = {}
    base = resident
    if best_at >= 0:  # walk again to the peak's event: the live set there
        for i, _, at_base, at_live in replay():
            if i == best_at:
                base, live = at_base, at_live
                break
    groups: dict[str, dict[str, int]] = {}
    logits = {"bf16": {"count": 0, "bytes": 0}, "fp32": {"count": 0, "bytes": 0}}
    for size in live.values():
        kind = logits_kind(size, elements)
        if kind:
            logits[kind]["count"] += 1
            logits[kind]["bytes"] += block_bytes(size)
            continue
        label = next(lbl for floor, lbl in SIZE_GROUPS if size >= floor)
        g = groups.setdefault(label, {"count": 0, "bytes": 0})
        g["count"] += 1
        g["bytes"] += block_bytes(size)
    # A block split off a segment keeps a remainder under 1 MiB unsplit, which the
    # history cannot see; a missing event shows up far beyond that.
    complete = measured_peak is None or abs(best - measured_peak) <= (1 << 20) + measured_peak * 1e-3
    return {
        "elements": elements, "replayed_peak": best, "measured_peak": measured_peak,
        "complete": bool(trace) and complete, "events": len(trace),
        "resident_at_peak": base, "logits_bf16": logits["bf16"], "logits_fp32": logits["fp32"],
        "other_groups": {k: groups[k] for _, k in SIZE_GROUPS if k in groups},
    }


def control_step(hold_copy: bool, tokens: int = 2048, vocab: int = 32768,
                 hidden: int = 256) -> dict[str, Any]:
    """The positive control's loss step: logits from a matmul, Soup's loss, backward.

    With ``hold_copy`` one extra bf16 copy of the logits is held across backward,
    the very retention the record found absent. The attribution must see it.
    """
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
        loss = ForCausalLMLoss(logits, labels, vocab)
        loss.backward()
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del held, logits, loss, h, w, labels
    torch.cuda.empty_cache()
    return attribute_peak(taken["snapshot"], resident, tokens * vocab, peak)


def positive_control(without: dict[str, Any], with_copy: dict[str, Any]) -> dict[str, Any]:
    """Passes only if holding one extra bf16 copy shows exactly one more bf16 logits block."""
    extra = with_copy["logits_bf16"]["count"] - without["logits_bf16"]["count"]
    passed = extra == 1 and without["complete"] and with_copy["complete"]
    return {"without_copy": without, "with_copy": with_copy, "extra_bf16_blocks": extra,
            "passed": passed}


# ---------------------------------------------------------------------------
# Running the arms: in process, isolated, across GPUs, and repeated
# ---------------------------------------------------------------------------


@dataclass
class Options:
    """What every arm needs to know, in-process or in a worker."""

    weights: str = "synthetic"
    dry_run: bool = False
    verbose: bool = False
    snapshot: bool = False
    snapshot_dir: Optional[str] = None
    log_dir: Optional[str] = None
    cache_dir: Optional[str] = None


class Stop:
    """Ctrl-C stops after the arm in flight; a second Ctrl-C, or SIGTERM, stops now.

    Stopping now raises KeyboardInterrupt, so the scratch folder is still removed
    and the rows measured so far are still printed and saved.
    """

    requested = False

    @classmethod
    def install(cls, quiet: bool = False) -> None:
        def on_int(signum: int, frame: Any) -> None:
            if cls.requested:
                raise KeyboardInterrupt
            cls.requested = True
            if quiet:  # a worker: the parent has said it
                return
            # sys.stderr may be an arm's Soup log right now; the user must see this.
            print("\ninterrupt: stopping after the arm in flight (Ctrl-C again to stop now)",
                  file=sys.__stderr__, flush=True)

        def on_term(signum: int, frame: Any) -> None:
            cls.requested = True
            raise KeyboardInterrupt

        try:
            signal.signal(signal.SIGINT, on_int)
            signal.signal(signal.SIGTERM, on_term)
        except ValueError:  # not the main thread
            pass


class Progress:
    """One line per finished arm on stderr: i/n, model, seq, elapsed, time left."""

    def __init__(self, total: int, started: Optional[float] = None):
        self.total = max(total, 1)
        self.started = started or time.perf_counter()
        self.done = 0

    def arm(self, row: dict[str, Any]) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.started
        left = elapsed / self.done * (self.total - self.done)
        peak = f"{row['real_peak'] / GB:.4f} GB" if row.get("real_peak") else "no peak"
        print(f"[arm {self.done}/{self.total}] {row['model']} seq {row['seq']} "
              f"batch {row['batch']}: {row['status']}, {peak}; elapsed {elapsed:.1f} s, "
              f"~{left:.0f} s left", file=sys.stderr, flush=True)


def plan_arms(models: list[str], seqs: Optional[list[int]], batches: list[int]) -> list[Arm]:
    """Grid order: model, then seq, then batch (the record's order)."""
    arms = []
    for model in models:
        for seq in (seqs or list(RECORD_GRID.get(model, ()))):
            for batch in batches:
                arms.append(Arm(model=model, seq=seq, batch=batch, index=len(arms)))
    return arms


def schedule(arms: list[Arm], gpus: list[int]) -> dict[int, list[Arm]]:
    """Deal arms to GPUs, costliest first, to the least-loaded GPU; ties to the lower id.

    The cost is Soup's own prediction (it tracks the step's size); output order
    never depends on this: rows are merged back in grid order.
    """
    queues: dict[int, list[Arm]] = {g: [] for g in gpus}
    load = {g: 0 for g in gpus}
    cost = {a.index: predicted_bytes(SHAPES[a.model], a.seq, a.batch) if a.model in SHAPES
            else a.seq * a.batch for a in arms}
    for a in sorted(arms, key=lambda a: (-cost[a.index], a.index)):
        g = min(gpus, key=lambda g: (load[g], gpus.index(g)))
        queues[g].append(a)
        load[g] += cost[a.index]
    for g in gpus:
        queues[g].sort(key=lambda a: a.index)
    return queues


def merge_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: (r["index"], r.get("repeat", 0)))


class RowSink:
    """Rows are appended as JSON lines as they finish, so nothing is lost: beside
    --json for the user, and a worker's file the parent reads back."""

    def __init__(self, path: Optional[Path]):
        self.path = path

    @classmethod
    def beside(cls, json_path: Optional[str]) -> "RowSink":
        if not json_path:
            return cls(None)
        path = Path(json_path + ".rows.jsonl")
        path.unlink(missing_ok=True)  # created by the first finished row
        return cls(path)

    def add(self, row: dict[str, Any]) -> None:
        if self.path:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(public_row(row)) + "\n")

    def finish(self) -> None:
        if self.path:
            self.path.unlink(missing_ok=True)


def public_row(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not k.startswith("_")}


def measured_row(arm: Arm, shape: Shape, base: str, build_s: float, scratch: Scratch,
                 opts: Options, device: str) -> dict[str, Any]:
    """run_arm, plus the snapshot's attribution (the raw snapshot is kept only on request)."""
    row = run_arm(arm, shape, base, scratch, device=device, dry_run=opts.dry_run,
                  weights=opts.weights, build_s=build_s, snapshot=opts.snapshot,
                  verbose=opts.verbose, log_dir=Path(opts.log_dir) if opts.log_dir else None)
    snap = row.pop("_snapshot", None)
    if snap is not None:
        row["attribution"] = attribute_peak(snap, row["resident_before_step"] or 0,
                                            row["elements"], row["real_peak"])
        if opts.snapshot_dir:
            import pickle

            out = Path(opts.snapshot_dir) / f"snapshot-{arm.model}-{arm.seq}-b{arm.batch}.pickle"
            with open(out, "wb") as fh:
                pickle.dump(snap, fh)
            row["snapshot_file"] = str(out)
    if device.startswith("cuda"):
        import torch

        row["gpu"] = f"{os.environ.get('CUDA_VISIBLE_DEVICES', '0')}: {torch.cuda.get_device_name(0)}"
    return row


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def arm_device(opts: Options) -> str:
    """Where Soup builds the streamed model: CPU for a dry run, else the GPU."""
    return "cpu" if opts.dry_run else "cuda"


def run_in_process(arms: list[Arm], shapes: dict[str, Shape], bases: dict[str, tuple[str, float]],
                   scratch: Scratch, opts: Options, on_row: Callable[[dict[str, Any]], None],
                   repeat: int = 0) -> None:
    device = arm_device(opts)
    built: set[str] = set()
    for arm in arms:
        if Stop.requested:
            break
        base, build_s = bases[arm.model]
        row = measured_row(arm, shapes[arm.model], base, 0.0 if arm.model in built else build_s,
                           scratch, opts, device)
        built.add(arm.model)
        row["repeat"] = repeat
        on_row(row)


def worker_main(spec_path: str) -> int:
    """A fresh process: run the arms in the spec, append each row to its out file."""
    spec = json.loads(Path(spec_path).read_text())
    Stop.install(quiet=True)
    opts = Options(**spec["options"])
    shapes = {k: Shape(**v) for k, v in spec["shapes"].items()}
    bases = {k: (v[0], v[1]) for k, v in spec["bases"].items()}
    arms = [Arm(**a) for a in spec["arms"]]
    scratch = Scratch()
    scratch.root = Path(spec["scratch_root"])  # borrowed: the parent removes it
    scratch.shard_root = Path(os.environ["SOUP_LAYER_STREAM_CACHE_DIR"])
    sink = RowSink(Path(spec["out"]))
    try:
        run_in_process(arms, shapes, bases, scratch, opts, sink.add, repeat=spec.get("repeat", 0))
    except KeyboardInterrupt:  # "stop now": the arm in flight is dropped, quietly
        return EXIT_INTERRUPTED
    return EXIT_INTERRUPTED if Stop.requested else EXIT_OK


def lost_row(arm: Arm, shape: Shape, opts: Options, base: str, repeat: int,
             code: Optional[int]) -> dict[str, Any]:
    """A FAILED row for an arm whose worker process died before reporting it."""
    row = new_row(arm, shape, base=base, weights=opts.weights, dry_run=opts.dry_run)
    row.update(error_kind="FAILED", pid=None, repeat=repeat,
               error=f"worker process exited with code {code} before this arm reported")
    return finish_row(row, shape)


def complete_lines(path: Path) -> list[str]:
    """Lines a worker has finished writing; a line still being written is left for later."""
    text = path.read_text(encoding="utf-8")
    return text.split("\n")[:-1]


def visible_gpu(ordinal: int) -> str:
    """--gpus counts the GPUs this process sees; a worker needs the id behind it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if ordinal < len(ids):
            return ids[ordinal]
    return str(ordinal)


def run_workers(jobs: list[tuple[Optional[int], list[Arm], int]], shapes: dict[str, Shape],
                bases: dict[str, tuple[str, float]], scratch: Scratch, opts: Options,
                on_row: Callable[[dict[str, Any]], None]) -> None:
    """Each job is (gpu or None, arms, repeat) in its own fresh process.

    Jobs for different GPUs run at once; jobs for the same GPU run one after
    another. Rows are read back as each worker appends them. A worker that dies
    leaves a FAILED row for every arm it did not report, never a silent gap.
    Workers run in their own session, so a terminal's Ctrl-C reaches this
    process alone and is passed on once ("stop after the arm in flight"); a
    second one, or an error here, stops them now and keeps what they wrote.
    """
    lanes: dict[Optional[int], list[tuple[list[Arm], int]]] = {}
    for gpu, arms, repeat in jobs:
        lanes.setdefault(gpu, []).append((arms, repeat))
    running: dict[Optional[int], dict[str, Any]] = {}
    counter = 0
    forwarded = False

    def launch(g: Optional[int]) -> None:
        nonlocal counter
        arms, repeat = lanes[g].pop(0)
        counter += 1
        work = scratch.path("workers", f"{counter:04d}")
        out = work / "rows.jsonl"
        out.write_text("")
        spec = {"options": asdict(opts), "shapes": {k: asdict(v) for k, v in shapes.items()},
                "bases": bases, "arms": [asdict(a) for a in arms], "repeat": repeat,
                "scratch_root": str(scratch.root), "out": str(out)}
        (work / "spec.json").write_text(json.dumps(spec))
        env = dict(os.environ)
        if g is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible_gpu(g)
            # One shard cache per GPU lane: two lanes sharding one model at once would race.
            env["SOUP_LAYER_STREAM_CACHE_DIR"] = str(Path(scratch.shard_root) / f"gpu{g}")
            Path(env["SOUP_LAYER_STREAM_CACHE_DIR"]).mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_worker",
                                 str(work / "spec.json")], env=env, start_new_session=True)
        running[g] = {"proc": proc, "out": out, "seen": 0, "arms": arms, "repeat": repeat,
                      "reported": set()}

    def drain(g: Optional[int]) -> None:
        entry = running[g]
        lines = complete_lines(entry["out"])
        for line in lines[entry["seen"]:]:
            row = json.loads(line)
            entry["reported"].add(row["index"])
            on_row(row)
        entry["seen"] = len(lines)

    def settle(g: Optional[int]) -> None:
        """A worker has exited: its last rows, then a FAILED row for each lost arm."""
        drain(g)
        entry = running.pop(g)
        code = entry["proc"].returncode
        if Stop.requested:  # arms it skipped on request were not lost
            return
        for arm in entry["arms"]:
            if arm.index not in entry["reported"]:
                on_row(lost_row(arm, shapes[arm.model], opts, bases[arm.model][0],
                                entry["repeat"], code))

    try:
        for g in lanes:
            if lanes[g]:
                launch(g)
        while running:
            time.sleep(0.2)
            if Stop.requested and not forwarded:
                forwarded = True
                for entry in running.values():
                    entry["proc"].send_signal(signal.SIGINT)
            for g in list(running):
                drain(g)
                if running[g]["proc"].poll() is not None:
                    settle(g)
                    if lanes[g] and not Stop.requested:
                        launch(g)
    finally:
        for entry in running.values():  # only after a second Ctrl-C or an error here
            if entry["proc"].poll() is None:
                entry["proc"].send_signal(signal.SIGINT if forwarded else signal.SIGTERM)
        for g in list(running):
            try:
                running[g]["proc"].wait(timeout=15)
            except subprocess.TimeoutExpired:
                running[g]["proc"].kill()
                running[g]["proc"].wait()
            drain(g)
            running.pop(g)


def resolve_bases(keys: list[str], shapes: dict[str, Shape], opts: Options, scratch: Scratch,
                  custom: Optional[str]) -> dict[str, tuple[str, float]]:
    """Where each model's checkpoint comes from: built here, or the hub, or --model."""
    bases: dict[str, tuple[str, float]] = {}
    for key in keys:
        if key == "custom":
            assert custom is not None
            bases[key] = (str(Path(custom).resolve()) if Path(custom).exists()
                          else hub_snapshot(custom, scratch), 0.0)
        elif opts.weights == "hub":
            bases[key] = (hub_snapshot(shapes[key].hub_id, scratch), 0.0)
        else:
            path, build_s = synthetic_checkpoint(shapes[key], scratch.checkpoint_root())
            bases[key] = (str(path), build_s)
    return bases


def hub_snapshot(repo_id: str, scratch: Scratch) -> str:
    """Fetch a hub checkpoint into scratch (or --cache-dir), so Soup reads a local folder.

    Soup's own hub path would cache the weights under ~/.soup, outside scratch.
    """
    from huggingface_hub import snapshot_download

    root = (scratch.cache_dir / "hub") if scratch.cache_dir else scratch.path("hub")
    dest = root / repo_id.replace("/", "--")
    try:
        return snapshot_download(repo_id, local_dir=str(dest),
                                 allow_patterns=["*.safetensors", "*.json", "*.txt", "*.model",
                                                 "*.jinja"])
    except Exception as exc:
        raise UsageError(f"--weights hub: cannot fetch {repo_id} from the hub ({last_line(exc)}); "
                         "--weights synthetic builds the same shapes with no network") from None


# ---------------------------------------------------------------------------
# The modes
# ---------------------------------------------------------------------------


def measure_mode(dry_run: bool) -> dict[str, Any]:
    """The shipped constants, Soup's probe three times with the spread, then by vocab."""
    from soup_cli.utils.layer_stream import (
        LOGITS_BYTES_PER_ELEMENT,
        LOGITS_LOSS_BYTES_PER_ELEMENT,
        measure_logits_loss_bytes_per_element,
    )

    constants = {"LOGITS_BYTES_PER_ELEMENT": LOGITS_BYTES_PER_ELEMENT,
                 "LOGITS_LOSS_BYTES_PER_ELEMENT": LOGITS_LOSS_BYTES_PER_ELEMENT}

    def probe(**kw: Any) -> Any:
        if dry_run:
            return "n/a (dry run)"
        v = measure_logits_loss_bytes_per_element(**kw)
        return "n/a (probe failed)" if v is None else float(v)

    repeats = [probe() for _ in range(3)]
    nums = [v for v in repeats if not isinstance(v, str)]
    spread: Any = (max(nums) - min(nums)) if len(nums) == 3 else "-"
    by_vocab = {v: probe(vocab_size=v) for v in MEASURE_VOCABS}
    return {"constants": constants, "repeats": repeats, "spread": spread, "by_vocab": by_vocab}


def sdpa_extra_mb(seq: int, backend: str) -> Any:
    """Extra allocation of one causal self-attention over its inputs, in MB (1e6 bytes)."""
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
        base = torch.cuda.memory_allocated()
        ctx = sdpa_kernel(kinds[backend]) if backend in kinds else contextlib.nullcontext()
        with ctx:
            out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - base) / 1e6
        del out
        return round(extra, 1)
    except Exception as exc:  # a backend that raises is data, not a crash
        return f"n/a ({type(exc).__name__})"
    finally:
        del q
        torch.cuda.empty_cache()


def sdpa_mode(dry_run: bool, seqs: Iterable[int] = SDPA_SEQS) -> dict[str, Any]:
    """Each backend once, untimed, first: a first call also allocates library
    workspace (cuBLAS for the math path), which is not the attention's own cost."""
    seqs = list(seqs)
    extra: dict[str, list[Any]] = {}
    if not dry_run:
        for backend in SDPA_BACKENDS:
            sdpa_extra_mb(min(seqs), backend)
    for backend in SDPA_BACKENDS:
        extra[backend] = ["n/a (dry run)" if dry_run else sdpa_extra_mb(q, backend) for q in seqs]
    return {"seqs": seqs, "extra_mb": extra}


def determinism_mode(plan: dict[str, Any], args: argparse.Namespace, shapes: dict[str, Shape],
                     scratch: Scratch, opts: Options, sink: Optional["RowSink"] = None
                     ) -> dict[str, Any]:
    """Each chosen arm, N times, each time in a fresh process."""
    repeats = plan["repeats"] or 2
    if args.models or args.seq or args.model or plan["batches"] != [1]:
        arms = plan_arms(plan["models"], plan["seqs"], plan["batches"])
    else:
        arms = [Arm("smol", 4096, 1, 0), Arm("smol", 6144, 1, 1)]
    bases = resolve_bases(sorted({a.model for a in arms}), shapes, opts, scratch, args.model)
    collected: list[dict[str, Any]] = []
    progress = Progress(len(arms) * repeats)
    jobs = [(plan["gpus"][0] if plan["gpus"] else None, [a], rep)
            for rep in range(repeats) for a in arms]

    def on_row(row: dict[str, Any]) -> None:
        collected.append(row)
        if sink is not None:
            sink.add(dict(row, mode="determinism"))
        progress.arm(row)

    run_workers(jobs, shapes, bases, scratch, opts, on_row)
    out = []
    for a in arms:
        mine = sorted((r for r in collected if r["index"] == a.index), key=lambda r: r["repeat"])
        peaks = [r.get("real_peak") for r in mine]
        nums = [p for p in peaks if p]
        spread = (max(nums) - min(nums)) / min(nums) * 100 if len(nums) >= 2 else None
        out.append({"model": shapes[a.model].name, "model_key": a.model, "seq": a.seq,
                    "batch": a.batch, "peaks": peaks, "pids": [r["pid"] for r in mine],
                    "statuses": [r["status"] for r in mine],
                    "spread_pct": spread, "rows": [public_row(r) for r in mine]})
    return {"repeats": repeats, "arms": out}


# ---------------------------------------------------------------------------
# The stack a run came from
# ---------------------------------------------------------------------------


def package_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def gpu_driver() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:
        return None


def environment(weights: str, isolation: str, argv: list[str]) -> dict[str, Any]:
    """The environment stamp every output carries."""
    import torch

    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count_visible": torch.cuda.device_count() if cuda else 0,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "driver": gpu_driver() if cuda else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "trl": package_version("trl"),
        "peft": package_version("peft"),
        "soup_cli": package_version("soup-cli"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "weights": weights,
        "isolation": isolation,
        "command": " ".join(argv),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def header_line(env: dict[str, Any]) -> str:
    return (f"stack: torch {env['torch']} (CUDA {env['cuda'] or 'none'}) | "
            f"GPU {env['gpu'] or 'none'}"
            + (f" (driver {env['driver']})" if env.get("driver") else "")
            + f" | transformers {env['transformers']} | trl {env['trl']} | peft {env['peft']}"
            f" | soup-cli {env['soup_cli']} | weights {env['weights']} | arms {env['isolation']}")


# ---------------------------------------------------------------------------
# Tables (fixed width; every figure labelled measured, Soup or record)
# ---------------------------------------------------------------------------


def gb(v: Optional[float], places: int = 4) -> str:
    return "-" if v is None else f"{v / GB:.{places}f}"


def ratio(v: Optional[float], places: int = 3) -> str:
    return "-" if v is None else f"{v:.{places}f}x"


def sweep_table(rows: list[dict[str, Any]]) -> str:
    """One section per model. seq and realised lead, as in the record."""
    peak_na = "n/a (dry run)"
    cols = [("seq", 6), ("realised", 8), ("batch", 5), ("predicted GB", 12),
            ("real peak GB", 13), ("pred/real", 9), ("A10G peak GB", 12), ("vs A10G", 8),
            ("14xE GB", 8), ("non-logits GB", 13), ("over-est", 8), ("14xE<=peak", 10),
            ("status", 7)]
    head = "  ".join(f"{name:>{w}}" for name, w in cols)
    out = []
    models: list[str] = []
    for r in rows:
        if r["model"] not in models:
            models.append(r["model"])
    for model in models:
        out.append(f"{model}  (predicted: Soup's estimator; real peak: measured here; "
                   "A10G: the record)")
        out.append(head)
        out.append("-" * len(head))
        for r in (r for r in rows if r["model"] == model):
            void = r["status"] == "VOID"
            if r.get("real_peak") is not None:
                real = gb(r["real_peak"])
            elif r["status"] in ("OOM", "FAILED"):
                real = r["status"]
            else:
                real = peak_na if r.get("dry_run") else "-"
            flag = r.get("retained_copy_would_fit")
            cells = [
                str(r["seq"]), "-" if r.get("realised") is None else str(r["realised"]),
                str(r["batch"]), gb(r["predicted"]), real,
                "VOID" if void else ratio(r.get("pred_over_real")),
                gb(r.get("record_a10g_peak")),
                "VOID" if void else ratio(r.get("vs_record")),
                gb(r["logits14_bytes"], 3), gb(r["nonlogits_modelled_bytes"], 3),
                "VOID" if void else ratio(r.get("nonlogits_overestimate")),
                "-" if flag is None else ("FITS" if flag else "no"),
                r["status"],
            ]
            out.append("  ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, cols, strict=True)))
        out.append("")
    out.append(overestimate_line(rows))
    notes = [f"  {r['model']} seq {r['seq']} batch {r['batch']}: {r['status']} - "
             f"{r.get('error') or ''}"
             + (f" (asked for {r['oom_request_bytes'] / GB:.2f} GB)" if r.get("oom_request_bytes") else "")
             for r in rows if r["status"] in ("OOM", "FAILED")]
    notes += [f"  {r['model']} seq {r['seq']}: teardown error (measurement kept): {r['teardown_error']}"
              for r in rows if r.get("teardown_error")]
    notes += [f"  {r['model']} seq {r['seq']} batch {r['batch']}: VOID - realised {r.get('realised_rows')} "
              f"!= requested {r['seq']}; no ratio is printed for it"
              for r in rows if r["status"] == "VOID"]
    if notes:
        out.append("notes:")
        out.extend(notes)
    return "\n".join(out)


def overestimate_summary(rows: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    vals = [r["nonlogits_overestimate"] for r in rows
            if r.get("status") in ("ok", "UNDER") and r.get("nonlogits_overestimate") is not None]
    if not vals:
        return None
    return {"n": len(vals), "mean": statistics.fmean(vals), "pstdev": statistics.pstdev(vals)}


def overestimate_line(rows: list[dict[str, Any]]) -> str:
    s = overestimate_summary(rows)
    rec = RECORD_A10G_OVERESTIMATE
    if s is None:
        return (f"non-logits over-estimate: no measured rows (record: mean {rec['mean']:.3f}x, "
                f"pstdev {rec['pstdev']:.4f})")
    return (f"non-logits over-estimate over {s['n']} measured rows: mean {s['mean']:.3f}x, "
            f"population stdev {s['pstdev']:.4f} (record, 10 rows: mean {rec['mean']:.3f}x, "
            f"pstdev {rec['pstdev']:.4f})")


def attribution_table(rows: list[dict[str, Any]], control: Optional[dict[str, Any]]) -> str:
    out = ["peak attribution (allocator history around the one step; measured here)"]
    if control is not None:
        verdict = "PASSED" if control.get("passed") else "FAILED"
        out.append(f"positive control: {verdict} - holding one extra bf16 logits copy across "
                   f"backward showed {control.get('extra_bf16_blocks')} more bf16 logits-shaped "
                   "block(s) at the peak (exactly 1 expected)")
    head = (f"{'model':>13}  {'seq':>5}  {'batch':>5}  {'bf16 logits':>11}  {'bf16 GB':>8}  "
            f"{'fp32 logits':>11}  {'fp32 GB':>8}  {'logits share':>12}  {'resident GB':>11}  "
            f"{'other (count, GB)':<40}")
    out += [head, "-" * len(head)]
    for r in rows:
        a = r.get("attribution")
        if not a:
            continue
        peak = a["replayed_peak"] or 1
        share = (a["logits_bf16"]["bytes"] + a["logits_fp32"]["bytes"]) / peak
        other = ", ".join(f"{k}: {v['count']}/{v['bytes'] / GB:.3f}" for k, v in a["other_groups"].items())
        if not a.get("complete"):
            other = "history incomplete: not a finding; " + other
        elif control is None:
            other = "no positive control ran: not a finding; " + other
        elif not control.get("passed"):
            other = "control failed: not a finding; " + other
        out.append(f"{r['model']:>13}  {r['seq']:>5}  {r['batch']:>5}  "
                   f"{a['logits_bf16']['count']:>11}  {a['logits_bf16']['bytes'] / GB:>8.3f}  "
                   f"{a['logits_fp32']['count']:>11}  {a['logits_fp32']['bytes'] / GB:>8.3f}  "
                   f"{share:>11.1%}  {a['resident_at_peak'] / GB:>11.3f}  {other:<40}")
    return "\n".join(out)


def measure_table(m: dict[str, Any]) -> str:
    rec = RECORD_MEASURE
    out = ["--measure: bytes per logit element (Soup's constants; Soup's probe measured here; "
           "the A10G record)",
           f"  LOGITS_BYTES_PER_ELEMENT      (Soup, shipped) {m['constants']['LOGITS_BYTES_PER_ELEMENT']}",
           f"  LOGITS_LOSS_BYTES_PER_ELEMENT (Soup, shipped) {m['constants']['LOGITS_LOSS_BYTES_PER_ELEMENT']}"]
    head = f"  {'probe':<22}  {'measured':>20}  {'A10G record':>20}"
    out += [head, "  " + "-" * (len(head) - 2)]

    def fmt(v: Any) -> str:
        return v if isinstance(v, str) else ("-" if v is None else repr(float(v)))

    for i, v in enumerate(m["repeats"], 1):
        out.append(f"  {'default, run ' + str(i):<22}  {fmt(v):>20}  {fmt(rec['repeat']):>20}")
    out.append(f"  {'spread (max - min)':<22}  {fmt(m['spread']):>20}  {fmt(rec['spread']):>20}")
    for vocab, v in m["by_vocab"].items():
        out.append(f"  {'vocab ' + str(vocab):<22}  {fmt(v):>20}  "
                   f"{fmt(rec['vocab'].get(int(vocab))):>20}")
    return "\n".join(out)


def sdpa_table(s: dict[str, Any]) -> str:
    out = ["--sdpa: extra allocation over the baseline, MB (measured here | A10G record); "
           f"bf16 query (1, {SDPA_HEADS}, seq, {SDPA_HEAD_DIM}), causal self-attention"]
    seqs = [int(x) for x in s["seqs"]]
    head = f"  {'backend':<14}" + "".join(f"  {'seq ' + str(q):>20}" for q in seqs)
    out += [head, "  " + "-" * (len(head) - 2)]
    for backend in SDPA_BACKENDS:
        cells = []
        for i, q in enumerate(seqs):
            v = s["extra_mb"][backend][i]
            mine = v if isinstance(v, str) else f"{v:.1f}"
            rec_vals = RECORD_SDPA_MB.get(backend)
            rec = "-"
            if rec_vals and q in SDPA_SEQS:
                rec = f"{rec_vals[SDPA_SEQS.index(q)]:.1f}"
            cells.append(f"{mine} | {rec}")
        out.append(f"  {backend:<14}" + "".join(f"  {c:>20}" for c in cells))
    out.append(f"  {RECORD_SDPA_DEFAULT_NOTE}; math is the positive control (the seq^2 cost is real)")
    return "\n".join(out)


def determinism_table(d: dict[str, Any]) -> str:
    out = ["--determinism: the same arm in fresh processes (measured here | A10G record)"]
    for entry in d["arms"]:
        peaks = ", ".join("-" if p is None else f"{p / GB:.4f}" for p in entry["peaks"])
        statuses = entry.get("statuses") or []
        findings = [f"repeat {i + 1} {st}" for i, st in enumerate(statuses) if st != "ok"]
        rec = RECORD_DETERMINISM.get((entry["model_key"], entry["seq"])) if entry["batch"] == 1 else None
        rec_s = f"{rec[0]:.4f}, {rec[1]:.4f} GB, spread {rec[2]:.2f}%" if rec else "-"
        spread = "-" if entry["spread_pct"] is None else f"{entry['spread_pct']:.2f}%"
        pids = ",".join(str(p) for p in entry["pids"])
        out.append(f"  {entry['model']} seq {entry['seq']} batch {entry['batch']}: peaks {peaks} GB "
                   f"(pids {pids}); spread {spread} | record {rec_s}"
                   + (f"; {', '.join(findings)}" if findings else ""))
    return "\n".join(out)


def compare_table(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Same arms in two saved runs (e.g. in-process against --isolate)."""
    out = [f"compare: A = {a['environment']['isolation']} ({a['environment']['date']}), "
           f"B = {b['environment']['isolation']} ({b['environment']['date']}); measured peaks"]
    head = f"  {'model':>13}  {'seq':>5}  {'batch':>5}  {'A GB':>9}  {'B GB':>9}  {'B - A bytes':>12}  {'diff':>8}"
    out += [head, "  " + "-" * (len(head) - 2)]
    index = {(r["model"], r["seq"], r["batch"]): r for r in b["rows"]}
    for r in a["rows"]:
        o = index.get((r["model"], r["seq"], r["batch"]))
        if not o or r.get("real_peak") is None or o.get("real_peak") is None:
            continue
        d = o["real_peak"] - r["real_peak"]
        out.append(f"  {r['model']:>13}  {r['seq']:>5}  {r['batch']:>5}  {gb(r['real_peak']):>9}  "
                   f"{gb(o['real_peak']):>9}  {d:>12}  {d / r['real_peak']:>8.3%}")
    return "\n".join(out)


# ---------------------------------------------------------------------------
# Reports: JSON, a markdown record, a plot
# ---------------------------------------------------------------------------


def exit_code(result: dict[str, Any]) -> int:
    """0 all rows ok; 1 any row VOID, OOM, FAILED or UNDER (or a failed control); 130 interrupted."""
    if result.get("interrupted"):
        return EXIT_INTERRUPTED
    findings = {"VOID", "OOM", "FAILED", "UNDER"}
    rows = list(result.get("rows") or [])
    for entry in (result.get("determinism") or {}).get("arms", []):
        rows.extend(entry.get("rows", []))
    if any(r.get("status") in findings for r in rows):
        return EXIT_FINDING
    if result.get("control") is not None and not result["control"].get("passed"):
        return EXIT_FINDING
    if result.get("error"):
        return EXIT_FINDING
    return EXIT_OK


def render_text(result: dict[str, Any]) -> str:
    """The header and every table this result holds, as the console shows them."""
    return header_line(result["environment"]) + "\n" + render_tables(result)


def render_tables(result: dict[str, Any]) -> str:
    parts = []
    if result.get("rows"):
        parts += ["", sweep_table(result["rows"])]
        if any(r.get("attribution") for r in result["rows"]):
            parts += ["", attribution_table(result["rows"], result.get("control"))]
    if result.get("determinism"):
        parts += ["", determinism_table(result["determinism"])]
    if result.get("measure"):
        parts += ["", measure_table(result["measure"])]
    if result.get("sdpa"):
        parts += ["", sdpa_table(result["sdpa"])]
    if result.get("interrupted"):
        parts += ["", f"interrupted: {len(result.get('rows') or [])} row(s) measured before the stop"]
    return "\n".join(parts) + "\n" if parts else ""


def verdict(r: dict[str, Any]) -> str:
    if r["status"] == "ok":
        return "over-predicts, safe"
    if r["status"] == "UNDER":
        return "UNDER-predicts"
    return r["status"]


def render_markdown(result: dict[str, Any]) -> str:
    """This run as a record in the #395 record's style, ready to paste."""
    env = result["environment"]
    rows = result.get("rows") or []
    md = [f"# Second-stack VRAM record: {env.get('gpu') or 'no GPU'} ({env['date'][:10]})", "",
          f"Stack: {env.get('gpu') or 'no GPU'}, driver {env.get('driver') or '-'}, CUDA "
          f"{env.get('cuda') or '-'}, torch {env['torch']}, transformers {env['transformers']}, "
          f"trl {env['trl']}, peft {env['peft']}, Python {env['python']}, Soup {env['soup_cli']}, "
          f"{env['platform']}. Weights: {env['weights']}. Arms: {env['isolation']}.", "",
          f"Command: `{env['command']}`", "",
          f"Compared against the A10G record: {A10G_STACK}. Predicted = Soup's "
          "`estimate_stream_peak_vram`; real peak = `torch.cuda.max_memory_allocated()` "
          "around one optimizer step, measured by this run.", ""]
    models: list[str] = []
    for r in rows:
        if r["model"] not in models:
            models.append(r["model"])
    for model in models:
        md += [f"## {model}", "",
               "| seq | realised | batch | predicted GB | real peak GB | pred/real | A10G real GB "
               "| vs A10G | verdict |", "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in (x for x in rows if x["model"] == model):
            void = r["status"] == "VOID"
            md.append(f"| {r['seq']} | {r.get('realised') if r.get('realised') is not None else '-'} "
                      f"| {r['batch']} | {gb(r['predicted'])} | {gb(r.get('real_peak'))} | "
                      f"{'VOID' if void else ratio(r.get('pred_over_real'))} | "
                      f"{gb(r.get('record_a10g_peak'))} | {'VOID' if void else ratio(r.get('vs_record'))} "
                      f"| {verdict(r)} |")
        md.append("")
    if rows:
        md += ["## 14 x E against the real peak", "",
               "14 x E = Soup's logits charge (12 bytes of loss arithmetic + a 2-byte retained "
               "bf16 copy) per logits element; where it exceeds the whole real peak, the retained "
               "copy cannot be there.", "",
               "| model | seq | batch | 14 x E GB | real peak GB | retained copy would fit "
               "| A10G real peak GB | A10G: would fit |", "|---|---:|---:|---:|---:|---|---:|---|"]
        for r in rows:
            flag = r.get("retained_copy_would_fit")
            rec = r.get("record_a10g_peak")
            rec_flag = "-" if rec is None else ("yes" if r["logits14_bytes"] <= rec else "no")
            md.append(f"| {r['model']} | {r['seq']} | {r['batch']} | {gb(r['logits14_bytes'], 3)} | "
                      f"{gb(r.get('real_peak'))} | {'-' if flag is None else ('yes' if flag else 'no')} "
                      f"| {gb(rec)} | {rec_flag} |")
        md += ["", "## Non-logits over-estimate", "",
               "non-logits modelled = predicted - 14 x E; over-estimate = non-logits modelled / "
               "(real peak - 12 x E).", "",
               "| model | seq | batch | non-logits modelled GB | real - 12 x E GB | over-estimate "
               "| A10G over-estimate (from its published peak) |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            rest = (r["real_peak"] - r["logits12_bytes"]) if r.get("real_peak") else None
            rec = r.get("record_a10g_peak")
            # The record's per-row figure, derived from its published peak like ours.
            rec_over = r["nonlogits_modelled_bytes"] / (rec - r["logits12_bytes"]) if rec else None
            md.append(f"| {r['model']} | {r['seq']} | {r['batch']} | "
                      f"{gb(r['nonlogits_modelled_bytes'], 4)} | {gb(rest)} | "
                      f"{'VOID' if r['status'] == 'VOID' else ratio(r.get('nonlogits_overestimate'))} "
                      f"| {ratio(rec_over)} |")
        md += ["", overestimate_line(rows), ""]
    if any(r.get("attribution") for r in rows):
        md += ["## Peak attribution", "", "```", attribution_table(rows, result.get("control")),
               "```", ""]
    for key, title, fn in (("determinism", "Determinism", determinism_table),
                           ("measure", "--measure", measure_table), ("sdpa", "--sdpa", sdpa_table)):
        if result.get(key):
            md += [f"## {title}", "", "```", fn(result[key]), "```", ""]
    timings = result.get("timings") or {}
    if timings:
        md += ["## Harness cost", "", "```", json.dumps(timings, indent=2), "```", ""]
    return "\n".join(md)


def render_plot(result: dict[str, Any], path: str) -> None:
    """pred/real against seq: this run, the A10G and RTX 3050 records, and the 1.0 line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    env = result["environment"]
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    here = env.get("gpu") or "this run"
    series: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for r in result.get("rows") or []:
        if r.get("pred_over_real") is not None and r["status"] != "VOID":
            series.setdefault((r["model"], r["batch"]), []).append((r["seq"], r["pred_over_real"]))
    # One colour per model, one line style per stack: this run solid, A10G dashed.
    colours = {SHAPES["smol"].name: "tab:blue", SHAPES["qwen"].name: "tab:orange"}
    for (model, batch), pts in series.items():
        pts.sort()
        label = f"{model}, {here} (this run)" + (f", batch {batch}" if batch != 1 else "")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linewidth=2, label=label,
                color=colours.get(model) if batch == 1 else None)
    for key in ("smol", "qwen"):
        pts = sorted((seq, v[1]) for (k, seq), v in RECORD_A10G_PREDICTED.items() if k == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="s", linestyle="--", alpha=0.7,
                color=colours[SHAPES[key].name], label=f"{SHAPES[key].name}, A10G record")
    pts = sorted((seq, p / r) for (k, seq), (p, r) in RECORD_RTX3050.items())
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="^", linestyle=":", color="crimson",
            label="SmolLM2-135M, RTX 3050 record")
    ax.axhline(1.0, color="black", linewidth=1)
    ax.text(ax.get_xlim()[0], 0.99, " below 1.0: the prediction under-predicts (the #395 failure)",
            va="top", fontsize=8)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("predicted / real peak VRAM")
    ax.set_title(f"Soup stream pre-flight: predicted / real peak ({here}, {env['date'][:10]})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_outputs(result: dict[str, Any], args: argparse.Namespace) -> None:
    """--json (atomically), --markdown and --plot; the markdown is rendered before anything
    is written, so a result that cannot be rendered leaves no half set of files."""
    markdown = render_markdown(result) if args.markdown else None
    if args.json:
        tmp = Path(args.json + ".tmp")
        tmp.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
        tmp.replace(args.json)
    if markdown is not None:
        Path(args.markdown).write_text(markdown, encoding="utf-8")
    if args.plot:
        render_plot(result, args.plot)


def load_result(path: str, flag: str = "--from-json") -> dict[str, Any]:
    try:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{flag} {path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{flag} {path}: not a saved result ({last_line(exc)})") from None
    if not isinstance(result, dict) or "environment" not in result or "rows" not in result:
        raise UsageError(f"{flag} {path}: not a result this tool wrote")
    return result


# ---------------------------------------------------------------------------
# The CLI
# ---------------------------------------------------------------------------

EPILOG = """exit codes:
  0    every row ok (prediction at or above the real peak, realised == requested)
  1    any row VOID (realised != requested), OOM, FAILED or UNDER (prediction below
       the real peak), or the snapshot positive control failed
  2    usage error (one line on stderr)
  130  interrupted (rows measured so far are printed and saved)
"""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="issue395_second_stack_vram.py",
               description="Re-measure Soup's stream peak-VRAM pre-flight (issue #395 record).",
               epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = p.add_argument_group("modes (default: the sweep)")
    modes.add_argument("--sweep", action="store_true", help="run the sweep alongside other modes")
    modes.add_argument("--measure", action="store_true", help="Soup's logits bytes-per-element probe")
    modes.add_argument("--sdpa", action="store_true", help="attention extra allocation per backend")
    modes.add_argument("--determinism", nargs="?", const=2, default=None, metavar="N",
                       help="repeat arms in N fresh processes (default 2; default arms: "
                            "SmolLM2 at 4096 and 6144)")
    arms = p.add_argument_group("arms")
    arms.add_argument("--models", default=None, help="comma list of smol,qwen (default both)")
    arms.add_argument("--seq", default=None, help="comma list of seq lengths for every chosen model")
    arms.add_argument("--batch", default="1", help="comma list of batch sizes (default 1)")
    arms.add_argument("--model", default=None, metavar="ID_OR_PATH",
                      help="any causal LM Soup can stream, instead of the record's models")
    arms.add_argument("--weights", choices=("synthetic", "hub"), default="synthetic",
                      help="synthetic: build architecture-exact checkpoints here (no network)")
    arms.add_argument("--cache-dir", default=None, help="keep built checkpoints and shards here")
    run = p.add_argument_group("running")
    run.add_argument("--dry-run", action="store_true",
                     help="everything but the CUDA step, on CPU")
    run.add_argument("--isolate", action="store_true", help="each arm in its own fresh process")
    run.add_argument("--gpus", default=None, help="comma list of GPU ids; one process per GPU")
    run.add_argument("--snapshot", action="store_true",
                     help="attribute each peak from the allocator history (+ positive control)")
    run.add_argument("--snapshot-dir", default=None, help="also write each raw snapshot here")
    run.add_argument("--verbose", action="store_true", help="show Soup's own console output live")
    run.add_argument("--log-dir", default=None, help="keep Soup's per-arm console logs here")
    out = p.add_argument_group("outputs")
    out.add_argument("--json", default=None, metavar="PATH", help="every row, result and timing")
    out.add_argument("--markdown", default=None, metavar="PATH", help="a record ready to paste")
    out.add_argument("--plot", default=None, metavar="PATH", help="PNG of pred/real against seq")
    out.add_argument("--from-json", default=None, metavar="PATH",
                     help="re-render a saved result (no GPU, no Soup setup)")
    out.add_argument("--compare", default=None, metavar="PATH",
                     help="with --from-json: peaks of the same arms in another saved result")
    return p


def parse_ints(flag: str, text: Optional[str], *, minimum: int = 1) -> Optional[list[int]]:
    if text is None:
        return None
    items = text.split(",")
    if not text.strip() or any(not i.strip() for i in items):
        raise UsageError(f"{flag} {text!r}: empty item; give a comma list of whole numbers")
    out = []
    for item in items:
        item = item.strip()
        if not (item.isascii() and item.lstrip("-").isdigit()):
            raise UsageError(f"{flag} {item!r} is not a whole number")
        value = int(item)
        if value < minimum:
            raise UsageError(f"{flag} {value} must be at least {minimum}")
        if value in out:
            raise UsageError(f"{flag} {text}: {value} is named twice")
        out.append(value)
    return out


def check_output_path(flag: str, path: Optional[str]) -> None:
    if path is None:
        return
    target = Path(path)
    if flag == "--plot" and target.suffix.lower() != ".png":
        raise UsageError(f"--plot {path}: the plot is a PNG; give a path ending in .png")
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise UsageError(f"{flag} {path} is a folder; give a file path")
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: folder {parent} does not exist")
    try:
        probe = tempfile.NamedTemporaryFile(dir=parent, prefix=".issue395-probe-", delete=True)
        probe.close()
    except OSError as exc:
        raise UsageError(f"{flag} {path}: folder {parent} cannot be written ({exc.strerror})") from None


def validate(args: argparse.Namespace) -> dict[str, Any]:
    """Every cheap check, before any import of torch or Soup and before any arm runs."""
    if args.model and args.models:
        raise UsageError("--model and --models are exclusive: one brings its own model")
    if args.model is not None:
        if not args.model.strip():
            raise UsageError("--model needs a checkpoint folder or a hub id")
        models = ["custom"]
    elif args.models is None:
        models = list(SHAPES)
    else:
        models = [m.strip() for m in args.models.split(",")]
        if not args.models.strip() or any(not m for m in models):
            raise UsageError(f"--models {args.models!r}: empty name; choose from {','.join(SHAPES)}")
        unknown = [m for m in models if m not in SHAPES]
        if unknown:
            raise UsageError(f"--models: unknown model {unknown[0]!r}; choose from {','.join(SHAPES)}")
        if len(set(models)) != len(models):
            raise UsageError(f"--models {args.models}: a model is named twice")
    seqs = parse_ints("--seq", args.seq)
    batches = parse_ints("--batch", args.batch) or [1]
    gpus = parse_ints("--gpus", args.gpus, minimum=0)
    repeats = None
    if args.determinism is not None:
        counts = parse_ints("--determinism", str(args.determinism), minimum=2) or []
        if len(counts) != 1:
            raise UsageError(f"--determinism {args.determinism}: give one repeat count")
        repeats = counts[0]
    if args.model and seqs is None:
        raise UsageError("--model needs --seq (there is no record grid for it)")
    if args.compare and not args.from_json:
        raise UsageError("--compare goes with --from-json")
    for flag, path in (("--json", args.json), ("--markdown", args.markdown), ("--plot", args.plot)):
        check_output_path(flag, path)
    if args.snapshot_dir:
        if not Path(args.snapshot_dir).is_dir():
            raise UsageError(f"--snapshot-dir {args.snapshot_dir}: no such folder")
        args.snapshot = True
    if args.log_dir and not Path(args.log_dir).is_dir():
        raise UsageError(f"--log-dir {args.log_dir}: no such folder")
    if args.cache_dir:
        args.cache_dir = os.path.expanduser(args.cache_dir)
        check_cache_dir_bounds(args.cache_dir)  # before creating anything there
        try:
            Path(args.cache_dir).mkdir(exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--cache-dir {args.cache_dir}: cannot create that folder "
                             f"({exc.strerror})") from None
    return {"models": models, "seqs": seqs, "batches": batches, "gpus": gpus, "repeats": repeats}


def check_max_positions(shapes: dict[str, Shape], seqs: list[int], models: list[str]) -> None:
    for m in models:
        limit = shapes[m].max_positions
        for s in seqs:
            if limit and s > limit:
                raise UsageError(f"--seq {s} is beyond {shapes[m].name}'s maximum positions ({limit})")


def check_gpus(gpus: list[int]) -> None:
    import torch

    count = torch.cuda.device_count() if cuda_available() else 0
    missing = [g for g in gpus if g >= count]
    if missing:
        raise UsageError(f"--gpus: GPU {missing[0]} is not there ({count} CUDA device(s) visible)")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    started = time.perf_counter()
    if args.from_json:
        return from_json(args)
    Stop.install()  # before the slow imports: a Ctrl-C or SIGTERM there still cleans up
    plan = validate(args)
    if plan["gpus"] is None and "CUDA_VISIBLE_DEVICES" not in os.environ:
        # Soup refuses to stream with more than one GPU visible (DataParallel);
        # arms run on GPU 0 unless --gpus spreads them.
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    # Scratch first: huggingface_hub and friends read their cache variables at import.
    with Scratch(args.cache_dir) as scratch:
        return run_in_scratch(args, argv, plan, scratch, started)


def run_in_scratch(args: argparse.Namespace, argv: list[str], plan: dict[str, Any],
                   scratch: Scratch, started: float) -> int:
    """Every mode asked for; rows are printed and saved whatever stops the run."""
    t_imports = time.perf_counter()
    import torch  # noqa: F401

    import_soup()
    imports_s = time.perf_counter() - t_imports
    if not args.dry_run and not cuda_available():
        raise UsageError("CUDA is required for the real peak and no CUDA GPU is visible; "
                         "--dry-run runs the whole Soup setup and the guard on CPU")
    if plan["gpus"] is not None:
        check_gpus(plan["gpus"])
    scratch.verify_shard_root()
    shapes = dict(SHAPES)
    if args.model:
        shapes["custom"] = load_custom_shape(args.model)
    check_max_positions(shapes, plan["seqs"] or [max(RECORD_GRID.get(m, (0,)))
                                                 for m in plan["models"]], plan["models"])
    modes_chosen = args.measure or args.sdpa or args.determinism is not None
    do_sweep = args.sweep or not modes_chosen
    opts = Options(weights="local" if args.model else args.weights, dry_run=args.dry_run,
                   verbose=args.verbose, snapshot=args.snapshot, snapshot_dir=args.snapshot_dir,
                   log_dir=args.log_dir, cache_dir=args.cache_dir)
    isolation = ("isolated, one fresh process per arm" if args.isolate else
                 f"one process per GPU ({args.gpus})" if plan["gpus"] else "in one process")
    if not do_sweep:
        isolation = ("determinism: one fresh process per repeat" if args.determinism is not None
                     else "no arms")
    result: dict[str, Any] = {"tool": "issue395_second_stack_vram", "schema": 1,
                              "environment": environment(opts.weights, isolation,
                                                         [os.path.basename(__file__)] + argv),
                              "options": asdict(opts), "rows": [], "determinism": None,
                              "measure": None, "sdpa": None, "control": None,
                              "interrupted": False, "error": None}
    print(header_line(result["environment"]), flush=True)
    sink = RowSink.beside(args.json)
    usage_error: Optional[str] = None
    rows: list[dict[str, Any]] = []
    progress = Progress(0, started)

    def on_row(row: dict[str, Any]) -> None:
        rows.append(row)  # kept first: nothing after this may lose a finished row
        result["rows"] = merge_rows(rows)
        sink.add(row)
        progress.arm(row)

    try:
        if do_sweep:
            arms = plan_arms(plan["models"], plan["seqs"], plan["batches"])
            progress.total = len(arms)
            bases = resolve_bases(sorted({a.model for a in arms}), shapes, opts, scratch,
                                  args.model)
            if plan["gpus"]:
                jobs = []
                for gpu, queue in schedule(arms, plan["gpus"]).items():
                    if args.isolate:
                        jobs += [(gpu, [a], 0) for a in queue]
                    elif queue:
                        jobs.append((gpu, queue, 0))
                run_workers(jobs, shapes, bases, scratch, opts, on_row)
            elif args.isolate:
                run_workers([(None, [a], 0) for a in arms], shapes, bases, scratch, opts, on_row)
            else:
                run_in_process(arms, shapes, bases, scratch, opts, on_row)
            if opts.snapshot and not opts.dry_run and not Stop.requested:
                result["control"] = positive_control(control_step(False), control_step(True))
        if args.determinism is not None and not Stop.requested:
            result["determinism"] = determinism_mode(plan, args, shapes, scratch, opts, sink)
        if args.measure and not Stop.requested:
            result["measure"] = measure_mode(opts.dry_run)
        if args.sdpa and not Stop.requested:
            result["sdpa"] = sdpa_mode(opts.dry_run)
    except KeyboardInterrupt:
        Stop.requested = True
    except UsageError as exc:
        if not rows:
            sink.finish()
            raise
        # e.g. --determinism's model unreachable after the sweep: keep the sweep's rows
        usage_error = str(exc)
        print(f"error: {usage_error}", file=sys.stderr)
    except Exception as exc:  # a harness bug still prints and saves what was measured
        result["error"] = last_line(exc)
        result["traceback"] = traceback.format_exc()
        print(f"error: the harness failed after {len(rows)} row(s): {result['error']}",
              file=sys.stderr)
    result["rows"] = merge_rows(rows)
    result["interrupted"] = Stop.requested
    result["timings"] = run_timings(result, imports_s, time.perf_counter() - started)
    print("\n" + render_tables(result), end="", flush=True)
    code = EXIT_USAGE if usage_error else exit_code(result)
    result["exit_code"] = code
    if usage_error:
        result["error"] = f"usage: {usage_error}"
    write_outputs(result, args)
    if not result["error"]:  # after a harness failure the row file stays as a second copy
        sink.finish()
    return code


def run_timings(result: dict[str, Any], imports_s: float, total_s: float) -> dict[str, Any]:
    """The harness's own cost: per arm (build, setup, step, teardown) and in total."""
    rows = result.get("rows") or []
    t = {"total_s": round(total_s, 2), "imports_s": round(imports_s, 2), "arms": len(rows)}
    for key in ("build_s", "setup_s", "step_s", "teardown_s"):
        vals = [r["timings"][key] for r in rows if r.get("timings", {}).get(key) is not None]
        t[f"sum_{key}"] = round(sum(vals), 2)
    overhead = [r["timings"]["setup_s"] + r["timings"]["teardown_s"] for r in rows
                if r["timings"].get("setup_s") is not None and r["timings"].get("teardown_s") is not None]
    if overhead:
        t["median_arm_overhead_s"] = round(statistics.median(overhead), 3)
    return t


def from_json(args: argparse.Namespace) -> int:
    result = load_result(args.from_json)
    for flag, path in (("--json", args.json), ("--markdown", args.markdown), ("--plot", args.plot)):
        check_output_path(flag, path)
    other = load_result(args.compare, "--compare") if args.compare else None
    try:
        text = render_text(result)
        if other is not None:
            text += "\n" + compare_table(result, other) + "\n"
        write_outputs(result, args)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UsageError(f"--from-json {args.from_json}: not a result this tool wrote "
                         f"({last_line(exc)})") from None
    print(text, end="")
    return exit_code(result)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--_worker"] and len(argv) == 2:
        return worker_main(argv[1])
    try:
        args = build_parser().parse_args(argv)
        return run(args, argv)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # stopped before any arm ran: nothing to print or save
        print("interrupted before any arm ran", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
