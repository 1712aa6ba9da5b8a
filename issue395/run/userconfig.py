"""The user's own inputs: a soup.yaml (the file `soup train` takes), read by Soup's own loader so
Soup's own validation applies, and a hub id's config.json from the local Hugging Face cache or,
online, that one file alone. No torch."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..constants import STREAM_KEYS
from ..errors import UsageError, cut, last_line, soups_words
from ..record import LORA_DROPOUT, OURS_QUANT
from ..tasks import PROTOCOL_TASK, TASKS
from ..model.arm import Adapter, Arm, Settings, lora_dropout
from ..model.streaming import STREAMED_CHECKPOINTS, Streaming
from ..estimator.soup_gate import resident_departures, resident_lines, resident_unmodelled, streamed_unmodelled
from ..estimator.stacks import package_version
from ..estimator.steady import ABOVE_BOUND
from ..results.extras import ResidentGate
from .checks import HUB_ID, LOADER_NEEDS, looks_like_a_path


@dataclass(frozen=True)
class UserRun:
    """What a soup.yaml asks for: its run as one typed Arm (``arm``: its shape, task, adapter, settings and
    streaming as Soup's loader read them; its base "custom" with ``checkpoint`` the base as the file writes it,
    until issue395.run.configarm resolves it to a registry key), and what is not the run's shape: the file, Soup's
    gate override, how each key is read, the text, and a resident run's Soup gate input."""

    path: str
    arm: Arm
    gate_override: Optional[int] = None  # training.stream_vram_override: bytes Soup's gate takes as free
    keys: tuple = ()  # one line per key of the file that changes the peak or Soup's gate: how it is read
    text: str = ""  # the file as written (--find-max's probes copy it, changing only their keys)
    resident: Optional["ResidentRun"] = None  # training.stream_layers false: Soup's resident gate's input
    dropped: tuple = ()  # settings that move the peak which a measured arm's Soup config does not carry (``dropped``)

    @property
    def base(self) -> str:
        """The file's base as written (a hub id or a folder)."""
        return str(self.arm.checkpoint)

    @property
    def probe(self) -> bool:
        """training.stream_vram_probe: Soup's gate is one measured step (decide_measured_fit); the arm's too."""
        return self.arm.streaming.probe


@dataclass(frozen=True)
class ResidentRun:
    """A resident soup.yaml (training.stream_layers false): the input Soup's resident gate takes, as `soup train`'s
    CLI builds it from the file (commands/train.py's _build_hardware_fit_input: computed by Soup; None where it
    builds none and skips its gate); its gradient checkpointing is the arm's (``Streaming.checkpointing``)."""

    soup_input: Optional[dict]
    soup_profile: Optional[dict] = None  # `soup profile`'s estimate of the file (ResidentGate.profile_of)
    unmodelled: Optional[str] = None  # a setting the resident estimate does not model (soup_gate.ASSUMED)


def file_streaming(t: Any) -> Streaming:
    """How the file's run streams, off Soup's loaded ``cfg.training``: a resident run (stream_layers false) reads
    no streaming mode, only its gradient checkpointing (any tier is HF's full checkpointing, as Soup's
    resolve_gradient_checkpointing sets it); a streamed one its modes and Soup's probe."""
    if not getattr(t, "stream_layers", False):
        return Streaming(layers=False, checkpointing=bool(getattr(t, "gradient_checkpointing", False)))
    return Streaming.of_training({k: getattr(t, k, None) for k in STREAM_KEYS + ("stream_vram_probe",)})


def missing_for_loader(exc: ImportError) -> str:
    """The one line for a loader that cannot be imported: the package that is missing, by name."""
    top = (exc.name or "").split(".")[0]
    if top == "soup_cli":
        return "--config needs soup-cli installed: its own loader reads the file (pip install soup-cli)"
    package = LOADER_NEEDS.get(top, top or "a dependency")
    return (f"--config needs {package} (module {top or '?'}), which soup-cli's config loader imports and is not "
            f"installed here: a `pip install --no-deps soup-cli` lacks it; pip install "
            f"{' '.join(LOADER_NEEDS.values())}")


