"""issue395.constraints.findmax: --find-max's search and its probe. The search runs against a faked
``completes(value)``: the CUDA probe (Soup's step on a card under the ballast) is the only thing faked,
and it is said so where it is. The probe's soup.yaml is read back by Soup's own loader
(soup_cli.config.loader, whichever release this venv holds); the outcome is judged from Soup's
console as soup-cli prints it (its gate lines and its OOM line, copied from a committed run)."""

from __future__ import annotations

import itertools
import math
import types
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import readme_yaml
import yaml

from issue395.constraints import findmax as F

SEQ = dict(resolution=64, low=64, high=32768)


def fake_probe(limit, fail_at=()):
    """The faked CUDA probe: completes up to ``limit``, OOM above it; FAILED (not OOM) at ``fail_at``."""
    def probe(value):
        if value in fail_at:
            return F.Probe(value, F.FAILED, line="ValueError: something else")
        return F.Probe(value, F.COMPLETED if value <= limit else F.OOM, steps=2)
    return probe


def test_the_bracket_starts_at_the_tools_answer_and_steps_up_by_a_doubling_distance():
    found = F.find_max(fake_probe(1920), "seq", 1792, **SEQ)
    assert [p.value for p in found.probes] == [1792, 1856, 1984, 1920]  # +64, +128, then the bisection
    assert (found.limit, found.above, found.adjacent, found.stopped) == (1920, 1984, True, None)


def test_a_start_that_does_not_complete_steps_down_then_bisects():
    found = F.find_max(fake_probe(1472), "seq", 1792, **SEQ)
    assert [p.value for p in found.probes][:4] == [1792, 1728, 1600, 1344]  # -64, -128, -256: 1344 completes
    assert (found.limit, found.above, found.adjacent) == (1472, 1536, True)


@pytest.mark.parametrize("limit,start", list(itertools.product([64, 640, 1920, 2048, 4032, 32768],
                                                                [64, 1024, 1792, 2112, 32768, None])))
def test_the_limit_and_the_value_above_are_adjacent_at_the_resolution_in_a_few_probes(limit, start):
    found = F.find_max(fake_probe(limit), "seq", start, **SEQ, limit=100)  # the default limit: its own test
    assert found.limit == limit and found.adjacent
    assert found.above == (None if limit == SEQ["high"] else limit + 64)
    assert all(p.completed == (p.value <= limit) for p in found.probes)
    off = abs((start or 64) - limit) / 64 + 1
    assert len(found.probes) <= 2 * math.ceil(math.log2(off)) + 3  # a bracket, not log2(32768) from the floor


@pytest.mark.parametrize("limit,start,other", list(itertools.product([640, 1920, 3712, 32768],
                                                                      [1024, 3264, None], [1792, 3200, 4096, None])))
def test_a_second_prediction_anywhere_still_finds_the_limit(limit, start, other):
    """Soup's gate's longest beside this tool's: wherever the two sit, the search ends at the limit,
    adjacent to the first OOM, and every probe's outcome is the faked card's."""
    found = F.find_max(fake_probe(limit), "seq", start, **SEQ, limit=100, other=other)
    assert found.limit == limit and found.adjacent
    assert all(p.completed == (p.value <= limit) for p in found.probes)


@pytest.mark.parametrize("other", [None, 64, 1856, 1920, 2432, 32768])
def test_a_right_answer_is_proven_in_two_probes_wherever_soups_gate_sits(other):
    """Issue 52 item 4: this tool's answer completes and its next step raises OOM, two probes, with
    Soup's gate's answer anywhere (far above the limit it costs nothing); and an answer one step over
    the limit is proven in two the other way. The CUDA probe is faked (no OOM can happen on CPU)."""
    right = F.find_max(fake_probe(1856), "seq", 1856, **SEQ, other=other)
    assert [(p.value, p.outcome) for p in right.probes] == [(1856, F.COMPLETED), (1920, F.OOM)]
    over = F.find_max(fake_probe(1856), "seq", 1920, **SEQ, other=other)
    assert [p.value for p in over.probes] == [1920, 1856] and (over.limit, over.above) == (1856, 1920)


def test_soups_gate_far_above_the_limit_is_not_probed():
    """The issue's six-probe search (results/fit4-anatomy-findmax-*/find-max-qwen-dpo-nf4-r64-T4.json:
    this tool's 2432, the limit 2560, Soup's gate's 3328 probed second): the faked probe at the measured
    limit, the real search, which never probes 3328 and proves the limit in four."""
    found = F.find_max(fake_probe(2560), "seq", 2432, **SEQ, other=3328)
    assert 3328 not in [p.value for p in found.probes]
    assert (found.limit, found.above, len(found.probes)) == (2560, 2624, 4)


