"""issue395.run.clashes: the table of option clashes, through settle on real command lines (the
parser, settle, Soup's own loader for --config's soup.yaml, on CPU). Every rule is met by a command
line and says its own line; a command line with several faults is told the first in settle's order,
a bad value before a clash where settle reads the value first. Nothing is faked: the rule that
spoke is recorded by wrapping Clash.first, which still decides."""

from __future__ import annotations

import pytest

from issue395.errors import UsageError
from issue395.run import clashes
from issue395.run.options import settle
from issue395.run.parser import build_parser

ESTIMATE = ["--estimate", "--model", "smol", "--seq", "128"]
YAML = """base: HuggingFaceTB/SmolLM2-135M
task: sft
data: {train: data.jsonl, max_length: 128}
training: {batch_size: 1, quantization: none, stream_layers: true, lora: {r: 4, alpha: 8, target_modules: [q_proj]}}
"""

#: One command line per rule, in the table's order, and the line it says.
EVERY_RULE = [
    (["--card", "list", "--seq", "128"], "--card list and --seq are exclusive: it lists the named cards"),
    (["--exit-code"], "--exit-code goes with --estimate (its exit code says whether the run fits)"),
    (["--stack", "torch=2.11.0"], "--stack goes with --estimate (it names the training box's stack for an estimate)"),
    (["--from-json", "r.json", "--sweep"],
     "--from-json and --sweep are exclusive: --from-json re-renders saved results and runs nothing"),
    (["--config", "{yaml}", "--seq", "128"], "--config and --seq are exclusive: the file gives it"),
    (["--config", "{yaml}", "--map"], "--config and --map are exclusive: the file is one arm"),
    (["--expert-layout", "fused"], "--expert-layout goes with --map (an axis) or --estimate"),
    (["--loss-chunk", "off"], "--loss-chunk goes with --map (an axis) or --estimate"),
    (["--recompute", "on"], "--recompute goes with --map (an axis) or --estimate"),
    (["--stream-layers", "off"], "--stream-layers goes with --map (an axis)"),
    (["--gradient-checkpointing", "on"], "--gradient-checkpointing goes with --map (an axis)"),
    (["--stream-vram-probe", "on"], "--stream-vram-probe goes with --map (an axis)"),
    ([*ESTIMATE, "--weights", "hub"],
     "--estimate and --weights are exclusive: an estimate reads the config, no weights"),
    (["--compare", "r.json"], "--compare goes with --from-json"),
    (["--find-max", "seq", "--card", "12GB"], "--find-max needs --config: it finds the limit of your soup.yaml's run"),
    (["--find-max", "seq", "--config", "{yaml}"],
     "--find-max needs --card or --emulate-card: the card it finds the limit on"),
    (["--find-max", "seq", "--config", "{yaml}", "--card", "12GB", "--emulate-card", "T4"],
     "--card and --emulate-card are exclusive: --find-max searches one card, named once"),
    (["--find-max", "batch", "--config", "{yaml}", "--card", "12GB", "--lanes"],
     "--find-max runs your soup.yaml's own run, probe by probe, each `soup train` in a fresh process: not with "
     "--estimate, --sweep, --measure, --sdpa, --determinism, --isolate, --gpus, --shard, --lanes, --snapshot, "
     "--snapshot-dir, --markdown, --plot, --cap, --min-free or --weights hub"),
    ([*ESTIMATE, "--dry-run"], "--estimate and --dry-run are exclusive: an estimate runs nothing"),
    ([*ESTIMATE, "--context", "1"], "--context goes with --card: it is the context of the card to fit"),
    ([*ESTIMATE, "--exit-code"], "--exit-code needs --card: it says whether the run fits a card"),
    (["--card", "A10G"], "--card goes with --estimate"),
    (["--targets", "q_proj"], "--targets goes with --estimate"),
    (["--lora-r", "8"], "--lora-r goes with --estimate"),
    (["--context", "1"], "--context goes with --estimate or --emulate-card"),
    (["--map", "--isolate"], "--map and --isolate are exclusive"),
    (["--families", "smol"], "--families goes with --map"),
    (["--quant", "none"], "--quant goes with --map"),
    (["--model", "x", "--models", "smol"], "--model and --models are exclusive: one brings its own model"),
    (["--shard", "1/2", "--gpus", "0"],
     "--shard is one shard of the grid; --gpus, --isolate and --determinism make their own"),
    (["--model", "x"], "--model needs --seq (there is no record grid for it)"),
    (["--cap", "soup", "--sdpa"], "--cap runs each arm under a capped allocator; --measure, --sdpa and --snapshot "
     "would run under it too: run them without --cap"),
    (["--emulate-card", "A10G", "--dry-run"], "--emulate-card holds CUDA memory outside the allocator for each arm in "
     "a fresh process: not with --dry-run, --cap, --determinism, --measure, --sdpa or --snapshot"),
    (["--min-free", "--measure"], "--min-free runs each arm in capped fresh processes on a GPU: not with --dry-run, "
     "--cap, --emulate-card, --determinism, --measure, --sdpa or --snapshot"),
    (["--cap", "soup", "--dry-run"], "--cap re-runs arms on a GPU, each in a fresh process: not with --dry-run or "
     "--determinism"),
    (["--snapshot-dir", "snaps", "--dry-run"], "--snapshot attributes the CUDA step's peak; a --dry-run has no step"),
    ([*ESTIMATE, "--lanes"], "--estimate and --lanes are exclusive: an estimate runs nothing"),
    (["--lanes", "--min-free"], "--lanes shares the card between arms; --cap, --emulate-card and --min-free arms need "
     "the whole card: run them without --lanes (one at a time, as they always run)"),
    (["--lanes", "--determinism"],
     "--lanes and --determinism are exclusive: each repeat is a fresh process of its own"),
    (["--lanes", "--shard", "1/2"], "--shard is one shard of the grid; --lanes makes its own"),
    (["--lanes", "--measure"], "--lanes spreads the arms; --measure and --sdpa alone run none (add --sweep)"),
    ([*ESTIMATE, "--shard-dir", "shards"], "--estimate and --shard-dir are exclusive: nothing is sharded"),
]


