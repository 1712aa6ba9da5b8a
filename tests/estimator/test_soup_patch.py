"""issue395.estimator.soup_patch and soup_gate: --soup-patch's diff applied with the real `patch -p1` to a
copy of the installed soup_cli (and of every release unpacked under ISSUE395_RELEASE_SOURCES); the module it
adds imports only the standard library (loaded in an isolated interpreter with neither the tool nor soup_cli
on its path); the PATCHED soup_cli's own number, by its own corrected_peak module, against the real CUDA
peak of every committed H200 arm of every task of the installed release (the peaks are the record's, read
from results/; nothing is faked); the patched setup's own _stream_budget_lines, run here on CPU on Soup's own
config (its loader) and transformers' own config of the model, computes that same number; the patched gate
on the committed --find-max probes' free memory. Issue 51 item 6, the resident gate: the patched
commands/train.py's own _hardware_fit_preflight on Soup's loaded config of small resident soup.yaml files,
beside the stock one, on a faked CUDA card (gpu_info's total; torch's free memory where a test says so),
and the patched `soup train` CLI gating then training a resident run on CPU, and running it up to
detect_device on expandable segments (the allocator the gate's need holds on). A CUDA step cannot run here:
the streamed gate's GPU proof was bench/gpu-soup-patch.sh (git history), the resident one's
results/resident-patch-h100-soup0.77.0-96b7b97 (bench/gpu-next.sh resident-patch, git history)."""

from __future__ import annotations

import importlib.util
import inspect
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from issue395.estimator.estimate import estimate
from issue395.estimator.releases import PATCH_MODULE, installed_release, soup_dir, wheel_sources
from issue395.estimator.soup_gate import gate_kwargs
from issue395.estimator.soup_number import patched, patched_preflight, soup_preflight_from_config
from issue395.estimator.soup_patch import is_importable_stdlib_only, patched_files, soup_patch
from issue395.model.registry import config_json, stream_mode


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHECKS = _bench("estimator_checks")
TASK_ARMS = CHECKS.tasks_arms()
SFT_ARMS = [dict(a, task="sft") for a in CHECKS.load_arms()]
ARMS = [a for a in TASK_ARMS + SFT_ARMS if a["release"] == installed_release()]
VERSION = "test"


def _apply(src: Path, into: Path, diff: str, dry: bool = False) -> subprocess.CompletedProcess:
    """``patch -p1`` in a folder holding a copy of ``src`` as soup_cli/ (site-packages' layout)."""
    shutil.copytree(src, into / "soup_cli")
    for meta in src.parent.glob("soup_cli-*.dist-info"):
        shutil.copytree(meta, into / meta.name)
    return subprocess.run(["patch", "-p1"] + (["--dry-run"] if dry else []), input=diff, text=True, cwd=into,
                          capture_output=True)


@pytest.fixture(scope="module")
def patched_site(tmp_path_factory) -> Path:
    """A copy of the installed soup_cli and its dist-info, patched by --soup-patch's own diff."""
    site = tmp_path_factory.mktemp("site")
    done = _apply(soup_dir(), site, soup_patch(soup_dir(), VERSION))
    assert done.returncode == 0, done.stdout + done.stderr
    return site


