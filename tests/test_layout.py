"""The house: a protocol script a page long, and a package of one-concern modules beside it,
each importing only what lies below it (docs/LAYOUT.md's order), never the script."""

from __future__ import annotations

import ast
import re

from conftest import ROOT, SCRIPT

PACKAGE = ROOT / "issue395"


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