def test_soups_gate_inside_the_stride_is_probed_and_proven_with_its_next_step():
    """Where Soup's gate's answer lies inside the walk's next stride it is the far end probed, and where
    it completes its next step is probed next: Soup's answer at the limit is proven by it
    (results/fit4-anatomy-findmax-*/find-max-qwen3-simpo-12GB.json's: 2304, Soup's 2368, OOM at 2432)."""
    found = F.find_max(fake_probe(2368), "seq", 2304, **SEQ, other=2368)
    assert [p.value for p in found.probes] == [2304, 2368, 2432]
    inside = F.find_max(fake_probe(3200), "seq", 3072, **SEQ, other=3264)  # llama32-sft-r128-8GB's
    assert [p.value for p in inside.probes] == [3072, 3136, 3264, 3200] and inside.adjacent


def committed_searches():
    root = Path(__file__).resolve().parents[2] / "results"
    for path in sorted(root.rglob("*.json")):
        data = __import__("json").loads(path.read_text())
        if isinstance(data, dict) and data.get("kind") == "find-max" and data["measured"]["proven"]:
            yield pytest.param(data, id=str(path.relative_to(root)))


@pytest.mark.parametrize("data", list(committed_searches()))
def test_every_committed_search_replayed_needs_no_more_probes_and_finds_its_limit(data):
    """Each committed --find-max search that proved its limit, replayed from its own start and Soup's
    gate's answer with the probe faked at its measured limit (a CUDA OOM cannot happen on CPU): the same
    limit and first OOM, in no more probes than it took on the GPU."""
    m = data["measured"]
    found = F.find_max(fake_probe(m["limit"]), m["axis"], m["start"], m["resolution"], m["low"], m["high"],
                       other=data["soup_gate_longest"])
    assert (found.limit, found.above, found.adjacent) == (m["limit"], m["oom_above"], True)
    assert len(found.probes) <= len(m["probes"])


def test_nothing_completes_the_smallest_value_raised_oom():
    found = F.find_max(fake_probe(0), "seq", 128, **SEQ)
    assert (found.limit, found.above, found.adjacent) == (None, 64, True)


def test_a_probe_failing_for_another_reason_is_reported_not_counted_as_oom():
    found = F.find_max(fake_probe(1920, fail_at={1984}), "seq", 1792, **SEQ)
    failed = found.probe_at(1984)
    assert failed.outcome == F.FAILED and failed.line == "ValueError: something else"
    assert found.above is None and found.limit == 1856 and not found.adjacent  # 1984 is no OOM
    assert found.stopped == "the probe at 1984 failed, not OOM: ValueError: something else"
    assert found.to_json()["probes"][-1]["outcome"] == "failed" and found.to_json()["proven"] is False


def test_the_batch_axis_steps_by_one_and_the_probe_limit_is_said():
    found = F.find_max(fake_probe(7), "batch", 1, resolution=1, low=1, high=1024)
    assert (found.limit, found.above, found.adjacent) == (7, 8, True)
    cut = F.find_max(fake_probe(1000), "batch", 1, resolution=1, low=1, high=1024, limit=3)
    assert len(cut.probes) == 3 and cut.stopped == "the probe limit (3) was reached" and not cut.adjacent


# -- the probe's soup.yaml, read back by Soup's own loader --
USER = """base: Qwen/Qwen2.5-0.5B
task: dpo
experiment_name: mine
data: {train: pairs.jsonl, format: dpo, max_length: 2048, val_split: 0.2, chat_template: chatml}
training: {batch_size: 2, epochs: 5, lr: 0.0001, gradient_accumulation_steps: 2, quantization: none,
           stream_layers: true, logging_steps: 7, optimizer: adamw_torch,
           lora: {r: 16, alpha: 32, dropout: 0.05, target_modules: [q_proj, v_proj]}}
output: ./runs/mine
"""


def dumped(text: str) -> dict:
    from soup_cli.config.loader import load_config_from_string

    return load_config_from_string(text).model_dump()


def without(d: dict, keys) -> dict:
    d = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
    for key in keys:
        *parents, last = key.split(".")
        node = d
        for part in parents:
            node = node[part]
        node.pop(last, None)
    return d


