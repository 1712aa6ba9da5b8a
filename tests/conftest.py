"""Shared fixtures and helpers: the harness module, one checkpoint cache per session, a clean
process state around every test, the harness run in-process and as a fresh process, rows
built through the harness's own constructor, the record's ten arms as one result (the A10G
record's published peaks standing in for CUDA measurements) and committed results several files
read, and the one fake the suite needs.

Everything runs on CPU: the real Soup setup goes through the harness's --dry-run path, or,
where a test needs a measured peak, through the measured path with only the CUDA step faked
(``fake_cuda``): Soup builds on CPU (``h.STEP_DEVICE``) and ``h.real_peak`` is replaced.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "issue395_second_stack_vram.py"
sys.path.insert(0, str(ROOT))
import issue395_second_stack_vram as h  # noqa: E402
from issue395.measure.console import Stop
from issue395.measure.cuda import attribute_peak
from issue395.errors import EXIT_USAGE
from issue395.model.arm import Arm, predicted_bytes
from issue395.results.merge import merge
from issue395.record import DATA_ROWS, RECORD_A10G_PEAK, RECORD_GRID, SDPA_SEQS
from issue395.model.registry import SHAPES, Shape
from issue395.results.result import Result
from issue395.results.row import Row, arm_row
from issue395.results.saved import load_result
from issue395.results.stack import environment

SMOL, QWEN = SHAPES["smol"], SHAPES["qwen"]


@contextlib.contextmanager
def clean_process_state():
    """h.main in-process sets CUDA_VISIBLE_DEVICES and installs its own SIGINT handler and
    Ctrl-C flag; none of that may leak out of the block."""
    saved_env = dict(os.environ)
    saved_handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    saved_tempdir = tempfile.tempdir
    Stop.requested = False
    try:
        yield
    finally:
        Stop.requested = False
        for sig, handler in saved_handlers.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        tempfile.tempdir = saved_tempdir
        os.environ.clear()
        os.environ.update(saved_env)


@pytest.fixture(autouse=True)
def _clean_process_state():
    """No test's in-process run leaks its environment, signal handlers or Ctrl-C flag into the next."""
    with clean_process_state():
        yield



def canonical_runs(events: list) -> list:
    """An allocator request sequence (("alloc", bytes), ("free", bytes), ...) with each run of frees between two
    requests in one order: the allocator's state after a run is the same in any order (coalescing is), so the order
    within it is not checked."""
    out, run = [], []
    for e in events:
        if e[0] == "free":
            run.append(e)
        else:
            out += sorted(run) + [e]
            run = []
    return out + sorted(run)

def main_captured(argv) -> tuple[int, str, str]:
    """h.main in this process outside a test (a session fixture's run, which has no capfd):
    (exit code, stdout, stderr), the process state restored after it."""
    out, err = io.StringIO(), io.StringIO()
    with clean_process_state(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = h.main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="session")
