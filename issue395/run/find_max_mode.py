"""--find-max (issue 29 item 5), settled once into a ``FindMax`` (the file read once: its arm checked as
--config's measured arm is, its estimate on the card as --estimate settles it) and executed here: for the
user's soup.yaml and one card, this tool's answer and Soup's gate by --estimate's own code path, then the search (issue395.constraints.findmax) over
probes of the real `soup train`, each in a fresh process under the card's ballast; the text, the
JSON, and on CPU (or with --dry-run) the first probe's soup.yaml and the plan alone."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

from ..constants import ALLOC_CONF_VAR, comma_list
from ..errors import EXIT_FINDING, EXIT_OK, EXIT_USAGE, UsageError
from ..tasks import task
from ..constraints.findmax import (ALLOC_WHY, ALLOW_OOM_ATTEMPT, PROBE_KEYS, PROBE_LIMIT, FindMax, ResidentSearch, find_max,
                                   measured_growth, measured_words, probe_config, probe_table, read_at_edge, soup_checks,
                                   probe_allocator, probe_words, run_probe, soup_command, write_probe_config)
from ..report.outputs import write_json
from ..text import gb
from .checks import ARM_NEEDS, one_card, require_installed
from .clashes import check
from .configarm import config_arm
from .estimate_mode import FromFile, settle_values, under_the_file
from .parser import FIND_MAX_NO_CUDA
from ..host.measured import Outputs
from .request import FindMaxRequest
from ..host.scratch import Scratch, cache_dir_of, shard_dir_of, writable_folder
from .userconfig import read_soup_config

UNITS = {"seq": "tokens", "batch": "batch"}
#: The probed key of the axis not searched: the file's own value, not a probe's change.
OTHER_AXIS_KEY = {"seq": "training.batch_size", "batch": "data.max_length"}
#: Soup's resident gate as its CLI runs it (commands/train.py, _hardware_fit_preflight)
RESIDENT_RULE = "hardware_fit's number +10% against the card's total memory (decide_hardware_fit)"


@dataclass
class Answers:
    """What --estimate's code path says of the file's run on the card: this tool's longest that fits,
    the longest Soup's gate admits, the axis's grid, and Soup's gate at any value (computed)."""

    axis: str
    card: Any  # issue395.estimator.cards.Card
    budget: Any  # issue395.estimator.cards.Budget
    tool: Optional[int]  # computed by this tool: the corrected estimate's longest that fits
    soup: Optional[int]  # computed by Soup: the longest its gate admits
    low: int
    step: int
    high: int
    gate_rule: str
    gate_at: Callable[[int], dict]
    #: this tool's longest on another budget (like_budget: the box's own context, measured where the probes run, like
    #: for like, as an emulated card's probes bring the box's context, not the card's; and the runtime's growth the
    #: probes measured where given, findmax.measured_growth)
    tool_with_context: Callable[[Any], Optional[int]] = lambda b: None
    #: this tool's charge at a value on a budget, part by part (computed): the corrected allocated peak, the
    #: allocator's reserve (needs free - allocated) and what lies outside the allocator at the step's
    #: end (the budget's context, and its runtime's growth)
    charged_at: Callable[[int, Any], Optional[dict]] = lambda value, b: {}
    #: a resident file's run (training.stream_layers false), and why its estimate gave no answer (None: it did)
    resident: Any = None  # issue395.run.userconfig.ResidentRun
    refused: Optional[str] = None

    def like_budget(self, context: int, cc: Optional[tuple], growth: Optional[int] = None) -> Any:
        """The card's budget as the probes have it: ``context`` and the compute capability ``cc`` of the box they run
        on (the runtime's growth by cards.step_growth for this run, or ``growth`` where the probes measured it)."""
        from ..estimator.cards import budget

        return budget(self.card, context, growth, resident=self.resident is not None, cc=cc)

    def first_and_second(self, like: Optional[int]) -> tuple[int, Optional[int]]:
        """Where the search starts (this tool's like-for-like answer, else its answer on the card's
        context; where its estimate does not model the run, Soup's gate's answer; else the smallest) and the
        second prediction it brackets with (Soup's gate's)."""
        first = like if like is not None else self.tool if self.tool is not None else (
            self.soup if self.refused and self.soup is not None else self.low)
        return first, self.soup

    def started_from(self, like: Optional[int]) -> str:
        """What the first probe is, in words."""
        if like is not None:
            return "this tool's longest that fits with the box's own context"
        if self.tool is not None:
            return "this tool's longest that fits"
        if self.refused is None:
            return "this tool's longest that fits: none fits, so the smallest"
        return (f"this tool's estimate does not answer ({self.refused}): " + (
            "Soup's gate's longest" if self.soup is not None else "the smallest, then a plain doubling"))


