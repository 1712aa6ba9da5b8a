"""soup-cli releases: where a release's source is (the installed one, or an unpacked wheel), the
features of a release that decide Soup's own number and this tool's per-release physics, and the
table of every release this tool has read, 0.73.3 to 0.77.0 (``RELEASE_FEATURES``). The features
are read from each release's own source (``soup_number.read_features``, with ``ast``); the table
pins what was read, so a test can hold detection to it and a saved row of a release that is not
installed keeps its physics. A release not in the table works through detection when it is
installed. Stdlib only.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import UsageError

#: One release's unpacked soup_cli/ (with its soup_cli-X.dist-info beside it), read as the installed one.
SOURCE_ENV = "ISSUE395_SOUP_SOURCE"
#: A folder of unpacked wheels, <folder>/<version>/soup_cli (.ci/run fetches them): other releases' source.
RELEASES_ENV = "ISSUE395_RELEASE_SOURCES"
#: --soup-patch's module inside soup_cli/, and the words its header opens with: a soup_cli folder that
#: holds it is a patched release (its gate compares the corrected peak; soup_number computes it so).
PATCH_MODULE = "utils/corrected_peak.py"
PATCH_MARKER = "issue395 corrected pre-flight"


class UnknownRelease(UsageError):
    """A soup-cli version that cannot be read as one (no model is to blame: said without one)."""


def release_key(release: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version like 0.76.1, 0.77.0rc1 or 0.77.0+local."""
    m = re.match(r"\s*(\d+)(?:\.(\d+))?(?:\.(\d+))?", release or "")
    if not m:
        raise UnknownRelease(f"soup-cli release {release!r} is not a version this can read (e.g. 0.77.0)")
    return tuple(int(g or 0) for g in m.groups())  # type: ignore[return-value]


def soup_dir() -> Path:
    """The installed soup_cli/ (found, never imported), or the one SOURCE_ENV names."""
    override = os.environ.get(SOURCE_ENV)
    if override:
        return Path(override)
    spec = importlib.util.find_spec("soup_cli")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("soup-cli is not installed, so Soup's own pre-flight cannot be computed")
    return Path(list(spec.submodule_search_locations)[0])


def installed_release() -> str:
    meta = next(soup_dir().parent.glob("soup_cli-*.dist-info"), None)
    return meta.name[9:-10] if meta is not None else importlib.metadata.version("soup-cli")


def release_source(release: Optional[str] = None) -> Optional[Path]:
    """Where ``release``'s own soup_cli/ is: the installed one, or RELEASES_ENV's unpacked wheel;
    None when neither holds it."""
    if release is None or release == installed_release():
        return soup_dir()
    folder = os.environ.get(RELEASES_ENV)
    path = Path(folder) / release / "soup_cli" if folder else None
    return path if path is not None and (path / "utils" / "layer_stream.py").is_file() else None


def wheel_sources() -> dict[str, Path]:
    """Every release unpacked under RELEASES_ENV, by version (empty when it is unset)."""
    folder = os.environ.get(RELEASES_ENV)
    if not folder or not Path(folder).is_dir():
        return {}
    return {p.name: p / "soup_cli" for p in sorted(Path(folder).iterdir(), key=lambda p: p.name)
            if (p / "soup_cli" / "utils" / "layer_stream.py").is_file()}