@pytest.mark.parametrize("axis,value", [("seq", 1856), ("batch", 3)])
def test_the_probes_soup_yaml_keeps_every_user_key_but_what_it_must_change(axis, value, tmp_path):
    config = F.probe_config(USER, axis, value, data=tmp_path / "train.jsonl", output=tmp_path / "out",
                            override=150_000_000_000, data_format="dpo", base="/ckpt/qwen")
    path = F.write_probe_config(tmp_path, config, [{"prompt": "hi", "chosen": "a", "rejected": "b"}] * 8)
    mine, theirs = dumped(path.read_text()), dumped(USER)
    assert without(mine, F.PROBE_KEYS) == without(theirs, F.PROBE_KEYS)
    assert mine["data"]["max_length"] == (value if axis == "seq" else 2048)
    assert mine["training"]["batch_size"] == (value if axis == "batch" else 2)
    assert (mine["data"]["train"], mine["data"]["val_split"], mine["training"]["epochs"]) == (
        str(tmp_path / "train.jsonl"), 0.0, 1)
    assert mine["training"]["stream_vram_override"] == 150_000_000_000 and mine["base"] == "/ckpt/qwen"
    assert mine["training"]["logging_steps"] == 7 and mine["training"]["gradient_accumulation_steps"] == 2
    assert len((tmp_path / "train.jsonl").read_text().splitlines()) == 8


def test_a_format_of_the_users_own_is_replaced_by_the_rows_format_and_auto_is_kept(tmp_path):
    kw = dict(data=tmp_path / "t.jsonl", output=tmp_path / "o", override=None, data_format="chatml")
    alpaca = USER.replace("task: dpo", "task: sft").replace("format: dpo", "format: alpaca")
    assert F.probe_config(alpaca, "seq", 128, **kw)["data"]["format"] == "chatml"
    auto = USER.replace("task: dpo", "task: sft").replace("format: dpo", "format: auto")
    config = F.probe_config(auto, "seq", 128, **kw)
    assert config["data"]["format"] == "auto" and "stream_vram_override" not in config["training"]  # None: the file's gate


# -- the outcome, from Soup's console --
#: Soup's gate panel as it printed it on the H200 (results/task-map-h200-soup0.77.0-*/soup-train-dpo-qwen-*.txt),
#: wrapped at the panel's width.
PANEL = """│   peak VRAM    ~8.50 GB at batch 1 x seq 1856 (2 rows — chosen+rejected are  │
│   free VRAM    150.11 GB (training.stream_vram_override; driver reports      │
│   11.36 GB)                                                                 │
"""


def test_judge_reads_soups_own_lines():
    done = F.judge(1856, PANEL + "{'loss': 0.69}\n", 0, 2, 2, 41.0)
    assert (done.outcome, done.soup_gb, done.driver_free_gb, done.seconds) == (F.COMPLETED, 8.50, 11.36, 41.0)
    oom = F.judge(1984, PANEL + "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n"
                  "GPU ran out of memory\n", 1, None, 2)
    assert oom.outcome == F.OOM and "CUDA out of memory" in oom.line
    short = F.judge(64, PANEL, 0, 1, 2)
    assert short.outcome == F.FAILED and short.line == "exit 0 after 1 of 2 step(s)"
    other = F.judge(64, PANEL + "ValueError: data.train: no such file\n", 1, None, 2)
    assert other.outcome == F.FAILED and other.line == "ValueError: data.train: no such file"
    refused = F.judge(64, "a streaming step is predicted to need 9.34 GB of VRAM but only 8.00 GB is free\n", 1, None, 2)
    assert refused.outcome == F.FAILED and refused.line == "refused by Soup's gate"
    # the resident gate's panel, as commands/train.py's _hardware_fit_preflight prints it (stock and patched alike)
    resident = F.judge(64, "╭──── Hardware-fit gate ────╮\n│ Predicted peak VRAM 49.3 GB (corrected: ...) │\n", 1, None, 2)
    assert resident.outcome == F.FAILED and resident.line == "refused by Soup's gate"
    lifted = F.judge(64, "╭── Hardware-fit warning ──╮\n│ --allow-oom-attempt set: launching anyway. │\n{'loss': 1}\n",
                     0, 2, 2)
    assert lifted.outcome == F.COMPLETED