def answers(req: FindMaxRequest) -> Answers:
    if req.estimate.user is not None and req.estimate.user.resident is not None:
        return resident_answers(req)
    from ..estimator.cards import budget, workspace_env
    from ..estimator.fits import axis_range, longest, longest_soup_admits
    from ..estimator.resident import estimate_run

    axis, run, config = req.axis, req.estimate, req.estimate.config
    gate, arm = run.gate, req.arm
    card = run.cards[0]
    b = budget(card, run.context)
    available = gate.available(b.gate_free_bytes)
    low, step, high = axis_range(config, axis, arm.task)
    kernels = card.kernels(workspace_env())  # its cuBLAS workspace, and where NF4's gemm_4bit fuses on it

    def gate_at(value: int) -> dict:
        mine = estimate_run(replace(arm, **{axis: value}), config)
        one = mine if not gate.probe else estimate_run(replace(gate.measured(arm), **{axis: value}), config)
        return {"value": value, "soup_predicted": mine.soup_predicted, "gate_free_bytes": available,
                "admits": gate.admits(mine.soup_predicted, gate.probed(one), available)}

    def charged_at(value: int, at: Any) -> dict:
        e = estimate_run(replace(arm, **{axis: value}), config, **kernels)
        return {"allocated": e.split_allocated, "reserve": e.needs_free - e.split_allocated,  # `soup train`: split
                "outside": card.total_bytes - at.step_free_bytes}

    def tool_with_context(at: Any) -> Optional[int]:
        return longest(axis, config, at.step_free_bytes, arm, **kernels)

    return Answers(axis, card, b, longest(axis, config, b.step_free_bytes, arm, **kernels),
                   longest_soup_admits(axis, config, available, arm, gate), low, step, high, gate.rule, gate_at,
                   tool_with_context, charged_at)


def resident_answers(req: FindMaxRequest) -> Answers:
    """A resident file's answers on the card: this tool's corrected resident estimate at each value (as --estimate
    answers the file), and Soup's resident gate's (computed by Soup: the input its CLI built from the file with
    the axis's value, decide_hardware_fit on the card's total as CUDA reports it)."""
    from ..estimator.cards import budget
    from ..estimator.fits import axis_range, longest_resident
    from ..estimator.resident import estimate_run
    from ..results.extras import ResidentGate

    axis, run, config = req.axis, req.estimate, req.estimate.config
    r, card, arm = run.user.resident, run.cards[0], req.arm
    b = budget(card, run.context, resident=True)  # the runtime's growth on the card asked's own architecture
    total = card.total_bytes - card.hidden_bytes  # what CUDA reports as the card's total, which Soup's gate reads
    low, step, high = axis_range(config, axis, arm.task)

    def gate_at(value: int) -> dict:
        return {"value": value, **ResidentGate.at(r.soup_input, axis, value, total).to_json()}

    def charged_at(value: int, at: Any) -> Optional[dict]:
        if r.unmodelled:
            return None
        try:
            e = estimate_run(replace(arm, **{axis: value}), config, dispatch=card.dispatch)
        except UsageError:  # not modelled there: nothing charged
            return None
        return {"allocated": e.corrected_predicted, "reserve": e.needs_free - e.corrected_predicted,
                "outside": card.total_bytes - at.step_free_bytes}

    def tool_at(free: int) -> tuple[Optional[int], Optional[str]]:  # a setting it does not model: no answer
        return (None, r.unmodelled) if r.unmodelled else longest_resident(axis, config, free, arm,
                                                                          dispatch=card.dispatch)

    tool, refused = tool_at(b.step_free_bytes)
    return Answers(axis, card, b, tool, ResidentGate.longest(r.soup_input, axis, total, low, step, high), low, step,
                   high, RESIDENT_RULE, gate_at,
                   lambda at: tool_at(at.step_free_bytes)[0],
                   charged_at, resident=r, refused=refused)


