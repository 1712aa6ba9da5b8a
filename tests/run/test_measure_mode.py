"""run/measure_mode.py: the measured modes (the sweep, the map, a soup.yaml's one arm, --determinism,
--measure and --sdpa): ``settle``'s checks, once, before any arm (every output folder, an empty shard,
NF4 without bitsandbytes), and ``execute``'s plan of processes, its row file and its outputs, on CPU."""

from __future__ import annotations
import pytest
from conftest import main, one_error_line, readme_yaml


# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


@pytest.mark.parametrize("folder", ["/proc/x", "/proc/x/y", "/proc"])
def test_a_log_dir_where_nothing_can_be_made_is_one_line_before_any_arm(capfd, tmp_path, folder):
    """Issue 29 item 8: a --log-dir in which no file can be made is one line naming it, before any arm runs."""
    argv = ["--dry-run", "--config", readme_yaml(tmp_path), "--log-dir", folder]
    one_error_line(*main(capfd, argv), "--log-dir", folder)
