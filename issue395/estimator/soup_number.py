"""Soup's own pre-flight number, computed by Soup's own code: its ``estimate_stream_peak_vram``
read from the installed soup-cli's source with ``ast`` and executed in an isolated namespace (no
torch, no soup_cli import), fed the arguments Soup's setup passes it, which are computed here from
the config: the shard bytes Soup counts (its union layer spec for MoE and hybrid layers), extras,
the large-layer slot, the expert in flight and the chunked loss. Equal to the byte to every
``soup_predicted`` the GPU captured, on both releases and on 0.77.0's new families.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import math
import os
import typing
from pathlib import Path

from ..errors import UsageError
from .arch import Arch, arch_from_config
from .moe import expert_in_flight, union_bytes

RELEASES = ("0.73.3", "0.77.0")


# -- Soup's own pre-flight, computed by Soup's code without importing it --
def _soup_dir() -> Path:
    override = os.environ.get("ISSUE395_SOUP_SOURCE")  # another release's unpacked soup_cli/
    if override:
        return Path(override)
    spec = importlib.util.find_spec("soup_cli")  # locates; does not import the package
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("soup-cli is not installed, so Soup's own pre-flight cannot be computed")
    return Path(list(spec.submodule_search_locations)[0])


def installed_release() -> str:
    meta = next(_soup_dir().parent.glob("soup_cli-*.dist-info"), None)
    return meta.name[9:-10] if meta is not None else importlib.metadata.version("soup-cli")


_SOUP_CACHE: dict = {}


def soup_namespace() -> dict:
    """Soup's estimator and every top-level name it reaches, exec'd from its source, nothing else."""
    src = _soup_dir() / "utils" / "layer_stream.py"
    if src in _SOUP_CACHE:
        return _SOUP_CACHE[src]
    tree = ast.parse(src.read_text(encoding="utf-8"))
    defs = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(t, ast.Name):
                    defs[t.id] = node
    wanted, todo = set(), ["estimate_stream_peak_vram", "SUPPORTED_STREAM_ARCHS", "_STREAM_ARCH_ALIASES"]
    while todo:
        name = todo.pop()
        if name in wanted or name not in defs:
            continue
        wanted.add(name)
        todo.extend(n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name))
    body = [n for n in tree.body if any(n is defs[w] for w in wanted)]
    ns: dict = {"math": math, "__name__": "soup_layer_stream_extract"}
    ns.update({k: getattr(typing, k) for k in typing.__all__})
    exec(compile(ast.Module(body=body, type_ignores=[]), str(src), "exec"), ns)
    _SOUP_CACHE[src] = ns
    return ns


def supported_archs() -> tuple:
    return tuple(soup_namespace()["SUPPORTED_STREAM_ARCHS"])


def stream_aliases() -> dict:
    """Model types the installed Soup streams as another (0.77.0: qwen3_5_text as qwen3)."""
    return dict(soup_namespace().get("_STREAM_ARCH_ALIASES", {}))


def streamed_as(model_type) -> str | None:
    family = stream_aliases().get(model_type, model_type)
    return family if family in supported_archs() else None


def require_streamed(model_type: str, who: str) -> None:
    """One line where the installed Soup does not stream a registry model's type (the newest release
    this tool knows, 0.77.0, streams every one)."""
    if streamed_as(model_type) is None:
        raise UsageError(f"{who}: the installed soup-cli does not stream {model_type} (soup-cli 0.77.0 does)")


def arch_of(config: dict) -> Arch:
    """The config's Arch (arch_from_config), once Soup is known to stream its model_type."""
    mt = config.get("model_type") if isinstance(config, dict) else None
    if isinstance(config, dict) and streamed_as(mt) is None:
        raise UsageError(f"model_type {mt!r} cannot be layer-streamed by Soup (it streams "
                         f"{', '.join(supported_archs() + tuple(stream_aliases()))})")
    return arch_from_config(config)