def plan_lines(ask: FindMaxRequest, a: Answers, like: Optional[int] = None) -> list[str]:
    unit = UNITS[a.axis]
    start, second = a.first_and_second(like)
    which = a.started_from(like)
    then = (f", Soup's gate's longest, {second}, probed only where it brackets the limit (inside the next stride, in place "
            f"of its far end; where it completes, its next step after it)" if second is not None and second != start else "")
    return [f"plan: start at {a.axis} {start} ({which}) and probe its next step (an answer that is right completes and "
            f"the next raises OOM: two probes); else step on by {a.step}, {2 * a.step}, {4 * a.step} ... {unit} the way "
            f"the outcome points until one flips{then}; then bisect to the resolution, {a.step} {unit}, within {a.low}..{a.high}; at most "
            f"{PROBE_LIMIT} probes; a cuDNN or cuBLAS failure is read as OOM where the probe's allocator peak left the "
            f"card less than the runtime's growth in a step, else probed once more",
            f"  each probe: {' '.join(soup_command())} train --config <the probe's soup.yaml> --yes"
            f"{' ' + ALLOW_OOM_ATTEMPT if a.resident else ''}"
            + (f" with {ALLOC_CONF_VAR}={probe_allocator()} ({ALLOC_WHY})" if a.resident else "") + ", a fresh "
            f"process, while this process holds a ballast outside any allocator that leaves {a.card.name}'s total "
            f"({a.card.total_bytes:,} B) free; it completes when Soup exits 0 with the trainer's global step at "
            f"{ask.arm.steps}; an exit hook in that process reads its allocator's peaks, and torch's out-of-memory "
            f"message, where one comes, is read for the allocator's reserve at that moment",
            "  the probe's soup.yaml: every key of your file but " + "; ".join(
                f"{k} ({why})" for k, why in PROBE_KEYS.items() if k != OTHER_AXIS_KEY[a.axis]
                and not (a.resident and k == "training.stream_vram_override"))
            + (f"; Soup's resident gate is lifted on the command line instead ({ALLOW_OOM_ATTEMPT}, as Soup documents "
               "it), and Soup prints its warning where its gate, reading the GPU's own total, would refuse" if a.resident else "")]


def gate_words(ask: FindMaxRequest, a: Answers, found: FindMax, value: Optional[int], what: str) -> Optional[tuple[str, dict]]:
    """Soup's gate, unlifted, at ``value``: computed by Soup's own estimator code on the card's budget,
    and what Soup printed in that value's probe (its number and the free memory its driver reported)."""
    if value is None:
        return None
    g = dict(a.gate_at(value))
    p = found.probe_at(value)
    if a.resident:
        return resident_gate_words(a, g, p, ask.arm.steps, what)
    override = ask.estimate.gate.override
    if p is not None and p.soup_gb is not None and p.driver_free_gb is not None:
        g.update(probe_soup_gb=p.soup_gb, probe_driver_free_gb=p.driver_free_gb,
                 probe_admits=p.soup_gb <= (override / 1e9 if override is not None else p.driver_free_gb))
    said = (f"; in its probe Soup printed ~{p.soup_gb:.2f} GB with {p.driver_free_gb:.2f} GB free reported by its driver"
            if "probe_soup_gb" in g else "")
    outcome = "" if p is None else f" (measured: {probe_words(p, ask.arm.steps)})"
    line = (f"Soup's gate (unlifted) at {a.axis} {value}, {what}{outcome}: {'admits' if g['admits'] else 'refuses'} it "
            f"(computed by Soup's own estimator code: {gb(g['soup_predicted'], 2)} GB against {gb(g['gate_free_bytes'], 2)} GB "
            f"free at its gate, {a.gate_rule}){said}")
    return line, g


