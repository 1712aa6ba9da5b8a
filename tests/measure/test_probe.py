"""issue395.measure.probe (issue 51 item 5, Soup's #840): Soup's measured-fit probe, training.stream_vram_probe, on
the map's arms of every task. SFT's is Soup's own (the key set; Soup's setup runs its probe and decides the run on
it); for DPO, ORPO, SimPO and KTO, which Soup's schema refuses the key for, Soup's probe function is called by this
tool on the task's streamed model after Soup's setup. Soup's loader, setups, wrappers, the _STREAM_ROWS_PER_EXAMPLE
each declares and decide_measured_fit are the real ones here. Faked, because they need a GPU: Soup's probe function
itself (measure_step_peak_bytes: one CUDA step and its CUDA peak counters), the measured step (h.real_peak), the
free memory Soup's gate reads (torch.cuda.mem_get_info), and Soup's gate being on CUDA (its _stream_budget_lines'
on_cuda: off CUDA Soup never builds the probe's plan)."""

from __future__ import annotations

import importlib
import json
import sys

import pytest
from conftest import h, main, one_error_line

from issue395.errors import UsageError
from issue395.measure.measurement import Measurement, failure_of
from issue395.measure.probe import NOT_RUN, call_soup_probe, probe_config, probe_missing, watch_soup_probe
from issue395.model.registry import SHAPES, stream_mode, stream_mode_keys
from issue395.results.extras import SoupProbe
from issue395.results.row import Row
from issue395.tasks import TASKS, task

GB = 10**9
#: What the fakes report: the free memory Soup's gate reads, the probe's peak per row, the measured step's peak.
FREE, PROBE_PER_ROW, REAL = 1 * GB, 300_000_000, 100_000_000


def soup_rows_per_example(name: str) -> int:
    """The rows Soup's own wrapper for the task declares per example (its setup's _STREAM_ROWS_PER_EXAMPLE)."""
    module, cls = task(name).wrapper
    return getattr(importlib.import_module(module), cls)._STREAM_ROWS_PER_EXAMPLE


class FakeProbe:
    """Stands in for Soup's measure_step_peak_bytes (a CUDA step and its peak counters): Soup's own StepPeak, at
    PROBE_PER_ROW a row, and who called it with what."""

    def __init__(self):
        self.calls = []

    def __call__(self, model, *, rows, seq_len, vocab_size, device="cuda"):
        from soup_cli.utils.layer_stream_runtime import StepPeak

        self.calls.append({"caller": sys._getframe(2).f_code.co_name, "rows": rows, "seq": seq_len,
                           "vocab": vocab_size, "device": device, "lora": any("lora_" in n for n, _ in
                                                                               model.named_parameters())})
        return StepPeak(peak_bytes=rows * PROBE_PER_ROW, reserved_bytes=rows * PROBE_PER_ROW + 1, seconds=0.25,
                        rows=rows, seq_len=seq_len)


class FakeStep:
    """Stands in for h.real_peak (the CUDA step): REAL, and how many probes had run before it."""

    def __init__(self, probe: FakeProbe):
        self.probe, self.probes_before = probe, []

    def __call__(self, trainer, snapshot=False, steps=1):
        self.probes_before.append(len(self.probe.calls))
        return {"real_peak": REAL, "resident": 1234, "reserved": REAL, "step_s": 0.01, "snapshot": None}


@pytest.fixture
def soup_on_a_card(monkeypatch):
    """Soup's setup as on a CUDA card of FREE free bytes, its probe function and the step faked (the module's
    docstring says why each); returns (probe, step)."""
    import torch
    from soup_cli.trainer.stream_setup import StreamingSetupMixin
    from soup_cli.utils import layer_stream_runtime

    budget = StreamingSetupMixin._stream_budget_lines
    monkeypatch.setattr(StreamingSetupMixin, "_stream_budget_lines",
                        lambda self, *a, **kw: budget(self, *a, **dict(kw, on_cuda=True)))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (FREE, 80 * GB))
    probe = FakeProbe()
    monkeypatch.setattr(layer_stream_runtime, "measure_step_peak_bytes", probe)
    monkeypatch.setattr(h, "STEP_DEVICE", "cpu")
    step = FakeStep(probe)
    monkeypatch.setattr(h, "real_peak", step)
    return probe, step