def test_run_probe_holds_the_ballast_around_soups_own_process(tmp_path):
    """The ballast and Soup's process are faked (CUDA); the probe's command, order and judging are real."""
    config = F.write_probe_config(tmp_path, F.probe_config(USER, "seq", 1856, data=tmp_path / "t.jsonl",
                                                           output=tmp_path / "out", override=1, data_format="dpo"), [])
    events = []

    def run(argv, **kw):
        events.append(("soup", argv[-4:], kw["cwd"], kw["env"]["COLUMNS"]))
        (tmp_path / "out" / "checkpoint-2").mkdir(parents=True)
        (tmp_path / "out" / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2}')
        return types.SimpleNamespace(returncode=0, stdout=PANEL, stderr="")

    probe, ballast, log = F.run_probe(config, 1856, 2, 12_000_000_000, log_to=tmp_path / "soup.log",
                                      hold=lambda free: events.append(("hold", free)) or "B",
                                      release=lambda b: events.append(("release", b)), run=run)
    assert events[0] == ("hold", 12_000_000_000) and events[-1] == ("release", "B")
    assert events[1][1:] == (["train", "--config", str(config), "--yes"][-4:], str(tmp_path), "400")
    assert probe.completed and probe.steps == 2 and (tmp_path / "soup.log").read_text() == PANEL


def test_the_probe_runs_the_real_soup_cli_through_its_exit_hook(tmp_path):
    """The exit hook wraps the real ``python -m soup_cli`` (CPU: `--help`, no CUDA): Soup's own console
    comes through unchanged, and a process that never initialised CUDA writes no peaks."""
    import subprocess
    import sys

    peaks = tmp_path / "peaks.json"
    env = dict(__import__("os").environ, **{F.PEAKS_ENV: str(peaks)}, COLUMNS="200")
    hooked = subprocess.run(F.hooked_soup_command() + ["train", "--help"], capture_output=True, text=True, env=env, timeout=120)
    plain = subprocess.run(F.soup_command() + ["train", "--help"], capture_output=True, text=True,
                           env=env, timeout=120)
    assert hooked.returncode == plain.returncode == 0 and "--config" in hooked.stdout
    assert hooked.stdout == plain.stdout
    assert not peaks.exists() and F.read_peaks(peaks) is None


def test_a_probe_carries_the_allocator_peaks_its_process_wrote(tmp_path):
    """Soup's process is faked (it writes the file the hook would, as CUDA would have it); the reading,
    the record and the probe table are real."""
    config = F.write_probe_config(tmp_path, F.probe_config(USER, "seq", 1856, data=tmp_path / "t.jsonl",
                                                           output=tmp_path / "out", override=1, data_format="dpo"), [])

    def run(argv, **kw):
        Path(kw["env"][F.PEAKS_ENV]).write_text('{"allocated_peak": 9000000000, "requested_peak": 8990000000, '
                                                '"reserved_peak": 9100000000}')
        (tmp_path / "out" / "checkpoint-2").mkdir(parents=True)
        (tmp_path / "out" / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2}')
        return types.SimpleNamespace(returncode=0, stdout=PANEL, stderr="")

    probe, _, _ = F.run_probe(config, 1856, 2, 12_000_000_000, hold=lambda free: "B", release=lambda b: None, run=run)
    assert probe.allocator == F.ProbeAllocator(9_000_000_000, 8_990_000_000, 9_100_000_000)
    found = F.FindMax("seq", 64, 1856, 64, 4096, probes=[probe], limit=1856)
    row = next(ln for ln in F.probe_table(found, 2) if ln.lstrip().startswith("1 "))
    assert row.rstrip().endswith("9.000        9.100")
    broken = tmp_path / "broken.json"
    broken.write_text('{"allocated_peak": 1}')
    assert F.read_peaks(broken) is None


#: torch's own out-of-memory message, as Soup's console printed it in a committed probe (the real
#: `soup train` of Phi-3-mini NF4 r64 at seq 3328 on an emulated 4 GB card, results/fit4-anatomy-findmax-*)
TORCH_OOM = ("Rewind recorder disabled: CUDA out of memory. Tried to allocate 408.00 MiB. GPU 0 has a total capacity "
             "of 139.80 GiB of which 419.56 MiB is free. Process 496 has 135.79 GiB memory in use. Including non-PyTorch "
             "memory, this process has 3.58 GiB memory in use. Of the allocated memory 2.56 GiB is allocated by "
             "PyTorch, and 219.38 MiB is reserved by PyTorch but unallocated. If reserved but unallocated \n"
             "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.\n")


