"""Checks on what the command line names, before anything runs: whole numbers and their bounds,
output paths (writable, never an input), input files, hub ids against local paths, --cache-dir, and
the packages a mode imports (a `pip install --no-deps soup-cli` has enough for --estimate alone)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import stat
from pathlib import Path
from typing import Iterable, Optional

from ..constants import comma_list
from ..errors import UsageError
from ..record import OURS_QUANT
from ..tasks import PROTOCOL_TASK, TASKS
from ..report.outputs import NOT_OURS, not_ours
from ..host.scratch import writable_folder

#: The largest value each whole-number option takes: batch sizes no real run has, seq lengths
#: beyond any model's positions, and counts that would only run for hours are refused up front.
MAXIMA = {"--seq": (1_048_576, "longer than any model's positions"),
          "--batch": (1024, "larger than any real run's batch"),
          "--steps": (1000, "more optimizer steps than a peak needs"),
          "--lora-r": (1024, "a larger LoRA rank than any real run's"),
          "--determinism": (100, "more repeats than a determinism check needs"),
          "--gpus": (1023, "more GPUs than a host has")}


_WHOLE = re.compile(r"-?[0-9]{1,4000}")  # int() refuses longer strings


def _shown(item: str) -> str:
    return item if len(item) <= 40 else item[:40] + "..."


def parse_ints(flag: str, text: Optional[str], minimum: int = 1,
               maximum: Optional[int] = None, named: Optional[str] = None) -> Optional[tuple]:
    """A comma list of whole numbers in plain ASCII digits (a leading minus is read, then refused
    by ``minimum``); anything else, and anything above the flag's maximum, is one line. ``named``:
    where the value came from, where it is not the flag itself (a soup.yaml's key)."""
    if text is None:
        return None
    top, why = (maximum, "") if maximum is not None else MAXIMA.get(flag, (None, ""))
    flag = named or flag
    items = comma_list(text)
    if not all(items):
        raise UsageError(f"{flag} {_shown(text)!r}: empty item; give a comma list of whole numbers")
    out: list[int] = []
    for item in items:
        if not _WHOLE.fullmatch(item):
            raise UsageError(f"{flag} {_shown(item)!r} is not a whole number")
        if int(item) in out:
            raise UsageError(f"{flag} {_shown(text)}: {int(item)} is named twice")
        out.append(_bounded(flag, int(item), minimum, top, why))
    return tuple(out)


def _bounded(named: str, value: int, minimum: int, top: Optional[int], why: str) -> int:
    if value < minimum:
        raise UsageError(f"{named} {_shown(str(value))} must be at least {minimum}")
    if top is not None and value > top:
        raise UsageError(f"{named} {_shown(str(value))} is more than {top}" + (f", {why}" if why else ""))
    return value


def within(flag: str, value: int, minimum: int = 1, named: Optional[str] = None) -> int:
    """A whole number a soup.yaml gave (Soup's loader read it) inside the bounds ``flag`` has (MAXIMA), one line
    naming the file's key (``named``) where it is not."""
    top, why = MAXIMA.get(flag, (None, ""))
    return _bounded(named or flag, value, minimum, top, why)


#: A choice spelt as Soup's config spells it -> this tool's name for it, where the two differ (record.OURS_QUANT).
SPELLED = {"--quant": {soup: ours for soup, ours in OURS_QUANT.items() if soup != ours}}


def distinct_choices(flag: str, text: str, allowed: tuple[str, ...], noun: str) -> tuple[str, ...]:
    """A comma list of names from ``allowed``, none twice (a name twice is said as such only
    when every name is known; else what to choose from)."""
    items = comma_list(text)
    if len(set(items)) != len(items) and all(i in allowed for i in items):
        raise UsageError(f"{flag} {text}: a {noun} is named twice")
    if any(i not in allowed for i in items):
        hints = [f"Soup's {i} is {SPELLED[flag][i]} here" for i in items if i in SPELLED.get(flag, {})]
        raise UsageError(f"{flag} {text!r}: choose from {','.join(allowed)}" + (f" ({'; '.join(hints)})" if hints else ""))
    return items


def within_positions(name: str, limit: int, seqs: Iterable[int], given_as: str = "--seq") -> None:
    """A seq beyond a model's positions is one line here, not a FAILED row (0: no limit known);
    ``given_as`` names where the seq came from (a soup.yaml's data.max_length, say)."""
    beyond = [s for s in seqs if limit and s > limit]
    if beyond:
        raise UsageError(f"{given_as} {beyond[0]} is beyond {name}'s maximum positions ({limit})")


def check_output(flag: str, path: str) -> None:
    if not path.strip():
        raise UsageError(f"{flag}: the path is empty; give a file path")
    if path == "-" and flag == "--json":
        return  # stdout
    if path == "-":
        raise UsageError(f"{flag} -: only --json writes to stdout; give a file path")
    with contextlib.suppress(OSError):
        st = os.stat(os.path.realpath(path))
        if stat.S_ISREG(st.st_mode) and not st.st_mode & 0o222:  # even root: someone protected it
            raise UsageError(f"{flag} {path} is read-only; it is not replaced (give another path, or "
                             "make it writable)")
    if path.endswith(("/", os.sep)):  # out.json/ names a folder: never written as out.json
        raise UsageError(f"{flag} {path} ends in '/', a folder's spelling; give a file path")
    if flag == "--plot" and Path(path).suffix.lower() != ".png":
        raise UsageError(f"--plot {path}: the plot is a PNG; give a path ending in .png")
    if Path(path).is_dir():
        raise UsageError(f"{flag} {path} is a folder; give a file path")
    if not Path(os.path.realpath(path)).exists():
        writable_folder(flag, os.path.dirname(os.path.realpath(path)), given=path)


def config_is_a_file(given: str) -> None:
    """--config names a file to read: an empty value is no path (it read '.', issue 53 item 7), a FIFO, device
    or socket is never opened (a FIFO hung the run, item 6), a folder is said as one; each one line."""
    if not given.strip():
        raise UsageError("--config: the path is empty; give the soup.yaml `soup train` takes")
    path = os.path.expanduser(given)
    odd = odd_file(path)
    if odd and not odd.startswith("a symlink to nothing"):  # that one is said by the loader as not there
        raise UsageError(f"--config {given}: {odd}: give the soup.yaml `soup train` takes")
    if os.path.isdir(path):
        raise UsageError(f"--config {given} is a folder; give the soup.yaml `soup train` takes")
    if not os.path.lexists(path):
        raise UsageError(f"--config {given}: no such file (relative to the working directory {os.getcwd()})")


def never_replaced(flag: str, path: Optional[str]) -> None:
    """An output never replaces a file this tool did not write (a config.json, a soup.yaml, a script: issue 53
    items 1 and 2; the rule: USAGE.md, "Files it writes"), checked after the checks that name the input it is."""
    if path not in (None, "-") and not_ours(path):
        raise UsageError(f"{flag} {path} {NOT_OURS} (give a new path, or move the file away)")


def same_file(a: str, b: str) -> bool:
    """One file under two spellings: ./, a symlink, or a hard link."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def no_output_is_an_input(outputs: dict[str, Optional[str]], inputs: list[tuple[str, str]]) -> None:
    """An output never overwrites what the run reads: a saved result, --compare's, or --model's
    config.json or a file of its checkpoint folder."""
    for flag, path in outputs.items():
        if not path or path == "-":  # stdout
            continue
        for in_flag, source in inputs:
            inside = (os.path.isdir(source) and os.path.exists(path)
                      and os.path.dirname(os.path.realpath(path)) == os.path.realpath(source))
            if same_file(path, source) or inside:
                what = "a file of " if inside else ""
                raise UsageError(f"{flag} {path} is {what}{in_flag} {source}: an output would overwrite "
                                 "its input; give the output its own path")


#: A hub id as the hub accepts one: a name, or org/name, of letters, digits, '_', '-' and '.'.
HUB_ID = re.compile(r"(?:[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9])?/)?[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9])?")


def local_or_hub(model: str) -> str:
    """--model as given: an existing file or folder (~ expanded), or a hub id. A value that
    looks like a path (starts with / . or ~, ends with .json, has more than one '/', or its
    first folder exists here) and is not there is one line, not a hub lookup."""
    path = os.path.expanduser(model)
    odd = odd_file(path)
    if odd and os.path.exists(path):
        raise UsageError(f"--model {model}: {odd}: give a checkpoint folder, a config.json or a hub id")
    if os.path.exists(path):
        return path
    if os.path.lexists(path):
        raise UsageError(f"--model {model}: a symlink to nothing ({os.path.realpath(path)} is not there)")
    if looks_like_a_path(model):
        raise UsageError(f"--model {model}: no such file or folder")
    if not HUB_ID.fullmatch(model) or "--" in model or ".." in model or len(model) > 96:
        raise UsageError(f"--model {model}: no such file or folder, nor a hub id (org/name)")
    return model


def looks_like_a_path(value: str) -> bool:
    """A model named by a path rather than a hub id: it starts with / . or ~, ends with .json, has
    more than one '/', or its first folder exists here."""
    first = value.split("/")[0]
    return (value.startswith(("/", ".", "~")) or value.lower().endswith(".json") or value.count("/") > 1
            or ("/" in value and os.path.isdir(first)) or os.sep != "/" and os.sep in value)


def odd_file(path: str) -> Optional[str]:
    """What a path is when it is there but is neither a regular file nor a folder: said as such,
    not as "no such file" (None for a file, a folder, or nothing at all)."""
    if not os.path.lexists(path):
        return None
    if not os.path.exists(path):
        return f"a symlink to nothing ({os.path.realpath(path)} is not there)"
    mode = os.stat(path).st_mode
    for test, what in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return f"{what}, not a file"
    return None


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


def one_int(flag: str, text: Optional[str], default: int, minimum: int = 1, named: Optional[str] = None) -> int:
    values = parse_ints(flag, text, minimum, named=named)
    if values is not None and len(values) != 1:
        raise UsageError(f"{named or flag} {text}: give one whole number")
    return values[0] if values else default


def settle_tasks(given: Optional[str]) -> tuple:
    """--task: Soup's streamed tasks, each once (the protocol's SFT where none is named)."""
    return (PROTOCOL_TASK,) if given is None else distinct_choices("--task", given, tuple(TASKS), "task")


def context_within_cards(flag: str, cards, context: Optional[int]) -> None:
    """A --context that leaves a card nothing once the runtime's growth is out (cards.step_free) is
    one line, never a table of negative free memory."""
    from ..estimator.cards import step_free

    short = next((c for c in cards if context is not None and step_free(c.total_bytes - context) <= 0), None)
    if short is not None:
        raise UsageError(f"--context {context / 1e9:g} GB leaves {flag} {short.name} ({short.total_bytes / 1e9:.2f} GB "
                         "total) no free memory for a step: the context is part of the card's total; give the "
                         "context your card leaves, as an idle process sees it")


def one_card(flag: str, given: str):
    """A card this tool knows or a size, given to ``flag`` (--emulate-card, --find-max's card)."""
    from ..estimator.cards import parse_card

    try:
        return parse_card(given)
    except UsageError as exc:
        raise UsageError(str(exc).replace("--card", flag, 1)) from None


#: What soup-cli's config loader imports beyond soup-cli itself (soup_cli/config/loader.py and
#: schema.py), by module -> the package pip installs it from: a `pip install --no-deps soup-cli`
#: (enough for --estimate --model) lacks them.
LOADER_NEEDS = {"yaml": "pyyaml", "pydantic": "pydantic", "rich": "rich"}

#: What a run that builds and steps arms (a dry run too) imports, by module -> pip package: the
#: training stack (requirements.txt pins it), the packages Soup's own setup imports (its "train"
#: extra: accelerate, datasets) and its loader's.
ARM_NEEDS = {"torch": "torch", "transformers": "transformers", "trl": "trl", "peft": "peft",
             "accelerate": "accelerate", "datasets": "datasets", "safetensors": "safetensors", "jinja2": "jinja2",
             **LOADER_NEEDS}
#: --plot draws with matplotlib, whatever mode writes it.
PLOT_NEEDS = {"matplotlib": "matplotlib"}


def not_installed(modules: dict) -> list[str]:
    """The pip packages of ``modules`` (module -> package) whose module is not importable here,
    found without importing them (importlib's finder)."""
    missing = []
    for module, package in modules.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found and package not in missing:
            missing.append(package)
    return missing


def require_installed(what: str, modules: dict, hint: str = "pip install -r requirements.txt") -> None:
    """One line before any work where a mode's packages are not installed: each named, and the pip
    command that installs them."""
    missing = not_installed(modules)
    if missing:
        raise UsageError(f"{what} needs {', '.join(missing)}, not installed here (a `pip install --no-deps "
                         f"soup-cli` has enough for --estimate alone): {hint}")