def test_the_patch_applies_to_the_installed_release_with_patch_p1(tmp_path):
    diff = soup_patch(version=VERSION)
    done = _apply(soup_dir(), tmp_path, diff, dry=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checking file soup_cli/utils/corrected_peak.py" in done.stdout
    assert "checking file soup_cli/trainer/stream_setup.py" in done.stdout
    assert diff.startswith("--- /dev/null\n+++ b/soup_cli/" + PATCH_MODULE)


@pytest.mark.parametrize("release", sorted(wheel_sources()) or ["(none unpacked)"])
def test_each_unpacked_release_takes_its_own_patch(tmp_path, release):
    if release not in wheel_sources():
        pytest.skip("no release unpacked under ISSUE395_RELEASE_SOURCES (.ci/run unpacks 0.74.0 to 0.76.1)")
    src = wheel_sources()[release]
    done = _apply(src, tmp_path, soup_patch(src, VERSION), dry=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_patched_folder_reads_as_patched_and_is_not_patched_twice(patched_site):
    assert patched(patched_site / "soup_cli") == f"issue395 corrected pre-flight (issue395 {VERSION})"
    assert patched(soup_dir()) is None
    with pytest.raises(Exception, match="already patched"):
        patched_files(patched_site / "soup_cli")


def test_the_module_imports_only_the_standard_library_and_runs_alone(patched_site):
    path = patched_site / "soup_cli" / PATCH_MODULE
    text = path.read_text()
    assert is_importable_stdlib_only(text)
    assert "issue395" not in {line.split()[1].split(".")[0] for line in text.splitlines()
                              if line.startswith(("import ", "from "))}
    # -I: no user site, no PYTHONPATH, no current folder: neither the tool nor soup_cli can be found
    probe = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('cp', sys.argv[1]); "
             "m = importlib.util.module_from_spec(s); sys.modules['cp'] = m; s.loader.exec_module(m); "
             "print(sorted(k for k in sys.modules if k.split('.')[0] in ('issue395', 'soup_cli', 'torch')))")
    done = subprocess.run([sys.executable, "-I", "-c", probe, str(path)], capture_output=True, text=True,
                          cwd=str(patched_site.parent))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_module_is_generated_from_the_estimators_source_not_a_copy(patched_site):
    """Every function of the estimate's own module stands in the bundle as its source has it (but
    estimate_key: a map key's estimate, which Soup's setup never asks)."""
    text = (patched_site / "soup_cli" / PATCH_MODULE).read_text()
    import ast

    source = (ROOT / "issue395" / "estimator" / "estimate.py").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name != "estimate_key":
            assert ast.get_source_segment(source, node) in text, node.name


def test_every_keyword_of_the_estimate_is_fed_from_soups_setup_or_is_the_tools_own():
    """A keyword the estimate gains (issue 34's) must be read from Soup's config in soup_gate.gate_kwargs,
    or it would be left at its default inside Soup: named here."""
    from types import SimpleNamespace as S

    tcfg = S(quantization="none", batch_size=1, lora=S(target_modules=["q_proj"], r=8, dropout=0.05),
             optimizer="adamw_torch", stream_buffers=2)
    _, fed = gate_kwargs(S(task="sft", data=S(max_length=512)), tcfg, config_json("qwen"))
    tools_own = {"config", "release", "allowance", "workspace", "transformers", "dispatch", "adapter"}  # a saved
    # row's stacks; inside Soup, the installed release and transformers are the ones it runs, and preflight reads the
    # card's dispatch; ``adapter`` is the resident estimate's (Soup's gate runs the streamed step, its dtype its own)
    assert set(inspect.signature(estimate).parameters) - tools_own - set(fed) == set()


def _arm_call(arm: dict) -> tuple[dict, dict]:
    family, stream = stream_mode(arm["family"])
    targets = tuple(arm.get("targets") or ()) or None
    from issue395.estimator.arch import arch_from_config, protocol_targets

    config = config_json(family)
    return config, dict(quant=arm["quant"], seq=arm["seq"], batch=arm["batch"], lora_r=8, stream=stream,
                        task=arm["task"], targets=targets or protocol_targets(arch_from_config(config)))


@pytest.mark.parametrize("arm", ARMS, ids=lambda a: f"{a['task']}-{a['family']}-{a['quant']}-{a['seq']}x{a['batch']}")
def test_the_patched_number_is_at_least_the_real_peak_and_at_most_1_05x_on_every_committed_arm(patched_site, arm):
    """By the patched soup_cli's own corrected_peak.preflight, called as its setup calls it, on the arm's
    run: one optimizer step (what the arm measured)."""
    config, kw = _arm_call(arm)
    record = patched_preflight(patched_site / "soup_cli", config, optimizer="adamw_torch",
                               formula=arm["soup_predicted"], steps=1, **kw)
    assert record["refused"] is None
    assert arm["real_peak"] <= record["peak"] <= 1.05 * arm["real_peak"], record["peak"] / arm["real_peak"]
    assert record["gate_bytes"] > record["peak"]  # the gate compares what must be free, not the allocated peak


def test_the_patched_gate_on_the_committed_find_max_card_admits_the_limit_or_one_step_below(patched_site,
                                                                                            monkeypatch):
    """Qwen2.5-0.5B DPO on an emulated 12 GB card, 3 steps a probe (results/findmax-kimi-*): 1856 completed,
    1920 raised OOM. The free memory is the one Soup's own gate printed in those probes (11.36 GB)."""
    found = json.loads(next(ROOT.glob("results/findmax-kimi-anatomy-*/find-max-qwen-dpo-12GB.json")).read_text())
    if installed_release() != "0.77.0":
        pytest.skip("the probes ran soup-cli 0.77.0")
    monkeypatch.setenv("ISSUE395_SOUP_SOURCE", str(patched_site / "soup_cli"))
    free = max(p["driver_free_gb"] for p in found["measured"]["probes"]) * 1e9
    limit, above = found["measured"]["limit"], found["measured"]["oom_above"]
    admitted = [seq for seq in range(limit - 4 * 64, above + 4 * 64, 64)
                if soup_preflight_from_config(config_json("qwen"), quant="none", seq=seq, batch=1,
                                              targets=("q_proj", "v_proj"), lora_r=8, task="dpo")[0] <= free]
    assert max(admitted) in (limit, limit - 64)


SETUP = r"""
import inspect, json, sys, tempfile
from pathlib import Path
from types import SimpleNamespace
from transformers import AutoConfig
from soup_cli.config.loader import load_config_from_string
import importlib
out = []
for arm in json.loads(sys.argv[1]):
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(arm["config"]))
    cfg = load_config_from_string(arm["yaml"])
    module, name = arm["wrapper"]
    cls = getattr(importlib.import_module(module), name)
    self = cls.__new__(cls)
    self.device = "cpu"
    fn = cls._stream_budget_lines
    kw = dict(model_config=AutoConfig.from_pretrained(folder), layer_bytes=1, embed_bytes=1,
              index=SimpleNamespace(n_layers=1, quant_specs={}, total_params=0, dtype="bfloat16", expert_layout="",
                                    expert_shapes=None), on_cuda=False, large_layer_bytes=0, target_modules=None)
    lines, _ = fn(self, cfg, cfg.training, **{k: v for k, v in kw.items() if k in inspect.signature(fn).parameters})
    out.append({"record": {k: v for k, v in self._corrected_preflight.items() if k != "terms"}, "lines": list(lines),
                "accumulation": cfg.training.gradient_accumulation_steps})
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.release
def test_the_patched_setup_itself_gates_on_the_corrected_number_on_cpu(patched_site):
    """Soup's own _stream_budget_lines (patched), on Soup's loader's config and transformers' AutoConfig of
    the model, in a process whose soup_cli is the patched copy: its gate's number is the one this tool
    computes for the patched release (at the file's accumulation, Soup's default 4: its held gradients
    charged), and its panel prints the corrected peak beside Soup's formula."""
    from issue395.tasks import TASKS

    cases = [("qwen", "dpo", "none", 1856, 1, ["q_proj", "v_proj"], 8),
             ("phi3-mini", "sft", "nf4", 3712, 1, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], 64),
             ("gemma2-2b", "kto", "none", 1024, 2, "all-linear", 16)]
    arms = []
    for family, task, quant, seq, batch, targets, r in cases:
        yaml = json.dumps({"base": "unused", "task": task, "data": {"train": "train.jsonl", "max_length": seq},
                           "training": {"batch_size": batch, "quantization": {"none": "none", "nf4": "4bit"}[quant],
                                        "stream_layers": True, "lora": {"r": r, "alpha": 2 * r,
                                                                        "target_modules": targets}}})
        arms.append({"config": config_json(family), "yaml": yaml, "wrapper": list(TASKS[task].wrapper)})
    env = {"PYTHONPATH": str(patched_site), "PATH": "/usr/bin:/bin", "HOME": str(patched_site)}
    done = subprocess.run([sys.executable, "-c", SETUP, json.dumps(arms)], capture_output=True, text=True, env=env,
                          cwd=str(patched_site), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for (family, task, quant, seq, batch, targets, r), g in zip(cases, got):
        record = patched_preflight(patched_site / "soup_cli", config_json(family), quant=quant, seq=seq, batch=batch,
                                   targets=targets, lora_r=r, stream={}, task=task, optimizer="adamw_torch",
                                   formula=g["record"]["formula"], accumulation=g["accumulation"])
        assert g["record"]["refused"] is None, g["record"]
        assert g["record"]["gate_bytes"] == record["gate_bytes"] and g["record"]["peak"] == record["peak"], family
        assert any(line.startswith("  peak VRAM    ~" + f"{record['gate_bytes'] / 1e9:.2f}") for line in g["lines"])
        assert any("corrected    peak" in line and "Soup's formula" in line for line in g["lines"]), g["lines"]


def test_estimate_sets_the_patched_gate_beside_the_stock_formula(patched_site, monkeypatch, capfd):
    """--estimate with the patched soup_cli as the installed one (ISSUE395_SOUP_SOURCE, as a patched install
    reads): Soup's own number is its patched gate's, its stock formula beside it, and the longest seq Soup's
    gate admits is this tool's longest that fits (both the corrected estimate); unpatched it is not."""
    from conftest import main

    argv = ["--estimate", "--config", str(ROOT / "bench" / "find-max" / "qwen-dpo.yaml"), "--card", "12GB"]
    code, stock, _ = main(capfd, argv)
    monkeypatch.setenv("ISSUE395_SOUP_SOURCE", str(patched_site / "soup_cli"))
    code2, out, err = main(capfd, argv)
    assert code == code2 == 0, err
    assert "Soup's own pre-flight GB (patched: its gate's number)" in out and "Soup's formula GB (stock" in out
    assert "Soup's formula" not in stock
    verdict = next(line for line in out.splitlines() if line.startswith("  12GB:"))
    fits, admits = (int(verdict.split(word)[1].split(";")[0].split()[0]) for word in
                    ("longest seq that fits ", "longest seq it admits "))
    assert admits == fits
    assert "longest seq it admits 1792" not in next(line for line in stock.splitlines() if line.startswith("  12GB:"))


@pytest.mark.parametrize("setting", [("bnb_4bit_use_double_quant", False),
                                     ("stream_nf4_scale_cache", True), ("moe_lora", True), ("optimizer", "adafactor"),
                                     ("quantization", "8bit"), ("stream_recompute", "auto"), ("use_galore", True),
                                     ("activation_offloading", "cpu"), ("auto_mixed_precision", True)])
def test_a_setting_the_estimator_does_not_model_keeps_soups_formula_and_says_so(setting):
    """The patched streamed gate gives no number of another run: a setting the streamed estimate does not model
    (soup_gate.streamed_unmodelled: single quantisation and the scale cache under NF4, MoE LoRA, GaLore, activation
    offloading, auto mixed precision, which --estimate says NOT modelled beside the run without it), a bounded
    optimizer, another quantization or recompute mode keeps Soup's formula, and its line names the setting (a
    boolean as a soup.yaml writes it)."""
    from types import SimpleNamespace as S

    from issue395.estimator.soup_gate import preflight

    lora = S(target_modules=["q_proj", "v_proj"], r=8, dropout=0.05)
    tcfg = S(quantization="4bit", batch_size=1, lora=lora, optimizer="adamw_torch", stream_buffers=2)
    cfg = S(task="sft", data=S(max_length=512))
    assert preflight(cfg, tcfg, config_json("qwen"), formula=123)["gate_bytes"] is not None
    name, value = setting
    setattr(lora if name.startswith("lora.") else tcfg, name.split(".")[-1], value)
    record = preflight(cfg, tcfg, config_json("qwen"), formula=123)
    assert record["gate_bytes"] is None and record["formula"] == 123
    assert "the gate keeps Soup's formula" in record["line"] and name in record["line"]
    assert {True: "true", False: "false"}.get(value, value) in record["line"]


def test_the_patched_gate_reads_the_runs_stream_buffers_off_soups_config():
    """Issue 50 item 4: training.stream_buffers, a run setting (issue395.model.arm.SETTINGS), reaches the patched
    gate from Soup's own config: at 3 its estimate is the estimate at buffers 3, not Soup's formula kept."""
    from types import SimpleNamespace as S

    from issue395.estimator.soup_gate import preflight

    lora = S(target_modules=["q_proj", "v_proj"], r=8, dropout=0.05)
    cfg = S(task="sft", data=S(max_length=512))
    peaks = [preflight(cfg, S(quantization="4bit", batch_size=1, lora=lora, optimizer="adamw_torch", stream_buffers=n),
                       config_json("qwen"), formula=123)["peak"] for n in (2, 3)]
    want = [estimate(config_json("qwen"), quant="nf4", seq=512, steps=2, buffers=n, soup=False).corrected_predicted
            for n in (2, 3)]
    assert peaks == want and peaks[1] > peaks[0]


def test_both_patched_gates_read_the_lora_dropout_off_soups_config(patched_site):
    """Issue 50 item 1: training.lora.dropout is modelled (no mask at p 0), so neither gate keeps Soup's formula for
    it: each reads it off Soup's config (model.arm.lora_dropout, as a --config file's Adapter does), in the bundled
    module too. Streamed (Mistral-7B NF4 2048x1, the layer phase binding): at 0 the estimate at lora_dropout 0, at
    0.1 Soup's default's (masks and output alike). Resident (Qwen2.5 1024x1, Soup's loader's config): less at 0,
    as the tool's own gate computes it."""
    from types import SimpleNamespace as S

    from soup_cli.config.loader import load_config_from_string

    from issue395.estimator.soup_gate import resident_kwargs, resident_preflight
    from issue395.estimator.soup_number import _patched_module

    path = patched_site / "soup_cli" / PATCH_MODULE
    module = _patched_module(path, path.stat().st_mtime)
    mistral, cfg = config_json("mistral-7b"), S(task="sft", data=S(max_length=2048))

    def tcfg(p):
        return S(quantization="4bit", batch_size=1, lora=S(target_modules=["q_proj", "v_proj"], r=8, dropout=p),
                 optimizer="adamw_torch", stream_buffers=2)

    streamed = {p: module.preflight(cfg, tcfg(p), mistral) for p in (0.05, 0.1, 0.0)}
    want = {p: estimate(mistral, quant="nf4", seq=2048, steps=2, lora_dropout=p, soup=False) for p in (0.05, 0.0)}
    assert all(r["refused"] is None for r in streamed.values())
    assert streamed[0.05]["peak"] == streamed[0.1]["peak"] == want[0.05].corrected_predicted
    assert streamed[0.0]["peak"] == want[0.0].corrected_predicted < want[0.05].corrected_predicted
    lora = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    files = {p: load_config_from_string(_resident_yaml(Path("Qwen2.5-0.5B"), 1024, 1, lora=dict(lora, dropout=p)))
             for p in (0.05, 0.0)}
    assert resident_kwargs(files[0.0], config_json("qwen"))[1]["lora_dropout"] == 0.0
    mine = {p: resident_preflight(f, config_json("qwen"), free=None, total=10**11)["peak"] for p, f in files.items()}
    theirs = {p: module.resident_preflight(f, config_json("qwen"), free=None, total=10**11)["peak"]
              for p, f in files.items()}
    assert theirs == mine and mine[0.0] < mine[0.05]


def test_single_quantisation_keeps_soups_formula_in_the_patched_streamed_gate_only_under_nf4(patched_site):
    """bnb_4bit_use_double_quant is bitsandbytes' 4-bit setting (soup_gate.ASSUMED, read once by the
    patched gate, --estimate's key lines and the measured arm): false on a bf16 streamed file leaves the run
    modelled, so the patched streamed gate (the bundled module, on Soup's own loader's config) gives its corrected
    number, the one of the same file without the key; it kept Soup's formula before. On the NF4 file it keeps
    Soup's formula and its line names the setting."""
    from soup_cli.config.loader import load_config_from_string

    from issue395.estimator.soup_number import _patched_module

    path = patched_site / "soup_cli" / PATCH_MODULE
    module = _patched_module(path, path.stat().st_mtime)

    def gate(quant: str, **training) -> dict:
        cfg = load_config_from_string(json.dumps({
            "base": "unused", "data": {"train": "train.jsonl", "max_length": 1024},
            "training": {"batch_size": 1, "quantization": quant, "stream_layers": True,
                         "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}, **training}}))
        return module.preflight(cfg, cfg.training, config_json("qwen"), formula=123)

    bf16, plain = gate("none", bnb_4bit_use_double_quant=False), gate("none")
    assert bf16["refused"] is None and bf16["gate_bytes"] is not None
    assert (bf16["peak"], bf16["gate_bytes"]) == (plain["peak"], plain["gate_bytes"])
    nf4 = gate("4bit", bnb_4bit_use_double_quant=False)
    assert gate("4bit")["refused"] is None
    assert nf4["gate_bytes"] is None and nf4["formula"] == 123
    assert "training.bnb_4bit_use_double_quant false is not modelled" in nf4["line"]
    assert "the gate keeps Soup's formula" in nf4["line"]


def test_a_config_the_estimator_cannot_read_keeps_soups_formula_not_a_crash_of_soups_setup():
    from types import SimpleNamespace as S

    from issue395.estimator.soup_gate import preflight

    tcfg = S(quantization="none", batch_size=1, lora=S(target_modules=["q_proj"], r=8, dropout=0.05),
             optimizer="adamw_torch", stream_buffers=2)
    record = preflight(S(task="sft", data=S(max_length=512)), tcfg, {"model_type": "qwen2"}, formula=7)
    assert record["gate_bytes"] is None and record["formula"] == 7 and "hidden_size" in record["refused"]


# Issue 51 item 6: the resident gate (commands/train.py's _hardware_fit_preflight), patched.

RESIDENT_GATE = r"""
import io, json, sys
import typer
from rich.console import Console
from soup_cli.config.loader import load_config_from_string
import soup_cli.commands.train as train
out = []
for case in json.loads(sys.argv[1]):
    if case.get("free") is not None:  # the CUDA card is faked: the free memory torch reads on it
        import torch
        torch.cuda.mem_get_info = lambda device=None, _f=case["free"], _t=case["total"]: (_f, _t)
    buf = io.StringIO()
    train.console = Console(file=buf, width=1000, color_system=None)
    try:  # gpu_info is faked too: the card's total as Soup's get_gpu_info reports it
        train._hardware_fit_preflight(load_config_from_string(case["yaml"]), {"memory_total_bytes": case["total"]},
                                      allow_oom_attempt=case["allow"])
        code = None
    except typer.Exit as exc:
        code = exc.exit_code
    out.append({"exit": code, "console": buf.getvalue()})
print(json.dumps(out))
"""


def _resident_yaml(base: Path, seq: int, batch: int, **training) -> str:
    """A small resident soup.yaml (stream_layers false; Soup's defaults but for the run's own keys)."""
    import yaml

    return yaml.safe_dump({"base": str(base), "task": "sft", "data": {"train": "train.jsonl", "max_length": seq},
                           "training": {"batch_size": batch, "quantization": "none", "stream_layers": False,
                                        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
                                        **training}})


def _base(root: Path, name: str, family: str) -> Path:
    """A local base folder holding the family's config.json (named as its hub id names it, which Soup's
    model_size_from_name reads where no weights are local)."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_json(family)))
    return folder


@pytest.fixture(scope="module")
def resident_gate(patched_site, tmp_path_factory):
    """The patched soup_cli's own _hardware_fit_preflight, in a process whose soup_cli is the patched copy, on
    Soup's loader's config of each case's soup.yaml; the CUDA card is faked (gpu_info's total, and where a
    case gives it, torch's free-memory reading); on CPU torch reads no free memory, so those cases compare
    with the card's total less the context bound. Cases by name -> (case, outcome)."""
    from issue395.estimator.cards import CARDS, CONTEXT_BOUND_BYTES
    from issue395.estimator.soup_gate import resident_preflight

    root = tmp_path_factory.mktemp("resident")
    qwen, moe = _base(root, "Qwen2.5-0.5B", "qwen"), _base(root, "Qwen3.5-35B-A3B", "qwen3.5-moe")
    big, small = _resident_yaml(qwen, 4096, 4), _resident_yaml(qwen, 1024, 1)
    from soup_cli.config.loader import load_config_from_string

    edge = resident_preflight(load_config_from_string(small), config_json("qwen"), free=None,
                              total=1)["gate_bytes"] + CONTEXT_BOUND_BYTES  # the smallest card it fits on
    card = CARDS["rtx4090"].total_bytes
    full = _resident_yaml(qwen, 1024, 1, lora={"r": 0})  # Soup's full fine-tuning
    full_gate = resident_preflight(load_config_from_string(full), config_json("qwen"), free=None, total=1)
    full_edge = (full_gate["gate_bytes"] or 0) + CONTEXT_BOUND_BYTES
    # first: a later case's faked free-memory reading stays in the process
    cases = {} if full_gate["refused"] else {"full-edge": dict(yaml=full, total=full_edge, allow=False),
                                             "full-edge-less-1": dict(yaml=full, total=full_edge - 1, allow=False)}
    cases |= {"big": dict(yaml=big, total=card, allow=False), "big-allowed": dict(yaml=big, total=card, allow=True),
             "small-edge": dict(yaml=small, total=edge, allow=False),
             "small-edge-less-1": dict(yaml=small, total=edge - 1, allow=False),
             "small-busy-card": dict(yaml=small, total=card, allow=False, free=edge - CONTEXT_BOUND_BYTES - 1),
             "moe-small-card": dict(yaml=_resident_yaml(moe, 1024, 1, gradient_checkpointing=True), total=4 * 10**9,
                                    allow=False),
             "moe-large-card": dict(yaml=_resident_yaml(moe, 1024, 1, gradient_checkpointing=True), total=card,
                                    allow=False)}
    env = {"PYTHONPATH": str(patched_site), "PATH": "/usr/bin:/bin", "HOME": str(root), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", RESIDENT_GATE, json.dumps(list(cases.values()))], capture_output=True,
                          text=True, env=env, cwd=str(root), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: (case, outcome) for (name, case), outcome in zip(cases.items(), got)}


def _stock(case: dict) -> tuple:
    """The installed (stock) soup_cli's own _hardware_fit_preflight on the same faked card: (exit, console)."""
    import io

    import typer
    from rich.console import Console
    from soup_cli.config.loader import load_config_from_string

    import soup_cli.commands.train as train

    buf, saved = io.StringIO(), train.console
    train.console = Console(file=buf, width=1000, color_system=None)
    try:
        train._hardware_fit_preflight(load_config_from_string(case["yaml"]), {"memory_total_bytes": case["total"]},
                                      allow_oom_attempt=case["allow"])
        return None, buf.getvalue()
    except typer.Exit as exc:
        return exc.exit_code, buf.getvalue()
    finally:
        train.console = saved


def test_the_patch_adds_the_resident_gate_to_the_installed_releases_train_command(patched_site):
    text = (patched_site / "soup_cli" / "commands" / "train.py").read_text()
    assert "from soup_cli.utils.corrected_peak import resident_preflight" in text
    assert text.index("def _corrected_free_bytes") < text.index("def _hardware_fit_preflight")


def test_stock_soup_admits_a_resident_run_the_patched_gate_refuses_in_soups_panel(resident_gate):
    """Qwen2.5-0.5B SFT bf16 4096x4 (no checkpointing) on an RTX 4090's total (faked card): Soup's formula
    (+10%) is under the card's total, so stock Soup launches it; the corrected resident estimate's need is over
    it, so the patched gate refuses, exit 1, in Soup's own panel, with the corrected number, what it charges,
    and Soup's formula beside it."""
    from issue395.estimator.resident import estimate_resident
    from issue395.results.extras import ResidentGate
    from soup_cli.config.loader import load_config_from_string

    case, patched_out = resident_gate["big"]
    stock_exit, stock_console = _stock(case)
    assert stock_exit is None and stock_console == ""  # stock Soup: admitted, silently
    soup = ResidentGate.computed(ResidentGate.input_of(load_config_from_string(case["yaml"])), case["total"])
    assert soup.admits is True
    peak = estimate_resident(config_json("qwen"), quant="none", seq=4096, batch=4, targets=("q_proj", "v_proj"),
                             lora_r=8, steps=2, accumulation=4).corrected_predicted  # Soup's default accumulation
    assert patched_out["exit"] == 1
    panel = patched_out["console"]
    assert "Hardware-fit gate" in panel and "Reduce batch_size / max_length" in panel
    assert f"Predicted peak VRAM {peak / 1e9:.1f} GB (corrected" in panel
    assert "resident weights and adapter" in panel and "allocator reserve" in panel
    assert f"Soup's formula: {soup.peak / 1e9:.1f} GB (+10% margin = {soup.required / 1e9:.1f} GB)" in panel
    assert "it admits the run" in panel


def test_allow_oom_attempt_launches_what_the_patched_gate_refuses_with_soups_warning(resident_gate):
    _, out = resident_gate["big-allowed"]
    assert out["exit"] is None
    assert "Hardware-fit warning" in out["console"] and "--allow-oom-attempt set: launching anyway." in out["console"]


def test_the_patched_gate_admits_a_run_that_fits_to_the_byte_and_refuses_one_byte_less(resident_gate):
    """Qwen2.5-0.5B SFT bf16 1024x1: on a card whose total less the context bound is exactly the corrected
    need (torch reads no free memory on CPU), admitted with one line; one byte smaller, refused."""
    _, fits = resident_gate["small-edge"]
    _, short = resident_gate["small-edge-less-1"]
    assert fits["exit"] is None and ": fits." in fits["console"]
    assert "Hardware-fit (corrected peak VRAM): " in fits["console"]
    assert "GB free under expandable segments (the patch sets them)" in fits["console"]  # as the patched train does
    assert "context bound" in fits["console"]
    assert short["exit"] == 1 and "Hardware-fit gate" in short["console"]


def test_the_patched_gate_compares_the_free_memory_torch_reads_not_the_total(resident_gate):
    """The same run on a 24 GB card (faked) that another process holds all but one byte short of the need:
    Soup's formula admits it against the total; the patched gate reads torch's free memory and refuses."""
    case, out = resident_gate["small-busy-card"]
    assert _stock(case)[0] is None
    assert out["exit"] == 1 and "free on the card (torch.cuda.mem_get_info)" in out["console"]


def test_a_moe_base_keeps_soups_formula_and_says_so(resident_gate):
    """Qwen3.5-MoE with checkpointing: the resident estimate does not model it, so Soup's own formula gates it, as
    stock Soup does (refused on a 4 GB card, and on a 24 GB one as stock Soup decides), after one line."""
    for name in ("moe-small-card", "moe-large-card"):
        case, out = resident_gate[name]
        stock_exit, stock_console = _stock(case)
        assert out["exit"] == stock_exit, name
        assert "not computed (a resident qwen3_5_moe_text run with gradient checkpointing is not yet modelled" in out[
            "console"]
        assert "the gate keeps Soup's formula" in out["console"]
        assert out["console"].endswith(stock_console)  # then Soup's own panel, or nothing, as stock
    assert resident_gate["moe-small-card"][1]["exit"] == 1


def test_a_release_without_the_resident_gate_gets_its_streamed_gate_patched_and_one_line(tmp_path):
    """A train.py with no _hardware_fit_preflight (renamed here in a copy): the diff patches the streamed gate
    alone and still applies."""
    from issue395.estimator.soup_patch import NO_RESIDENT_GATE, resident_site

    src = tmp_path / "src" / "soup_cli"
    shutil.copytree(soup_dir(), src)
    train = src / "commands" / "train.py"
    train.write_text(train.read_text().replace("_hardware_fit_preflight", "_another_gate"))
    assert resident_site(train.read_text()) is None
    diff = soup_patch(src, VERSION)
    assert "b/soup_cli/commands/train.py" not in diff and "b/soup_cli/trainer/stream_setup.py" in diff
    assert _apply(src, tmp_path / "site", diff, dry=True).returncode == 0
    assert "resident gate is not patched" in NO_RESIDENT_GATE


@pytest.mark.parametrize("dotted, value", [("unfrozen_parameters", ["model.layers.0"]), ("lora.use_dora", True),
                                           ("use_liger", True), ("backend", "unsloth"), ("quantization", "8bit"),
                                           ("batch_size", "auto"), ("optimizer", "adafactor"),
                                           ("auto_mixed_precision", True)])
def test_a_resident_setting_the_estimate_does_not_model_keeps_soups_formula(dotted, value):
    """Each names itself in the line; Soup's defaults (the same file without it) are modelled."""
    from soup_cli.config.loader import load_config_from_string

    from issue395.estimator.soup_gate import resident_preflight

    import yaml

    raw = yaml.safe_load(_resident_yaml(Path("Qwen2.5-0.5B"), 1024, 1))
    assert resident_preflight(load_config_from_string(yaml.safe_dump(raw)), config_json("qwen"), free=None,
                              total=10**11)["refused"] is None
    where = raw if dotted == "backend" else raw["training"]
    for part in dotted.split(".")[:-1]:
        where = where[part]
    where[dotted.split(".")[-1]] = value
    record = resident_preflight(load_config_from_string(yaml.safe_dump(raw)), config_json("qwen"), free=None,
                                total=10**11, formula=(1.0, 1.1, True))
    assert record["gate_bytes"] is None and dotted.split(".")[-1] in record["refused"]
    assert "the gate keeps Soup's formula" in record["line"]


def test_every_resident_and_streamed_assumption_is_soups_own_default():
    """soup_gate.ASSUMED (the resident and the streamed estimate's) holds Soup's schema defaults (or an unset that
    means them), so a plain file is modelled, on whichever release is installed; a key the release does not have
    is its default."""
    from soup_cli.config.schema import LoraConfig, SoupConfig, TrainingConfig

    from issue395.estimator.soup_gate import ASSUMED

    for row in ASSUMED:
        model = SoupConfig if row.top else LoraConfig if row.key.startswith("lora.") else TrainingConfig
        field = model.model_fields.get(row.key.split(".")[-1])
        if field is not None:
            assert field.default in (row.value, *row.same), row.key


#: `soup train`'s own CLI (``python -m soup_cli``) run up to its detect_device, which creates the CUDA context
#: (and so fixes the allocator torch uses): detect_device is replaced by one that reports the variable and stops
#: the run there (no CUDA card here, so nothing past it could run). One case a run, the environment set per case.
AT_DETECT_DEVICE = r"""
import json, os, runpy, sys
import soup_cli.commands.train as train
seen = []
def detect_device(backend=None):
    seen.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    raise SystemExit(97)
train.detect_device = detect_device
out = []
for case in json.loads(sys.argv[1]):
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if case["exported"] is not None:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = case["exported"]
    sys.argv = ["soup", "train", "--config", case["config"], "--yes"]
    try:
        runpy.run_module("soup_cli", run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code
    out.append({"exit": code, "at_detect_device": seen.pop() if code == 97 else "never reached"})
print(json.dumps(out))
"""


def _at_detect_device(site, root: Path, cases: list) -> list:
    """PYTORCH_CUDA_ALLOC_CONF as each case's `soup train` holds it when detect_device is called: the soup_cli
    of ``site`` (None: the installed, stock one)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(root), "HF_HUB_OFFLINE": "1"} | (
        {"PYTHONPATH": str(site)} if site else {})
    done = subprocess.run([sys.executable, "-c", AT_DETECT_DEVICE, json.dumps(cases)], capture_output=True,
                          text=True, env=env, cwd=str(root), timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert [o["exit"] for o in out] == [97] * len(cases), out  # each reached detect_device
    return [o["at_detect_device"] for o in out]


def test_the_patched_soup_train_runs_a_resident_run_on_expandable_segments_keeping_a_users_value(patched_site,
                                                                                                  tmp_path):
    """The finding (results/resident-patch-h200-soup0.77.0-faaa21d, resident-findmax-h200-soup0.77.0-faaa21d):
    stock `soup train` creates a resident run's CUDA context on torch's default allocator (0.77.0 sets expandable
    segments for a streamed run only, 0.73.3 only past detect_device), while the patched resident gate charges the
    reserve measured under expandable segments. The patched copy's own train(), run by its CLI up to detect_device
    (faked to stop there: no CUDA here), holds PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for a resident run
    where the variable was unset or empty, keeps a value the user exported, and a streamed run has it as Soup
    gives it; the stock installed Soup on the same files, for contrast, as its own configure_cuda_alloc_hint
    decides."""
    import soup_cli.utils.gpu as gpu

    base = _base(tmp_path, "Qwen2.5-0.5B", "qwen")
    configs = {}
    for name, stream in (("resident", False), ("streamed", True)):
        configs[name] = tmp_path / f"{name}.soup.yaml"
        configs[name].write_text(_resident_yaml(base, 1024, 1, stream_layers=stream))
    user = "garbage_collection_threshold:0.6"
    cases = [dict(config=str(configs["resident"]), exported=None), dict(config=str(configs["resident"]), exported=""),
             dict(config=str(configs["resident"]), exported=user), dict(config=str(configs["streamed"]), exported=None),
             dict(config=str(configs["streamed"]), exported=user)]
    expandable = "expandable_segments:True"
    assert _at_detect_device(patched_site, tmp_path, cases) == [expandable, expandable, user, expandable, user]
    soup_streamed = expandable if hasattr(gpu, "configure_cuda_alloc_hint") else None  # 0.77.0 has it, 0.73.3 not
    assert _at_detect_device(None, tmp_path, [cases[0], cases[3]]) == [None, soup_streamed]


def test_a_release_whose_train_has_no_detect_device_line_keeps_its_resident_gate_unpatched(tmp_path):
    """Where train() has no `device, device_name = detect_device(...)` (renamed here in a copy), the resident gate
    is not patched either (its need would not hold on the default allocator): the diff patches the streamed gate
    alone, still applies, and the line says why."""
    from issue395.estimator.soup_patch import NO_RESIDENT_GATE, alloc_hint_site, resident_site

    src = tmp_path / "src" / "soup_cli"
    shutil.copytree(soup_dir(), src)
    train = src / "commands" / "train.py"
    train.write_text(train.read_text().replace("device, device_name = detect_device(",
                                               "device, device_name = detect_the_device("))
    assert resident_site(train.read_text()) is not None and alloc_hint_site(train.read_text()) is None
    diff = soup_patch(src, VERSION)
    assert "b/soup_cli/commands/train.py" not in diff and "b/soup_cli/trainer/stream_setup.py" in diff
    assert _apply(src, tmp_path / "site", diff, dry=True).returncode == 0
    assert "detect_device" in NO_RESIDENT_GATE and "resident gate is not patched" in NO_RESIDENT_GATE


SOUP_TRAIN = r"""
import runpy, sys
import soup_cli.commands.train as train
assert hasattr(train, "_corrected_free_bytes"), train.__file__  # the patched copy, not the installed Soup
real, total = train.get_gpu_info, int(sys.argv[2])
# the CUDA card is faked: get_gpu_info reports a card of this total; the run itself is on CPU
train.get_gpu_info = lambda backend=None: dict(real(backend=backend), memory_total_bytes=total)
sys.argv = ["soup", "train", "--config", sys.argv[1], "--yes"]
runpy.run_module("soup_cli", run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.release
def test_the_patched_soup_train_cli_gates_a_resident_run_then_trains_it_on_cpu(patched_site, cache_dir, tmp_path):
    """The real `soup train` of the patched copy (its CLI from `python -m soup_cli`'s own entry) on a resident
    SmolLM2 (synthetic weights) SFT file at 64 tokens, on CPU, with get_gpu_info faked to report a card so
    Soup's CLI runs its resident gate (on CPU it skips it): on a 1 GB card, whose total Soup's formula (+10%)
    admits, the patched gate refuses before any training (exit 1, Soup's panel, no output folder); on an 80 GB
    card it admits with its one line, and the run trains its one step (the trainer's own state)."""
    from issue395.constraints.findmax import probe_config, steps_done, write_probe_config
    from issue395.host.checkpoints import synthetic_checkpoint
    from issue395.model.registry import SHAPES
    from conftest import h

    base = synthetic_checkpoint(SHAPES["smol"], cache_dir / "checkpoints")[0]
    data, out = tmp_path / "train.jsonl", tmp_path / "out"
    user = h.soup_config_yaml(str(base), data, out, 64, 1, "none", ("q_proj", "v_proj"), (),
                              training={"stream_layers": False})
    config = write_probe_config(tmp_path, probe_config(user, "seq", 64, data=data, output=out, override=None,
                                                       data_format="chatml"), h.task_rows("sft", 64, 1))
    env = {"PYTHONPATH": str(patched_site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
           "COLUMNS": "400"}

    def soup_train(total: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", SOUP_TRAIN, str(config), str(total)], capture_output=True,
                              text=True, env=env, cwd=str(tmp_path), timeout=600)

    refused = soup_train(10**9)
    assert refused.returncode == 1, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "Hardware-fit gate" in refused.stdout and "(corrected: this tool's resident estimate" in refused.stdout
    assert "it admits the run" in refused.stdout and not out.exists()  # Soup's formula would have launched it
    done = soup_train(80 * 10**9)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Hardware-fit (corrected peak VRAM): " in done.stdout and ": fits." in done.stdout
    assert steps_done(out, done.stdout) == 1


def test_the_patched_gate_admits_a_full_fine_tuning_by_its_corrected_number_and_refuses_one_byte_less(resident_gate):
    """Issue 51 item 1: Qwen2.5-0.5B SFT bf16 1024x1 with training.lora.r 0 (Soup's full fine-tuning) is gated by
    the corrected full fine-tuning estimate, not Soup's formula: on a card (faked: gpu_info's total; torch reads
    no free memory on CPU) whose total less the context bound is exactly its need, admitted in one line naming
    full fine-tuning; one byte smaller, refused in Soup's panel. Stock Soup judges both by its formula on the
    input its CLI builds (0.73.3's CLI passes peft "lora" for r 0, so it admits both; 0.77.0's is_full_finetune
    passes peft "full"). On 0.77.0 the corrected number is estimate_master's (fp32 master weights under bf16
    autocast), the same figure in the patched Soup's bundled module and in this tool."""
    from issue395.results.extras import ResidentGate
    from soup_cli.config.loader import load_config_from_string

    if "full-edge" not in resident_gate:
        pytest.skip("the installed Soup's full fine-tuning is one the estimate refuses (its gate keeps the formula)")
    case, fits = resident_gate["full-edge"]
    _, short = resident_gate["full-edge-less-1"]
    assert fits["exit"] is None and ": fits." in fits["console"] and "full fine-tuning (lora.r 0)" in fits["console"]
    assert short["exit"] == 1 and "Hardware-fit gate" in short["console"]
    soup = ResidentGate.computed(ResidentGate.input_of(load_config_from_string(case["yaml"])), case["total"] - 1)
    assert _stock(dict(case, total=case["total"] - 1))[0] == (None if soup.admits else 1)
