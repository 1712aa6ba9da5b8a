"""Bad input and exit codes: the one line on stderr, and what each exit means; an exception's last line
and Soup's refusals in Soup's own words, cut to one line."""

from __future__ import annotations

import re

EXIT_OK, EXIT_FINDING, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
#: --estimate --exit-code: the run fits on every card by this tool's estimate, but Soup's own gate
#: (as the file sets it: training.stream_vram_override, stream_vram_probe) refuses it on some, so
#: `soup train` would not start it (1 stays "does not fit on some card").
EXIT_SOUP_REFUSES = 3


class UsageError(Exception):
    """Bad input: one line on stderr, exit 2."""


class InvalidRun(UsageError):
    """A run no stack can start (peft refuses it: a LoRA target the model lacks, a dropout nn.Dropout refuses): bad
    input in every mode, never a run the estimator merely does not model ("not estimated" beside Soup's gate)."""


#: The longest a quoted message (an exception's line, Soup's refusal) runs on the one line.
QUOTE_CHARS = 300


def cut(text: str, limit: int = QUOTE_CHARS) -> str:
    """``text`` at most ``limit`` characters, cut at a word with an ellipsis where it is longer."""
    if len(text) <= limit:
        return text
    head = text[:limit - 3]
    word = head.rsplit(" ", 1)[0]
    # a word boundary near the end (a very long word is cut inside itself rather than lose the line)
    return (word if len(word) >= limit // 2 else head).rstrip(" ,;:-\u2014") + "..."


def last_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return cut(f"{type(exc).__name__}: {text[-1] if text else ''}".strip())


#: pydantic's words before a validator's own message (Soup's loader keeps them: 'loc: Value error, ...').
PYDANTIC_PREFIX = re.compile(r"^(?:Value error|Assertion failed|Assertion error), ")
#: A location in Soup's loader's join ('training -> lora -> r'): words, dots, brackets, arrows; no colon.
LOCATION = re.compile(r"^([\w.\[\]\- >]*?): ")


def soups_words(message: str) -> str:
    """Soup's loader joins pydantic's errors as 'loc: msg'; a check on the whole file has no loc
    (': Value error, ...'): its words alone, without pydantic's 'Value error, ' prefix. The loc is
    the text before the first ': ' (a message's own colons stay)."""
    parts = []
    for part in " ".join(message.split()).split("; "):
        m = LOCATION.match(part)
        loc, msg = (m.group(1).strip(), part[m.end():]) if m else ("", part)
        msg = PYDANTIC_PREFIX.sub("", msg)
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)