def test_an_oom_probe_reads_the_allocators_reserve_from_torchs_message():
    probe = F.judge(3328, PANEL + TORCH_OOM + "Error: GPU ran out of memory during training.\n", 1, None, 3)
    assert probe.outcome == F.OOM
    r = probe.oom
    assert r.tried == 408 * 2**20 and r.reserved_unallocated == int(219.38 * 2**20)
    assert r.allocated == int(2.56 * 2**30) and r.process_in_use == int(3.58 * 2**30)
    assert r.outside_allocator == r.process_in_use - r.allocated - r.reserved_unallocated > 0
    assert F.judge(3328, PANEL + "Error: GPU ran out of memory during training.\n", 1, None, 3).oom is None


def test_a_probe_reads_the_runtimes_growth_as_its_process_exits_and_at_an_oom(tmp_path):
    """Issue 51 item 4: the exit hook's reading of the device's free memory and the allocator's reserved bytes (FAKED:
    Soup's process writes the file the hook would, with figures CUDA would have given; the ballast's free memory is
    faked too) puts the probe's memory outside the allocator, and less the box's context, what the runtime grew by.
    The reading, the record and the arithmetic on it are real; a probe whose hook read no exit figures (every probe
    before it did) has no growth from them, and an OOM's torch message gives its own."""
    config = F.write_probe_config(tmp_path, F.probe_config(USER, "seq", 2112, data=tmp_path / "t.jsonl",
                                                           output=tmp_path / "out", override=None, data_format="chatml"), [])
    held, context = 10_001_514_496, 623_706_112

    def run(argv, **kw):  # after the step: 9.3 GB mapped by the allocator, 150 MB more outside it than the context
        Path(kw["env"][F.PEAKS_ENV]).write_text(
            '{"allocated_peak": 9081700000, "requested_peak": 9081690000, "reserved_peak": 9198000000, '
            f'"free_at_exit": {held - 9_300_000_000 - context - 150_000_000}, "reserved_at_exit": 9300000000}}')
        (tmp_path / "out" / "checkpoint-2").mkdir(parents=True)
        (tmp_path / "out" / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2}')
        return types.SimpleNamespace(returncode=0, stdout=PANEL, stderr="")

    ballast = types.SimpleNamespace(size=1, free_after=held)
    probe, _, _ = F.run_probe(config, 2112, 2, 10_000_000_000, hold=lambda free: ballast, release=lambda b: None,
                              run=run)
    assert probe.completed and probe.free_held == held
    assert F.runtime_growth(probe, context) == 150_000_000
    old = replace(probe, allocator=replace(probe.allocator, free_at_exit=None, reserved_at_exit=None))
    assert F.runtime_growth(old, context) is None
    oom = F.judge(3328, PANEL + TORCH_OOM + "Error: GPU ran out of memory during training.\n", 1, None, 3)
    assert F.runtime_growth(oom, context) == oom.oom.outside_allocator - context  # torch's reading alone
    both = replace(oom, allocator=probe.allocator, free_held=held)
    assert F.runtime_growth(both, context) == 150_000_000  # the exit's bytes, not the message's rounded GiB
    found = F.FindMax("seq", 64, 2112, 64, 4096, probes=[old, probe], limit=2112)
    assert F.measured_growth(found, context) == 150_000_000 and F.measured_growth(found, None) is None
    assert F.measured_growth(F.FindMax("seq", 64, 2112, 64, 4096, probes=[old]), context) is None
    table = F.probe_table(found, 2, context)
    assert "runtime growth MB" in table[0] and table[-1].rstrip().endswith("150.0") and table[-2].rstrip().endswith("-")
    assert "runtime growth MB" not in F.probe_table(F.FindMax("seq", 64, 2112, 64, 4096, probes=[old]), 2, context)[0]


# -- a cuDNN or cuBLAS failure at the memory edge (issue 52 item 3) --
#: The committed probe one step past Mistral-7B ORPO NF4's limit on the emulated 6 GB card
#: (results/fit4-pages-findmax-stack-*/call-4/find-max-mistral-orpo-nf4-6GB.json, seq 3008): its
#: allocator's peaks as Soup's process read them at exit, the card, and the box's context measured there.
EDGE_ALLOCATOR = F.ProbeAllocator(allocated_peak=5_072_832_000, requested_peak=5_072_820_588, reserved_peak=5_567_938_560)
EDGE_CARD_FREE = 6_442_450_944 - 623_706_112
CUDNN = ("RuntimeError: cuDNN error: CUDNN_STATUS_INTERNAL_ERROR\n"
         "Error: RuntimeError: cuDNN error: CUDNN_STATUS_INTERNAL_ERROR\n")