def resident_gate_words(a: Answers, g: dict, p: Any, steps: int, what: str) -> tuple[str, dict]:
    """Soup's resident gate, unlifted, at ``g``'s value (computed by Soup: results.extras.ResidentGate)."""
    outcome = "" if p is None else f" (measured: {probe_words(p, steps)})"
    head = f"Soup's resident gate (unlifted) at {a.axis} {g['value']}, {what}{outcome}: "
    if g["input"] is None:
        return head + "no verdict: its CLI builds no input for this file, so it skips its gate", g
    return (head + f"{'admits' if g['admits'] else 'refuses'} it (computed by Soup's own code: {gb(g['peak'], 2)} GB, "
            f"+10% {gb(g['required'], 2)} GB, against the card's {gb(g['card_total'], 2)} GB total)"), g


def margin_at_oom(a: Answers, found: FindMax, at: Any) -> Optional[tuple[str, dict]]:
    """The margin's parts at the first OOM above the limit, where Soup's console holds torch's own
    out-of-memory message (measured, inside Soup's process), beside this tool's charge at that value
    on the budget the probes had (computed: ``at``, Answers.like_budget)."""
    p = found.probe_at(found.above) if found.above is not None else None
    if p is None or p.oom is None:
        return None
    r, c = p.oom, a.charged_at(found.above, at)
    if c is None:  # this tool's estimate does not model the run there
        return None
    d = {"value": found.above, "measured": {"allocated_plus_request": r.allocated + r.tried,
                                            "reserve": r.reserved_unallocated, "outside": r.outside_allocator},
         "charged": c}
    return (f"the margin at the first OOM ({a.axis} {found.above}; measured: torch's message in Soup's process; charged: "
            f"computed by this tool): allocated + the failed request {gb(r.allocated + r.tried, 3)} GB, corrected peak "
            f"{gb(c['allocated'], 3)} GB; the allocator's reserve {r.reserved_unallocated / 1e6:.1f} MB, charged "
            f"{c['reserve'] / 1e6:.1f} MB; outside the allocator {r.outside_allocator / 1e6:.1f} MB, charged "
            f"{c['outside'] / 1e6:.1f} MB (the context the probes had and the runtime's growth, {at.growth_from})"), d


def execute(ask: FindMaxRequest, protocol: Any) -> int:
    """--find-max: the plan (--dry-run, on any box), or the search on a CUDA box; its text and --json."""
    a = answers(ask)
    lift = None if ask.dry_run else gate_lift()  # Soup's gate lifted by the GPU's own total: every probe is admitted
    from ..results.stack import measure_context

    # like for like: the probes' Soup processes bring this box's CUDA context out of the card's total,
    # measured here, in this process on the same GPU (None on CPU or with --dry-run)
    box = None if ask.dry_run else (measure_context() or {}).get("context_bytes")
    cc = None if ask.dry_run else box_capability()  # the card the probes run on, whose runtime grows in them
    like = a.tool_with_context(a.like_budget(box, cc)) if box is not None else None
    from ..estimator.stacks import check_installed

    t = task(ask.arm.task)
    words = said(ask, a, box, like, cc)
    with Scratch(ask.cache_dir, ask.shard_dir) as scratch:
        base = ask.arm.checkpoint
        if not ask.dry_run:
            base = checkpoint_for(ask, scratch)
        write = probe_writer(ask, a, protocol, t, scratch, base, lift)
        stack = check_installed(nf4=ask.arm.quant == "nf4")
        first = write(a.first_and_second(None)[0])
        refused = soup_checks(first, t.name)  # Soup's own config and data checks on CPU: a refusal costs no probe
        if ask.dry_run:
            return print_plan(ask, a, words, stack, first, refused)
        if refused:
            raise UsageError(f"--find-max: Soup refuses the probe's copy of --config {ask.arm.adapter.soup_config} before "
                             f"any probe (its own checks, on CPU): {refused}")
        found = run_search(ask, a, scratch, write, box, like, words[0])
    return report_found(ask, a, found, words, (box, cc), like, stack)