@pytest.fixture
def spoke(monkeypatch):
    """The indexes in CLASHES of the rules that clashed, in order."""
    said = []
    first = clashes.Clash.first

    def recorded(self, facts):
        line = first(self, facts)
        if line is not None:
            said.append(clashes.CLASHES.index(self))
        return line

    monkeypatch.setattr(clashes.Clash, "first", recorded)
    return said


def refused(argv, tmp_path, monkeypatch) -> str:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "soup.yaml").write_text(YAML)
    argv = [a.format(yaml=tmp_path / "soup.yaml") for a in argv]
    with pytest.raises(UsageError) as exc:
        settle(build_parser().parse_args(argv), argv)
    return str(exc.value)


def test_every_rule_is_met_by_a_command_line_and_says_its_own_line():
    assert len(EVERY_RULE) == len(clashes.CLASHES)


@pytest.mark.parametrize("index", range(len(EVERY_RULE)))
def test_each_rule_says_its_line(index, spoke, tmp_path, monkeypatch):
    argv, line = EVERY_RULE[index]
    assert refused(argv, tmp_path, monkeypatch) == line
    assert spoke == [index], f"{argv} was refused by rule {spoke}, not {index}"


@pytest.mark.parametrize("argv, first", [
    # --estimate's own list is read before --lanes, which is read on the settled run
    ([*ESTIMATE, "--lanes", "--sweep"], "--estimate and --sweep are exclusive: an estimate runs nothing"),
    # --min-free's rule stands before --cap's --dry-run rule
    (["--min-free", "--cap", "soup", "--dry-run"], "--min-free runs each arm in capped fresh processes on a GPU: not "
     "with --dry-run, --cap, --emulate-card, --determinism, --measure, --sdpa or --snapshot"),
    # --cap's --measure rule is read before --emulate-card's card is, and its clash after
    (["--cap", "soup", "--measure", "--emulate-card", "nope"], "--cap runs each arm under a capped allocator; "
     "--measure, --sdpa and --snapshot would run under it too: run them without --cap"),
    # a value settle reads first is told before a clash
    (["--seq", "abc", "--cap", "soup", "--dry-run"], "--seq 'abc' is not a whole number"),
    (["--shard", "3/2", "--gpus", "0"], "--shard 3/2: give K/N with 1 <= K <= N, e.g. --shard 2/4"),
    # the first option the file gives, in CONFIG_GIVES' order, not the command line's
    (["--config", "{yaml}", "--batch", "2", "--model", "x"], "--config and --model are exclusive: the file gives it"),
])
def test_a_command_line_with_several_faults_is_told_the_first_in_settles_order(argv, first, tmp_path, monkeypatch):
    assert refused(argv, tmp_path, monkeypatch) == first


@pytest.mark.parametrize("extra", [["--estimate"], ["--sweep"], ["--cap", "soup"], ["--min-free"], ["--isolate"],
                                   ["--gpus", "0"], ["--snapshot"], ["--plot", "p.png"], ["--weights", "hub"],
                                   ["--determinism"], ["--shard", "1/2"]])
def test_every_option_find_max_excludes_is_its_one_line(extra, spoke, tmp_path, monkeypatch):
    argv = ["--find-max", "seq", "--config", "{yaml}", "--emulate-card", "12GB", *extra]
    assert refused(argv, tmp_path, monkeypatch).startswith("--find-max runs your soup.yaml's own run")
    assert spoke == [EVERY_RULE.index(next(r for r in EVERY_RULE if "--lanes, --snapshot" in r[1]))]


def test_find_max_beside_a_key_the_file_gives_or_the_map_is_the_config_rule(tmp_path, monkeypatch):
    """--find-max needs --config, so the options --config refuses are told by --config's own rules."""
    for extra, line in ((["--seq", "128"], "--config and --seq are exclusive: the file gives it"),
                        (["--map"], "--config and --map are exclusive: the file is one arm"),
                        (["--exit-code"], "--exit-code goes with --estimate (its exit code says whether the run fits)")):
        argv = ["--find-max", "seq", "--config", "{yaml}", "--card", "12GB", *extra]
        assert refused(argv, tmp_path, monkeypatch) == line


def test_a_stage_no_rule_names_is_refused():
    with pytest.raises(AssertionError):
        clashes.check("no such stage")


def test_a_constraint_under_map_is_not_refused_for_its_own_isolate(spoke):
    """--map --isolate clashes, but --cap, --emulate-card and --min-free isolate each arm themselves."""
    argv = ["--map", "--isolate", "--cap", "soup", "--families", "smol", "--seq", "128"]
    run = settle(build_parser().parse_args(argv), argv)
    assert run.isolate and run.map and spoke == []