def read_soup_config(path: str) -> UserRun:
    """A soup.yaml through soup_cli.config.loader (its own schema and validators): one line for a
    file Soup refuses, a config Soup would not stream, or an option the estimator does not model."""
    try:
        from soup_cli.config.loader import load_config_from_string
    except ImportError as exc:
        raise UsageError(missing_for_loader(exc)) from None
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--config {path}: cannot be read ({last_line(exc)})") from None
    raw = raw_yaml(text)
    try:
        cfg = load_config_from_string(text)
    except Exception as exc:  # Soup's own validation: its message, one line, a typo it follows from first
        typos = [(dotted, near) for dotted, near in unknown_in(raw)[0] if near]
        first = (f"{typos[0][0]} is not a key of soup-cli {package_version('soup-cli')}'s config schema (did you mean "
                 f"{typos[0][1]}?{f'; {len(typos) - 1} more such key(s)' if len(typos) > 1 else ''}), so "
                 if typos else "")
        raise UsageError(cut(f"--config {path}: {first}Soup refuses it: {soups_words(str(exc))}")) from None
    base = os.path.expanduser(str(cfg.base))
    if looks_like_a_path(str(cfg.base)) and not os.path.exists(base):  # a path, never a hub lookup
        raise UsageError(f"--config {path}: base {cfg.base}: no such folder (a path, relative to the working "
                         f"directory {os.getcwd()}; a hub id is org/name)")
    t = cfg.training
    resident = None
    if not getattr(t, "stream_layers", False):  # a resident run: every mode answers it
        resident = ResidentRun(ResidentGate.input_of(cfg), ResidentGate.profile_of(cfg), resident_unmodelled(cfg))
    task = str(getattr(cfg, "task", PROTOCOL_TASK))
    # Soup's loader refuses a streamed run's other tasks and quantizations itself: what reaches here is a resident
    # run's, which Soup trains, and only this tool does not model
    if task not in TASKS:
        raise UsageError(f"--config {path}: task {task!r} is not one this tool models ({', '.join(TASKS)}: the tasks "
                         "Soup streams), resident or streamed")
    quant = OURS_QUANT.get(str(t.quantization))
    if quant is None:
        raise UsageError(f"--config {path}: training.quantization {t.quantization!r} is not one this tool models "
                         f"({', '.join(OURS_QUANT)}: the ones Soup streams), resident or streamed")
    if not isinstance(t.batch_size, int):
        raise UsageError(f"--config {path}: training.batch_size {t.batch_size!r} is one the estimator does not "
                         "model (give a whole number)")
    lora = t.lora
    targets = lora.target_modules
    if isinstance(targets, str):  # auto and all-linear: resolved as --targets resolves them (model.targets)
        targets = (targets,)
    if str(t.optimizer) in ABOVE_BOUND:  # its states outnumber the bound an unmodelled optimizer is charged at
        raise UsageError(f"--config {path}: training.optimizer {t.optimizer} is not modelled: it keeps "
                         f"{ABOVE_BOUND[str(t.optimizer)]}, more than the upper bound this tool charges an optimizer "
                         "it has no table entry for")
    if getattr(t, "stream_recompute", None) == "auto":
        raise UsageError(f"--config {path}: training.stream_recompute 'auto' is an option the estimator does not "
                         "model (it measures a step at setup; give on or off)")
    override = getattr(t, "stream_vram_override", None)
    arm = Arm("custom", int(cfg.data.max_length), int(t.batch_size), quant=quant, task=task, settings=Settings.read(t),
              streaming=file_streaming(t), checkpoint=str(cfg.base),
              adapter=Adapter(tuple(targets), int(lora.r), int(lora.alpha), str(path), lora_dropout(t)))
    return UserRun(str(path), arm, gate_override=None if override is None else int(override),
                   keys=tuple(unknown_keys(raw)) + tuple(key_lines(cfg, arm, set_in(raw, "training"))), text=text,
                   resident=resident, dropped=dropped(cfg, quant))


def raw_yaml(text: str) -> Any:
    """The file as YAML data, for naming its keys (libyaml's loader where it is there: the same safe
    loader, fast on a huge file); None where it is not YAML (Soup's loader says why)."""
    import yaml

    try:
        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except Exception:
        return None


def set_in(raw: Any, block: str) -> set:
    """The keys the file itself sets in one block (``training``): what is Soup's default is not the file's."""
    node = raw.get(block) if isinstance(raw, dict) else None
    return {str(k) for k in node} if isinstance(node, dict) else set()


def _model_in(annotation: Any) -> Any:
    """The pydantic model a field holds (Optional[LoraConfig] -> LoraConfig), or None."""
    import typing

    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return annotation
    return next((m for m in map(_model_in, typing.get_args(annotation)) if m is not None), None)


