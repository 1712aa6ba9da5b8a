"""Which attention the installed transformers runs for an architecture, read from its source (stdlib
only: transformers is located, never imported). A model class that declares ``_supports_sdpa =
False`` runs eager attention, whose additive masks are materialised in the model's dtype; under SDPA
a causal mask without padding is skipped (``sdpa_mask``'s ``allow_is_causal_skip``) or kept as bool.

transformers 5.24.0 turned Gemma-2's SDPA off ("sdpa does not support softcapping"); 5.16.1 ran it.
Evidence: docs/PEAK.md, "eager_masks".

Known limitations: the source is read by a pattern (``_supports_sdpa = False`` in the architecture's
modeling file), not by resolving the class Soup builds; a model whose file is not found is taken to
run SDPA, as every architecture the committed arms measured did.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Optional

_NO_SDPA = re.compile(r"^\s*_supports_sdpa\s*=\s*False\b", re.MULTILINE)

#: For a saved row, whose transformers is not the one installed: the first transformers release whose
#: source was read with SDPA off, per architecture (5.16.1, the pinned release, reads SDPA on; the
#: releases between were not read, and are taken as the pinned one).
EAGER_SINCE = {"gemma2": (5, 24, 0)}


def transformers_root() -> Optional[Path]:
    """The installed transformers package's folder, or None (located by its spec, not imported)."""
    try:
        spec = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


@lru_cache(maxsize=None)
def runs_eager(model_type: str, root: Optional[str] = None) -> bool:
    """Whether the transformers at ``root`` (None: the installed one) declares no SDPA for
    ``model_type``'s model classes, so the model runs eager attention."""
    base = Path(root) if root is not None else transformers_root()
    if base is None:
        return False
    for name in dict.fromkeys((model_type, model_type.removesuffix("_text"))):
        path = base / "models" / name / f"modeling_{name}.py"
        if path.is_file():
            return bool(_NO_SDPA.search(path.read_text(encoding="utf-8", errors="replace")))
    return False


def _version(text: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


#: --stack transformers=VERSION (issue 53 item 16): the training box's transformers, named while the estimate
#: runs elsewhere (a laptop); its attention is taken by EAGER_SINCE in place of the installed source's.
_TRAINING_BOX: dict = {}


@contextlib.contextmanager
def training_box(transformers_version: Optional[str]) -> Iterator[None]:
    """Within it, an architecture's attention is the one ``transformers_version`` runs (None: the installed)."""
    saved = dict(_TRAINING_BOX)
    _TRAINING_BOX["transformers"] = transformers_version
    try:
        yield
    finally:
        _TRAINING_BOX.clear()
        _TRAINING_BOX.update(saved)


def box_transformers() -> Optional[str]:
    """The training box's transformers (--stack transformers=VERSION), None where none is named."""
    return _TRAINING_BOX.get("transformers")


def eager(model_type: str, transformers_version: Optional[str] = None) -> bool:
    """Whether ``model_type`` runs eager attention: under the installed transformers (None), read from
    its source; under a saved row's transformers release, or the training box's (--stack), by EAGER_SINCE."""
    if transformers_version is None:
        transformers_version = _TRAINING_BOX.get("transformers")
    if transformers_version is None:
        return runs_eager(model_type)
    since = EAGER_SINCE.get(model_type)
    return since is not None and _version(transformers_version) >= since


#: eager attention's scores per element in the recomputed layer: bf16 scores, the softcap's divide,
#: tanh and multiply (Gemma-2), the masked sum, softmax's fp32 upcast and its bf16 result
EAGER_SCORE_BYTES = 2 + 3 * 2 + 2 + 4 + 2


def eager_masks(a, seq: int, rows: int) -> int:
    """Eager attention's additive masks: (rows, 1, seq, seq) in the model's bf16, one for the full
    layers and one for the sliding ones (transformers' eager_mask; under SDPA a causal mask without
    padding is skipped). Evidence: docs/PEAK.md, "eager_masks"."""
    return (2 if a.window else 1) * 2 * rows * seq * seq


def eager_scores(a, seq: int, rows: int) -> int:
    """Eager attention's scores in the one layer being recomputed, a bound op by op
    (EAGER_SCORE_BYTES). Evidence: docs/PEAK.md, "eager_masks"."""
    return EAGER_SCORE_BYTES * rows * a.heads * seq * seq