def box_capability() -> Optional[tuple]:
    """The compute capability of the card the probes run on (this process's device 0, as CUDA_VISIBLE_DEVICES
    shows it to Soup's); None where CUDA cannot say."""
    try:
        import torch

        return tuple(torch.cuda.get_device_capability(0))
    except Exception:  # noqa: BLE001 -- unknown: the runtime's growth is charged at its bound
        return None


def gate_lift() -> int:
    """The GPU's total bytes, the override that lifts Soup's streamed gate for every probe (one GPU
    visible, as Soup streams only with one); no CUDA is a usage error."""
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")  # Soup refuses to stream with several GPUs visible
    import torch

    if not torch.cuda.is_available():
        raise UsageError(FIND_MAX_NO_CUDA)
    return int(torch.cuda.mem_get_info()[1])


def probe_writer(ask: FindMaxRequest, a: Answers, protocol: Any, t: Any, scratch: Scratch, base: Optional[str],
                 lift: Optional[int]) -> Callable[[int], Path]:
    """What writes one probe's folder at a value of the axis: its soup.yaml (the file's, the probed keys
    changed; a streamed run's gate lifted by ``lift``, the GPU's total, or by the card's total in a plan;
    a resident run's left to --allow-oom-attempt) and its data rows, in the scratch folder; the write
    returns the soup.yaml's path."""
    run, axis = ask.estimate, ask.axis
    user_text = run.user.text
    arm = ask.arm

    def write(value: int) -> Path:
        folder = scratch.path("find-max", f"{axis}-{value}")
        seq, batch = (value, arm.batch) if axis == "seq" else (arm.seq, value)
        config = probe_config(user_text, axis, value, data=folder / "train.jsonl", output=folder / "out",
                              override=None if a.resident else lift if lift is not None else a.card.total_bytes,
                              data_format=t.data_format, base=base)
        return write_probe_config(folder, config, protocol.task_rows(t.name, seq, batch * arm.micro_batches * arm.steps))

    return write


def print_plan(ask: FindMaxRequest, a: Answers, words: tuple[str, str, str, str], stack: Any, first: Path,
               refused: Optional[str]) -> int:
    """--dry-run: the plan in words and the first probe's soup.yaml (and, with --json, the plan as data,
    nothing measured); a finding where Soup's own checks refuse the probe's file."""
    run = ask.estimate
    head, tool_line, soup_line, like_line = words
    plan = [*plan_lines(ask, a), *([f"  Soup refuses the probe's file before any probe (its own checks, on "
                                    f"CPU): {refused}"] if refused else [])]
    print("\n".join([head + " -- --dry-run: the plan, nothing run", "  " + tool_line, "  " + like_line,
                     "  " + soup_line, "  " + stack.line(), *plan,
                     *([f"  base: {run.model} is a registry model's hub id: on the GPU box "
                        "the probes run the synthetic checkpoint this tool builds for it (no download)"]
                       if ask.arm.checkpoint is None else []),
                     *(f"  from the file: {k}" for k in run.keys),
                     "the first probe's soup.yaml (as written in the scratch folder, removed at exit; "
                     + (f"each probe runs it with {ALLOW_OOM_ATTEMPT}):" if a.resident else
                        "on the GPU box stream_vram_override is the GPU's total):"),
                     first.read_text().rstrip()]))
    if ask.outputs.json:  # the plan, as data: nothing measured
        if not write_json(ask.outputs.json, "find-max", {
                **json_head(ask, a, None), "dry_run": True, "measured": None, "stack": stack.to_json(),
                "plan": [ln.strip() for ln in plan],
                "soup_refuses": refused, "first_probe_config": first.read_text()}):
            return EXIT_USAGE
        print(f"the plan: --json {ask.outputs.json}", file=sys.stderr)
    return EXIT_FINDING if refused else EXIT_OK


