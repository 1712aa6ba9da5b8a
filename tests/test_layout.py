"""The house: a protocol script a page long, and a package of one-concern modules beside it,
each importing only what lies below it (docs/LAYOUT.md's order), never the script; and the tests
mirror the modules, one tests/test_<module>.py each, beside a few named suites that pin no one
module."""

from __future__ import annotations

import ast
import re

from conftest import ROOT, SCRIPT

PACKAGE = ROOT / "issue395"
TESTS = ROOT / "tests"

#: The test files that are no one module's: the persona suites (end to end), the goldens, the bench
#: scripts' run and this file.
NOT_A_MODULE = {"test_new_user", "test_hostile", "test_children_and_saved_results", "test_faults",
                "test_cli", "test_golden", "test_bench", "test_layout"}


def layout_order() -> list[str]:
    """The modules in the order docs/LAYOUT.md's table lists them, lowest first."""
    layout = (ROOT / "docs" / "LAYOUT.md").read_text(encoding="utf-8")
    return re.findall(r"^\| `(\w+)` \|", layout, re.M)


def imports_of(path) -> set[str]:
    """Package modules a module imports, at any depth, annotations under TYPE_CHECKING included:
    an import only a type checker follows still ties the two modules into one cycle."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                found |= {node.module} if node.module else {a.name for a in node.names}
            elif (node.module or "").startswith("issue395."):
                found.add(node.module.split(".")[1])
    return found


def test_every_module_is_in_the_layout_and_imports_only_what_lies_below_it():
    order = layout_order()
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert sorted(order) == modules
    for name in modules:
        above = [m for m in imports_of(PACKAGE / f"{name}.py") if order.index(m) >= order.index(name)]
        assert not above, f"{name} imports {above}, which do not lie below it"


def test_the_package_never_imports_the_script():
    for path in PACKAGE.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        named = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        named |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "issue395_second_stack_vram" not in named, path.name
        assert "import_module" not in path.read_text(encoding="utf-8") or path.stem == "console", path.name


def test_the_script_is_a_page_and_no_module_is_over_450_lines():
    assert len(SCRIPT.read_text(encoding="utf-8").splitlines()) <= 400
    for path in PACKAGE.glob("*.py"):
        assert len(path.read_text(encoding="utf-8").splitlines()) <= 450, path.name


def package_modules() -> set[str]:
    return {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}


def present_test_files() -> set[str]:
    return {p.stem for p in TESTS.glob("test_*.py")}


def test_every_module_has_its_own_test_file():
    missing = sorted(f"tests/test_{m}.py" for m in package_modules() if f"test_{m}" not in present_test_files())
    assert not missing, f"a module without its test file: {missing}"


def test_every_test_file_is_a_modules_or_one_of_the_named_suites():
    own = {f"test_{m}" for m in package_modules()}
    stray = sorted(present_test_files() - own - NOT_A_MODULE)
    assert not stray, f"test files named for no module (name each for the module it pins): {stray}"
    assert NOT_A_MODULE <= present_test_files(), sorted(NOT_A_MODULE - present_test_files())  # no stale name
    assert not NOT_A_MODULE & own, sorted(NOT_A_MODULE & own)  # a module's file is never exempt


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
    ``from issue395.m import name`` (or ``from .m``), or ``alias.name`` on an imported module. A
    name a test monkeypatches on the module (``setattr(alias, "name", ...)``) is patched where it is
    used, not taken through it."""
    aliases, patched = {}, set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            module = (n.module or "").removeprefix("issue395.") if n.level or (n.module or "").startswith(
                "issue395.") else None
            if module in modules:
                yield from ((module, a.name) for a in n.names)
            if n.module == "issue395" or (n.level and not n.module):
                aliases |= {(a.asname or a.name): a.name for a in n.names if a.name in modules}.items()
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
    modules = {p.stem: _defined_and_imported(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    files = [*PACKAGE.glob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "bench").glob("*.py"), SCRIPT]
    through = sorted(f"{path.relative_to(ROOT)}: {module}.{name}" for path in files
                     for module, name in _takes_through(ast.parse(path.read_text(encoding="utf-8")), set(modules))
                     if name in modules[module][1])
    assert not through, through
