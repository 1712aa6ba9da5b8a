"""The house: a protocol script a page long, and a package in wings beside it. docs/LAYOUT.md is
the law: its wings stand bottom-up, each with its modules in order, lowest first; a module imports
only from the modules listed above it in its own wing and from the wings below, never the script;
every module stands in the table under the wing whose folder holds it; the estimator wing is stdlib
only at import; and each wing's tests live in tests/<wing>/."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

from conftest import ROOT, SCRIPT

PACKAGE = ROOT / "issue395"
TESTS = ROOT / "tests"
ROOT_WING = ""  # issue395/ itself: constants, errors and the like


def layout() -> dict[str, list[str]]:
    """docs/LAYOUT.md's wings, bottom-up (the root first), each with its modules in order, lowest
    first: a wing's section is headed by its folder in backticks (`issue395/` for the root)."""
    wings, wing = {}, None
    for line in (ROOT / "docs" / "LAYOUT.md").read_text(encoding="utf-8").splitlines():
        heading = re.match(r"^### `issue395/(\w*)/?`", line)
        if heading:
            wing = heading.group(1)
            wings[wing] = []
        elif line.startswith("## "):
            wing = None
        row = re.match(r"^\| `(\w+)` \|", line)
        if row and wing is not None:
            wings[wing].append(row.group(1))
    return wings


def package_modules() -> dict[str, tuple[str, object]]:
    """Every module of the package by name: its wing ('' for the root) and its path."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if path.stem == "__init__":
            continue
        wing = path.parent.relative_to(PACKAGE).as_posix()
        assert path.stem not in found, f"two modules named {path.stem}"
        found[path.stem] = ("" if wing == "." else wing, path)
    return found


def imports_of(path) -> set[str]:
    """Package modules a module imports, at any depth, annotations under TYPE_CHECKING included:
    an import only a type checker follows still ties the two modules into one cycle. A module is
    named by its last part (module names are unique across the wings)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level or module.startswith("issue395"):
                found |= {module.split(".")[-1]} if module and module.split(".")[-1] not in layout() \
                    else {a.name for a in node.names}
    return found