def run_search(ask: FindMaxRequest, a: Answers, scratch: Scratch, write: Callable[[int], Path], box: Optional[int],
           like: Optional[int], head: str) -> FindMax:
    """The search on the GPU: each probe a real soup train of ``write``'s file, read at the edge of the
    card's free memory, its line printed as it ends (its log kept under --log-dir), from this tool's
    answer (like for like where the box's context is measured) bracketed with Soup's gate's."""
    axis = ask.axis
    scratch.verify_shard_root()
    logs = Path(ask.log_dir) if ask.log_dir else None
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
    print(head, flush=True)
    print("\n".join(plan_lines(ask, a, like)), flush=True)

    # what the card leaves the probes' Soup processes: its total less the context they bring (this box's)
    card_free = a.card.total_bytes - (box if box is not None else a.budget.context_bytes)

    def probe(value: int):
        config = write(value)
        p, ballast, log = run_probe(config, value, ask.arm.steps, a.card.total_bytes,
                                    log_to=config.parent / "soup-train.log", allow_oom_attempt=bool(a.resident),
                                    expandable=bool(a.resident))
        p = read_at_edge(p, card_free)  # a cuDNN or cuBLAS failure, read by the allocator's figures
        if logs is not None:
            shutil.copyfile(config.parent / "soup-train.log", logs / f"soup-find-max-{axis}-{value}.log")
        print(f"  probe {axis} {value}: {probe_words(p, ask.arm.steps)} ({p.seconds} s; ballast {ballast.size:,} B, "
              f"free with it held {ballast.free_after:,} B)", flush=True)
        return p

    start, second = a.first_and_second(like)
    return find_max(probe, axis, start, a.step, a.low, a.high, other=second)


def report_found(ask: FindMaxRequest, a: Answers, found: FindMax, words: tuple[str, str, str, str],
                 where: tuple[Optional[int], Optional[tuple]], like: Optional[int], stack: Any) -> int:
    """The search's text (the measured limit beside both answers, Soup's gate at the limit and above it,
    the margin at the first OOM, the probes' table) and its --json; a finding unless the limit and the
    first value above it are adjacent. ``where``: the box's context (measured) and compute capability."""
    run, axis = ask.estimate, ask.axis
    box, cc = where
    head, tool_line, soup_line, like_line = words
    unit = UNITS[axis]
    measured = measured_words(found, ask.arm.steps)
    gates = [gate_words(ask, a, found, found.limit, "the limit"),
             gate_words(ask, a, found, found.above, "the first above it")]
    margin = margin_at_oom(a, found, a.like_budget(box if box is not None else a.budget.context_bytes, cc))
    grown, grown_line = growth_answer(a, found, box, cc)
    lines = [head,
             "  measured (the real soup train, " + (f"Soup's resident gate lifted by {ALLOW_OOM_ATTEMPT}, on "
                                                     f"{ALLOC_CONF_VAR}={probe_allocator()}" if a.resident
                                                     else "Soup's gate lifted by training.stream_vram_override")
             + f"): {measured} "
             f"(resolution {a.step} {unit}; {len(found.probes)} probe(s), {found.seconds:.1f} s)",
             "  " + tool_line, "  " + like_line, *([f"  {grown_line}"] if grown_line else []), "  " + soup_line,
             *(f"  {g[0]}" for g in gates if g),
             *([f"  {margin[0]}"] if margin else []), "  " + stack.line(),
             *(f"  from the file: {k}" for k in run.keys),
             "probes (measured, in order; Soup's number and the driver's free memory as Soup printed them at its gate; "
             "allocated and reserved: the peaks of the allocator in Soup's own process, read as it exited"
             + ("; runtime growth: its memory outside the allocator as it exited or at its OOM, less the box's context"
                if grown_line else "") + "):",
             *probe_table(found, ask.arm.steps, box)]
    print("\n".join(lines), flush=True)
    if ask.outputs.json and not write_json(ask.outputs.json, "find-max", {
            **json_head(ask, a, like), "measured": found.to_json(),
            "this_tool_longest_like_for_like": like, "box_context_bytes": box, "stack": stack.to_json(),
            "box_compute_capability": ".".join(map(str, cc)) if cc else None,
            **({"this_tool_like_for_like_growth": growth_json(a.like_budget(box, cc))} if box is not None else {}),
            **grown,
            "soup_gate_at_limit": gates[0][1] if gates[0] else None,
            "soup_gate_above_limit": gates[1][1] if gates[1] else None,
            "margin_at_first_oom": margin[1] if margin else None}):
        return EXIT_USAGE
    return EXIT_OK if found.adjacent else EXIT_FINDING


