"""issue395.run.patchout: --soup-patch OUT.diff through the command line, as a maintainer runs it: the diff
of the installed soup-cli written (and taken by the real `patch -p1 --dry-run` in a copy of its
site-packages folder), and bad command lines as one line and exit 2. Soup is read from its source; nothing
is faked."""

from __future__ import annotations

import shutil
import subprocess

from conftest import main, one_error_line

from issue395.estimator.releases import soup_dir


def test_soup_patch_writes_the_diff_and_says_how_to_apply_it(capfd, tmp_path):
    out = tmp_path / "soup.diff"
    code, stdout, err = main(capfd, ["--soup-patch", out])
    assert code == 0, err
    assert f"--soup-patch: wrote {out}" in stdout and "patch -p1 --dry-run <" in stdout
    assert "_stream_budget_lines, the streamed gate" in stdout and "_hardware_fit_preflight, the resident gate" in stdout
    site = tmp_path / "site"
    shutil.copytree(soup_dir(), site / "soup_cli")
    done = subprocess.run(["patch", "-p1", "--dry-run"], input=out.read_text(), text=True, cwd=site,
                          capture_output=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_soup_patch_stands_alone_and_never_writes_a_folder_or_into_soup(capfd, tmp_path):
    code, out, err = main(capfd, ["--soup-patch", tmp_path / "x.diff", "--map"])
    one_error_line(code, out, err, "stands alone", "--map")
    code, out, err = main(capfd, ["--soup-patch", tmp_path])
    one_error_line(code, out, err, "is a folder")
    inside = soup_dir() / "utils" / "x.diff"
    code, out, err = main(capfd, ["--soup-patch", inside])
    one_error_line(code, out, err, "inside the installed soup_cli")
    assert not inside.exists() and not (tmp_path / "x.diff").exists()


def test_soup_patch_never_replaces_the_users_soup_yaml_but_replaces_its_own_diff(capfd, tmp_path):
    """Issue 53 item 2: --soup-patch soup.yaml overwrote the user's soup.yaml with the diff. Now one line,
    exit 2, the file untouched; a diff this tool wrote is replaced by the next --soup-patch."""
    yaml = tmp_path / "soup.yaml"
    yaml.write_text("base: Qwen/Qwen2.5-0.5B\n")
    one_error_line(*main(capfd, ["--soup-patch", yaml]), f"--soup-patch {yaml}", "not this tool's own output")
    assert yaml.read_text() == "base: Qwen/Qwen2.5-0.5B\n"
    diff = tmp_path / "soup.diff"
    for _ in range(2):
        code, _, err = main(capfd, ["--soup-patch", diff])
        assert code == 0, err