#: How many of the keys Soup's schema does not have are named a line each; the rest are counted.
LISTED_KEYS = 10


def unknown_in(raw: Any) -> tuple[list[tuple[str, Optional[str]]], int]:
    """The file's keys Soup's schema does not have, by Soup's own config classes (their fields and
    aliases): the first LISTED_KEYS as (dotted key, the key probably meant or None), and how many in all."""
    import difflib

    try:
        from soup_cli.config.loader import SoupConfig
    except ImportError:
        return [], 0
    known: list[str] = []
    found: list[str] = []
    count = 0

    def walk(node: Any, model: Any, path: str) -> None:
        nonlocal count
        fields = model.model_fields
        by_name = {**{f.alias: f for f in fields.values() if f.alias}, **fields}
        known.extend(path + n for n in fields)
        for key, value in (node.items() if isinstance(node, dict) else ()):
            field = by_name.get(key) if isinstance(key, str) else None
            if field is None:
                count += 1
                if len(found) < LISTED_KEYS:
                    found.append(path + str(key))
            elif isinstance(value, dict) and _model_in(field.annotation) is not None:
                walk(value, _model_in(field.annotation), f"{path}{key}.")

    walk(raw, SoupConfig, "")
    leaves = [k.rsplit(".", 1)[-1] for k in known]
    out = []
    for dotted in found:
        key = dotted.rsplit(".", 1)[-1]
        near = difflib.get_close_matches(dotted, known, n=1, cutoff=0.8) or difflib.get_close_matches(
            key, leaves, n=1, cutoff=0.8)
        meant = (next((k for k in known if k.endswith(near[0])), near[0]) if near and key not in STREAM_KEYS
                 else None)
        out.append((dotted, meant))
    return out, count


def unknown_keys(raw: Any) -> list[str]:
    """A key Soup's schema does not have (a typo, or a key of another release): Soup ignores it
    (its models take extra keys silently), so it is named here, with the nearest key it has; past
    LISTED_KEYS, how many more."""
    listed, count = unknown_in(raw)
    lines, release = [], package_version("soup-cli")
    for dotted, meant in listed:
        key = dotted.rsplit(".", 1)[-1]
        hint = ("; soup-cli 0.77.0's streaming mode, not this release's" if key in STREAM_KEYS
                else f"; did you mean {meant}?" if meant else "")
        lines.append(f"{dotted} is not a key of soup-cli {release}'s config schema: Soup ignores it, and so "
                     f"does this estimate{hint}")
    if count > len(listed):
        lines.append(f"and {count - len(listed):,} more keys soup-cli {release}'s config schema does not have "
                     "(Soup ignores them, and so does this estimate)")
    return lines


def dropped(cfg: Any, quant: str) -> tuple:
    """The file's settings that move the peak and that a measured arm's Soup config (the protocol's, with the file's
    shape, adapter, streaming modes and SETTINGS) does not carry, each as ``training.key value``: every one the
    estimate does not model (a resident run's soup_gate.resident_departures, a streamed run's
    soup_gate.streamed_unmodelled)."""
    t = cfg.training
    found = streamed_unmodelled(t, quant) if getattr(t, "stream_layers", False) else resident_departures(cfg)
    return tuple(setting for setting, _ in found)