def growth_answer(a: Answers, found: FindMax, box: Optional[int], cc: Optional[tuple]) -> tuple[dict, Optional[str]]:
    """This tool's longest like for like with the probes' own runtime growth (measured in each probe's process:
    findmax.measured_growth, the most any probe read) in place of the growth the like-for-like answer charges
    (cards.step_growth on the box's card), beside the box's context: its JSON keys (absent where no probe read it, as
    in every search before the probes' exit hook read it) and its line."""
    grown = measured_growth(found, box)
    if grown is None:
        return {}, None
    charged = a.like_budget(box, cc)
    answer = a.tool_with_context(a.like_budget(box, cc, grown))
    return ({"runtime_growth_bytes": grown, "this_tool_longest_like_for_like_measured_growth": answer},
            f"computed by this tool like for like with the probes' own runtime growth (measured in each probe's process "
            f"as it exited or at its OOM, the most of them: {grown / 1e6:.1f} MB after the box's context, in place of "
            f"{growth_words(charged)}): the longest {a.axis} that fits {a.card.name}: "
            f"{answer if answer is not None else 'none'}")


def growth_words(b: Any) -> str:
    """The runtime's growth a budget charges, and which it is (cards.GROWTH_BOUND, GROWTH_RESIDENT, GROWTH_PROBES)."""
    return f"{b.growth / 1e6:.1f} MB ({b.growth_from})"


def growth_json(b: Any) -> dict:
    return {"bytes": b.growth, "source": b.growth_from}


def said(ask: FindMaxRequest, a: Answers, box: Optional[int], like: Optional[int],
         cc: Optional[tuple] = None) -> tuple[str, str, str, str]:
    """The search's head line, and this tool's, Soup's and the like-for-like answer in words, each labelled."""
    from ..estimator.fits import steps_words
    from ..estimator.steady import is_bounded

    run, arm, axis, card, r = ask.estimate, ask.arm, ask.axis, a.card.name, a.resident
    head = (f"--find-max {axis}: {run.model}, from --config {arm.adapter.soup_config} ("
            + (f"a resident run, training.stream_layers false{', gradient checkpointing' if arm.streaming.checkpointing else ''}; "
               if r else "") + f"{arm.task} {arm.quant}, "
            + (f"batch {arm.batch}" if axis == "seq" else f"seq {arm.seq}")
            + f"), on {card} ({a.card.total_bytes:,} B; {ask.flag}); {steps_words(arm.steps, run.steps_from)}")
    tool = a.tool if a.tool is not None else f"none (not estimated: {a.refused})" if a.refused else "none"
    soup = (a.soup if a.soup is not None else "none: its CLI builds no input for this file, so it skips its gate"
            if r and r.soup_input is None else "none")
    estimate = "the corrected resident estimate" if r else "--estimate's corrected estimate"
    if r and arm.full:  # how far it is measured: estimator/full.py's Known limitations
        from ..estimator.full import measured_words
        estimate += f" of a full fine-tuning, {measured_words()}"
    optimizer = arm.settings.optimizer
    if optimizer and arm.steps > 1 and is_bounded(optimizer):  # its answer is the bound's: said where it is read
        estimate += f", an UPPER BOUND: training.optimizer {optimizer} is not modelled"
    tool_line = (f"computed by this tool ({estimate}, {a.budget.context_source} context; the runtime's growth "
                 f"{growth_words(a.budget)}): the longest {axis} that fits {card}: {tool}")
    soup_line = (f"computed by Soup ({'its resident gate as soup train runs it' if r else 'its own pre-flight'}, "
                 f"{a.gate_rule}, gate unlifted): the longest {axis} Soup's {'resident ' if r else ''}gate admits on "
                 f"{card}: {soup}")
    like_line = ("computed by this tool like for like (the context the probes had: this box's own, measured here, "
                 f"{box / 1e9:.3f} GB; the runtime's growth {growth_words(a.like_budget(box, cc))}): the longest {axis} "
                 f"that fits {card}: {like if like is not None else 'none'}"
                 if box is not None else
                 "like for like (this tool's longest with the context the probes have): on the GPU box, with its "
                 "context measured there")
    return head, tool_line, soup_line, like_line


