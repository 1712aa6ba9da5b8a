"""``--soup-patch``: a unified diff against a soup-cli release's own source that makes Soup's own
pre-flight gates gate on this tool's corrected peak. It adds ``soup_cli/utils/corrected_peak.py``, this
tool's estimator bundled into one stdlib-only module (generated here from the estimator's own source,
with ``ast``: the functions ``soup_gate.preflight`` and ``soup_gate.resident_preflight`` reach, in their
modules' order, each name kept but where two modules define it; so a change to the estimator is in the
next patch, never a copy that drifts), and patches two call sites. The streamed gate: the setup's call of
``estimate_stream_peak_vram`` (``_stream_budget_lines`` in ``soup_cli/trainer/stream_setup.py``, the one
call every task's wrapper reaches), so that the number its gate compares is the corrected one; Soup's
gate stays Soup's there (the free memory it reads, ``training.stream_vram_override``, the probe and their
messages), its formula printed beside. The resident gate (``_hardware_fit_preflight`` in
``soup_cli/commands/train.py``, where the release has one): before Soup's formula, the corrected resident
estimate of the file's run is compared with the free memory torch reads, as the streamed gate's reading
is (soup_gate.resident_preflight says why); a run that does not fit is refused in Soup's own panel and
words (its title, its ``--allow-oom-attempt`` tail, which still launches it), one that fits is admitted
with one line; a run the estimate does not model goes on to Soup's formula, said so. Its need holds under
expandable segments, which Soup sets for a streamed run only, so ``train`` sets them before ``detect_device``
for every run (``ALLOC_HINT``; a release missing either site keeps its resident gate unpatched). ``patch -p1``
applies it in the folder that holds ``soup_cli/`` (site-packages). Stdlib only; Soup is read, never
imported.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import re
import subprocess
from pathlib import Path
from typing import Optional

from ..constants import ALLOC_CONF_VAR, EXPANDABLE_SEGMENTS
from ..errors import UsageError
from .releases import PATCH_MARKER, PATCH_MODULE, installed_release, soup_dir

PACKAGE = Path(__file__).resolve().parents[1]  # issue395/
#: What the bundle is built from: the glue Soup's two gates call, and each name of the tool that stands
#: in for reading Soup from outside (inside Soup, the release is the one patched, and Soup has
#: already checked that it streams the model).
ENTRIES = (("issue395.estimator.soup_gate", "preflight"), ("issue395.estimator.soup_gate", "resident_preflight"))
STUBS = {
    ("issue395.estimator.releases", "installed_release"):
        'def installed_release() -> str:\n    """The release this module was generated for."""\n    return RELEASE\n',
    ("issue395.estimator.soup_number", "features"):
        'def features(release=None) -> Features:\n    """The patched release\'s features, as read from its own '
        'source when this module was generated."""\n    return FEATURES\n',
    ("issue395.estimator.soup_number", "arch_of"):
        'def arch_of(config: dict, src=None) -> Arch:\n    """Soup\'s setup has already checked that it streams '
        'the model."""\n    return arch_from_config(config)\n',
    ("issue395.estimator.soup_number", "soup_preflight_from_config"):
        'def soup_preflight_from_config(*args, **kwargs):\n    """Soup\'s formula is Soup\'s own call, beside this '
        'module\'s."""\n    raise RuntimeError("the corrected pre-flight never computes Soup\'s formula")\n',
}


def _module_path(name: str) -> Path:
    return PACKAGE.parent / (name.replace(".", "/") + ".py")


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")[:-node.level]
    return ".".join(base + ([node.module] if node.module else []))


class _Module:
    """One module of the tool as the bundler reads it: its top-level statements by the names they
    define, its imports of the tool's names and of the standard library's."""

    def __init__(self, name: str):
        self.name, self.path = name, _module_path(name)
        self.text = self.path.read_text(encoding="utf-8")
        self.lines = self.text.splitlines()
        tree = ast.parse(self.text)
        self.defs: dict = {}
        self.imports: dict = {}  # local name -> (module, name) of the tool
        self.stdlib: dict = {}  # local name -> its import line
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            self.defs[n.id] = node
            elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
                src = _absolute(name, node)
                for a in node.names:
                    if src.split(".")[0] == "issue395":
                        self.imports[a.asname or a.name] = (src, a.name)
                    else:
                        self.stdlib[a.asname or a.name] = f"from {src} import {a.name}" + (
                            f" as {a.asname}" if a.asname else "")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    self.stdlib[a.asname or a.name.split(".")[0]] = f"import {a.name}" + (
                        f" as {a.asname}" if a.asname else "")

    def segment(self, node: ast.AST) -> str:
        """The statement's whole lines, with the comment lines right above it (its ``#:`` words)."""
        start = (node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno) - 1
        while start > 0 and self.lines[start - 1].lstrip().startswith("#"):
            start -= 1
        return "\n".join(self.lines[start:node.end_lineno]) + "\n"