def test_probe_keys_are_a_streamed_runs_mode_after_the_family():
    """--stream-vram-probe off,on adds a +probe key per streamed key (training.stream_vram_probe true); a resident
    run takes none (Soup's schema refuses the key without stream_layers), and a value outside off,on is refused."""
    keys = stream_mode_keys(["smol"], ["fused"], [None], ["on"], ("on", "off"), ("off",), ("off", "on"))
    assert keys == ("smol", "smol+probe", "smol+resident")
    assert stream_mode("smol+probe") == ("smol", {"stream_vram_probe": True})
    assert "stream_vram_probe" not in stream_mode("smol")[1] and "stream_vram_probe" not in stream_mode("smol+resident")[1]
    with pytest.raises(UsageError, match="add --stream-layers on"):
        stream_mode_keys(["smol"], ["fused"], [None], ["on"], ("off",), ("off",), ("on",))
    with pytest.raises(UsageError, match="--stream-vram-probe"):
        stream_mode_keys(["smol"], ["fused"], [None], ["on"], ("on",), ("off",), ("maybe",))


def test_the_probe_axis_off_the_map_or_on_a_soup_without_it_is_one_line(capfd, monkeypatch):
    """--stream-vram-probe is the map's axis: alone it is one line; so is a Soup with no probe to run (one line
    naming the installed release: faked here by taking Soup's probe function away)."""
    one_error_line(*main(capfd, ["--stream-vram-probe", "on", "--dry-run"]), "--stream-vram-probe", "--map")
    assert probe_missing() is None  # 0.73.3 and 0.77.0 both have it
    from soup_cli.utils import layer_stream_runtime

    monkeypatch.delattr(layer_stream_runtime, "measure_step_peak_bytes")
    one_error_line(*main(capfd, ["--map", "--families", "smol", "--stream-vram-probe", "on", "--dry-run"]),
                   "has no training.stream_vram_probe")


def test_soups_loader_takes_the_key_for_sft_and_this_tool_calls_the_probe_where_it_refuses_it():
    """Soup's own loader decides who probes: it takes training.stream_vram_probe for SFT (SOUP, the key in the
    config Soup's setup reads) and refuses it for every preference task, whose config is loaded without it (CALLED);
    an arm that does not ask gets no record; Soup's deferral ceiling is read from Soup."""
    from soup_cli.config.loader import load_config_from_string
    from soup_cli.trainer import stream_setup

    for name in TASKS:
        text = h.soup_config_yaml("x/base", "/tmp/d.jsonl", "/tmp/out", 64, task(name).min_batch, stream=(("stream_vram_probe", True),),
                                  task_name=name)
        config, record = probe_config(load_config_from_string, text)
        want = SoupProbe.SOUP if name == "sft" else SoupProbe.CALLED
        assert (record.path, record.outcome, record.ceiling) == (want, NOT_RUN, stream_setup._PROBE_DEFERRAL_CEILING)
        assert config.training.stream_vram_probe is (name == "sft") and config.task == name
    plain = h.soup_config_yaml("x/base", "/tmp/d.jsonl", "/tmp/out", 64, 1, task_name="dpo")
    assert probe_config(load_config_from_string, plain)[1] is None


@pytest.mark.slow
@pytest.mark.release
def test_a_probe_map_of_the_five_tasks_carries_soups_probe_and_verdict_beside_the_real_step(
        capfd, soup_on_a_card, cache_dir, tmp_path):
    """The map of SmolLM2 at seq 64 batch 2 (KTO's smallest) over the five tasks with the probe on: SFT's probe is called by Soup's
    own setup (_run_stream_vram_probe), the four others' by this tool after Soup's setup, each on the streamed LoRA
    model at batch x the task's own _STREAM_ROWS_PER_EXAMPLE rows, seq and the family's vocab, and before the measured
    step; each row's record holds the probe's peak, the free memory Soup's gate read and decide_measured_fit's verdict
    (a DPO probe of 4 rows, 1.2 GB, against 1 GB free refuses a step whose real peak, 0.1 GB, fits); the JSON reads back to
    the same rows and the per-task table says it."""
    from soup_cli.utils.layer_stream import decide_measured_fit

    probe, step = soup_on_a_card
    out_json = tmp_path / "probe.json"
    code, out, err = main(capfd, ["--map", "--families", "smol", "--stream-vram-probe", "on", "--task",
                                  ",".join(TASKS), "--quant", "none", "--seq", "64", "--batch", "2",
                                  "--cache-dir", cache_dir, "--json", out_json])
    assert code == 0, err
    assert [(c["caller"], c["rows"], c["seq"], c["vocab"], c["device"], c["lora"]) for c in probe.calls] == [
        ("_run_stream_vram_probe" if name == "sft" else "call_soup_probe", 2 * soup_rows_per_example(name), 64,
         SHAPES["smol"].vocab, "cpu", True) for name in TASKS]
    assert step.probes_before == [1, 2, 3, 4, 5], "each arm's probe ran before its measured step, no margin re-run"
    saved = json.loads(out_json.read_text())["rows"]
    for r, name in zip(saved, TASKS):
        p, rows = r["soup_probe"], 2 * soup_rows_per_example(name)
        fit = decide_measured_fit(measured_bytes=rows * PROBE_PER_ROW, predicted_bytes=r["soup_predicted"],
                                  available_bytes=FREE)
        assert (r["model_key"], r.get("task", "sft"), r["real_peak"]) == ("smol+probe", name, REAL)
        assert p["path"] == ("soup" if name == "sft" else "called") and p["outcome"] is None
        assert (p["peak"], p["rows"], p["seq"], p["available"], p["admits"]) == (
            rows * PROBE_PER_ROW, rows, 64, FREE, fit.fits)
        assert Row.from_json(r).soup_probe == SoupProbe.from_json(p, "soup_probe")
    assert [r["soup_probe"]["admits"] for r in saved] == [True, False, False, False, True]
    table = out[out.index("Soup's stream_vram_probe per task"):]
    assert "SmolLM2-135M [probe] dpo" in table and "refuses, real peak fits" in table and "this tool" in table
    assert f"{PROBE_PER_ROW * 2 / REAL:.3f}x" in table


