"""issue395.estimator.releases: a soup-cli release the estimator has not read gets the nearest known
release's physics, marked as such, not a flat refusal (issue 22, usability)."""

from __future__ import annotations

import pytest
from conftest import main

from issue395.estimator.releases import UnknownRelease, nearest_release, physics_label

KNOWN = ("0.73.3", "0.77.0")


@pytest.mark.parametrize("release, nearest", [
    ("0.77.0", "0.77.0"), ("0.73.3", "0.73.3"), ("0.76.1", "0.77.0"), ("0.74.0", "0.73.3"), ("0.72.0", "0.73.3"),
    ("0.75.0", "0.73.3"), ("0.75.2", "0.77.0"), ("0.78.2", "0.77.0"), ("0.77.1rc1", "0.77.0"), ("1.0.0", "0.77.0"),
])
def test_the_nearest_known_release(release, nearest):
    assert nearest_release(release, KNOWN) == nearest


def test_an_unreadable_release_is_refused_and_a_nearest_one_is_marked():
    with pytest.raises(UnknownRelease):
        nearest_release("nightly", KNOWN)
    assert physics_label("0.77.0", "0.77.0") == "0.77.0"
    assert physics_label("0.76.1", "0.77.0") == "0.76.1 (physics of 0.77.0, the nearest known release)"


def test_estimate_under_a_release_it_does_not_know_uses_the_nearest_and_says_so(capfd, tmp_path, monkeypatch):
    """The installed soup_cli's source, presented as 0.76.1 (ISSUE395_SOUP_SOURCE with a dist-info
    of that version beside it): Soup's own number still comes from that source."""
    import json
    import importlib.util
    from pathlib import Path

    real = Path(list(importlib.util.find_spec("soup_cli").submodule_search_locations)[0])
    (tmp_path / "soup_cli").symlink_to(real, target_is_directory=True)
    (tmp_path / "soup_cli-0.76.1.dist-info").mkdir()
    monkeypatch.setenv("ISSUE395_SOUP_SOURCE", str(tmp_path / "soup_cli"))
    out = tmp_path / "e.json"
    code, stdout, err = main(capfd, ["--estimate", "--model", "llama31-8b", "--seq", "512", "--json", out])
    assert code == 0, err
    head = next(line for line in stdout.splitlines() if line.startswith("soup-cli"))  # below the verdict lines
    assert head.startswith("soup-cli 0.76.1 (physics of 0.77.0, the nearest known release)")
    data = json.loads(out.read_text())
    assert data["soup_cli"] == "0.76.1" and data["physics_release"] == "0.77.0"
    assert data["rows"][0]["release"] == "0.77.0"