def _names_used(node: ast.AST) -> set:
    """Names a statement reads, annotations left out (they are strings under the bundle's
    ``from __future__ import annotations``)."""
    out: set = set()

    def visit(n: ast.AST) -> None:
        if isinstance(n, ast.Name):
            out.add(n.id)
        for field, value in ast.iter_fields(n):
            if field in ("annotation", "returns"):
                continue
            for child in (value if isinstance(value, list) else [value]):
                if isinstance(child, ast.AST):
                    visit(child)
        if isinstance(n, ast.AnnAssign) and n.value is not None:
            visit(n.value)

    visit(node)
    return out


def _reach(modules: dict) -> tuple[dict, dict]:
    """Walk from the entries (and Features, the bundle's FEATURES) through every name each statement
    reads, following the tool's imports to their modules: the statements the bundle must hold, by
    (module, name), and the stdlib import lines they need. ``modules`` gains each module read."""

    def mod(name: str) -> _Module:
        if name not in modules:
            modules[name] = _Module(name)
        return modules[name]

    wanted: dict = {}  # (module, name) -> the statement node (or a stub)
    stdlib: dict = {}
    todo = [*ENTRIES, ("issue395.estimator.releases", "Features")]
    while todo:
        key = todo.pop()
        if key in wanted:
            continue
        m = mod(key[0])
        if key[1] not in m.defs:
            if key[1] in m.imports:
                todo.append(m.imports[key[1]])
                continue
            raise UsageError(f"{m.path}: {key[1]} is not a top-level definition the bundle can take")
        node = m.defs[key[1]]
        wanted[key] = node
        for other in [k for k, v in m.defs.items() if v is node]:  # a tuple assignment defines several
            wanted[(key[0], other)] = node
        if key in STUBS:
            continue
        for used in _names_used(node):
            if used in m.defs:
                todo.append((key[0], used))
            elif used in m.imports:
                todo.append(m.imports[used])
            elif used in m.stdlib:
                stdlib[m.stdlib[used]] = None
    return wanted, stdlib


def _module_order(modules: dict) -> list:
    """The modules' names in the bundle's order: a module's statements stand after every module they
    import (the tool's own layering), ties by name."""
    deps = {name: {src for src, _ in modules[name].imports.values() if src in modules} for name in modules}
    seen: list = []

    def place(name: str) -> None:
        if name in seen:
            return
        for d in sorted(deps[name]):
            place(d)
        seen.append(name)

    for name in sorted(modules):
        place(name)
    return seen


def _renames(order: list, wanted: dict) -> dict:
    """One global name per definition: where two modules define one name, the module later in
    ``order`` has its name renamed (name_of_module), by (module, name)."""
    bare: dict = {}
    rename: dict = {}
    for name in order:
        for (mname, n), node in wanted.items():
            if mname != name:
                continue
            owner = bare.setdefault(n, (mname, id(node)))
            if owner != (mname, id(node)):
                rename[(mname, n)] = f"{n}_of_{mname.rsplit('.', 1)[-1]}"
    return rename


def _module_part(m: _Module, wanted: dict, rename: dict, done: set) -> Optional[str]:
    """One module's part of the bundle: its wanted statements in source order (a stub where the bundle
    stands in for one), each renamed name rewritten, the names it imports under another name bound
    first; None where it adds no statement. ``done`` holds the statements already placed (one node can
    define several names)."""
    name = m.name
    local = {n: rename[(name, n)] for (mn, n) in rename if mn == name}
    local.update({n: rename[src] for n, src in m.imports.items() if src in rename})
    body = []
    for node in sorted({id(v): v for (mn, _), v in wanted.items() if mn == name}.values(),
                       key=lambda v: v.lineno):
        if id(node) in done:
            continue
        done.add(id(node))
        own = next((STUBS[(name, n)] for n, v in m.defs.items() if v is node and (name, n) in STUBS), None)
        text = own if own is not None else m.segment(node)
        for old, new in local.items():
            text = re.sub(rf"(?<![\w.]){re.escape(old)}(?![\w])", new, text)
        body.append(text)
    aliases = sorted({f"{n} = {rename.get(src, src[1])}" for n, src in m.imports.items()
                      if n != rename.get(src, src[1]) and src in wanted and n not in local})
    if aliases and body:  # an import under another name: bound after the module it came from
        body.insert(0, "\n".join(aliases) + "  # the names this module imports them as\n")
    if not body:
        return None
    return f"# -- {name} ({m.path.relative_to(PACKAGE.parent)}) --\n" + "\n\n".join(body)