@pytest.mark.slow
@pytest.mark.release
def test_soups_own_probe_refusing_an_sft_arm_is_refused_with_its_peak_and_no_step(
        capfd, soup_on_a_card, monkeypatch, cache_dir, tmp_path):
    """SFT's probe is Soup's gate: a probe past the free memory Soup read (0.3 GB against 0.25 GB, faked) is Soup's
    refusal, the row REFUSED with Soup's measured reason and the probe's peak and verdict kept, and no step run."""
    import torch

    probe, step = soup_on_a_card
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (FREE // 4, 80 * GB))
    out_json = tmp_path / "refused.json"
    code, out, err = main(capfd, ["--map", "--families", "smol", "--stream-vram-probe", "on", "--quant", "none",
                                  "--seq", "64", "--batch", "1", "--cache-dir", cache_dir, "--json", out_json])
    row = json.loads(out_json.read_text())["rows"][0]
    assert row["failure"] == "REFUSED" and "MEASURED" in row["error"] and step.probes_before == []
    assert (row["soup_probe"]["peak"], row["soup_probe"]["available"], row["soup_probe"]["admits"]) == (
        PROBE_PER_ROW, FREE // 4, False)


def test_a_refusal_by_soups_own_probe_is_refused_and_one_by_the_called_probe_gates_nothing(monkeypatch):
    """The watcher on Soup's real decide_measured_fit: on Soup's own path its verdict is the arm's gate (an error
    starting with its reason is REFUSED, as is its probe running out of memory at setup); on the called path it is recorded and leaves Soup's gate as it was. Off
    CUDA the called probe is Soup's own function, which returns None: the record stays "not run"."""
    from soup_cli.utils import layer_stream

    for path in SoupProbe.PATHS:
        m = Measurement(soup_probe=SoupProbe(path, outcome=NOT_RUN))
        with watch_soup_probe(m):
            fit = layer_stream.decide_measured_fit(measured_bytes=2 * GB, predicted_bytes=GB, available_bytes=GB)
        assert (m.soup_probe.available, m.soup_probe.admits) == (GB, False)
        m.fail(ValueError(fit.reason))
        assert failure_of(m)["failure"] == ("REFUSED" if path == SoupProbe.SOUP else "FAILED")

    oom = Measurement(soup_probe=SoupProbe(SoupProbe.SOUP, outcome="oom"))  # Soup's probe ran out at setup
    oom.fail(ValueError("a streaming step at batch 1 x seq 64 ran out of VRAM while being measured"))
    assert failure_of(oom)["failure"] == "REFUSED"

    class Wrapper:  # what call_soup_probe reads of Soup's wrapper after its setup: its streamed model, device, rows
        _STREAM_ROWS_PER_EXAMPLE, device = 2, "cpu"
        model = type("M", (), {"config": type("C", (), {"vocab_size": 100})()})()

    config = type("Cfg", (), {"training": type("T", (), {"batch_size": 1})(), "data": type("D", (), {"max_length": 64})()})()
    m = Measurement(soup_probe=SoupProbe(SoupProbe.CALLED, outcome=NOT_RUN))
    with watch_soup_probe(m):
        call_soup_probe(Wrapper(), config, m)
    assert m.soup_probe.outcome == NOT_RUN and m.soup_probe.peak is None and m.soup_probe.rows == 2
