"""--config: the user's soup.yaml (read once, by issue395.run.userconfig through Soup's own loader, into its
``UserRun``, its run one typed Arm) settled into what it stands for. For --estimate, the values it gives in place
of the options (issue395.run.estimate_mode reads them off the UserRun's Arm, each error naming its key); as a
measured arm (``config_arm``), that Arm with its base resolved: a registry model (a family's or the record's hub id:
that model's architecture-exact synthetic checkpoint, as --map builds it) or a checkpoint folder (as --model PATH
runs one). No base is ever downloaded unless --weights hub asks: any other base is one line.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional

from ..errors import UsageError
from ..model.arm import Arm
from ..model.registry import ALL_FAMILIES, FAMILIES, SHAPES, by_hub_id, max_positions
from ..estimator.soup_number import require_streamed
from ..measure.shapes import bitsandbytes_present
from .checks import HUB_ID, within_positions
from .userconfig import UserRun

#: What the file gives, as the options it replaces: each is refused beside --config (clashes).
CONFIG_GIVES = ("--model", "--quant", "--seq", "--batch", "--task", "--targets", "--lora-r", "--families", "--models",
                "--expert-layout", "--loss-chunk", "--recompute")


#: --estimate --config's steps when --steps is not given: the run's steady state. `soup train` runs
#: many optimizer steps; from the second on the optimizer's states are live and each later step
#: repeats that peak, so two steps hold the peak over all of them.
STEADY_STEPS = 2

def config_arm(user: UserRun, weights: str, dry_run: bool, soup_resolves_targets: bool = False) -> Arm:
    """The soup.yaml's Arm (``user.arm``) with its base resolved (a registry key, or "custom" with its checkpoint
    folder or, with --weights hub, its hub id), checked as a measured arm; a base this tool cannot run without a
    download is one line. ``soup_resolves_targets``: --find-max's probes run `soup train` on the file, which
    resolves ``target_modules: auto`` itself (issue 53 item 8), so it is not refused there."""
    arm = user.arm
    if arm.adapter.targets == ("auto",) and arm.adapter.lora_r and not soup_resolves_targets:  # r 0 trains no target
        raise UsageError(f"--config {user.path}: training.lora.target_modules 'auto' is estimated (--estimate) but "
                         "not run as an arm here: name the modules")
    if user.dropped and not soup_resolves_targets:  # --find-max's probes run the file itself, every key of it
        them = "it" if len(user.dropped) == 1 else "them"
        raise UsageError(f"--config {user.path}: {', '.join(user.dropped)}: a measured arm runs the protocol's Soup "
                         f"config with the file's shape, adapter, streaming modes and settings, which does not carry "
                         f"{them}, so it would measure another run; remove {them} to measure the run without")
    model, key = base_of(user, weights)
    if key != "custom" and not arm.streaming.resident:  # a resident run needs Soup to stream nothing
        require_streamed((FAMILIES[key] if key in FAMILIES else SHAPES[key]).model_type,
                         f"--config {user.path}: base {user.base}")
    if key != "custom":
        within_positions(user.base, max_positions(key), (arm.seq,), f"--config {user.path}: data.max_length")
    if arm.quant == "nf4" and not dry_run and not bitsandbytes_present():
        raise UsageError(f"--config {user.path}: training.quantization 4bit needs bitsandbytes, which is not "
                         "installed here")
    optimizer = arm.settings.optimizer
    if bitsandbytes_optimizer(optimizer) and not dry_run and not bitsandbytes_present():
        raise UsageError(f"--config {user.path}: training.optimizer {optimizer} is bitsandbytes', which is not "
                         "installed here")
    arm = replace(arm, base=key, checkpoint=model)
    arm.streaming.checked(key)  # a resident file is the map's resident arm (`family+resident[+gc]`)
    return arm


def bitsandbytes_optimizer(name: str) -> bool:
    """An optimizer transformers builds from bitsandbytes (its 8-bit and paged ones: adamw_8bit,
    paged_adamw_32bit, lion_8bit, ...)."""
    return "8bit" in name or name.startswith("paged_") or "bnb" in name


def base_of(user: UserRun, weights: str) -> tuple[Optional[str], str]:
    """(checkpoint, key) of a soup.yaml's base: a folder here first (as transformers reads a base),
    then a registry model's hub id, then, only with --weights hub, any hub id (fetched as --model's)."""
    folder = os.path.expanduser(user.base)
    if os.path.isdir(folder):
        return folder, "custom"
    base_is_no_family_key(user)
    key = by_hub_id(user.base)
    if key is not None:
        return None, key
    if weights == "hub" and HUB_ID.fullmatch(user.base) and user.base.count("/") == 1:
        return user.base, "custom"
    raise UsageError(f"--config {user.path}: base {user.base!r} is neither a checkpoint folder here nor a model "
                     "this tool builds (a family's hub id, e.g. mistralai/Mistral-7B-v0.3); it downloads "
                     "nothing unless --weights hub asks")


def base_is_no_family_key(user: UserRun) -> None:
    """A base spelled as this tool's family key (``base: mistral-7b``), with no folder of that name here, is
    no base `soup train` loads (transformers reads it as a hub id no one publishes): one line naming the
    family's hub id, the same in --estimate, --find-max and the measured arm (issue 53 item 4)."""
    if user.base in ALL_FAMILIES and not os.path.isdir(os.path.expanduser(user.base)):
        hub = (FAMILIES[user.base] if user.base in FAMILIES else SHAPES[user.base]).hub_id
        raise UsageError(f"--config {user.path}: base {user.base!r} is this tool's name for a family, not a base "
                         f"`soup train` can load (no folder of that name here, nor a hub id): write base: {hub}")
