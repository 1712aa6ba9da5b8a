"""The stack a verdict holds for: the packages whose code decides a streamed step's peak (and Soup's
number), read where the tool runs by their installed metadata (never imported: ``--estimate`` stays
torch-free), and ``KNOWN_STACKS``, the table of the stacks this tool's physics was measured on, each
with its evidence (the committed results folders whose stack.txt or JSON name it). For the stack in
use, ``check`` says whether the physics was verified there, and what is charged where it was not.
Stdlib only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata
from typing import Callable, Mapping, Optional

from .attention import box_transformers

#: The packages a stack line names, in its order: each one's code decides a streamed step's peak
#: (torch's allocator and autograd; transformers' forward; peft's adapter; trl's loss; bitsandbytes'
#: NF4 shards) or Soup's number (soup-cli).
PACKAGES = ("torch", "transformers", "peft", "trl", "bitsandbytes", "soup-cli")
#: Only an NF4 arm runs it: a bf16 verdict does not depend on it, so it is neither compared nor named.
NF4_ONLY = ("bitsandbytes",)
NOT_INSTALLED = "not installed"
#: What a stack no row of the table matches is charged, beyond the physics as verified.
NOTHING_EXTRA = "nothing extra"
#: Where the table is, as every stack line cites it.
TABLE = "issue395/estimator/stacks.py"


@dataclass(frozen=True)
class TermNote:
    """What was measured on a stack the physics was not verified on, for one term of the estimate
    (``terms.Term``'s key): the difference in bytes against a verified stack and what is charged."""

    term: str
    note: str


@dataclass(frozen=True)
class KnownStack:
    """A stack this tool's physics was measured on: each of PACKAGES' versions (torch without its
    local build tag, the GPU box's +cu130), the results folders whose stack.txt or JSON name it, and
    whether the physics was verified there (every committed arm's corrected estimate never under)
    or only measured, its differences carried per term by ``notes``."""

    versions: tuple[tuple[str, str], ...]
    evidence: tuple[str, ...]
    verified: bool = True
    notes: tuple[TermNote, ...] = ()

    def version(self, package: str) -> str:
        return dict(self.versions)[package]


def _stack(torch: str, transformers: str, peft: str, trl: str, bitsandbytes: str, soup_cli: str) -> tuple:
    return tuple(zip(PACKAGES, (torch, transformers, peft, trl, bitsandbytes, soup_cli)))


#: Every stack the physics was measured on, with its evidence: the folders under results/ whose
#: stack.txt (pip's list on the GPU box) or JSON (the run's environment) name it. All on one H200
#: box (torch 2.11.0+cu130); tests/estimator/test_stacks.py reads each folder and holds it to its row.
KNOWN_STACKS: tuple[KnownStack, ...] = (
    KnownStack(_stack("2.11.0", "5.16.1", "0.20.0", "0.29.1", "0.50.2", "0.73.3"), (
        "cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37",
        "carried-bytes-h200x2-soup0.73.3-8e62cc5",
        "isolated-determinism-h200x2-soup0.73.3-5670dee",
        "landed-tree-check-h200-soup0.73.3-115b15d",
        "margin-map-h200x2-soup0.73.3-f3ad9d2",
        "margin-map-in-4-parts-h200-soup0.73.3-3238e1a-to-b3a7891",
        "pre-workspace-fix-h200x2-soup0.73.3-5670dee",
        "process-paths-check-h200x2-soup0.73.3-8f3eadb",
        "record-h200x2-soup0.73.3-e7c26f7",
        "redesign-h200-soup0.73.3-d3e592a",
        "scaling-h200x2-soup0.73.3-eb93db1",
        "split-check-h200x2-soup0.73.3-b5bee37",
        "step-refactor-check-h200-soup0.73.3-6cf515f",
        "tasks-rest-h200-soup0.77.0-and-0.73.3-7e1f9a6",
        "two-gpu-record-h200x2-soup0.73.3-b3a7891",
        "untied-seq512-h200x2-soup0.73.3-and-0.77.0-f3ad9d2",
    )),
    KnownStack(_stack("2.11.0", "5.16.1", "0.20.0", "0.29.1", "0.50.2", "0.77.0"), (
        "deepseek-fla-map512-h200-soup0.77.0-6a3069a",
        "depth-and-cap-proof-h200-soup0.77.0-6f45ab3",
        "emulated-card-proof-h200-soup0.77.0-9520654",
        "findmax-kimi-anatomy-h200-soup0.77.0-f6c944f",
        "fit4-anatomy-findmax-h200-soup0.77.0-2de65db-and-f2319d3",
        "fit4-pages-findmax-stack-h200-soup0.77.0-6a4d442",
        "map-077-full-h200-soup0.77.0-684477c",
        "min-free-h200-soup0.77.0-13837da",
        "moe-and-stream-modes-h200-soup0.77.0-fcde6d3",
        "out-of-sample-and-fit-proof-h200-soup0.77.0-95d9ed3",
        "outside-allocator-h200-soup0.77.0-cb63dba",
        "past-the-gate-h200-soup0.77.0-1e6bde4",
        "record-h200-soup0.77.0-9852dcc",
        "task-anatomy-h200-soup0.77.0-and-0.73.3-3f5620a",
        "task-map-h200-soup0.77.0-f8e1b91-and-85975aa",
        "tasks-rest-h200-soup0.77.0-and-0.73.3-7e1f9a6",
        "untied-seq512-h200x2-soup0.73.3-and-0.77.0-f3ad9d2",
    )),
    # What `pip install "soup-cli[all]==0.77.0"` resolved on 2026-12-01, measured beside the pinned stack
    # (bench/rerenders.py stack-latest renders the comparison, arm by arm: results/stack-latest-vs-pinned.txt).
    KnownStack(_stack("2.11.0", "5.24.0", "0.21.2", "0.29.1", "0.50.2", "0.77.0"), (
        "fit4-pages-findmax-stack-h200-soup0.77.0-6a4d442",
    ), notes=(
        TermNote("eager_masks", "Gemma-2 runs eager attention (transformers 5.24.0 declares _supports_sdpa = False): "
                 "its two (rows, 1, seq, seq) bf16 masks are live at the peak, +8,388,608 B on DPO 1024x1, charged "
                 "by this term where transformers is 5.24.0 or later"),
    )),
)


def box_stack(text: str) -> dict[str, str]:
    """The versions a GPU box's stack.txt names (pip's list there: one package and its version a line)."""
    return dict(re.findall(r"^(\S+)\s+(\d\S*)\s*$", text, flags=re.M))


def package_version(name: str) -> str:
    """A package's installed version from its metadata (the package is never imported)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return NOT_INSTALLED


def transformers_release(version: Optional[str] = None) -> str:
    """The transformers release a run has, its local tag dropped: ``version`` (a saved row's), else the training
    box's (--stack transformers=VERSION), else the installed one's metadata (NOT_INSTALLED where none is)."""
    return release(version or box_transformers() or package_version("transformers"))


def installed_stack(version: Optional[Callable[[str], str]] = None) -> dict[str, str]:
    """The stack where the tool runs, by package: soup-cli as the release whose source Soup's number
    is computed from (``releases.installed_release``: ISSUE395_SOUP_SOURCE's, where set)."""
    from .releases import installed_release

    found = {p: (version or package_version)(p) for p in PACKAGES}
    try:
        found["soup-cli"] = installed_release()
    except Exception:  # no soup_cli/ to read: its metadata's word stands
        pass
    return found


def release(version: Optional[str]) -> Optional[str]:
    """A version without its local build tag (2.11.0+cu130 is torch 2.11.0)."""
    return re.sub(r"\+.*$", "", version) if version else version


@dataclass(frozen=True)
class StackCheck:
    """The stack a verdict holds for against KNOWN_STACKS: the row it matches (None: none), or the
    nearest verified one and the packages that differ from it."""

    stack: tuple[tuple[str, str], ...]
    #: packages left out of the comparison: not recorded (an older saved result) or NF4_ONLY on bf16
    unrecorded: tuple[str, ...]
    match: Optional[KnownStack]
    nearest: KnownStack
    #: (package, here, on the nearest verified stack), where they differ
    differs: tuple[tuple[str, str, str], ...]

    @property
    def status(self) -> str:
        if self.match is None:
            return "not verified"
        return "verified" if self.match.verified else "measured, not verified"

    @property
    def charged(self) -> str:
        """What the estimate charges for this stack beyond the physics as verified."""
        if self.match is not None and self.match.notes:
            return "; ".join(f"{n.term}: {n.note}" for n in self.match.notes)
        return NOTHING_EXTRA

    def names(self) -> str:
        """The stack as a stack line names it: each package and its version."""
        return ", ".join(f"{p} {v}" for p, v in self.stack)

    def words(self) -> str:
        """Whether the physics was verified on this stack, its evidence, and what is charged where not."""
        unrec = f", {', '.join(self.unrecorded)} not recorded" if self.unrecorded else ""
        if self.match is not None and self.match.verified:
            charged = f"; charged for it: {self.charged}" if self.match.notes else ""
            return f"verified on this stack{unrec}{charged} ({len(self.match.evidence)} results folders: {TABLE})"
        differ = ", ".join(f"{p} {here} (verified on {there})" for p, here, there in self.differs)
        measured = (f", measured on it (results/{self.match.evidence[0]})" if self.match is not None
                    and self.match.evidence else "")
        return f"not verified on this stack{unrec}: {differ}{measured}; charged for it: {self.charged} ({TABLE})"

    def line(self) -> str:
        return f"stack: {self.names()}: {self.words()}"

    def to_json(self) -> dict:
        return {"packages": dict(self.stack), "status": self.status,
                "verified": self.match is not None and self.match.verified,
                "not_recorded": list(self.unrecorded),
                "evidence": [f"results/{e}" for e in (self.match.evidence if self.match else ())],
                "differs": [{"package": p, "here": h, "verified_on": t} for p, h, t in self.differs],
                "charged": self.charged,
                "notes": [{"term": n.term, "note": n.note} for n in (self.match.notes if self.match else ())],
                "table": TABLE}


def check(stack: Mapping[str, Optional[str]], nf4: bool = True,
          known: tuple[KnownStack, ...] = KNOWN_STACKS) -> StackCheck:
    """``stack`` (package: version; None where a saved result did not record it) against the table:
    compared on every package it records, bitsandbytes only where an arm is NF4."""
    named = tuple((p, stack[p]) for p in PACKAGES if stack.get(p) is not None and (nf4 or p not in NF4_ONLY))
    unrecorded = tuple(p for p in PACKAGES if stack.get(p) is None and (nf4 or p not in NF4_ONLY))

    def differs(row: KnownStack) -> tuple:
        return tuple((p, v, row.version(p)) for p, v in named if release(v) != row.version(p))

    match = next((row for row in known if not differs(row)), None)
    verified = [row for row in known if row.verified] or list(known)
    nearest = min(verified, key=lambda r: len(differs(r)))
    return StackCheck(named, unrecorded, match, nearest,
                      () if match is not None and match.verified else differs(nearest))


def check_installed(nf4: bool = True) -> StackCheck:
    """The stack where the tool runs, checked (a package not installed is compared as such)."""
    return check(installed_stack(), nf4)