def test_every_module_stands_in_the_layout_under_the_wing_that_holds_it():
    wings, modules = layout(), package_modules()
    listed = {m: w for w, ms in wings.items() for m in ms}
    assert sum(len(ms) for ms in wings.values()) == len(listed), "a module listed twice"
    assert {m: w for m, (w, _) in modules.items()} == listed
    folders = {p.parent.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")} - {"."}
    assert folders == set(wings) - {ROOT_WING}, "a wing folder without its LAYOUT.md section, or the reverse"
    assert len(wings[ROOT_WING]) + 1 <= 8, "at most 8 modules at issue395/ itself"


def test_a_module_imports_only_what_lies_below_it():
    """Below: a wing listed earlier, or a module listed earlier in its own wing."""
    wings, modules = layout(), package_modules()
    order = list(wings)
    rank = {m: (order.index(w), ms.index(m)) for w, ms in wings.items() for m in ms}
    for name, (wing, path) in modules.items():
        above = sorted(m for m in imports_of(path) if rank[m] >= rank[name])
        assert not above, f"{wing or 'issue395'}/{name} imports {above}, which do not lie below it"


def test_a_wings_face_hands_on_nothing():
    """A wing's __init__.py is its docstring: every name is taken from the module that defines it."""
    for path in PACKAGE.rglob("__init__.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        assert ast.get_docstring(tree) and len(tree.body) == 1, path.relative_to(ROOT)


def test_the_package_never_imports_the_script():
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        named = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        named |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "issue395_second_stack_vram" not in named, path.name
        assert "import_module" not in path.read_text(encoding="utf-8") or path.stem == "console", path.name


def test_the_estimator_wing_imports_no_torch_and_no_soup():
    """The estimator runs where torch is not installed: its modules import the stdlib only, and
    read Soup's source with ast rather than import it."""
    names = [f"issue395.estimator.{m}" for m in layout()["estimator"]]
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import " + ", ".join(names)
            + "; print(sorted(m for m in ('torch', 'soup_cli', 'transformers', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_script_is_a_page():
    assert len(SCRIPT.read_text(encoding="utf-8").splitlines()) <= 400


def test_each_wing_has_its_tests_folder():
    wings = set(layout()) - {ROOT_WING}
    missing = sorted(f"tests/{w}/" for w in wings if not list((TESTS / w).glob("test_*.py")))
    assert not missing, f"a wing without its tests: {missing}"
    strays = sorted(p.name for p in TESTS.iterdir() if p.is_dir() and p.name not in wings
                    and p.name not in {"golden", "__pycache__"})
    assert not strays, f"a tests folder named for no wing: {strays}"


def _defined_and_imported(path) -> tuple[set[str], set[str]]:
    """The names a module defines at its top level, and those it only imports (at any depth)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))}
    defined |= {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                for t in ast.walk(t) if isinstance(t, ast.Name)}
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    return defined, imported - defined


def _takes_through(tree, modules: set[str]):
    """(module, name) for each package name this file takes from a package module: a
    ``from issue395.wing.m import name`` (or ``from .m``, ``from ..wing.m``), or ``alias.name`` on
    an imported module. A
    name a test monkeypatches on the module (``setattr(alias, "name", ...)``) is patched where it is
    used, not taken through it."""
    aliases, patched = {}, set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("issue395")):
            module = (n.module or "").split(".")[-1]
            if module in modules:
                yield from ((module, a.name) for a in n.names)
            elif module in ("", "issue395", *layout()):  # a wing, or the package: its modules by name
                aliases |= {(a.asname or a.name): a.name for a in n.names if a.name in modules}.items()
        elif isinstance(n, ast.Import):
            aliases |= {(a.asname or a.name): a.name.split(".")[-1] for a in n.names
                        if a.asname and a.name.startswith("issue395.") and a.name.split(".")[-1] in modules}.items()
        elif isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", "")) == "setattr" \
                and len(n.args) >= 2 and isinstance(n.args[0], ast.Name) and isinstance(n.args[1], ast.Constant):
            patched.add((n.args[0].id, n.args[1].value))
    aliases = dict(aliases)
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases \
                and (n.value.id, n.attr) not in patched:
            yield aliases[n.value.id], n.attr


def test_no_module_hands_on_a_name_it_only_imports():
    """Each name is taken from the module that defines it: a module that imports a name is not a
    second address for it (estimate had re-exported soup_number's and constants' names)."""
    modules = {name: _defined_and_imported(path) for name, (_, path) in package_modules().items()}
    files = [*PACKAGE.rglob("*.py"), *TESTS.rglob("*.py"), *(ROOT / "bench").glob("*.py"), SCRIPT]
    through = sorted(f"{path.relative_to(ROOT)}: {module}.{name}" for path in files
                     for module, name in _takes_through(ast.parse(path.read_text(encoding="utf-8")), set(modules))
                     if name in modules[module][1])
    assert not through, through


#: The longest a function may run (its def to its last line): a function past a page is split (issue 50).
LONGEST_FUNCTION = 80


def test_no_function_runs_past_a_page():
    """Issue 50's bound, held where it can slip: no function or method of the package, the entry script or bench/
    runs past LONGEST_FUNCTION lines (an ast walk over every one, nested ones too)."""
    files = sorted(PACKAGE.rglob("*.py")) + [SCRIPT] + sorted((ROOT / "bench").glob("*.py"))
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in files for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION]
    assert not long, long


def test_the_command_lines_wing_stays_the_command_line():
    """Issue 50's bounds on what grows unseen: run/ (the command line and its modes) at most 3,500 lines, the
    rest of the work in the wings that own it; bench/ at most 20 tracked files (a device call that has run lives on
    in its results folder's commands.txt)."""
    lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in (PACKAGE / "run").glob("*.py"))
    assert lines <= 3500, lines
    bench = subprocess.run(["git", "ls-files", "bench"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert len(bench) <= 20 or not bench, bench
