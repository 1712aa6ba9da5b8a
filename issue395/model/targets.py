"""LoRA targets as Soup names them: its own spellings 'auto' and 'all-linear' resolved the way
Soup's LoraConfig resolves them (auto is peft's default table for the model type; all-linear every
linear module of a decoder layer), for --estimate --targets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ..errors import UsageError


def soup_targets(targets: Optional[tuple], config: dict, arch: Any, given: Optional[str],
                 named: str = "--targets") -> Optional[tuple]:
    """Soup's own spellings, resolved as Soup's LoraConfig resolves them: 'auto' is None to peft,
    which takes its default table's modules for the model type; 'all-linear' is every linear
    layer of a decoder layer (peft leaves the output head out). ``named``: where the targets came
    from (the option, or a soup.yaml's key)."""
    if targets is None or not {"auto", "all-linear"} & set(targets):
        return targets
    if len(targets) > 1:
        raise UsageError(f"{named} {given}: auto and all-linear stand alone, not in a list")
    if targets == ("all-linear",):
        return tuple(arch.modules)
    table = peft_default_targets(named)
    mt = config.get("model_type")
    if mt not in table:
        raise UsageError(f"{named} auto: peft has no default LoRA targets for model_type {mt!r} (Soup's auto "
                         "defers to peft's table, so `soup train` would fail too); name them, from its layer's linear "
                         f"modules: {named} {','.join(arch.modules)} (or some of them)")
    return tuple(table[mt])


def peft_default_targets(named: str = "--targets") -> dict:
    """peft's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, read from its source (importing
    peft would import torch and bitsandbytes for one table)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("peft")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"{named} auto: peft is not installed, and its table is what Soup's auto means")
    source = Path(list(spec.submodule_search_locations)[0]) / "utils" / "constants.py"
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING"
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise UsageError(f"{named} auto: peft's default table is not in {source}")