def _nf4_bytes(n: int) -> int:
    """bitsandbytes NF4 + double quant, as Soup's shard stores it: packed nibbles, uint8
    absmax per 64-block, fp32 nested absmax per 256 absmax, a 4-byte offset."""
    blocks = -(-n // 64)
    return -(-n // 2) + blocks + 4 * -(-blocks // 256) + 4


def layer_bytes(a: Arch, quant: str, per_expert: bool = False) -> int:
    """One streamed layer as Soup's shard header counts it (linears NF4 or bf16, the rest bf16);
    for MoE, latent and hybrid layers the union of every layer kind's tensors (issue395.estimator.moe)."""
    if a.layers is not None:
        return union_bytes(a.layers.union, quant, per_expert, _nf4_bytes)
    out = 2 * a.h * a.norms * (2 if a.norm_bias else 1) + (4 * a.head_dim if a.qk_norm else 0)
    for fan_in, fan_out, bias in a.modules.values():
        out += (_nf4_bytes(fan_in * fan_out) if quant == "nf4" else 2 * fan_in * fan_out)
        out += 2 * fan_out if bias else 0
    return out


def linear_elements(a: Arch) -> int:
    return sum(fi * fo for fi, fo, _ in a.modules.values())


def lora_params(a: Arch, targets: tuple, r: int) -> int:
    return a.L * sum(r * (a.modules[t][0] + a.modules[t][1]) for t in targets)


def soup_preflight_from_config(config: dict, *, quant: str, seq: int, batch: int, targets,
                               lora_r: int, release: str | None = None,
                               stream: dict | None = None) -> tuple[int, dict]:
    """Soup's own number (computed by Soup's estimator) and the kwargs Soup's setup passes it.
    0.77.0 moves an untied model's vocab matrices out of extras into one large-layer slot; its
    streaming modes (``stream``: Soup training keys) change the layer and add their terms."""
    a = arch_of(config)
    release = release or installed_release()
    if release not in RELEASES:
        raise UsageError(f"release {release!r} is not one this knows ({', '.join(RELEASES)})")
    stream = stream or {}
    if stream and release == "0.73.3":
        raise UsageError(f"soup-cli 0.73.3 has no {', '.join(sorted(stream))}: streaming modes need 0.77.0")
    per_expert = stream.get("stream_expert_layout") == "per_expert"
    if per_expert and streamed_as(a.model_type) != "deepseek_v3":
        raise UsageError(f"Soup refuses stream_expert_layout 'per_expert' on {a.model_type} (it admits "
                         "deepseek_v3 only: stream_setup.py PER_EXPERT_LAYOUT_ARCHS)")
    norm = 2 * a.h * (2 if a.norm_bias else 1)
    vocab_mat = 2 * a.V * a.h
    head_bias = 2 * a.V if a.model_type == "phi" and not a.tied else 0
    terms = {"layer_bytes": layer_bytes(a, quant, per_expert), "buffers": 2}
    if release == "0.73.3" or a.tied:
        terms["extras_bytes"] = vocab_mat * (1 if a.tied else 2) + norm + head_bias
    else:
        terms["extras_bytes"] = norm + head_bias
    # Soup's _estimate_adapter_params: layers x n_targets x 2 x r x hidden
    terms["adapter_params"] = a.L * len(targets) * 2 * lora_r * a.h
    terms.update(vocab_size=a.V, hidden_size=a.h, intermediate_size=a.i, n_layers=a.L,
                 seq_len=seq, batch_size=batch, logits_bytes_per_element=14.0)
    if release == "0.77.0":
        in_flight = expert_in_flight(a.layers.expert, quant) if per_expert and a.layers else 0
        terms.update(large_layer_bytes=0 if a.tied else vocab_mat, persistent_bytes=in_flight,
                     loss_chunk=stream.get("stream_loss_chunk"))
    fn = soup_namespace()["estimate_stream_peak_vram"]
    kwargs = dict(terms)
    params = fn.__code__.co_varnames[:fn.__code__.co_argcount + fn.__code__.co_kwonlyargcount]
    if "large_layer_bytes" not in params:  # 0.77.0's kwargs on 0.73.3's code: its sum is the same
        kwargs["extras_bytes"] += kwargs.pop("large_layer_bytes", 0) + kwargs.pop("persistent_bytes", 0)
        kwargs.pop("loss_chunk", None)
    return int(fn(**kwargs)), terms
