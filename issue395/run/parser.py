"""The command line's parser: every option with its help, the defaults epilog, and usage errors as
one line (exit 2, no usage dump). What the options mean together is settled in ``options``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

from ..errors import UsageError
from ..record import MAP_BATCHES, MAP_SEQS, QUANTS, RECORD_GRID
from ..model.registry import ALL_FAMILIES
from ..tasks import TASKS

EPILOG = f"""defaults:
  arms       SmolLM2-135M at seq {','.join(map(str, RECORD_GRID['smol']))} and Qwen2.5-0.5B at seq
             {','.join(map(str, RECORD_GRID['qwen']))}, batch 1 (the record's grid)
  weights    synthetic: architecture-exact checkpoints built here, no network
  cache-dir  none: everything is built in a scratch folder removed at exit. A --cache-dir
             must lie under $HOME, the working directory or the temp dir, where Soup honours
             it; every folder an option names is created when missing.

exit codes:
  0    every row ok (prediction at or above the real peak, realised == requested); in a
       dry run, every row realised as requested. REFUSED (Soup's gate said the run will not
       fit) and SKIPPED (NF4 without bitsandbytes) rows are not findings
  1    any row VOID (realised != requested), OOM, FAILED or UNDER (prediction below the
       real peak), the snapshot's positive control failed, or the harness failed
  2    usage error, or an output that could not be written (one line on stderr)
       --estimate: 0 (the answer printed), unless --exit-code: will `soup train` run it to the
       end? 0 it fits on every --card and Soup's gate (as the file sets it) admits it, 1 it
       does not fit on some card, 3 it fits but Soup's gate refuses it on some
  130  interrupted (rows measured so far are printed and saved)
"""


#: What --cap caps each arm at: Soup's own pre-flight, the corrected allocated peak or needs-free
#: (issue395.estimator.estimate), or nothing (the control).
CAPS = ("soup", "corrected", "needs-free", "off")
FIND_MAX_NO_CUDA = ("--find-max runs the real `soup train` on a GPU and no CUDA GPU is visible here: it needs a CUDA "
                    "box; --dry-run prints the first probe's soup.yaml and the plan on CPU")
NO_CUDA = ("CUDA is required for the real peak and no CUDA GPU is visible; --dry-run runs the whole "
           "Soup setup and the guard on CPU")


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:  # a prefix is no option: --estimat is a typo, not --estimate
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        raise UsageError(meant(self, message))

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        if args is not None:
            given_once(self, list(args))
        return super().parse_known_args(None if args is None else values_taken(self, list(args)), namespace)


def meant(parser: argparse.ArgumentParser, message: str) -> str:
    """argparse's 'unrecognized arguments' with the option each unknown flag was probably meant to be."""
    import difflib

    if not message.startswith("unrecognized arguments: "):
        return message
    flags = [w.split("=")[0] for w in message[len("unrecognized arguments: "):].split() if w.startswith("--")]
    known = [o for o in parser._option_string_actions if o.startswith("--")]
    hints = []
    for flag in flags:
        near = difflib.get_close_matches(flag, known, n=1, cutoff=0.8)
        near = near or [o for o in known if o.startswith(flag) and len(flag) > 3][:1]  # a prefix once taken
        if near:
            hints.append(f"{flag}: did you mean {near[0]}?")
    return message + (f" ({'; '.join(hints)})" if hints else "")


def given_once(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """An option that takes a value, given twice, is one line: argparse would keep the last and drop the
    first without a word (``--card 24GB --card 80GB --exit-code`` checked 80GB alone). A comma list's
    values go in one comma list; --from-json's paths all after the one flag. A flag (--dry-run) may repeat."""
    seen: dict[str, str] = {}
    for i, word in enumerate(argv):
        if word == "--":
            return
        flag, eq, value = word.partition("=")
        action = parser._option_string_actions.get(flag) if flag.startswith("--") else None
        if action is None or action.nargs == 0:
            continue
        if not eq:  # its value(s): the words up to the next option (one, where it takes one)
            rest = argv[i + 1:i + 2] if action.nargs is None else \
                list(itertools.takewhile(lambda w: not w.startswith("-"), argv[i + 1:]))
            value = " ".join(rest[:1] if action.nargs in (None, "?") else rest)
        if flag in seen:
            listed = "comma list" in (action.help or "")
            how = (f"several go in one comma list ({flag} {seen[flag]},{value})" if listed else
                   f"every path after the one {flag} ({flag} {seen[flag]} {value})" if action.nargs == "+"
                   else "give it once")
            raise UsageError(f"{flag} is given twice ({seen[flag] or 'bare'}, then {value or 'bare'}): a second "
                             f"would silently replace the first; {how}")
        seen[flag] = value


def values_taken(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """argparse reads a value that starts with '-' (``--card -1GB``, ``--seq -64``) as an option
    and says "expected one argument"; an option that takes one value takes the next word as it,
    unless that word is itself an option, so the value is read and refused by its own check."""
    out: list[str] = []
    words = iter(argv)
    for word in words:
        action = parser._option_string_actions.get(word)
        if word == "--":
            out += [word, *words]
            break
        if action is not None and action.nargs is None and action.option_strings[0].startswith("--"):
            following = next(words, None)
            if following is not None and following.startswith("-") and following != "--" \
                    and following.split("=")[0] not in parser._option_string_actions:
                out.append(f"{word}={following}")
                continue
            out += [word] + ([following] if following is not None else [])
            continue
        out.append(word)
    return out


#: The console command `pip install` makes (pyproject.toml's [project.scripts]).
COMMAND = "issue395"


def command_name() -> str:
    """What the user typed, as usage names it: the console command `issue395`, else the entry script
    (issue 53 item 11: `issue395 --help` said `usage: issue395_second_stack_vram.py`)."""
    return COMMAND if os.path.basename(sys.argv[0] or "") == COMMAND else "issue395_second_stack_vram.py"


def add_modes(p: argparse.ArgumentParser) -> None:
    """The modes: each a way of running the tool (the sweep is the default)."""
    m = p.add_argument_group("modes (default: the sweep)")
    m.add_argument("--sweep", action="store_true", help="run the sweep alongside other modes")
    m.add_argument("--measure", action="store_true", help="Soup's logits bytes-per-element probe")
    m.add_argument("--sdpa", action="store_true", help="attention's extra allocation per backend")
    m.add_argument("--map", action="store_true",
                   help=f"the margin map: every family Soup streams x {{{', '.join(QUANTS)}}} x seq "
                        f"{{{', '.join(map(str, MAP_SEQS))}}} (within max positions) x batch "
                        f"{{{', '.join(map(str, MAP_BATCHES))}}}, and where the margin goes")
    m.add_argument("--estimate", action="store_true",
                   help="does a run fit? Soup's own pre-flight and the corrected estimate, term by term, "
                        "from --model CONFIG.json or a family, on CPU (no torch, no GPU)")
    m.add_argument("--find-max", default=None, choices=("seq", "batch"),
                   help="on a CUDA box, with --config and --card (or --emulate-card): the largest seq (or batch) whose "
                        "run of the real `python -m soup_cli train` completes --steps optimizer steps (default: the "
                        "run's steady state, 2) on that card, each probe a fresh process under a ballast, Soup's gate "
                        "lifted by its own training.stream_vram_override (a resident file's, stream_layers false: by "
                        "its --allow-oom-attempt, on expandable segments unless PYTORCH_CUDA_ALLOC_CONF is exported); bracketed from this tool's longest that fits and bisected to 64 tokens (seq) or 1 (batch), beside this tool's answer and Soup's "
                        "gate. --dry-run: the first probe's soup.yaml and the plan")
    m.add_argument("--soup-patch", default=None, metavar="OUT.diff",
                   help="write a unified diff against the installed soup-cli's own source that makes Soup's own gates "
                        "(streamed and resident) compare this tool's corrected peak (its estimator, generated into soup_cli/utils/"
                        "corrected_peak.py), and runs every `soup train` on expandable segments, where their needs hold; "
                        "`patch -p1` applies it in the folder that holds soup_cli/. Alone; on CPU")
    m.add_argument("--determinism", nargs="?", const="2", default=None, metavar="N",
                   help="repeat arms in N fresh processes (default 2; default arms: SmolLM2 at 4096 and 6144)")


def add_arm_options(p: argparse.ArgumentParser) -> None:
    """The arms: which models, shapes, tasks and Soup settings each arm of the grid takes."""
    a = p.add_argument_group("arms")
    a.add_argument("--models", default=None, help="comma list of smol,qwen (default both)")
    a.add_argument("--families", default=None, help="with --map: comma list of families (default "
                   "all: " + ",".join(ALL_FAMILIES) + ")")
    a.add_argument("--expert-layout", default=None, help="with --map (soup-cli 0.77.0): comma list of fused,"
                   "per_expert: training.stream_expert_layout, on the MoE families (default fused)")
    a.add_argument("--loss-chunk", default=None, help="with --map (soup-cli 0.77.0): comma list of off or "
                   "tokens per chunk: training.stream_loss_chunk (default off)")
    a.add_argument("--recompute", default=None, help="with --map (soup-cli 0.77.0): comma list of on,off: "
                   "training.stream_recompute (default on)")
    a.add_argument("--stream-layers", default=None, help="with --map: comma list of on,off: training.stream_layers "
                   "(default on; off: a resident run, every layer on the card, judged against Soup's resident gate)")
    a.add_argument("--gradient-checkpointing", default=None, help="with --map and --stream-layers off: comma list "
                   "of off,on: training.gradient_checkpointing on the resident runs (default off, Soup's)")
    a.add_argument("--stream-vram-probe", default=None, help="with --map: comma list of off,on: "
                   "training.stream_vram_probe on the streamed runs (default off, Soup's): Soup's measured step at setup "
                   "beside the real one; for a task Soup's schema refuses it for, Soup's probe called by this tool")
    a.add_argument("--quant", default=None, help="with --map or --estimate: comma list of none,nf4 (--map: both; "
                   "nf4 needs bitsandbytes)")
    a.add_argument("--seq", default=None, help="comma list of seq lengths, each at least 64 (Soup's schema), "
                   "for every chosen model (default: the record's grid)")
    a.add_argument("--task", default=None, help="comma list of Soup's streamed tasks: " + ",".join(TASKS)
                   + " (default sft, the protocol's); with --map or the sweep's arms, an axis of the grid (an "
                   "arm below a task's smallest batch, kto: 2, is SKIPPED with its reason); with --estimate, "
                   "Soup's own number and the corrected estimate at each task's rows")
    a.add_argument("--batch", default=None, help="comma list of batch sizes (default 1; --map: 1,4)")
    a.add_argument("--model", default=None, metavar="ID_OR_PATH",
                   help="any causal LM Soup can stream, instead of the record's models (needs --seq): "
                        "a checkpoint folder, a hub id, or a config.json (synthetic weights built from it)")
    a.add_argument("--weights", choices=("synthetic", "hub"), default="synthetic",
                   help="synthetic (default): build architecture-exact checkpoints here; hub: download")
    a.add_argument("--cache-dir", default=None, help="keep built checkpoints and Soup's shards here "
                   "(under $HOME, the working directory or the temp dir)")
    a.add_argument("--shard-dir", default=None, metavar="DIR",
                   help="Soup's layer shards here instead of in --cache-dir (or scratch), e.g. on /dev/shm "
                        "with TMPDIR=/dev/shm: Soup honours a shard cache only under $HOME, the working "
                        "directory or the temp dir. Checkpoints stay in --cache-dir (give one on disk: "
                        "without it scratch, under the temp dir, holds them too)")
    a.add_argument("--steps", default=None, help="optimizer steps per arm, the peak over all of them "
                   "(default 1, the protocol's; --estimate --config: 2, the run's steady state, with the file's "
                   "optimizer; --steps 1 keeps the protocol's one step)")


def add_estimate_options(p: argparse.ArgumentParser) -> None:
    """--estimate's options: the user's soup.yaml, the cards to fit, and what the estimate assumes."""
    e = p.add_argument_group("--estimate")
    e.add_argument("--config", default=None, metavar="SOUP_YAML", help="the soup.yaml `soup train` takes, read by "
                   "Soup's own loader: its base, data.max_length, training.batch_size, quantization, LoRA and "
                   "streaming modes drive --estimate, or, without it, one measured arm (with --emulate-card, "
                   "--cap, --min-free or --dry-run too), instead of --model, --quant, --seq, --batch, --targets, "
                   "--lora-r")
    e.add_argument("--card", default=None, help="comma list of cards to fit: named (A10G, L4, T4, RTX3090, "
                   "RTX4090, RTX5090, A100-40GB, A100-80GB, L40S, H100, H200, RTX3050-Laptop-4GB, ...; "
                   "--card list lists them with their sources) or sizes (24GB = 24e9 bytes, 24GiB = 24 x 2^30): "
                   "fits, the longest seq that fits, and Soup's gate")
    e.add_argument("--exit-code", action="store_true", help="with --estimate and --card: the exit code says whether "
                   "`soup train` will run it to the end: 0 only where it fits on every card (this tool's estimate) and "
                   "Soup's gate admits it there (its own number, with the file's training.stream_vram_override or "
                   "stream_vram_probe); 1 it does not fit on some card; 3 it fits but Soup's gate refuses it on some "
                   "(2 stays a usage error)")
    e.add_argument("--context", default=None, metavar="GB", help="with --card or --emulate-card: the CUDA context your card "
                   "leaves outside the allocator, in GB (default: Soup's measured 0.85 GB)")
    e.add_argument("--stack", default=None, metavar="PKG=VERSION,...",
                   help="with --estimate, run on another machine than the one that will train (a laptop): the "
                        "training box's packages, a comma list of torch, transformers, peft, trl, bitsandbytes "
                        "=VERSION, in place of this machine's; the stack check and transformers' attention "
                        "(Gemma-2 runs eager from 5.24.0) follow it")
    e.add_argument("--targets", default=None, help="comma list of LoRA targets (default q_proj,v_proj; "
                   "Phi-3: qkv_proj)")
    e.add_argument("--lora-r", default=None, help="LoRA rank (default 8)")


def add_running_options(p: argparse.ArgumentParser) -> None:
    """How the arms run: on CPU or CUDA, in fresh processes or lanes, constrained, sharded; what each keeps."""
    r = p.add_argument_group("running")
    r.add_argument("--dry-run", action="store_true", help="everything but the CUDA step, on CPU")
    r.add_argument("--isolate", action="store_true", help="each arm in its own fresh process")
    r.add_argument("--cap", default=None, choices=CAPS,
                   help="each arm in a fresh process with the caching allocator capped (set_per_process_memory_"
                        "fraction) at Soup's own pre-flight, the corrected allocated peak, or the corrected "
                        "needs-free; 'off' is the control (no cap); always with expandable_segments, as soup train")
    r.add_argument("--emulate-card", default=None, metavar="NAME|GB",
                   help="run each arm as if on this card (a named card or a size, as --card): in a fresh process "
                        "with expandable segments, a ballast outside the allocator leaves exactly the card's free "
                        "memory (total - context; --context GB gives yours), Soup's own gate decides, and the row "
                        "says refused by Soup / admitted and completed / admitted and OOM beside this tool's verdict")
    r.add_argument("--min-free", action="store_true",
                   help="per arm, the lowest allocator cap its step completes under: a bisection over fresh "
                        "processes (expandable segments) to max(0.25%% of the allocated peak, 4 MiB), beside "
                        "this tool's needs-free")
    r.add_argument("--lanes", nargs="?", const="auto", default=None, metavar="N",
                   help="N lanes at once on one GPU (each of --gpus): a long-lived process per lane runs its "
                        "shard of the arms (the map: whole families, the next one's checkpoint built while "
                        "this one's arms run) with the serial sweep's teardown, its threads bounded to "
                        "cores/N. max_memory_allocated is per process, so a peak never counts a "
                        "neighbour's; the issue measured four such lanes equal to the byte to a serial run "
                        "(but the known two-peak arm, SmolLM2 at 6144), and 0.77.0's default map at 4 lanes on an "
                        "H200 matched every committed one-process run of the same arm to the byte on 37 of 41 "
                        "(the other four NF4 arms 1,024 B apart; results/map-077-full-*-render.txt), where fresh "
                        "processes differ from one process by up to 0.9 MB (results/compare-in-process-vs-isolated.txt) "
                        "and pay 12-20 s of warm-up per arm. With --isolate: a fresh process per arm, N at once. "
                        "Bare --lanes: N = cores/4, at most the lanes there are work for. An arm whose "
                        "corrected needs-free (or Soup's own number, which its gate wants free) does not "
                        "fit a lane's share of the card runs after the lanes, alone, so Soup's gate "
                        "decides as on an idle card. On the map every arm runs in its family's lane (where "
                        "its checkpoint is, a lane's families costliest first), packed by bytes: each holds "
                        "this tool's needs-free for it, and the lanes' arms run together while their bytes fit "
                        "the card beside every lane's CUDA context, first asked first served; one that does not "
                        "fit beside the idle lanes runs after them, alone, and one that raises OOM or that Soup "
                        "refuses beside others is measured again holding the whole card. On 16 cores --lanes "
                        "4, 6 and 8 are 4, 2 and 2 threads a lane. --lanes 1: the serial run (on CPU, a faked peak: lanes 1 and 2 "
                        "give the same rows and tables, tests/run/test_lanes.py). Not with --cap, "
                        "--emulate-card or --min-free (they need the whole card), --determinism or --shard")
    r.add_argument("--gpus", default=None, help="comma list of GPU ids: one shard per GPU, merged")
    r.add_argument("--shard", default=None, metavar="K/N",
                   help="run only the arms whose grid index is K-1 modulo N (on the map: whole "
                        "families, dealt evenly); merge with --from-json")
    r.add_argument("--snapshot", action="store_true",
                   help="attribute each peak from the allocator history (+ positive control)")
    r.add_argument("--snapshot-dir", default=None, help="also write each raw snapshot here (implies --snapshot)")
    r.add_argument("--verbose", action="store_true", help="show Soup's own console output live; with --estimate, "
                   "the legends and each card's source")
    r.add_argument("--log-dir", default=None, help="keep Soup's per-arm console logs here")


def add_output_options(p: argparse.ArgumentParser) -> None:
    """Where the result is written, and the saved results re-rendered from."""
    o = p.add_argument_group("outputs")
    o.add_argument("--json", default=None, metavar="PATH", help="every row, result and timing")
    o.add_argument("--markdown", default=None, metavar="PATH", help="a record ready to paste")
    o.add_argument("--plot", default=None, metavar="PATH", help="PNG: pred/real against seq (the sweep); with "
                   "--map, the map's heatmap (family x seq x batch, one panel per quantization)")
    o.add_argument("--from-json", nargs="+", default=None, metavar="PATH",
                   help="re-render saved results, merging shards (no GPU, no Soup setup)")
    o.add_argument("--compare", default=None, metavar="PATH",
                   help="with --from-json: the same arms' peaks in another saved result")


def build_parser() -> argparse.ArgumentParser:
    """Every option, group by group in --help's order; one line on a usage error (``Parser``)."""
    p = Parser(prog=command_name(), epilog=EPILOG,
               description="Re-measure Soup's stream peak-VRAM pre-flight (the issue #395 record).",
               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_modes(p)
    add_arm_options(p)
    add_estimate_options(p)
    add_running_options(p)
    add_output_options(p)
    return p
