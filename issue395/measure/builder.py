"""Architecture-exact synthetic checkpoints: a tokenizer, the config, and weights of the right
shape (peak VRAM depends on shapes and dtypes, not on weight values); and the check that a
safetensors file (a built checkpoint's or a Soup shard's) is whole.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from ..model.registry import Shape
from .console import quiet_libraries
from .shapes import NOT_ARCH

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


#: Each becomes one token, with and without its leading space ("Ġ" in byte-level BPE).
TOKEN_WORDS = ("word", "hi", "user", "assistant", "system")


BUILDER_VERSION = 5  # per-expert hub layout and norms read from the class: same bytes for v5's families


def hf_config(shape: Shape, eos_id: int = 2, pad_id: int = 0) -> Any:
    """The transformers config of exactly the grid's shape, with the tokenizer's ids."""
    from transformers import AutoConfig

    kwargs = dict(tie_word_embeddings=True, hidden_act="silu") if shape.record else {}
    kwargs.update({k: v for k, v in shape.arch.items() if k not in NOT_ARCH})
    with quiet_libraries():  # a config's own warnings are not this tool's line
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
    plan = hub_layout([(name, tuple(p.shape)) for name, p in skeleton.state_dict().items()
                       if not (tied and name == "lm_head.weight")],  # a tied head is the embedding
                      shape.model_type)
    zero_norms = zero_centred_norms(skeleton)
    with quiet_libraries():
        config.save_pretrained(str(dest))
    del skeleton

    def write_weights(stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(395)
        # One random pool tiled from a moving offset, not half a billion normals one by one.
        size = 1 << 20
        pool = (torch.randn(2 * size, generator=gen, dtype=torch.float32) * 0.02).to(torch.bfloat16)

        def weights() -> Iterator[Any]:
            for i, (name, dims) in enumerate(plan):
                if "norm" in name:
                    yield torch.full(dims, 0.0 if name in zero_norms else 1.0, dtype=torch.bfloat16)
                else:
                    yield tiled(pool[(i * 7919) % size:][:size], math.prod(dims)).view(dims)

        write_safetensors(dest / "model.safetensors", plan, weights(), stop)
        return {"file_bytes": (dest / "model.safetensors").stat().st_size,
                "tensors": {name: ["BF16", list(dims)] for name, dims in plan}}

    return write_weights


#: Model types whose hub checkpoints store each routed expert as its own tensors, where
#: transformers 5 holds them fused in memory (its conversion_mapping merges them on load: deepseek_v3
#: -> qwen2_moe's converter). Soup's per_expert layout reads exactly those tensors
#: ("model.layers.N.mlp.experts.E.*"), so the builder writes the hub's layout, not the memory one.
PER_EXPERT_ON_DISK = ("deepseek_v3",)


class BuildStopped(Exception):
    """A checkpoint's writer was asked to stop between two tensors."""


def write_safetensors(path: Path, plan: list[tuple[str, tuple]], tensors: Iterator[Any],
                      stop: Callable[[], bool]) -> None:
    """bf16 ``tensors`` (in ``plan``'s order) to one safetensors file, each written as it is made:
    the header first (every shape is known), so a build holds one tensor in memory, not the
    whole model, and ``stop`` is asked between tensors (a Ctrl-C need not wait out 14.5 GB)."""
    import torch

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dims in plan:
        n = 2 * math.prod(dims)
        header[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as fh:
        fh.write(len(text).to_bytes(8, "little") + text)
        for _, tensor in zip(plan, tensors):
            if stop():
                raise BuildStopped(str(path))
            fh.write(tensor.contiguous().view(-1).view(torch.int16).numpy())  # bf16's bytes, no copy


def hub_layout(plan: list[tuple[str, tuple]], model_type: str) -> list[tuple[str, tuple]]:
    """The checkpoint's tensors as the hub stores them: fused experts split per expert."""
    if model_type not in PER_EXPERT_ON_DISK:
        return plan
    out: list[tuple[str, tuple]] = []
    for name, dims in plan:
        if name.endswith("mlp.experts.gate_up_proj"):  # (experts, 2 x moe_intermediate, hidden)
            experts, two_i, hidden = dims
            for e in range(experts):
                out += [(f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight", (two_i // 2, hidden)),
                        (f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight", (two_i // 2, hidden))]
        elif name.endswith("mlp.experts.down_proj"):  # (experts, hidden, moe_intermediate)
            experts, hidden, inter = dims
            out += [(f"{name[:-len('down_proj')]}{e}.down_proj.weight", (hidden, inter))
                    for e in range(experts)]
        else:
            out.append((name, dims))
    return out


def zero_centred_norms(model: Any) -> set[str]:
    """Norm weights the model applies as (1 + weight) (Gemma, Qwen3.5): their neutral value is
    zeros, where everyone else's is ones; ones there would double every activation. Read from
    each norm class's own forward, so a new family needs no list."""
    import inspect

    found: set[str] = set()
    for prefix, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or "norm" not in type(module).__name__.lower():
            continue
        try:
            source = inspect.getsource(type(module).forward).replace(" ", "")
        except (OSError, TypeError):
            continue
        if "1.0+self.weight" in source or "1+self.weight" in source:
            found.add(f"{prefix}.weight")
    return found


def tiled(tile: Any, n: int) -> Any:
    """``n`` values of ``tile`` repeated end to end, in a tensor owning exactly those ``n``: a
    view of a repeated tile would keep the whole repeat alive (2 MiB for every small tensor)."""
    import torch

    size = tile.numel()
    if n <= size:
        return tile[:n].clone()
    out = torch.empty(n, dtype=tile.dtype)
    whole = n // size
    out[:whole * size].view(whole, size).copy_(tile.expand(whole, size))
    out[whole * size:] = tile[:n - whole * size]
    return out


#: A Shape's fields that never shape its checkpoint: its names, the streaming mode (how Soup shards
#: it) and the LoRA adapter Soup puts on it (targets, rank, alpha and the grid's count of it), so a
#: --config arm's own adapter runs on its family's cached checkpoint.
NOT_SHAPING = ("name", "hub_id", "stream", "targets", "lora_r", "lora_alpha", "grid_adapter")


def checkpoint_fingerprint(shape: Shape) -> str:
    """Names a built checkpoint by everything that shapes it, so a cache is never stale."""
    fields_ = {k: v for k, v in asdict(shape).items() if k not in NOT_SHAPING}
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
