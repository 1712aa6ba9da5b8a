"""The pip way (pyproject.toml): the wheel a clone builds ships the entry script as a module beside the
package, its console command `issue395` is the script's own main (the same flags, the same --help), and
its ranges are the ones soup-cli 0.77.0 admits. Where the package is installed in the venv the suite runs
in (.ci/run's .venv-latest installs it from a git URL), the installed command itself is run: its --help
against the script's, and --estimate --config naming its stack. Nothing is faked."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from conftest import ROOT, SCRIPT

from issue395.estimator.stacks import check_installed

COMMAND = "issue395"
ENTRY = "issue395_second_stack_vram:main"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
#: the command a pip install put beside this venv's python (absent: the package is not installed here)
INSTALLED = Path(sys.executable).parent / COMMAND
needs_install = pytest.mark.skipif(not INSTALLED.is_file(), reason=(
    f"the package is not installed in this venv (no {INSTALLED}): .ci/run's .venv-latest installs it"))
#: the README's soup.yaml (Mistral-7B NF4 at 2048 x 1)
README_YAML = (ROOT / "README.md").read_text(encoding="utf-8").split("```yaml\n", 1)[1].split("```", 1)[0]


def test_the_console_command_is_the_entry_scripts_own_main_shipped_as_a_module():
    assert PYPROJECT["project"]["scripts"] == {COMMAND: ENTRY}
    assert PYPROJECT["tool"]["setuptools"]["py-modules"] == [SCRIPT.stem]
    module, func = ENTRY.split(":")
    assert (ROOT / f"{module}.py") == SCRIPT and f"\ndef {func}(" in SCRIPT.read_text(encoding="utf-8")


def _requires(dist_requires: list[str]) -> dict[str, str]:
    """Requires-Dist lines as {name: its specifiers, sorted}, an extra's as "name[extra]"."""
    out = {}
    for line in dist_requires:
        m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[[^]]*\])?\s*([^;]*)(?:;\s*extra\s*==\s*['\"]([\w-]+)['\"])?", line)
        name = m.group(1).lower() + (f"[{m.group(3)}]" if m.group(3) else "")
        out[name] = ",".join(sorted(m.group(2).replace(" ", "").split(",")))
    return out


def test_the_ranges_for_transformers_peft_and_trl_are_the_ones_soup_cli_0770_admits():
    """Read off the installed soup-cli 0.77.0's own metadata (its `all` extra); where this venv holds
    another release, that release's ranges are not 0.77.0's and the check skips."""
    if metadata.version("soup-cli") != "0.77.0":
        pytest.skip(f"soup-cli {metadata.version('soup-cli')} is installed; the ranges are 0.77.0's")
    soup = _requires(metadata.requires("soup-cli") or [])
    ours = _requires(PYPROJECT["project"]["dependencies"])
    for name in ("transformers", "peft", "trl", "torch"):
        assert ours[name] == soup[f"{name}[all]"], name
    assert _requires(PYPROJECT["project"]["optional-dependencies"]["nf4"])["bitsandbytes"] == \
        soup["bitsandbytes[all]"]
    assert ours["soup-cli"] == "<0.78,>=0.73.3"


@pytest.mark.slow
def test_the_wheel_a_clone_builds_ships_the_script_every_module_and_the_command(tmp_path):
    """Built from a copy of the tree's files (setuptools builds in place: the tree stays clean), offline,
    with the venv's own setuptools."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", SCRIPT.name):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "issue395", src / "issue395", ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "-w", str(tmp_path / "dist"), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    wheel = next((tmp_path / "dist").glob("*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "issue395").rglob("*.py")}
    assert SCRIPT.name in names and modules <= names, sorted(modules - names)
    dist = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert f"{COMMAND} = {ENTRY}" in zipfile.ZipFile(wheel).read(dist).decode()


def _run(argv: list, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=300)


@needs_install
def test_the_installed_commands_help_is_the_scripts(tmp_path):
    command, script = _run([INSTALLED, "--help"], tmp_path), _run([sys.executable, SCRIPT, "--help"], tmp_path)
    assert command.returncode == script.returncode == 0, command.stderr + script.stderr
    assert command.stdout.startswith(f"usage: {COMMAND} ") and script.stdout.startswith(f"usage: {SCRIPT.name} ")
    assert command.stdout.split("\n\n", 1)[1] == script.stdout.split("\n\n", 1)[1]  # all but usage's own lines


@needs_install
def test_the_installed_command_answers_estimate_config_naming_its_stack(tmp_path):
    (tmp_path / "soup.yaml").write_text(README_YAML, encoding="utf-8")
    done = _run([INSTALLED, "--estimate", "--config", "soup.yaml", "--card", "T4", "--json", "estimate.json"], tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("verdict (this tool's estimate and Soup's own gate): fits on T4")
    assert lines[1].startswith("--estimate: mistralai/Mistral-7B-v0.3, from --config soup.yaml: ")
    assert any(ln.startswith("  T4: sft nf4 2048x1: fits (needs ") for ln in lines), done.stdout
    stack = check_installed(nf4=True)
    assert f"  {stack.line()}" in lines, done.stdout
    saved = json.loads((tmp_path / "estimate.json").read_text())
    assert saved["stack"] == stack.to_json()


def test_the_readmes_pip_section_installs_torchs_cpu_wheel_before_the_package_on_a_cpu_box():
    """Issue 53 item 11: the README's pip commands pulled PyPI's CUDA torch (about 6.2 GB) onto a CPU box that
    only asks --estimate; its block installs torch from the CPU index first, a line said to be for a CPU box."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("## With pip", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    cpu = next(i for i, ln in enumerate(block) if "download.pytorch.org/whl/cpu" in ln)
    package = next(i for i, ln in enumerate(block) if 'install ".[all]"' in ln)
    assert cpu < package and "torch" in block[cpu] and "CPU box" in block[cpu]
