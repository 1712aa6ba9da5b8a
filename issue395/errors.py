"""Bad input and exit codes: the one line on stderr, and what each exit means."""

from __future__ import annotations

EXIT_OK, EXIT_FINDING, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """Bad input: one line on stderr, exit 2."""


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
