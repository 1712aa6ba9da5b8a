"""The real client on an emulated card: `soup train` itself, not its wrapper (issue 28 item 5,
issue 29 item 7; bench only, not the harness).

Why: the harness measures Soup's wrappers in its own process. A user runs `soup train --config
soup.yaml`, whose gate reads the device's free memory and whose trainer then runs every step. Here
this process is the ballast: it holds (free - card's free) bytes outside any allocator with
cudaMalloc (issue395.constraints.minfree, as --emulate-card does), so Soup's own process, started
after it as a subprocess, reads the card's free memory at its gate. The soup.yaml is written here:
the task, a synthetic checkpoint folder built by the harness's builder as base, seq, batch, the
quantization, the task's rows (the protocol's, issue395_second_stack_vram.task_rows) sized so one
epoch is exactly --steps steps, and, with --override, training.stream_vram_override (Soup's own
lift of its gate: the bytes it assumes free).

    python3 bench/soup_train_card.py --family qwen --task dpo --seq 2048 --batch 1 --card 12GB \\
        [--quant none] [--steps 2] [--override BYTES|total] [--train KEY=VALUE ...] [--work DIR]
        [--soup "python -m soup_cli"]

``--train stream_layers=false`` makes it a resident run (Soup's resident gate, commands/train.py's
_hardware_fit_preflight, compares its formula with the card's TOTAL as CUDA reports it, which a ballast
does not change: an emulated card shows what the run itself meets; a --soup-patch'ed Soup reads the free
memory the ballast leaves), ``gradient_checkpointing=true`` its checkpointing.

The soup.yaml, its rows and the probe itself (the ballast, Soup's process, its outcome read from
Soup's console and trainer state) are issue395.constraints.findmax's, the probe --find-max runs.
It prints Soup's gate lines (its peak-VRAM number and the free memory it read), whether Soup
admitted the run, whether it completed every step (the trainer state's global step against the
steps the data gives) or died (OOM, with Soup's own line), and Soup's exit code; exit 0 when the run
ended as Soup's gate said it would (refused, or admitted and completed), 1 when Soup admitted a run
that died, 2 on bad input. On CPU (no CUDA) it parses its arguments, writes the soup.yaml and exits 0
without running Soup (--dry-run does that anywhere). soup-cli 0.73.3 and 0.77.0 alike install
`soup = soup_cli.cli:run` and `python -m soup_cli`; this runs the latter with this interpreter
unless --soup names another command.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import issue395_second_stack_vram as h  # noqa: E402
from issue395.constraints.findmax import (COMPLETED, OOM, probe_config, run_probe, soup_command,  # noqa: E402
                                          soup_lines, write_probe_config)
from issue395.errors import UsageError  # noqa: E402
from issue395.estimator.cards import parse_card  # noqa: E402
from issue395.model.registry import ALL_FAMILIES  # noqa: E402
from issue395.tasks import TASKS, task  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from task_peak_anatomy import training_keys  # noqa: E402  (the one --train parser of bench/)


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="soup_train_card.py", description=__doc__.splitlines()[0])
    p.add_argument("--family", required=True, help=f"a registry model: {','.join(ALL_FAMILIES)}")
    p.add_argument("--task", default="sft", choices=tuple(TASKS))
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--quant", default="none", choices=("none", "nf4"))
    p.add_argument("--card", required=True, help="a named card or a size (24GB, 12GiB), as --emulate-card")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps: one epoch of exactly this many batches")
    p.add_argument("--override", default=None, help="training.stream_vram_override in bytes, or 'total' (this "
                   "GPU's total: the gate lifted)")
    p.add_argument("--train", action="append", default=[], metavar="KEY=VALUE",
                   help="any other Soup training key (task_peak_anatomy.py's): stream_layers=false, a resident run; "
                        "gradient_checkpointing=true; repeatable")
    p.add_argument("--work", default=None, help="keep the checkpoint, soup.yaml and Soup's output here")
    p.add_argument("--soup", default=None, help="the command that runs soup-cli (default: this python -m soup_cli)")
    p.add_argument("--dry-run", action="store_true", help="write the soup.yaml and print the command; run nothing")
    a = p.parse_args(argv)
    try:
        if a.family not in ALL_FAMILIES:
            raise UsageError(f"--family {a.family!r}: choose from {','.join(ALL_FAMILIES)}")
        parse_card(a.card)
        if a.seq < 64 or a.batch < task(a.task).min_batch or a.steps < 1:
            raise UsageError(f"--seq {a.seq} (>= 64), --batch {a.batch} (>= {task(a.task).min_batch} for "
                             f"{a.task}) and --steps {a.steps} (>= 1): one is out of Soup's bounds")
        if a.override not in (None, "total") and not a.override.isdigit():
            raise UsageError(f"--override {a.override!r}: bytes, or 'total'")
        a.train = training_keys(a.train)
    except (UsageError, SystemExit) as exc:
        p.exit(2, f"error: {exc}\n")
    return a


def write_config(a: argparse.Namespace, base: str, work: Path, override: Optional[int]) -> Path:
    """The protocol's config for the task (issue395_second_stack_vram) as the user's soup.yaml, made a
    probe by --find-max's own copy (findmax.probe_config): one epoch of exactly --steps batches of the
    task's rows, no validation split, Soup's gate lifted if asked."""
    from issue395.measure.shapes import family_shape

    shape = family_shape(a.family)
    data, out = work / "train.jsonl", work / "out"
    user = h.soup_config_yaml(base, data, out, a.seq, a.batch, a.quant, shape.targets, shape.stream,
                              shape.lora_r, shape.lora_alpha, a.task, training=a.train)
    config = probe_config(user, "seq", a.seq, data=data, output=out, override=override,
                          data_format=task(a.task).data_format)
    return write_probe_config(work, config, h.task_rows(a.task, a.seq, a.batch * a.steps))


def died_lines(probe) -> list[str]:
    """What a run that died leaves to read (measured, in Soup's process): Soup's line, torch's out-of-memory
    figures where it printed them (the reserve the allocator held but could not hand over), and the allocator's
    peaks its exit hook wrote; nothing for a run that completed or was refused."""
    if probe.completed or probe.line == "refused by Soup's gate":
        return []
    out = [f"Soup's line: {probe.line}"] if probe.line else []
    if probe.oom is not None:
        o = probe.oom
        out.append(f"torch's out-of-memory figures: tried {o.tried:,} B; allocated {o.allocated:,} B; reserved but "
                   f"unallocated {o.reserved_unallocated:,} B; the process {o.process_in_use:,} B; free {o.free:,} B")
    if probe.allocator is not None:
        p = probe.allocator
        out.append(f"allocator peaks (the exit hook): allocated {p.allocated_peak:,} B; requested {p.requested_peak:,} B; "
                   f"reserved {p.reserved_peak:,} B")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    a = parse(argv)
    import torch

    from issue395.host.checkpoints import quant_base, synthetic_checkpoint
    from issue395.host.scratch import Scratch
    from issue395.measure.shapes import family_shape

    cuda = torch.cuda.is_available()
    card = parse_card(a.card)
    command = soup_command(shlex.split(a.soup) if a.soup else None)
    with Scratch(a.work) as scratch:
        work = Path(a.work).resolve() if a.work else scratch.path("soup-train")
        work.mkdir(parents=True, exist_ok=True)
        total = int(torch.cuda.mem_get_info()[1]) if cuda else None
        override = total if a.override == "total" else None if a.override is None else int(a.override)
        if a.override == "total" and total is None:
            override = card.total_bytes  # CPU: a placeholder for the file only; nothing runs
        base = "BASE" if not cuda or a.dry_run else quant_base(
            scratch, str(synthetic_checkpoint(family_shape(a.family), scratch.checkpoint_root())[0]), a.quant)
        config = write_config(a, base, work, override)
        argv_soup = command + ["train", "--config", str(config), "--yes"]
        print(f"{a.family} {a.task} {a.quant} seq {a.seq} batch {a.batch}, {a.steps} step(s), as {card.name} "
              f"({card.total_bytes:,} B)" + (f"; stream_vram_override {override:,} B" if override is not None else "")
              + "".join(f"; training.{k}: {v}" for k, v in a.train.items()))
        print(f"  soup.yaml: {config}\n  command: {shlex.join(argv_soup)}")
        from soup_cli.config.loader import load_config_from_string

        load_config_from_string(config.read_text())  # Soup's own schema takes the file, here too
        if not cuda or a.dry_run:
            print("  Soup's loader takes it; not run: " + ("--dry-run" if a.dry_run else
                                                          "no CUDA GPU here (the ballast and Soup's step need one)"))
            return 0
        # Soup's process brings its own context out of the card's total, as on the card itself: the
        # ballast leaves the card's total free before Soup starts (this process's context is inside it).
        probe, ballast, log = run_probe(config, a.seq, a.steps, card.total_bytes, soup=command,
                                        log_to=work / "soup-train.log")
        print(f"  ballast: {ballast.size:,} B held outside any allocator; free with it held {ballast.free_after:,} B")
    for line in soup_lines(log):
        print(f"  Soup: {line}")
    refused = probe.line == "refused by Soup's gate"
    outcome = ("refused by Soup's gate" if refused else
               "admitted and died: OOM" if probe.outcome == OOM else
               f"admitted and completed {probe.steps} of {a.steps} step(s)" if probe.outcome == COMPLETED else
               f"admitted and failed (not OOM): {probe.line}")
    print(f"  outcome: {outcome}; soup exit code {probe.exit_code}" + (f"; log {work / 'soup-train.log'}" if a.work else ""))
    for line in died_lines(probe):
        print(f"  {line}")
    return 0 if refused or probe.outcome == COMPLETED else 1


if __name__ == "__main__":
    sys.exit(main())