def library_failure(value, reserved_peak=EDGE_ALLOCATOR.reserved_peak):
    """Soup's console for a step that failed inside cuDNN, judged for real; its allocator's peaks as the
    exit hook would have read them on CUDA (faked: no CUDA here)."""
    p = F.judge(value, PANEL + CUDNN, 1, None, 3)
    return replace(p, allocator=replace(EDGE_ALLOCATOR, reserved_peak=reserved_peak))


def test_judge_names_a_cudnn_status_on_a_failed_probe_and_no_other():
    p = F.judge(3008, PANEL + CUDNN, 1, None, 3)
    assert (p.outcome, p.library) == (F.FAILED, "CUDNN_STATUS_INTERNAL_ERROR")
    assert p.line == "Error: RuntimeError: cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"
    assert F.judge(64, PANEL + "ValueError: data.train: no such file\n", 1, None, 2).library is None


def test_a_library_failure_the_allocator_puts_at_the_memory_edge_reads_as_oom():
    """At the committed edge probe's figures (250.8 MB of the card left outside the allocator at its
    reserved peak, under the runtime's 262.1 MB growth in a step) a cuDNN failure is an OOM, said so;
    the same failure with the allocator a GB lower, or with no reading, stays a failure."""
    edge = F.read_at_edge(library_failure(3008), EDGE_CARD_FREE)
    assert edge.outcome == F.OOM and edge.library == "CUDNN_STATUS_INTERNAL_ERROR"
    assert edge.edge.startswith("CUDNN_STATUS_INTERNAL_ERROR read as OOM: the allocator's reserved peak (5.568 GB, "
                                "measured) left 250.8 MB of the card's 5.819 GB free, less than")
    assert F.probe_words(edge, 3).startswith("OOM (CUDNN_STATUS_INTERNAL_ERROR, read by the allocator's figures)")
    room = F.read_at_edge(library_failure(3008, EDGE_ALLOCATOR.reserved_peak - 10**9), EDGE_CARD_FREE)
    assert room.outcome == F.FAILED and room.edge.startswith("not read as OOM: ") and "1250.8 MB" in room.edge
    blind = F.read_at_edge(replace(library_failure(3008), allocator=None), EDGE_CARD_FREE)
    assert blind.outcome == F.FAILED and "no allocator reading" in blind.edge
    other = F.judge(64, PANEL + "ValueError: data.train: no such file\n", 1, None, 2)
    assert F.read_at_edge(other, EDGE_CARD_FREE) is other  # no library's status: as it is


def test_a_library_failure_not_at_the_edge_is_probed_once_more_and_the_second_outcome_counts():
    """The observed case: a cuDNN failure one step past the limit that raised OOM when run again. The
    CUDA probe is faked (its first run at 1984 fails inside cuDNN, away from the edge by its figures)."""
    runs = []

    def probe(value):
        runs.append(value)
        if value == 1984 and runs.count(1984) == 1:
            return F.read_at_edge(library_failure(value, 10**9), EDGE_CARD_FREE)
        return fake_probe(1920)(value)

    found = F.find_max(probe, "seq", 1920, **SEQ)
    assert runs == [1920, 1984, 1984]
    assert (found.limit, found.above, found.adjacent, found.stopped) == (1920, 1984, True, None)
    assert found.probe_at(1984).outcome == F.OOM  # the probe that decided it: the second


def test_a_search_stopped_by_a_failure_says_so_and_never_claims_no_oom_up_to_the_top():
    """The issue's search: completes up to one step under the largest seq there is, and fails there
    inside cuDNN (not at the edge by its figures) twice; faked probes, the real search and its words."""
    high = 131072

    def probe(value):
        if value == high:
            return F.read_at_edge(library_failure(value, 10**9), EDGE_CARD_FREE)
        return fake_probe(high)(value)

    found = F.find_max(probe, "seq", high - 64, resolution=64, low=64, high=high)
    assert [p.value for p in found.probes] == [high - 64, high, high] and not found.adjacent
    assert found.stopped.startswith(f"the probe at {high} failed twice, not OOM: Error: RuntimeError: cuDNN error: "
                                    "CUDNN_STATUS_INTERNAL_ERROR; not read as OOM: ")
    words = F.measured_words(found, 3)
    assert "no OOM up to" not in words
    assert words.startswith(f"seq {high - 64} completes 3 of 3 step(s); no probe above it completed or raised OOM "
                            f"-- stopped before the answer was proven: the probe at {high} failed twice")
    top = F.find_max(fake_probe(high), "seq", high - 64, resolution=64, low=64, high=high)
    assert F.measured_words(top, 3).endswith(f"no OOM up to the largest seq there is ({high})") and top.adjacent
# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


def test_a_search_stopped_by_a_non_oom_failure_says_what_failed_not_none_raised_oom():
    """Issue 36 item 14: a --find-max search stopped by a failure that is not an OOM quotes what failed, never
    'None raised OOM'; an OOM at the smallest says so."""
    from issue395.constraints.findmax import FAILED, FindMax, Probe, find_max, measured_words

    line = "Error: ValueError: Tokenizer has no chat_template. Pass data.chat_template: chatml"
    found = find_max(lambda v: Probe(v, FAILED, 0, line, 1.0, 1), "seq", 2048, 64, 64, 4096)
    words = measured_words(found, 2)
    assert "None" not in words and "raised OOM" not in words and "Tokenizer has no chat_template" in words, words
    oom = find_max(lambda v: Probe(v, "OOM", 0, "CUDA out of memory", 1.0, 1), "seq", 64, 64, 64, 4096)
    assert "the smallest, 64, raised OOM" in measured_words(oom, 2)


def test_judge_quotes_soups_error_line_not_its_verbose_hint():
    """Issue 36 item 14: a probe's line is Soup's error line, not its --verbose hint."""
    from issue395.constraints.findmax import judge

    log = ("Loading ...\n\nError: OSError: We couldn't connect to 'https://huggingface.co' to load the files.\n"
           "Check your internet connection.\nRun with --verbose for the full traceback.\n")
    p = judge(2048, log, 1, None, 2)
    assert p.line.startswith("Error: OSError: We couldn't connect"), p.line


@pytest.mark.slow
@pytest.mark.parametrize("template, refused", [("", True), ("  chat_template: chatml\n", False)])
@pytest.mark.release
def test_soups_own_checks_run_on_the_probes_file_before_any_probe(tmp_path, cache_dir, template, refused):
    """The synthetic checkpoint's tokenizer has no chat template: an SFT file that names none is
    refused by Soup's own format check (at setup, before any step), here on CPU, costing no probe."""
    from issue395.constraints.findmax import probe_config, soup_checks, write_probe_config
    from issue395.host.checkpoints import synthetic_checkpoint
    from issue395.model.registry import SHAPES
    from conftest import h

    base = synthetic_checkpoint(SHAPES["smol"], cache_dir / "checkpoints")[0]
    text = readme_yaml(tmp_path, seq=128, base=base).read_text().replace("quantization: 4bit", "quantization: none")
    text = text.replace("max_length: 128}", "max_length: 128}\n").replace("data: {train: data.jsonl, max_length: 128}",
                                                                          "data:\n  train: data.jsonl\n  max_length: 128\n"
                                                                          + template)
    config = probe_config(text, "seq", 128, data=tmp_path / "p" / "train.jsonl", output=tmp_path / "p" / "out",
                          override=10**10, data_format="chatml")
    path = write_probe_config(tmp_path / "p", config, h.task_rows("sft", 128, 4))
    line = soup_checks(path, "sft")
    if refused:
        assert line is not None and "chat_template" in line and "Value error" not in line, line
    else:
        assert line is None, line


# Issue 51 item 4: a resident soup.yaml's probe lifts Soup's resident gate with its own --allow-oom-attempt.

def test_soup_train_takes_allow_oom_attempt_through_the_probes_exit_hook():
    """The real ``soup train --help`` (CPU), through the probe's hooked command: the installed soup-cli (0.73.3 and
    0.77.0 both) has the option a resident probe passes."""
    import subprocess

    done = subprocess.run(F.hooked_soup_command() + ["train", "--help"], capture_output=True, text=True, timeout=120,
                          env=dict(__import__("os").environ, COLUMNS="300"))
    assert done.returncode == 0 and F.ALLOW_OOM_ATTEMPT in done.stdout