def cache_dir():
    """One --cache-dir for the whole session, under the temp dir (where Soup honours it):
    checkpoints are built and Soup's shards written once, then reused. Removed at the end."""
    path = Path(tempfile.mkdtemp(prefix="issue395-test-cache-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def smol_map_dry_run(cache_dir, tmp_path_factory):
    """One map dry run several tests read: SmolLM2 at seq 64, batch 1, bf16 and NF4, each arm Soup's real
    setup on CPU (``--map --dry-run --families smol --seq 64 --batch 1``), made once a session in this
    process with the session's --cache-dir. (exit code, stdout, stderr, the JSON it saved)."""
    out = tmp_path_factory.mktemp("smol-map") / "map.json"
    code, stdout, err = main_captured(["--map", "--dry-run", "--families", "smol", "--seq", "64", "--batch", "1",
                                       "--cache-dir", cache_dir, "--json", out])
    return code, stdout, err, json.loads(out.read_text()) if out.exists() else None


@pytest.fixture
def run_cli():
    """The harness as a fresh process, the way a terminal runs it (stdout, stderr captured)."""
    def run(args, *, cwd=None, env=None, timeout=600):
        return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)
    return run


def main(capfd, argv):
    """h.main in this process: (exit code, stdout, stderr)."""
    code = h.main([str(a) for a in argv])
    out, err = capfd.readouterr()
    return code, out, err


def one_error_line(code, out, err, *words):
    """A usage error: exit 2, nothing on stdout (not even the stack header), exactly one line
    on stderr naming ``words``, no traceback."""
    assert code == EXIT_USAGE, (out, err)
    assert out == "", out
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def table_rows(out: str, seq: int) -> list[str]:
    """The sweep table's lines for one seq."""
    return [line for line in out.splitlines() if line.split()[:1] == [str(seq)]]


#: A tiny streamable llama, the record's SmolLM2 at toy sizes: a real build in well under a second.
TINY = dataclasses.replace(SMOL, key="tiny", name="tiny", n_layers=2, vocab=512, hidden=64,
                           intermediate=128, max_positions=256, record=False,
                           arch=dict(SMOL.arch, num_attention_heads=4, num_key_value_heads=2))


def arm_of(key: str, seq: int, batch: int = 1, quant: str = "none", targets=None, lora_r: int | None = None,
           steps: int = 1, task: str = "sft", run: dict | None = None) -> Arm:
    """The Arm of a map key at these figures, as the tests spelled them in keywords (issue 50: every estimate of an
    arm takes the typed Arm)."""
    from issue395.model.arm import Adapter, Settings
    from issue395.record import LORA_R

    return Arm.at(key, seq, batch, quant=quant, task=task, settings=Settings(**(run or {})),
                  adapter=Adapter(tuple(targets) if targets else None, LORA_R if lora_r is None else lora_r),
                  steps=steps)


def cap_of(cap: str, key: str, release=None, config=None, **kw):
    """--cap's bytes for the arm of a map key (issue395.constraints.cap.cap_bytes, which takes an Arm)."""
    from issue395.constraints.cap import cap_bytes

    return cap_bytes(cap, arm_of(key, **kw), release, config)


def make_row(key: str = "smol", seq: int = 2048, batch: int = 1, index: int = 0, **measured) -> Row:
    """A row built the way an arm builds it: the harness's own constructor, with Soup's real
    prediction; ``measured`` are the fields a step would have measured. A realised length
    defaults to the requested one (the guard passes) unless given."""
    measured.setdefault("realised_width", seq)
    measured.setdefault("realised_rows", (seq,) * batch)
    return arm_row(Arm(key, seq, batch, index), SHAPES[key], **measured)


#: A shard's stack, every field a saved result carries and a merge compares (tests of Result and merge).
ENV = {"gpu": "NVIDIA H200", "driver": "570.1", "cuda": "13.0", "torch": "2.13.0+cu130",
       "transformers": "5.16.1", "trl": "0.29.1", "peft": "0.20.0", "soup_cli": "0.73.3",
       "python": "3.11.9", "weights": "synthetic", "dry_run": False, "arms": "shard 1/3 in one process",
       "cuda_visible_devices": "0", "date": "2025-01-01T00:00:00+00:00", "command": "x --shard 1/3"}


def safe_peak(seq: int, shape: Shape = SMOL) -> int:
    """A fake peak the prediction covers (pred/real 1.25x)."""
    return int(predicted_bytes(shape, seq) / 1.25)


class FakeStep:
    """Stands in for h.real_peak (the CUDA step, which cannot run here): records which seq
    each call was for and returns ``peaks[seq]``, or raises ``raises[seq]``, or runs
    ``actions[seq]`` first."""

    def __init__(self, peaks=None, raises=None, actions=None):
        self.calls: list[int] = []
        self.steps: list[int] = []  # the optimizer steps each call was asked to run
        self.peaks, self.raises, self.actions = peaks or {}, raises or {}, actions or {}

    def __call__(self, trainer, snapshot=False, steps=1):
        seq = int(trainer.args.max_length)
        self.calls.append(seq)
        self.steps.append(steps)
        if seq in self.actions:
            self.actions[seq]()
        if seq in self.raises:
            raise self.raises[seq]
        peak = self.peaks.get(seq, safe_peak(seq))
        return {"real_peak": peak, "resident": 1234, "reserved": peak, "step_s": 0.01, "snapshot": None}


@pytest.fixture
def fake_cuda(monkeypatch):
    """Fakes the CUDA step only: Soup builds the measured arm on CPU and the step is a
    FakeStep. Returns a function that installs a FakeStep built from its arguments."""
    monkeypatch.setattr(h, "STEP_DEVICE", "cpu")

    def install(**kw) -> FakeStep:
        step = FakeStep(**kw)
        monkeypatch.setattr(h, "real_peak", step)
        return step

    return install


def send_ctrl_c() -> None:
    """One Ctrl-C to this process, and wait until the harness's handler has seen it."""
    already = Stop.requested
    os.kill(os.getpid(), signal.SIGINT)
    deadline = time.monotonic() + 5
    while not already and not Stop.requested and time.monotonic() < deadline:
        time.sleep(0.01)


def short_chat_rows(short_seqs):
    """h.chat_rows, but rows for ``short_seqs`` carry half a seq of words: they tokenize short."""
    real = h.chat_rows

    def rows(seq, n=DATA_ROWS):
        if seq not in short_seqs:
            return real(seq, n)
        return [{"messages": [{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "word " * (seq // 2)}]}] * n

    return rows


cuda = pytest.mark.skipif(not __import__("torch").cuda.is_available(),
                          reason="needs a CUDA GPU (runs on the GPU box)")


#: A test that captures or counts the real transformers + peft model and holds the estimator's sequence or counts to
#: it: they were checked on this stack (issue395.estimator.sequence: SEQUENCE_TRANSFORMERS, SEQUENCE_PEFT), and on
#: another the model's own code is another's (the latest stack's run of them compares what no claim covers).
def _checked_stack() -> bool:
    from issue395.estimator.sequence import SEQUENCE_PEFT, SEQUENCE_TRANSFORMERS
    from issue395.estimator.stacks import package_version

    return (package_version("transformers"), package_version("peft")) == (SEQUENCE_TRANSFORMERS, SEQUENCE_PEFT)


checked_stack = pytest.mark.skipif(not _checked_stack(), reason="captures or counts the real model: checked on the "
                                   "pinned transformers and peft only (estimator/sequence.py)")


def dead_pid() -> int:
    """A process id that was real and is gone: what a killed run leaves in its scratch's name."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


#: Committed results several files read: the margin map on two GPUs, the map at seq 512 and 1024, and
#: a sweep of the record's grid with its --measure and --sdpa sections.
MAP_2GPU = ROOT / "results/margin-map-h200x2-soup0.73.3-f3ad9d2/map-2gpu.json"
MAP_512 = ROOT / "results/cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37/map-512-1024.json"
SWEEP = ROOT / "results/margin-map-in-4-parts-h200-soup0.73.3-3238e1a-to-b3a7891/full-cold.json"


@pytest.fixture(scope="module")
def merged_map():
    """The two committed maps merged, as --from-json merges them (its heatmap and its margins)."""
    return merge([load_result(str(MAP_2GPU)), load_result(str(MAP_512))], "merged from 2 result(s)")


# --- The record's ten arms as one result: what the tables, the markdown, a saved result and the
# exit codes are read against. No GPU: the A10G record's published peaks stand in for CUDA
# measurements, and the --measure and --sdpa sections carry fake numbers shaped like measure_mode
# and sdpa_mode output (those modes need CUDA).

#: The A10G record's published figures (docs/PROTOCOL.md), typed in here independently of the
#: harness's own copies.
PUBLISHED = {  # (model, seq): (predicted GB, real peak GB, pred/real)
    ("smol", 2048): (1.596, 1.3652, 1.169), ("smol", 3072): (2.345, 2.0167, 1.163),
    ("smol", 4096): (3.094, 2.6578, 1.164), ("smol", 4352): (3.281, 2.8184, 1.164),
    ("smol", 5120): (3.842, 3.3030, 1.163), ("smol", 6144): (4.591, 3.9430, 1.164),
    ("qwen", 2048): (4.854, 4.1770, 1.162), ("qwen", 4096): (9.346, 8.0123, 1.166),
    ("qwen", 5120): (11.592, 9.9294, 1.167), ("qwen", 6144): (13.837, 11.8481, 1.168),
}
RECORD_ARMS = list(PUBLISHED)

FAKE_MEASURE = {  # fake numbers, shaped like measure_mode() output
    "constants": {"LOGITS_BYTES_PER_ELEMENT": 14, "LOGITS_LOSS_BYTES_PER_ELEMENT": 12},
    "repeats": [12.0, 12.0, 12.0], "spread": 0.0,
    "by_vocab": {8192: 12.0, 32768: 12.0, 49152: 12.0, 151936: 12.01010951979781},
}
FAKE_SDPA = {  # fake numbers, shaped like sdpa_mode() output
    "seqs": list(SDPA_SEQS),
    "extra_mb": {"flash": [2.4, 3.7, 4.9, 6.1, 7.3],
                 "mem_efficient": [2.4, 3.5, 4.7, 5.9, 7.1],
                 "math": [383.9, 831.5, 1463.8, 2279.7, 3267.4],
                 "default": ["n/a (RuntimeError)", 3.7, 4.9, 6.1, 7.3]},
}


def record_row(key, seq, index=0, **measured):
    """One record arm, the A10G record's published peak standing in for CUDA."""
    measured.setdefault("real_peak", RECORD_A10G_PEAK[(key, seq)])
    measured.setdefault("resident", 100_000_000)
    measured.setdefault("reserved", measured["real_peak"])
    return make_row(key, seq, index=index, **measured)


def record_rows():
    rows = []
    for key, seqs in RECORD_GRID.items():
        for seq in seqs:
            rows.append(record_row(key, seq, index=len(rows)))
    return rows


_ENV = None


def make_result(rows=None, **kw):
    """A result of ``rows`` (the record's ten by default) under this machine's stack."""
    global _ENV
    if _ENV is None:
        _ENV = environment("synthetic", False, "in one process", ["issue395_second_stack_vram.py"])
    kw.setdefault("measure", copy.deepcopy(FAKE_MEASURE))
    kw.setdefault("sdpa", copy.deepcopy(FAKE_SDPA))
    kw.setdefault("timings", {"total_s": 1.0})
    return Result(environment=dict(_ENV), rows=record_rows() if rows is None else rows, **kw)


@pytest.fixture(scope="module")
def result():
    """The record's ten arms as one result, with --measure and --sdpa sections."""
    return make_result()


@pytest.fixture(scope="module")
def saved(result, tmp_path_factory):
    """``result`` saved as --json writes it."""
    path = tmp_path_factory.mktemp("saved") / "result.json"
    path.write_text(json.dumps(result.to_json(), indent=2, default=str))
    return path


def table_lines(text, model):
    """The data lines of one model's section of the sweep table."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(model + "  ("))
    out = []
    for line in lines[start + 3:]:
        if not line.strip():
            break
        out.append(line)
    return out


# --- the allocator histories the positive control reads (FAKED: hand-built in
# torch.cuda.memory._snapshot()'s plain-dict format; requested sizes) -----------------------

E = 1001  # logits elements; odd, so 2E and 4E are not multiples of 512
BF16, FP32 = 2 * E, 4 * E  # requested sizes: 2002, 4004
BF16_BLOCK, FP32_BLOCK = 2048, 4096  # what the allocator counts
R = 10_000_000  # resident when recording began


def alloc(addr, size):
    return {"action": "alloc", "addr": addr, "size": size}


def free(addr, size, completed=True):
    """A free as recent torch records it: free_requested, then free_completed."""
    events = [{"action": "free_requested", "addr": addr, "size": size}]
    if completed:
        events.append({"action": "free_completed", "addr": addr, "size": size})
    return events


def snapshot(*events):
    trace = []
    for e in events:
        trace.extend(e if isinstance(e, list) else [e])
    return {"device_traces": [trace], "segments": []}


def control_history(bf16_copies: int, fp32_copies: int = 0):
    """A loss step: bf16 logits, fp32 upcast, grad; plus held copies across it."""
    events = [alloc(1, BF16), alloc(2, FP32)]
    events += [alloc(100 + i, BF16) for i in range(bf16_copies)]
    events += [alloc(200 + i, FP32) for i in range(fp32_copies)]
    events += [alloc(3, FP32), free(2, FP32), free(3, FP32), free(1, BF16)]
    events += [free(100 + i, BF16) for i in range(bf16_copies)]
    events += [free(200 + i, FP32) for i in range(fp32_copies)]
    return snapshot(*events)


def control_peak(bf16_copies: int, fp32_copies: int = 0) -> int:
    return R + BF16_BLOCK * (1 + bf16_copies) + FP32_BLOCK * (2 + fp32_copies)


def attributed(copies: int, measured_off: int = 0, fp32_copies: int = 0):
    return attribute_peak(control_history(copies, fp32_copies), R, E,
                            control_peak(copies, fp32_copies) + measured_off)


class FakeDevice:
    """FAKE: cudaMalloc/cudaFree and mem_get_info over a card with ``free`` bytes."""

    def __init__(self, free, total):
        self.free, self.total, self.held = free, total, {}

    def mem_get_info(self):
        return self.free, self.total

    def cudaMalloc(self, ref, size):
        if size.value > self.free:
            return 2  # cudaErrorMemoryAllocation
        ptr = ctypes.cast(ref, ctypes.POINTER(ctypes.c_void_p))
        ptr[0] = 0x1000 + len(self.held)
        self.held[ptr[0]] = size.value
        self.free -= size.value
        return 0

    def cudaFree(self, ptr):
        self.free += self.held.pop(ptr.value)
        return 0


# --- the README's soup.yaml, and what --estimate --config answers for it (the new user's rounds three and
# four, issues 29 and 36, read it in several wings) -------------------------------------------------

#: The README's soup.yaml (Mistral-7B NF4, LoRA r 8 on q_proj, v_proj), every field a parameter.
README_YAML = ("base: {base}\ndata: {{train: data.jsonl, max_length: {seq}}}\n"
               "training:\n  batch_size: {batch}\n  quantization: 4bit\n  stream_layers: true\n"
               "  lora: {{r: {r}, alpha: 16, target_modules: {targets}}}\n{extra}")


def readme_yaml(folder, seq=2048, r=8, targets="[q_proj, v_proj]", extra="", name="soup.yaml", batch=1,
                base="mistralai/Mistral-7B-v0.3"):
    """The README's soup.yaml written to ``folder/name``, with the values given; ``extra`` is appended
    under ``training:`` (each line indented two spaces)."""
    path = folder / name
    path.write_text(README_YAML.format(seq=seq, r=r, targets=targets, extra=extra, batch=batch, base=base))
    return path


def estimate_config_json(capfd, tmp_path, config, *extra):
    """``--estimate --config config --json``: (the JSON it wrote, its stdout); the run must exit 0."""
    out = tmp_path / "e.json"
    code, text, err = main(capfd, ["--estimate", "--config", config, "--json", out, *extra])
    assert code == 0, err
    return json.loads(out.read_text()), text


def verdicts(out):
    """The verdict lines: the lines under the first that name a card and say fits or not."""
    import re

    return [ln.strip() for ln in out.splitlines()[1:] if re.match(r"  \S+: .*(fits|no room)", ln)]


def file_lines(text):
    """--estimate --config's lines on the file's own keys (how each is read)."""
    return [line for line in text.splitlines() if line.startswith("  from the file: ")]


#: A streamed soup.yaml of SmolLM2's shape at 512 on a base given by name (a family key, a folder, a hub id).
BASE_YAML = """base: {base}
task: sft
data: {{train: data.jsonl, max_length: 512}}
training:
  batch_size: 1
  quantization: none
  stream_layers: true
  lora: {{r: 8, alpha: 16, target_modules: [q_proj, v_proj]}}
"""


def edited_copy(tmp_path, source, edit):
    """A saved result's JSON as a user edited it by hand: ``edit`` applied to its data, written to saved.json."""
    data = json.loads(Path(source).read_text())
    edit(data)
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(data))
    return path