@dataclass(frozen=True)
class Features:
    """What a release's own source says about its pre-flight, beyond its estimator's code."""

    #: keyword names its ``estimate_stream_peak_vram`` takes past the twelve every release takes
    estimator_params: tuple
    #: what its setup passes the estimator: (keyword, the value as its source spells it)
    setup_kwargs: tuple
    #: its shard moves an untied embedding/head pair out of extras into ONE large-layer slot
    #: (layer_shard's large keys, layer_stream_runtime's large_layer_buffer_bytes; 0.74.0 on)
    splits_untied_pair: bool
    #: its setup charges the large slot through ``_stream_large_budget_bytes`` (0.76.0 on: twice on
    #: an untied model under a task that refills the slot before the backward)
    large_budget: bool
    #: per task (tasks.TASKS' wrappers): (task, _STREAM_ROWS_PER_EXAMPLE, _STREAM_REFILL_BEFORE_BACKWARD)
    tasks: tuple
    #: the streaming modes (constants.STREAM_KEYS) its training schema has
    stream_modes: tuple
    #: modules its ``_estimate_adapter_params`` counts for a string target (all-linear, auto)
    string_targets: int
    #: its DPO wrapper materialises TRL's "ref" adapter copy off Soup's meta skeleton
    #: (trainer/dpo.py ``materialize_meta_adapter_copy``, 0.74.0 on): a second adapter on the card
    materialises_ref_adapter: bool = False
    #: its runtime gives a streamed large layer whose slot a second forward refills a private copy
    #: of its weight (layer_stream_runtime ``_needs_a_private_weight``, 0.76.0 on)
    private_head_weight: bool = False

    def task(self, name: str) -> tuple[int, bool]:
        """(rows per example, refills before backward) of a task this release streams."""
        for t, rows, refill in self.tasks:
            if t == name:
                return rows, refill
        raise UsageError(f"task {name!r} is not one this soup-cli streams ({', '.join(t for t, _, _ in self.tasks)})")


_TWELVE = ("layer_bytes", "buffers", "extras_bytes", "adapter_params", "vocab_size", "hidden_size",
           "intermediate_size", "n_layers", "seq_len", "batch_size", "dtype", "logits_bytes_per_element")
_SETUP_073 = (("layer_bytes", "layer_bytes"), ("buffers", "tcfg.stream_buffers"), ("extras_bytes", "embed_bytes"),
              ("adapter_params", "self._estimate_adapter_params(tcfg, model_config)"), ("vocab_size", "vocab"),
              ("hidden_size", "hidden"), ("intermediate_size", "inter"), ("n_layers", "index.n_layers"),
              ("seq_len", "seq_len"), ("batch_size", "rows"), ("logits_bytes_per_element", "calibrated"))
_SETUP_074 = _SETUP_073 + (("large_layer_bytes", "large_layer_bytes"),)
_SETUP_077 = tuple((k, "self._estimate_adapter_params(tcfg, model_config, target_modules=target_modules)")
                   if k == "adapter_params" else (k, v) for k, v in _SETUP_074) + (
    ("persistent_bytes", "scale_cache_bytes + expert_bytes"), ("loss_chunk", "loss_chunk"))
_TASKS_073 = (("sft", 1, False), ("dpo", 2, False), ("orpo", 2, False), ("simpo", 2, False), ("kto", 1, False))
_TASKS_076 = (("sft", 1, False), ("dpo", 2, True), ("orpo", 2, False), ("simpo", 2, False), ("kto", 1, True))

_073 = Features((), _SETUP_073, False, False, _TASKS_073, (), 4)
_074 = Features(("large_layer_bytes",), _SETUP_074, True, False, _TASKS_073, (), 4, True)
_076 = Features(("large_layer_bytes",), _SETUP_074, True, True, _TASKS_076, (), 4, True, True)
_077 = Features(("large_layer_bytes", "persistent_bytes", "loss_chunk"), _SETUP_077, True, True, _TASKS_076,
                ("stream_expert_layout", "stream_loss_chunk", "stream_recompute"), 4, True, True)

#: Every release from 0.73.3 to 0.77.0 as read from its wheel (r3: layer_stream.py has four versions,
#: stream_setup.py five; 0.75.x differs from 0.74.0 off the estimator's path). What moves Soup's number:
#: 0.74.0 splits the untied pair (-2 V h on an untied model), 0.76.0 doubles the slot for DPO and KTO
#: on an untied model, 0.77.0 adds the streaming modes' terms (0 with none set).
RELEASE_FEATURES: dict[str, Features] = {
    "0.73.3": _073, "0.74.0": _074, "0.75.0": _074, "0.75.1": _074, "0.75.2": _074,
    "0.76.0": _076, "0.76.1": _076, "0.77.0": _077,
}


def release_label(release: str) -> str:
    """How a release is named beside its figures: a release not in RELEASE_FEATURES is named as
    read from its own source, and not pinned by this tool's tests."""
    return release if release in RELEASE_FEATURES else f"{release} (read from its own source; not a release this tool's tests pin)"