def test_a_resident_probe_runs_soup_train_with_allow_oom_attempt_and_no_streamed_gate_key(tmp_path):
    """The ballast and Soup's process are faked (CUDA): a resident probe's command line ends in --allow-oom-attempt,
    a streamed one's does not, and a probe written with no override keeps the file's gate keys as they are."""
    text = USER.replace("stream_layers: true", "stream_layers: false")
    config = F.write_probe_config(tmp_path, F.probe_config(text, "seq", 1024, data=tmp_path / "t.jsonl",
                                                           output=tmp_path / "out", override=None, data_format="dpo"), [])
    assert "stream_vram_override" not in config.read_text() and "stream_layers: false" in config.read_text()
    argvs = []

    def run(argv, **kw):
        argvs.append(argv)
        return types.SimpleNamespace(returncode=1, stdout="", stderr="GPU ran out of memory\n")

    for lifted in (True, False):
        p, _, _ = F.run_probe(config, 1024, 2, 12_000_000_000, hold=lambda free: "B", release=lambda b: None, run=run,
                              allow_oom_attempt=lifted)
        assert p.outcome == F.OOM
    assert argvs[0][-5:] == ["train", "--config", str(config), "--yes", "--allow-oom-attempt"]
    assert argvs[1][-4:] == ["train", "--config", str(config), "--yes"]


def test_a_resident_probe_runs_on_expandable_segments_unless_the_user_exported_a_setting(tmp_path, monkeypatch):
    """Soup's process is faked (CUDA): a resident probe's `soup train` starts with PYTORCH_CUDA_ALLOC_CONF set to
    expandable segments (the setting the resident need holds under; `soup train` sets it for streamed runs
    only), a value the user exported is passed on unchanged, and a streamed probe's environment gets nothing
    added (Soup sets it there itself). Measured why: results/resident-findmax-h200-soup0.77.0-faaa21d."""
    config = F.write_probe_config(tmp_path, F.probe_config(USER.replace("stream_layers: true", "stream_layers: false"),
                                                           "seq", 1024, data=tmp_path / "t.jsonl", output=tmp_path / "out",
                                                           override=None, data_format="dpo"), [])
    envs = []

    def run(argv, **kw):
        envs.append(kw["env"].get("PYTORCH_CUDA_ALLOC_CONF"))
        return types.SimpleNamespace(returncode=1, stdout="", stderr="GPU ran out of memory\n")

    probe = dict(hold=lambda free: "B", release=lambda b: None, run=run, allow_oom_attempt=True)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    F.run_probe(config, 1024, 2, 10**10, expandable=True, **probe)
    F.run_probe(config, 1024, 2, 10**10, expandable=False, **probe)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # empty counts as unset, as Soup's own rule has it
    F.run_probe(config, 1024, 2, 10**10, expandable=True, **probe)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    F.run_probe(config, 1024, 2, 10**10, expandable=True, **probe)
    assert envs == ["expandable_segments:True", None, "expandable_segments:True", "max_split_size_mb:128"]
    assert F.probe_allocator() == "max_split_size_mb:128"


@pytest.mark.slow
@pytest.mark.release
def test_the_real_soup_train_completes_a_resident_probes_file_on_cpu_with_its_gate_lifted(tmp_path, cache_dir):
    """The real `soup train` (CPU: no ballast to hold, so hold and release are stand-ins; Soup's resident gate skips
    itself without CUDA) runs a resident probe's soup.yaml, written by probe_config from a user's DPO file, with
    --allow-oom-attempt, on the synthetic SmolLM2 checkpoint: it accepts the option and the file, completes both
    optimizer steps, and the probe reads completed from Soup's own console and trainer state."""
    from conftest import h

    from issue395.model.registry import SHAPES
    from issue395.host.checkpoints import synthetic_checkpoint

    base = synthetic_checkpoint(SHAPES["smol"], cache_dir / "checkpoints")[0]
    text = ("base: HuggingFaceTB/SmolLM2-135M\ntask: dpo\ndata: {train: pairs.jsonl, max_length: 2048}\n"
            "training: {batch_size: 1, gradient_accumulation_steps: 1, quantization: none, stream_layers: false, "
            "lora: {r: 8, alpha: 16, target_modules: [q_proj, v_proj]}}\n")
    folder = tmp_path / "probe"
    config = F.write_probe_config(folder, F.probe_config(text, "seq", 128, data=folder / "train.jsonl",
                                                         output=folder / "out", override=None, data_format="dpo",
                                                         base=str(base)), h.task_rows("dpo", 128, 2))
    p, _, log = F.run_probe(config, 128, 2, 10**10, hold=lambda free: "B", release=lambda b: None,
                            allow_oom_attempt=True)
    assert p.completed and p.steps == 2 and p.exit_code == 0, log[-2000:]