def bundle(release: str, features_repr: str, version: str) -> str:
    """The module text: every statement the entry reaches, in dependency order, stdlib imports only."""
    modules: dict = {}
    wanted, stdlib = _reach(modules)
    order = _module_order(modules)
    rename = _renames(order, wanted)
    done: set = set()
    parts = [p for p in (_module_part(modules[name], wanted, rename, done) for name in order) if p is not None]
    header = (f'"""{PATCH_MARKER} (issue395 {version}): this tool\'s corrected peak-VRAM pre-flight for a LoRA step,\n'
              f"layer-streamed or resident, generated from its estimator's own source (issue395/estimator/, the\n"
              f"functions soup_gate.preflight and resident_preflight reach, bundled in their modules' order)\n"
              f"for soup-cli {release}.\n"
              f"Stdlib only; imports nothing of soup_cli or of the tool. Regenerate it with\n"
              f"`python issue395_second_stack_vram.py --soup-patch OUT.diff`; never edit it by hand.\n"
              '"""\n\nfrom __future__ import annotations\n\n')
    return (header + "\n".join(sorted(stdlib)) + "\n\n" + f"RELEASE = {release!r}\n\n\n" + "\n\n".join(parts)
            + f"\n\nFEATURES = {features_repr}\n")


def tool_version() -> str:
    """The tool's commit (git describe of this checkout, -dirty with uncommitted changes), or 'unknown
    commit' outside git."""
    try:
        out = subprocess.run(["git", "-C", str(PACKAGE.parent), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown commit"
    return f"commit {out.stdout.strip()}" if out.returncode == 0 and out.stdout.strip() else "unknown commit"


#: The lines inserted after the setup's ``predicted = estimate_stream_peak_vram(...)``: the
#: corrected pre-flight replaces the number the gate compares; Soup's formula stays beside it.
CALL_SITE = """\
        # {marker} (soup_cli/utils/corrected_peak.py): the gate compares the corrected peak's
        # free-memory need; Soup's formula is kept beside it in the panel.
        from soup_cli.utils.corrected_peak import preflight as _corrected_preflight

        self._corrected_preflight = _corrected_preflight(cfg, tcfg, model_config, formula=predicted)
        if self._corrected_preflight["gate_bytes"] is not None:
            predicted = self._corrected_preflight["gate_bytes"]
"""
PANEL_LINE = "        lines.append(self._corrected_preflight[\"line\"])\n"


#: Two helpers put above ``_hardware_fit_preflight``: what the resident gate reads that Soup's gate does not
#: (the model's config, the free memory), each failure handed to the corrected pre-flight, which keeps Soup's
#: formula and says why. LOCAL_RANK: a rank reads its own card, not card 0, before its device is set.
RESIDENT_HELPERS = """\
def _corrected_model_config(cfg):
    \"\"\"{marker}: the base's config as transformers reads it (a hub id or a
    local folder), or the exception that stopped it (the corrected pre-flight then keeps Soup's formula,
    saying why).\"\"\"
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(cfg.base))
    except Exception as exc:  # noqa: BLE001 -- never a crash of Soup's gate
        return exc


def _corrected_free_bytes():
    \"\"\"{marker}: the free memory of this rank's card as torch reads it, or
    None where it cannot.\"\"\"
    try:
        import torch

        return int(torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", "0") or 0))[0])
    except Exception:  # noqa: BLE001 -- the corrected pre-flight says what it compared with instead
        return None


"""
#: The lines put before ``inp = _build_hardware_fit_input(cfg)`` in ``_hardware_fit_preflight``: the run's
#: corrected resident peak answers first, in Soup's panel (its title, tail and exit); Soup's formula is
#: computed beside it, and gates the run alone where the corrected estimate does not model it.
RESIDENT_CALL_SITE = """\
    # {marker} (soup_cli/utils/corrected_peak.py): this tool's corrected
    # resident peak gates the run against the free memory torch reads, as the patched streamed gate
    # does; a run it does not model goes on to Soup's formula below, said so.
    from soup_cli.utils.corrected_peak import resident_preflight as _corrected_resident

    _formula = None
    _soup_input = _build_hardware_fit_input(cfg)
    if _soup_input is not None:
        from soup_cli.utils.hardware_fit import decide_hardware_fit as _decide

        _report = _decide(_soup_input, available_vram_gb=total_bytes / 1e9)
        _formula = (_report.peak_vram_gb, _report.required_with_margin_gb, _report.ok)
    _corrected = _corrected_resident(cfg, _corrected_model_config(cfg), free=_corrected_free_bytes(),
                                     total=total_bytes, formula=_formula)
    if _corrected["refused"] is not None:
        console.print(f"[yellow]{{markup_escape(_corrected['line'])}}[/]")
    elif _corrected["fits"]:
        console.print(f"[dim]{{markup_escape(_corrected['line'])}}[/]")
        return
    else:
        tail = (
            "[yellow]--allow-oom-attempt set: launching anyway.[/]"
            if allow_oom_attempt
            else "Reduce batch_size / max_length, enable gradient_checkpointing or "
            "quantization, or pass [bold]--allow-oom-attempt[/] to try anyway."
        )
        console.print(
            Panel(
                markup_escape(_corrected["panel"]) + "\\n\\n" + tail,
                title=(
                    "[yellow]Hardware-fit warning[/]"
                    if allow_oom_attempt
                    else "[bold red]Hardware-fit gate[/]"
                ),
                border_style="yellow" if allow_oom_attempt else "red",
            )
        )
        if not allow_oom_attempt:
            raise typer.Exit(1)
        return
"""
#: What a release without the resident gate gets instead: one line, and its streamed gate patched alone.
NO_RESIDENT_GATE = ("soup_cli/commands/train.py has no _hardware_fit_preflight calling _build_hardware_fit_input, "
                    "or no one `device, device_name = detect_device(...)` in train() to set expandable segments "
                    "before: this release's resident gate is not patched (its streamed gate is)")
#: The lines put before ``device, device_name = detect_device(...)`` in ``train`` (at its indentation): the
#: resident gate's need holds only on the allocator it was measured on. Soup's own rule for a streamed run
#: (0.77.0's utils/gpu.py configure_cuda_alloc_hint; 0.73.3 tries it in its streamed setup, after detect_device
#: has made the context), for every run.
ALLOC_HINT = """\
# {marker}: the patched resident gate's need is the allocated
# peak plus the allocator's reserve under expandable segments, which Soup sets for a streamed run at most; a
# resident run on the default allocator fragments past it. torch reads the variable once, when the CUDA
# context is created, which detect_device does. A value the user exported is kept; an empty one is unset.
import os as _os, sys as _sys

if _sys.platform.startswith("linux") and not _os.environ.get("{var}"):
    _os.environ["{var}"] = "{value}"

"""


def resident_site(train: str) -> Optional[tuple[int, int]]:
    """(the line of ``def _hardware_fit_preflight``, the line of its ``inp = _build_hardware_fit_input(cfg)``),
    0-based, read with ast from the release's own commands/train.py; None where it has no such gate."""
    for fn in ast.parse(train).body:
        if not (isinstance(fn, ast.FunctionDef) and fn.name == "_hardware_fit_preflight"):
            continue
        for n in fn.body:
            if (isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                    and getattr(n.value.func, "id", None) == "_build_hardware_fit_input"
                    and [getattr(t, "id", None) for t in n.targets] == ["inp"]
                    and "total_bytes" in {x.id for x in ast.walk(fn) if isinstance(x, ast.Name)}):
                start = fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno
                return start - 1, n.lineno - 1
    return None


def alloc_hint_site(train: str) -> Optional[tuple[int, int]]:
    """(the line ALLOC_HINT goes before: that of ``device, device_name = detect_device(...)`` in ``train``, or of
    the comment lines right above it, which stay with it; its indentation), 0-based, read with ast from the
    release's own commands/train.py; None where train() has no such line, or several."""
    lines = train.splitlines()
    for fn in ast.parse(train).body:
        if not (isinstance(fn, ast.FunctionDef) and fn.name == "train"):
            continue
        found = [n for n in ast.walk(fn) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                 and getattr(n.value.func, "id", None) == "detect_device" and len(n.targets) == 1
                 and isinstance(n.targets[0], ast.Tuple)
                 and [getattr(t, "id", None) for t in n.targets[0].elts] == ["device", "device_name"]]
        if len(found) != 1:
            return None
        start, indent = found[0].lineno - 1, found[0].col_offset
        while start > 0 and lines[start - 1].startswith(" " * indent + "#"):
            start -= 1
        return start, indent
    return None


def _call_site(stream_setup: str) -> tuple[int, int]:
    """(line after the setup's ``predicted = estimate_stream_peak_vram(...)``, line after the panel's
    ``lines = [...]`` that follows it), 0-based, read with ast from the release's own source."""
    tree = ast.parse(stream_setup)
    for fn in ast.walk(tree):
        if not (isinstance(fn, ast.FunctionDef) and fn.name == "_stream_budget_lines"):
            continue
        call = lines = None
        for n in fn.body:
            if (isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                    and getattr(n.value.func, "id", None) == "estimate_stream_peak_vram"
                    and [getattr(t, "id", None) for t in n.targets] == ["predicted"]):
                call = n
            elif call is not None and isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["lines"]:
                lines = n
                break
        if call is not None and lines is not None:
            return call.end_lineno, lines.end_lineno
    raise UsageError("soup_cli/trainer/stream_setup.py: no `predicted = estimate_stream_peak_vram(...)` and panel "
                     "`lines = [...]` in _stream_budget_lines, so this release's gate cannot be patched")


def patched_files(src: Path, version: Optional[str] = None) -> dict:
    """{path relative to site-packages: (old text or None, new text)} for the release at ``src``."""
    from .soup_number import read_features  # the release's own features, baked into the module

    if (src / PATCH_MODULE).exists():
        raise UsageError(f"{src} is already patched ({PATCH_MODULE} exists): give an unpatched soup_cli")
    release = installed_release() if src == soup_dir() else src.parent.name
    meta = next(src.parent.glob("soup_cli-*.dist-info"), None)
    if meta is not None:
        release = meta.name[9:-10]
    setup_path = src / "trainer" / "stream_setup.py"
    old = setup_path.read_text(encoding="utf-8")
    after_call, after_lines = _call_site(old)
    lines = old.splitlines(keepends=True)
    new = (lines[:after_call] + ["\n", CALL_SITE.format(marker=PATCH_MARKER)] + lines[after_call:after_lines]
           + [PANEL_LINE] + lines[after_lines:])
    module = bundle(release, repr(read_features(src)), version or tool_version())
    files = {f"soup_cli/{PATCH_MODULE}": (None, module), "soup_cli/trainer/stream_setup.py": (old, "".join(new))}
    train_path = src / "commands" / "train.py"
    train = train_path.read_text(encoding="utf-8") if train_path.exists() else ""
    site = resident_site(train) if train else None
    hint = alloc_hint_site(train) if site is not None else None
    if hint is not None:  # both or neither: a resident gate whose need the run's allocator breaks is half a patch
        lines = train.splitlines(keepends=True)
        block = ALLOC_HINT.format(marker=PATCH_MARKER, var=ALLOC_CONF_VAR, value=EXPANDABLE_SEGMENTS)
        inserts = {site[0]: RESIDENT_HELPERS.format(marker=PATCH_MARKER),
                   site[1]: RESIDENT_CALL_SITE.format(marker=PATCH_MARKER) + "\n",
                   hint[0]: "".join(" " * hint[1] + ln if ln.strip() else ln for ln in block.splitlines(keepends=True))}
        for at in sorted(inserts, reverse=True):
            lines.insert(at, inserts[at])
        files["soup_cli/commands/train.py"] = (train, "".join(lines))
    return files


def soup_patch(src: Optional[Path] = None, version: Optional[str] = None) -> str:
    """The unified diff (``patch -p1`` in site-packages) for the soup_cli folder ``src`` (the installed one)."""
    src = src or soup_dir()
    out = []
    for rel, (old, new) in patched_files(src, version).items():
        out.extend(difflib.unified_diff((old or "").splitlines(keepends=True), new.splitlines(keepends=True),
                                        "/dev/null" if old is None else f"a/{rel}", f"b/{rel}",
                                        n=3))
    return "".join(out)


def is_importable_stdlib_only(text: str) -> bool:
    """Every import of a bundled module is the standard library's."""
    for node in ast.walk(ast.parse(text)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else
                 ["."] if isinstance(node, ast.ImportFrom) else [])
        for n in names:
            top = n.split(".")[0]
            if top == "." or top in ("issue395", "soup_cli", "torch") or (
                    top != "__future__" and importlib.util.find_spec(top) is None):
                return False
    return True