def key_lines(cfg: Any, arm: Arm, given: Optional[set] = None) -> list[str]:
    """How each key of the file that changes the peak or Soup's gate is read: modelled (and how),
    or not modelled, one line each; Soup's defaults say nothing, but one that changes the peak
    (gradient accumulation) is said as Soup's default where the file does not set it (``given``:
    the training keys the file sets); ``arm``: the file's run (its quantization, whether it trains an adapter)."""
    t, lines, quant = cfg.training, [], arm.quant
    given = set(t.model_fields) if given is None else given
    override = getattr(t, "stream_vram_override", None)
    if override is not None:
        lines.append(f"training.stream_vram_override {override}: modelled: Soup's gate compares its number against "
                     f"{override / 1e9:.2f} GB, not the card's free memory (resolve_available_vram_bytes)")
    if getattr(t, "stream_vram_probe", False):
        lines.append("training.stream_vram_probe: modelled by its own rule (decide_measured_fit): Soup admits a run "
                     "whose one measured step's allocated peak fits the free memory, unless its number is over 4x "
                     "that; this tool's one-step allocated peak stands in for the measurement (Soup's docstring: "
                     "the probe's step reads 12.5-14.3% above the real step)")
    if getattr(t, "stream_layers", False):  # the streamed estimate is of the run without them, said so
        lines.extend(f"{setting}: NOT modelled: {why}" for setting, why in streamed_unmodelled(t, quant))
    else:  # the resident estimate would be another run's: none is given, as the patched gate gives none
        lines.extend(f"{unmodelled}, so this tool gives no estimate of the run (Soup's own gate still answers)"
                     for unmodelled in resident_lines(cfg))
    if getattr(t, "stream_layers", False) and getattr(t, "gradient_checkpointing", False):
        gc = t.gradient_checkpointing
        lines.append(f"training.gradient_checkpointing {str(gc).lower() if gc is True else gc}: changes nothing: "
                     f"{STREAMED_CHECKPOINTS}")
    for setting, value in Settings.read(t).given():  # one at the protocol's value says nothing
        if value != setting.protocol:
            default = "" if setting.soup in given else " (Soup's default, not set in the file)"
            lines.append(f"training.{setting.soup} {value}{default}: modelled: {setting.how(arm)}")
    dropout = lora_dropout(t)
    if 0 < dropout < 1 and dropout != LORA_DROPOUT:
        lines.append(f"training.lora.dropout {dropout:g}: modelled: peft's Dropout keeps its output and a 1-byte mask "
                     f"per adapted linear's input whatever p is, as at Soup's default {LORA_DROPOUT:g}")
    elif dropout != LORA_DROPOUT:
        lines.append(f"training.lora.dropout {dropout:g}: modelled, the dropout's output an upper bound: no 1-byte "
                     "mask is charged (peft runs nn.Identity at p 0 or below, nn.Dropout at p 1 writes none); the "
                     "output copy still is, though nn.Identity makes none (lora_A keeps its input, which may be one "
                     "the layer keeps anyway); Soup's own number does not read the dropout")
    for key in STREAM_KEYS:
        value = getattr(t, key, None)
        if value not in (None, "on", "fused"):  # Soup's defaults say nothing
            lines.append(f"training.{key} {value}: modelled (the streaming mode's own terms)")
    return lines


#: Seconds to wait for the hub's TCP connection before saying it cannot be reached: huggingface_hub
#: itself retries a failed connection five times with back-off (23 s of silence measured offline).
HUB_CONNECT_S = 3


def hub_reachable(model: str, named: str = "--model") -> None:
    """The hub's endpoint (HF_ENDPOINT honoured) answers a TCP connection, or one line at once."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    url = urlsplit(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=HUB_CONNECT_S).close()
    except OSError as exc:
        why = exc.strerror or (type(exc).__name__ if not str(exc) else str(exc))
        raise UsageError(f"{named} {model}: not in the local Hugging Face cache, and the hub ({host}) cannot be "
                         f"reached ({why}): give a config.json or a checkpoint folder, or fetch it where the "
                         "hub is reachable") from None


def hub_config(model: str, named: str = "--model") -> dict[str, Any]:
    """A hub id's config.json: the local Hugging Face cache first (HF_HUB_CACHE honoured), then,
    unless offline, that one file fetched alone. Offline with no cached copy: one line. ``named``:
    where the hub id came from (--model, or a soup.yaml's base)."""
    if not HUB_ID.fullmatch(model) or "/" not in model:
        raise UsageError(f"{named} {model}: no such config.json, nor a family, nor a hub id (org/name)")
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache
    except ImportError:
        raise UsageError(f"{named} {model}: huggingface_hub is not installed to read the hub cache") from None
    path = try_to_load_from_cache(model, "config.json")
    if not isinstance(path, str):
        if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
            raise UsageError(f"{named} {model}: no config.json in the local Hugging Face cache, and offline")
        import logging

        hub_reachable(model, named)
        logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # its retries: not our one line
        print(f"fetching {model}'s config.json alone from the hub (not cached here; HF_HUB_OFFLINE=1 "
              "never fetches) ...", file=sys.stderr, flush=True)
        try:
            path = hf_hub_download(model, "config.json")
        except Exception as exc:
            raise UsageError(f"{named} {model}: no config.json in the local Hugging Face cache, and the hub "
                             f"did not give one ({type(exc).__name__})") from None
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"{named} {model}: its cached config.json cannot be read ({type(exc).__name__})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{named} {model}: its config.json is not a JSON object")
    return config
