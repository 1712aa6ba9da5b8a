"""Soup releases: which known release's physics a release this tool has not read gets (the nearest
by version number), said as such wherever its figures are shown. Stdlib only."""

from __future__ import annotations

import re

from ..errors import UsageError


class UnknownRelease(UsageError):
    """A soup-cli version that cannot be read as one (no model is to blame: said without one)."""


def release_key(release: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version like 0.76.1, 0.77.0rc1 or 0.77.0+local."""
    m = re.match(r"\s*(\d+)(?:\.(\d+))?(?:\.(\d+))?", release or "")
    if not m:
        raise UnknownRelease(f"soup-cli release {release!r} is not a version this can read (e.g. 0.77.0)")
    return tuple(int(g or 0) for g in m.groups())  # type: ignore[return-value]


def nearest_release(release: str, known: tuple[str, ...]) -> str:
    """``release`` itself when known, else the known release nearest it in version order, each
    version read as one number (major, minor, patch as digits of base 1000): 0.76.1 -> 0.77.0,
    0.74.0 -> 0.73.3, 1.0.0 -> 0.77.0; a tie goes to the later release."""
    if release in known:
        return release

    def number(r: str) -> int:
        major, minor, patch = release_key(r)
        return (major * 1000 + minor) * 1000 + patch

    want = number(release)
    return min(known, key=lambda k: (abs(number(k) - want), -number(k)))


def physics_label(installed: str, physics: str) -> str:
    """How a release is named beside the figures: the nearest release's physics marked as such."""
    return installed if installed == physics else f"{installed} (physics of {physics}, the nearest known release)"