def json_head(ask: FindMaxRequest, a: Answers, like: Optional[int]) -> dict:
    """What a --find-max JSON holds whether it ran or planned: the file, the arm, the card, both answers, and what
    a resident file's search adds (its typed record; null for a streamed file)."""
    arm, r = ask.arm, a.resident
    resident = None if r is None else ResidentSearch(arm.streaming.checkpointing, r.soup_input, a.started_from(like), a.refused,
                                                     allocator_conf=probe_allocator())
    return {"config": arm.adapter.soup_config, "model": ask.estimate.model, "task": arm.task, "quant": arm.quant,
            "seq": arm.seq, "batch": arm.batch, "steps": arm.steps,
            "card": {"card": a.card.name, "bytes": a.card.total_bytes, "given_as": ask.flag},
            "this_tool_longest": a.tool, "this_tool_growth": growth_json(a.budget), "soup_gate_longest": a.soup,
            "soup_gate_rule": a.gate_rule,
            "probe_keys": [k for k in PROBE_KEYS if not (r and k == "training.stream_vram_override")],
            "resident": resident and resident.to_json(), "command": ["issue395_second_stack_vram.py", *ask.argv]}


def checkpoint_for(ask: FindMaxRequest, scratch: Scratch) -> str:
    """The checkpoint the probes run: the file's folder, or the synthetic checkpoint of the registry
    model whose hub id the file names (built here, as --config's measured arm builds it); under its
    quantization's own path (Soup keys its shards by the base's path)."""
    from ..measure.shapes import family_shape
    from ..host.checkpoints import quant_base, synthetic_checkpoint

    arm, folder = ask.arm, ask.arm.checkpoint
    if folder is None:
        print(f"building the synthetic checkpoint of {ask.estimate.model} ({arm.base}) ...", file=sys.stderr, flush=True)
        folder = str(synthetic_checkpoint(family_shape(arm.base), scratch.checkpoint_root())[0])
    return quant_base(scratch, folder, arm.quant, tuple(arm.streaming.stream().items()))


def chosen(args: argparse.Namespace) -> bool:
    return args.find_max is not None


def settle(args: argparse.Namespace, argv: list[str]) -> FindMaxRequest:
    """--find-max: the file, read once, as --config's measured arm (its base, without a download) and as
    --estimate's values on the one card asked (its steps: the run's steady state unless --steps)."""
    check("find max", args)
    flag, given = ("--card", args.card) if args.card is not None else ("--emulate-card", args.emulate_card)
    if len(comma_list(given)) != 1:
        raise UsageError(f"{flag} {given}: --find-max searches one card")
    one_card(flag, given)
    if not args.dry_run:  # the probes' checkpoint and Soup's own processes
        require_installed("--find-max", ARM_NEEDS)
    user = read_soup_config(args.config)  # a resident file too: its probes lift Soup's resident gate
    arm = config_arm(user, args.weights, args.dry_run, soup_resolves_targets=True)  # its probes are soup train's own
    with under_the_file(args.config):
        estimate = settle_values(args, FromFile(args, user), given)
    # the probes run in the scratch folder: the file's checkpoint folder (a relative one too) by its absolute path
    arm = replace(arm, steps=estimate.steps, checkpoint=arm.checkpoint and os.path.abspath(arm.checkpoint))
    for option, folder_given in (("--log-dir", args.log_dir), ("--cache-dir", args.cache_dir)):
        if folder_given is not None:
            writable_folder(option, folder_given)
    cache = cache_dir_of(args.cache_dir, args.shard_dir)
    return FindMaxRequest(estimate, arm, args.find_max, flag, dry_run=args.dry_run, log_dir=args.log_dir, cache_dir=cache,
                          shard_dir=shard_dir_of(args.shard_dir), outputs=Outputs.of(args), argv=tuple(argv))
