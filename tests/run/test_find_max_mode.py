"""issue395.run.find_max_mode: --find-max through the command line, in process, on CPU. Settle, Soup's own
loader, --estimate's code path and the search are real; on CPU the option exits 2 unless --dry-run.
The search itself is driven with the CUDA probe faked (``run_probe``: the ballast and Soup's step on
a card) and CUDA said present, where a test says so; nothing else is."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import yaml
from conftest import ROOT, main, one_error_line, readme_yaml

from issue395.constraints import findmax as F
from issue395.model.registry import config_json

YAML = """base: {base}
task: {task}
experiment_name: mine
data: {{train: pairs.jsonl, max_length: 2048, val_split: 0.1, chat_template: chatml}}
training: {{batch_size: 1, epochs: 3, quantization: none, stream_layers: true, logging_steps: 5,
           lora: {{r: 8, alpha: 16, target_modules: [q_proj, v_proj]}}}}
"""


@pytest.fixture
def soup_yaml(tmp_path):
    """A user's soup.yaml whose base is a checkpoint folder (Qwen2.5-0.5B's public config alone)."""
    def write(task="dpo"):
        base = tmp_path / "qwen"
        base.mkdir(exist_ok=True)
        (base / "config.json").write_text(json.dumps(config_json("qwen")))
        path = tmp_path / "soup.yaml"
        path.write_text(YAML.format(base=base, task=task))
        return path
    return write


def estimate_json(capfd, path, card, tmp_path, *extra):
    out = tmp_path / "e.json"
    code, _, err = main(capfd, ["--estimate", "--config", path, "--card", card, "--json", out, *extra])
    assert code == 0, err
    return json.loads(out.read_text())


def test_on_cpu_find_max_is_one_line_exit_2_and_the_users_file_is_untouched(capfd, soup_yaml):
    path = soup_yaml()
    before = path.read_bytes()
    code, out, err = main(capfd, ["--find-max", "seq", "--config", path, "--card", "12GB"])
    one_error_line(code, out, err, "--find-max", "CUDA box", "--dry-run")
    assert path.read_bytes() == before


def test_the_dry_run_prints_the_plan_and_the_first_probes_soup_yaml_at_the_tools_answer(capfd, soup_yaml, tmp_path):
    from soup_cli.config.loader import load_config_from_string

    path = soup_yaml()
    before = path.read_bytes()
    card = estimate_json(capfd, path, "12GB", tmp_path)["rows"][0]["cards"][0]
    code, out, err = main(capfd, ["--find-max", "seq", "--config", path, "--emulate-card", "12GB", "--dry-run"])
    assert code == 0, err
    assert f"computed by this tool (--estimate's corrected estimate, bound context; the runtime's growth 262.1 MB " \
           f"(the bound)): the longest seq that fits 12GB: {card['longest_seq']}" in out
    assert f"the longest seq Soup's gate admits on 12GB: {card['longest_seq_soup_admits']}" in out
    assert f"plan: start at seq {card['longest_seq']}" in out and "bisect to the resolution, 64 tokens" in out
    text = out.split("box stream_vram_override is the GPU's total):\n", 1)[1]
    probe = load_config_from_string(text)  # Soup's own loader takes the first probe's soup.yaml
    assert probe.data.max_length == card["longest_seq"] and probe.training.epochs == 1
    assert probe.experiment_name == "mine" and probe.training.logging_steps == 5 and probe.task == "dpo"
    assert path.read_bytes() == before


def test_the_dry_run_plan_json_names_the_stack_it_was_computed_on(capfd, soup_yaml, tmp_path):
    """The plan's JSON, like a run's, carries the installed stack the answers were computed on."""
    import importlib.metadata as md

    out_json = tmp_path / "plan.json"
    code, out, err = main(capfd, ["--find-max", "seq", "--config", soup_yaml(), "--emulate-card", "12GB", "--dry-run",
                                  "--json", str(out_json)])
    assert code == 0, err
    stack = json.loads(out_json.read_text())["stack"]
    assert md.version("transformers") in json.dumps(stack) and md.version("soup-cli") in json.dumps(stack)


class FakeCudaProbe:
    """The CUDA probe faked: Soup's run completes up to ``limit``, raises OOM above it, fails for
    another reason at ``fail_at``; it reads back the soup.yaml the driver wrote for it."""

    def __init__(self, limit, axis="seq", fail_at=()):
        self.limit, self.axis, self.fail_at, self.configs = limit, axis, set(fail_at), []

    def __call__(self, config, value, wanted, card_total, *, log_to=None, **kw):
        self.configs.append(yaml.safe_load(config.read_text()))
        log_to.write_text("fake Soup console\n")
        with open(self.configs[-1]["data"]["train"]) as rows:
            self.rows = len(rows.readlines())
        if value in self.fail_at:
            p = F.Probe(value, F.FAILED, None, "RuntimeError: not memory", 30.0, 1)
        else:
            ok = value <= self.limit
            p = F.Probe(value, F.COMPLETED if ok else F.OOM, wanted if ok else None,
                        None if ok else "torch.OutOfMemoryError: CUDA out of memory", 30.0, 0 if ok else 1,
                        soup_gb=8.5, driver_free_gb=11.36)
        return p, type("Ballast", (), {"size": 1, "free_after": card_total})(), "fake Soup console\n"


BOX_CONTEXT = 623_706_112


@pytest.fixture
def cuda_box(monkeypatch):
    """CUDA said present (torch.cuda.is_available, mem_get_info), the box's context faked at the H200's
    committed figure (results/outside-allocator-*/context.txt), its card's compute capability at an A10G's (8.6: the
    runtime growth's bound charged, as on a CPU box; a test that needs Hopper fakes 9.0) and the CUDA probe faked."""
    import torch

    from issue395.results import stack
    from issue395.run import find_max_mode

    monkeypatch.setattr(stack, "measure_context", lambda *a: {"context_bytes": BOX_CONTEXT})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (150_000_000_000, 150_000_000_000))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 6))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")

    def install(fake):
        monkeypatch.setattr(find_max_mode, "run_probe", fake)
        return fake
    return install


def test_the_search_brackets_from_the_tools_answer_and_reports_limit_oom_resolution_probes(
        capfd, soup_yaml, tmp_path, cuda_box):
    path = soup_yaml()
    before = path.read_bytes()
    card = estimate_json(capfd, path, "13GB", tmp_path)["rows"][0]["cards"][0]
    tool, soup = card["longest_seq"], card["longest_seq_soup_admits"]
    # like for like: --estimate's own answer with the box's context given as --context
    like = estimate_json(capfd, path, "13GB", tmp_path, "--context", str(BOX_CONTEXT / 1e9))["rows"][0]["cards"][0]["longest_seq"]
    assert like > tool  # the box leaves less context than Soup's bound: one resolution step more here
    fake = cuda_box(FakeCudaProbe(like + 128))
    tool_card = tool
    tool = like
    out_json = tmp_path / "f.json"
    code, out, err = main(capfd, ["--find-max", "seq", "--config", path, "--emulate-card", "13GB", "--json", out_json,
                                  "--log-dir", tmp_path / "logs"])
    assert code == 0, err
    data = json.loads(out_json.read_text())
    m = data["measured"]
    assert m["start"] == tool and m["probes"][0]["value"] == tool  # the bracket starts at the like-for-like answer
    assert data["this_tool_longest_like_for_like"] == like and data["box_context_bytes"] == BOX_CONTEXT
    assert (m["limit"], m["oom_above"], m["resolution"], m["proven"]) == (tool + 128, tool + 192, 64, True)
    assert data["this_tool_longest"] == tool_card and data["soup_gate_longest"] == soup and data["steps"] == 2
    assert f"computed by this tool like for like (the context the probes had: this box's own, measured here, " \
           f"0.624 GB; the runtime's growth 262.1 MB (the bound)): the longest seq that fits 13GB: {like}" in out
    assert data["soup_gate_at_limit"]["admits"] == (tool + 128 <= soup)
    assert data["soup_gate_above_limit"]["probe_admits"] is True  # 8.5 GB printed <= 11.36 GB its driver reported
    assert f"measured (the real soup train, Soup's gate lifted by training.stream_vram_override): seq {tool + 128} " \
           f"completes 2 of 2 step(s); seq {tool + 192} raised OOM (resolution 64 tokens; {len(m['probes'])} probe(s)" in out
    assert f"Soup's gate (unlifted) at seq {tool + 192}, the first above it (measured: OOM: torch.OutOfMemoryError" in out
    for config in fake.configs:  # each probe: two steps of the file's batch, its gate lifted by the GPU's total
        assert config["training"]["stream_vram_override"] == 150_000_000_000 and config["training"]["epochs"] == 1
        assert config["experiment_name"] == "mine" and config["data"]["val_split"] == 0.0
    from soup_cli.config.loader import load_config_from_string

    accumulation = load_config_from_string(path.read_text()).training.gradient_accumulation_steps  # Soup's default
    assert fake.rows == 2 * accumulation and sorted(p.name for p in (tmp_path / "logs").iterdir())[0].startswith("soup-find-max-seq-")
    assert path.read_bytes() == before
    from issue395.estimator.stacks import check_installed

    stack = check_installed(nf4=False)  # the file's bf16: bitsandbytes neither compared nor named
    assert data["stack"] == stack.to_json() and f"  {stack.line()}" in out.splitlines()


def test_the_margin_at_the_first_oom_sets_torchs_reading_beside_this_tools_charge_at_that_seq(
        capfd, soup_yaml, tmp_path, cuda_box):
    """Soup's process is faked (its OOM probes print torch's message, read into OomReading); the search,
    the charge (--estimate's own figures at that seq with the box's context) and the report are real."""
    from issue395.constraints.findmax import OomReading

    reading = OomReading(tried=400_000_000, free=390_000_000, process_in_use=13_100_000_000,
                         allocated=12_000_000_000, reserved_unallocated=230_000_000)

    class WithTorchMessage(FakeCudaProbe):
        def __call__(self, *a, **kw):
            p, ballast, log = super().__call__(*a, **kw)
            return (p if p.outcome != F.OOM else replace(p, oom=reading)), ballast, log

    path = soup_yaml()
    like = estimate_json(capfd, path, "13GB", tmp_path, "--context", str(BOX_CONTEXT / 1e9))["rows"][0]["cards"][0]["longest_seq"]
    cuda_box(WithTorchMessage(like + 128))
    code, out, err = main(capfd, ["--find-max", "seq", "--config", path, "--emulate-card", "13GB", "--json",
                                  tmp_path / "f.json"])
    assert code == 0, err
    margin = json.loads((tmp_path / "f.json").read_text())["margin_at_first_oom"]
    above = like + 192
    at = yaml.safe_load(path.read_text())
    at["data"]["max_length"] = above
    (tmp_path / "at.yaml").write_text(yaml.safe_dump(at))
    row = estimate_json(capfd, tmp_path / "at.yaml", "13GB", tmp_path, "--context", str(BOX_CONTEXT / 1e9))["rows"][0]
    card = row["cards"][0]
    assert margin["value"] == above
    assert margin["measured"] == {"allocated_plus_request": 12_400_000_000, "reserve": 230_000_000,
                                  "outside": 870_000_000}
    from issue395.estimator.estimate import EXPANDABLE_RESERVE_BYTES

    # `soup train`'s expandable segments split every block: the split peak, at most the corrected one
    assert margin["charged"]["allocated"] == row["needs_free"] - EXPANDABLE_RESERVE_BYTES <= row["corrected_predicted"]
    assert margin["charged"]["reserve"] == EXPANDABLE_RESERVE_BYTES
    assert margin["charged"]["outside"] == card["total_bytes"] - card["step_free_bytes"]
    assert f"the margin at the first OOM (seq {above}; measured: torch's message in Soup's process" in out
    assert "the allocator's reserve 230.0 MB, charged" in out


def test_the_batch_axis_and_a_non_oom_failure_is_reported_exit_1(capfd, soup_yaml, tmp_path, cuda_box):
    """The faked probe completes at the first value (this tool's answer) and fails, not OOM, one above it."""
    class FailsAboveTheStart(FakeCudaProbe):
        def __call__(self, config, value, *a, **kw):
            if not self.configs:
                self.limit, self.fail_at = value, {value + 1}
            return super().__call__(config, value, *a, **kw)

    path = soup_yaml("sft")
    cuda_box(FailsAboveTheStart(None, "batch"))
    code, out, err = main(capfd, ["--find-max", "batch", "--config", path, "--card", "RTX4060-Laptop-8GB",
                                  "--steps", "1", "--json", tmp_path / "b.json"])
    assert code == 1, err
    data = json.loads((tmp_path / "b.json").read_text())
    m = data["measured"]
    start = data["this_tool_longest"]
    assert start is not None and m["probes"][0]["value"] == start and m["resolution"] == 1 and data["steps"] == 1
    assert m["oom_above"] is None and m["limit"] == start and m["probes"][-1]["outcome"] == "failed"
    assert f"stopped before the answer was proven: the probe at {start + 1} failed, not OOM: RuntimeError: not memory" in out


@pytest.mark.parametrize("extra,words", [
    (["--card", "12GB,T4"], ("--card 12GB,T4", "one card")),
    (["--emulate-card", "huge"], ("--emulate-card 'huge'",)),
    (["--card", "12GB", "--steps", "0"], ("--steps",)),
])
def test_bad_find_max_input_is_one_line(capfd, soup_yaml, extra, words):
    code, out, err = main(capfd, ["--find-max", "seq", "--config", soup_yaml(), *extra])
    one_error_line(code, out, err, *words)


def test_the_readmes_find_max_dry_run_is_what_it_prints(capfd, tmp_path, monkeypatch):
    """The README's --find-max paragraph: its command on the README's DPO soup.yaml prints its lines."""
    from conftest import ROOT

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (tmp_path / "soup-dpo.yaml").write_text(readme.split("```yaml\n")[2].split("```", 1)[0], encoding="utf-8")
    block = next(b for b in readme.split("```bash\n")[1:] if "--find-max" in b.split("```", 1)[0])
    command = block.split("```", 1)[0].split()[2:]
    shown = block.split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    monkeypatch.chdir(tmp_path)
    code, out, err = main(capfd, command)
    assert code == 0, err
    missing = [s for s in shown if s.rstrip() not in (ln.rstrip() for ln in out.splitlines())]
    assert not missing and len(shown) == 4, missing


def test_a_cudnn_failure_at_the_memory_edge_is_read_as_oom_and_proves_the_limit_in_two_probes(
        capfd, soup_yaml, tmp_path, cuda_box):
    """Issue 52 items 3 and 4 through the command line. The CUDA probe is faked (a CUDA OOM cannot happen
    on CPU): this tool's like-for-like answer completes, and the step above it fails inside cuDNN with the
    allocator's reserved peak leaving 200 MB of the 13 GB card (less the box's context): the mode reads
    that as OOM by the allocator's figures, and the limit is proven in two probes."""
    card_free = 13_000_000_000 - BOX_CONTEXT

    class CudnnAtTheEdge(FakeCudaProbe):
        def __call__(self, config, value, *a, **kw):
            p, ballast, log = super().__call__(config, value, *a, **kw)
            if p.outcome == F.OOM:  # the same step, failing inside cuDNN instead, as Soup's console prints it
                p = replace(F.judge(value, "Error: RuntimeError: cuDNN error: CUDNN_STATUS_INTERNAL_ERROR\n", 1, None,
                                    2, 30.0), allocator=F.ProbeAllocator(1, 1, card_free - 200_000_000))
            return p, ballast, log

    path = soup_yaml()
    like = estimate_json(capfd, path, "13GB", tmp_path, "--context", str(BOX_CONTEXT / 1e9))["rows"][0]["cards"][0]["longest_seq"]
    cuda_box(CudnnAtTheEdge(like))
    code, out, err = main(capfd, ["--find-max", "seq", "--config", path, "--emulate-card", "13GB", "--json",
                                  tmp_path / "f.json"])
    assert code == 0, err
    m = json.loads((tmp_path / "f.json").read_text())["measured"]
    assert [(p["value"], p["outcome"]) for p in m["probes"]] == [(like, "completed"), (like + 64, "OOM")]
    assert (m["limit"], m["oom_above"], m["proven"], m["stopped"]) == (like, like + 64, True, None)
    assert m["probes"][1]["library"] == "CUDNN_STATUS_INTERNAL_ERROR"
    assert m["probes"][1]["edge"].startswith("CUDNN_STATUS_INTERNAL_ERROR read as OOM: the allocator's reserved peak")
    assert "left 200.0 MB of the card's" in m["probes"][1]["edge"]
    assert f"seq {like} completes 2 of 2 step(s); seq {like + 64} raised OOM (CUDNN_STATUS_INTERNAL_ERROR read as OOM" in out
# Moved from tests/run/test_round3.py and test_round4.py (issues 29 and 36, the new user's rounds three
# and four), named for the behaviour each checks.


def test_find_max_dry_run_json_writes_the_plan_and_from_json_names_it(capfd, tmp_path):
    """Issue 36 item 10: --find-max --dry-run --json writes the plan (kind find-max, dry run, nothing
    measured), says where, and --from-json names it as a --find-max result."""
    path = readme_yaml(tmp_path, base="HuggingFaceTB/SmolLM2-135M", seq=512).read_text()
    (tmp_path / "s.yaml").write_text(path.replace("quantization: 4bit", "quantization: none"))
    out_json = tmp_path / "fm.json"
    code, out, err = main(capfd, ["--find-max", "seq", "--config", tmp_path / "s.yaml", "--card", "T4", "--dry-run",
                                  "--json", out_json])
    assert code == 0, err
    data = json.loads(out_json.read_text())
    assert data["kind"] == "find-max" and data["dry_run"] is True and data["measured"] is None
    assert data["this_tool_longest"] is not None and data["plan"], data
    assert f"--json {out_json}" in out + err or str(out_json) in out + err  # said where it went
    one_error_line(*main(capfd, ["--from-json", out_json]), "--find-max")
@pytest.mark.parametrize("targets", ["auto", "all-linear"])
def test_find_max_takes_soups_own_target_spellings_its_probes_resolve_them(capfd, tmp_path, targets):
    """Issue 53 item 8: --find-max refused `target_modules: auto` ("not run as an arm here"), although its probes
    run `soup train` on the file, which resolves it. The plan is printed, the probe's soup.yaml keeps the file's
    spelling, and no line speaks of an arm."""
    path = tmp_path / "soup.yaml"
    path.write_text(YAML.format(base="Qwen/Qwen2.5-0.5B", task="sft").replace("[q_proj, v_proj]", targets))
    code, out, err = main(capfd, ["--find-max", "seq", "--config", path, "--card", "T4", "--dry-run"])
    assert code == 0, err
    assert "plan: start at seq" in out and f"target_modules: {targets}" in out
    assert " arm" not in err


# Issue 51 item 4: --find-max on a resident soup.yaml (training.stream_layers false), each probe the real `soup train`
# with Soup's resident gate lifted by its own --allow-oom-attempt.

RESIDENT = """base: {base}
task: dpo
experiment_name: mine
data: {{train: pairs.jsonl, max_length: 1024}}
training: {{batch_size: 1, quantization: {quant}, stream_layers: false, gradient_checkpointing: {gc},
           lora: {{r: 8, alpha: 16, target_modules: [q_proj, v_proj]}}}}
"""


def resident_yaml(tmp_path, family="llama32-1b", folder="Llama-3.2-1B", gc="false", quant="none"):
    """A resident soup.yaml whose base is a checkpoint folder (a registry family's public config alone), named as
    the hub names it, so Soup's CLI reads its size from the name as it does for the hub id."""
    base = tmp_path / folder
    base.mkdir(exist_ok=True)
    (base / "config.json").write_text(json.dumps(config_json(family)))
    path = tmp_path / "resident.yaml"
    path.write_text(RESIDENT.format(base=base, gc=gc, quant=quant))
    return path


def resident_estimate_at(capfd, path, tmp_path, card, seq, *extra):
    """--estimate's resident answer for the file at ``seq`` on ``card`` (its JSON's card, and its resident block)."""
    at = yaml.safe_load(path.read_text())
    at["data"]["max_length"] = seq
    (tmp_path / "at.yaml").write_text(yaml.safe_dump(at))
    got = estimate_json(capfd, tmp_path / "at.yaml", card, tmp_path, *extra)
    return got["cards"][0], got["resident"]


@pytest.mark.parametrize("flag", ["--emulate-card", "--card"])
def test_a_resident_files_dry_run_starts_at_the_resident_estimates_longest_and_lifts_soups_gate_on_its_command_line(
        capfd, tmp_path, flag, monkeypatch):
    """The first probe is the corrected resident estimate's longest seq: --estimate's resident answer says it fits
    the card and 64 tokens more does not; Soup's resident gate's longest is what --estimate's Soup verdict admits, 64
    tokens more refused; the probe's soup.yaml is Soup's to load, resident, with no streamed gate key; the plan runs
    `soup train ... --allow-oom-attempt` on expandable segments (the setting the resident need holds under); the
    JSON's resident record is typed, the input Soup's CLI built the same as --estimate's. --card and --emulate-card
    alike."""
    from soup_cli.config.loader import load_config_from_string

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    path = resident_yaml(tmp_path)
    before = path.read_bytes()
    code, out, err = main(capfd, ["--find-max", "seq", "--config", path, flag, "16GB", "--dry-run", "--json",
                                  tmp_path / "plan.json"])
    assert code == 0, err
    data = json.loads((tmp_path / "plan.json").read_text())
    tool, soup = data["this_tool_longest"], data["soup_gate_longest"]
    assert resident_estimate_at(capfd, path, tmp_path, "16GB", tool)[0]["fits"] is True
    assert resident_estimate_at(capfd, path, tmp_path, "16GB", tool + 64)[0]["fits"] is False
    assert resident_estimate_at(capfd, path, tmp_path, "16GB", soup)[0]["soup_admits"] is True
    assert resident_estimate_at(capfd, path, tmp_path, "16GB", soup + 64)[0]["soup_admits"] is False
    soup_input = resident_estimate_at(capfd, path, tmp_path, "16GB", 1024)[1]["soup_input"]
    assert data["resident"] == {"checkpointing": False, "soup_input": soup_input, "started_from":
                                "this tool's longest that fits", "estimate_refused": None,
                                "gate_lifted_by": "--allow-oom-attempt", "allocator_conf": "expandable_segments:True"}
    assert data["card"]["given_as"] == flag and "training.stream_vram_override" not in data["probe_keys"]
    assert f"(a resident run, training.stream_layers false; dpo none, batch 1), on 16GB" in out
    assert f"computed by this tool (the corrected resident estimate, bound context; the runtime's growth 262.1 MB " \
           f"(the bound)): the longest seq that fits 16GB: {tool}" in out
    assert f"the longest seq Soup's resident gate admits on 16GB: {soup}" in out
    assert f"plan: start at seq {tool} (this tool's longest that fits)" in out
    assert "train --config <the probe's soup.yaml> --yes --allow-oom-attempt with " \
           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the setting this tool's resident need holds under" in out
    probe = load_config_from_string(data["first_probe_config"])  # Soup's own loader takes it
    assert probe.training.stream_layers is False and probe.data.max_length == tool and probe.experiment_name == "mine"
    assert "stream_vram_override" not in data["first_probe_config"]
    assert path.read_bytes() == before


class RecordsItsCommand(FakeCudaProbe):
    """The CUDA probe faked, as FakeCudaProbe, completing up to two resolution steps past the search's first
    value; it keeps whether each probe's `soup train` was told --allow-oom-attempt."""

    def __call__(self, config, value, *a, **kw):
        if not self.configs:
            self.limit, self.lifted = value + 128, []
        self.lifted.append((kw.get("allow_oom_attempt"), kw.get("expandable")))
        return super().__call__(config, value, *a, **kw)


@pytest.mark.parametrize("flag", ["--emulate-card", "--card"])
def test_a_resident_search_probes_soup_train_with_allow_oom_attempt_and_records_soups_resident_gate(
        capfd, tmp_path, cuda_box, flag, monkeypatch):
    """The CUDA probe is faked (a CUDA OOM cannot happen on CPU): Soup's run completes up to two resolution steps
    past this tool's like-for-like answer. The search starts there (--estimate's resident answer with the box's
    context: it fits, 64 tokens more does not), every probe's `soup train` gets --allow-oom-attempt and a soup.yaml
    with no streamed gate key, the limit is proven, the text says Soup's resident gate was lifted, and Soup's
    resident gate at the limit is its own verdict (--estimate's), as a typed record."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    path = resident_yaml(tmp_path)
    fake = cuda_box(RecordsItsCommand(None))
    code, out, err = main(capfd, ["--find-max", "seq", "--config", path, flag, "16GB", "--json", tmp_path / "f.json"])
    assert code == 0, err
    data = json.loads((tmp_path / "f.json").read_text())
    m, like, soup = data["measured"], data["this_tool_longest_like_for_like"], data["soup_gate_longest"]
    context = ("--context", str(BOX_CONTEXT / 1e9))
    assert resident_estimate_at(capfd, path, tmp_path, "16GB", like, *context)[0]["fits"] is True
    assert resident_estimate_at(capfd, path, tmp_path, "16GB", like + 64, *context)[0]["fits"] is False
    assert m["start"] == like and (m["limit"], m["oom_above"], m["proven"]) == (like + 128, like + 192, True)
    assert fake.lifted and set(fake.lifted) == {(True, True)}
    assert all("stream_vram_override" not in c["training"] and c["training"]["stream_layers"] is False
               for c in fake.configs)
    assert data["resident"]["started_from"] == "this tool's longest that fits with the box's own context"
    assert "measured (the real soup train, Soup's resident gate lifted by --allow-oom-attempt, on " \
           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): seq " \
           f"{like + 128} completes 2 of 2 step(s); seq {like + 192} raised OOM" in out
    gate = data["soup_gate_at_limit"]
    verdict = resident_estimate_at(capfd, path, tmp_path, "16GB", like + 128)[0]["soup_admits"]
    assert gate["value"] == like + 128 and gate["admits"] is verdict is (like + 128 <= soup)
    assert set(gate) == {"value", "input", "peak", "breakdown", "required", "card_total", "admits"}
    assert f"Soup's resident gate (unlifted) at seq {like + 128}, the limit (measured: completed 2 of 2 step(s)): " \
           f"{'admits' if verdict else 'refuses'} it (computed by Soup's own code: " in out


class ReadsItsGrowth(RecordsItsCommand):
    """RecordsItsCommand's faked CUDA probe whose exit hook read the device's free memory and the allocator's
    reserved bytes (FAKED: the figures CUDA would give where the runtime grew by ``growth`` past the box's context)."""

    def __init__(self, growth):
        super().__init__(None)
        self.growth = growth

    def __call__(self, config, value, wanted, card_total, **kw):
        p, ballast, log = super().__call__(config, value, wanted, card_total, **kw)
        reserved = 9_000_000_000
        exit_reading = F.ProbeAllocator(8_900_000_000, 8_899_000_000, reserved, free_at_exit=card_total - BOX_CONTEXT
                                        - self.growth - reserved, reserved_at_exit=reserved)
        return replace(p, allocator=exit_reading, free_held=card_total), ballast, log


def test_a_resident_search_answers_like_for_like_with_the_runtime_growth_its_probes_measured(
        capfd, tmp_path, cuda_box, monkeypatch):
    """Issue 51 item 4: the runtime's growth after the context is the most measured on four streamed arms
    (STEP_GROWTH_BYTES, 262.1 MB), where a resident bf16 checkpointed search left the runtime at most 180 MB
    (results/resident-findmax-expandable-h100-*/find-max-resident-phi3-sft-bf16-gc-10GB). The CUDA probe is FAKED,
    its exit hook's reading with it (a CUDA run cannot happen on CPU): with a growth of 10 MB read by every probe the
    search's JSON and text carry it and this tool's answer like for like with it, at or past its answer with the
    bound; read at the bound itself, the two answers are one; with no probe reading it (every committed search)
    neither the keys nor the line are there."""
    from issue395.estimator.cards import STEP_GROWTH_BYTES

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    path = resident_yaml(tmp_path)
    got = {}
    for growth in (10_000_000, STEP_GROWTH_BYTES):
        cuda_box(ReadsItsGrowth(growth))
        code, out, err = main(capfd, ["--find-max", "seq", "--config", path, "--emulate-card", "16.3GB", "--json",
                                      tmp_path / "f.json"])
        assert code == 0, err
        data = json.loads((tmp_path / "f.json").read_text())
        assert data["runtime_growth_bytes"] == growth
        got[growth] = (data["this_tool_longest_like_for_like"], data["this_tool_longest_like_for_like_measured_growth"])
        assert (f"computed by this tool like for like with the probes' own runtime growth (measured in each probe's "
                f"process as it exited or at its OOM, the most of them: {growth / 1e6:.1f} MB after the box's context, "
                f"in place of 262.1 MB (the bound)): the longest seq that fits 16.3GB: {got[growth][1]}") in out
        assert "runtime growth MB" in out
    like, grown = got[10_000_000]
    assert grown > like, "252 MB more of a 16.3 GB card fits a 64-token step more of Llama-3.2-1B DPO"
    assert got[STEP_GROWTH_BYTES][1] == got[STEP_GROWTH_BYTES][0]
    cuda_box(RecordsItsCommand(None))
    code, out, err = main(capfd, ["--find-max", "seq", "--config", path, "--emulate-card", "16.3GB", "--json",
                                  tmp_path / "f.json"])
    data = json.loads((tmp_path / "f.json").read_text())
    assert code == 0 and "runtime_growth_bytes" not in data and "runtime growth" not in out, err


def test_a_resident_search_on_a_hopper_box_answers_like_for_like_with_the_resident_growth_measured_there(
        capfd, tmp_path, cuda_box, monkeypatch):
    """Issue 51: the probes run on the box's own card, so the like-for-like answer charges the runtime's growth for
    the box's compute capability (FAKED here: torch.cuda.get_device_capability, as an H100's 9.0 and an A10G's 8.6),
    not the emulated plain size's (none known): on Hopper the 176.9 MB measured in `soup train`'s own resident runs,
    elsewhere the 262.1 MB bound, the JSON and the text saying which; the answer on the card asked keeps the bound."""
    import torch

    from issue395.estimator.arch import arch_from_config
    from issue395.estimator.cards import GROWTH_BOUND, GROWTH_RESIDENT, RESIDENT_STEP_GROWTH_BYTES, STEP_GROWTH_BYTES
    from issue395.estimator.sequence import replayed
    from issue395.estimator.stacks import transformers_release

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    # where the two charges straddle a 64-token step: the replayed DPO rests (this stack's transformers is the
    # replay's) leave the estimate ~120 MB under the bound's, so the card that shows the step differs
    card = "16.7GB" if replayed(arch_from_config(config_json("llama32-1b")), "none", ("q_proj", "v_proj"), "dpo",
                                transformers=transformers_release(None), environ={}) else "16.4GB"
    path = resident_yaml(tmp_path)
    got = {}
    for cc, growth, source in (((9, 0), RESIDENT_STEP_GROWTH_BYTES, GROWTH_RESIDENT),
                               ((8, 6), STEP_GROWTH_BYTES, GROWTH_BOUND)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, cc=cc: cc)
        cuda_box(RecordsItsCommand(None))
        code, out, err = main(capfd, ["--find-max", "seq", "--config", path, "--emulate-card", card, "--json",
                                      tmp_path / "f.json"])
        assert code == 0, err
        data = json.loads((tmp_path / "f.json").read_text())
        assert data["this_tool_like_for_like_growth"] == {"bytes": growth, "source": source}
        assert data["box_compute_capability"] == ".".join(map(str, cc))
        assert f"0.624 GB; the runtime's growth {growth / 1e6:.1f} MB ({source})): the longest seq that fits {card}: " \
               f"{data['this_tool_longest_like_for_like']}" in out
        got[cc] = (data["this_tool_longest_like_for_like"], data["this_tool_longest"])
    assert got[(9, 0)][1] == got[(8, 6)][1], "the answer on the card asked (a plain size) charges the bound either way"
    assert got[(9, 0)][0] > got[(8, 6)][0], "85 MB more of the card fits a 64-token step more of Llama-3.2-1B DPO"


@pytest.mark.parametrize("card, start", [("80GB", "Soup's gate's longest"), ("4GB", "the smallest, then a plain doubling")])
def test_a_resident_run_the_estimate_does_not_model_starts_from_soups_gate_or_the_smallest_and_says_so(
        capfd, tmp_path, cuda_box, card, start):
    """Phi-2 resident under NF4 with gradient checkpointing is not modelled by the corrected estimate: the search starts from Soup's
    resident gate's longest where it admits one (an 80 GB card), else from the smallest value and doubles (a 4 GB
    card, where Soup's gate admits nothing), and the text and the typed record say which and why. The CUDA probe is
    faked: Soup's run completes up to 1024 tokens."""
    path = resident_yaml(tmp_path, family="phi-2", folder="phi-2", gc="true", quant="4bit")
    fake = cuda_box(FakeCudaProbe(1024))
    code, out, err = main(capfd, ["--find-max", "seq", "--config", path, "--emulate-card", card, "--json",
                                  tmp_path / "f.json"])
    assert code == 0, (out, err)
    data = json.loads((tmp_path / "f.json").read_text())
    why = ("a resident nf4 phi run with gradient checkpointing is not yet modelled by this estimator (its recompute "
           "of an fp32 residual stream under autocast is not counted)")
    assert data["this_tool_longest"] is None and data["resident"]["estimate_refused"] == why
    assert data["resident"]["started_from"] == f"this tool's estimate does not answer ({why}): {start}"
    first = data["soup_gate_longest"] if card == "80GB" else 64
    assert (card == "80GB") == (first is not None and first > 64)
    assert fake.configs[0]["data"]["max_length"] == first and data["measured"]["start"] == first
    assert (data["measured"]["limit"], data["measured"]["oom_above"], data["measured"]["proven"]) == (1024, 1088, True)
    assert f"the longest seq that fits {card}: none (not estimated: {why})" in out
    assert data["margin_at_first_oom"] is None  # nothing charged where the estimate does not model the run


@pytest.mark.parametrize("layers", ["true", "false"])
def test_an_optimizer_charged_as_an_upper_bound_is_said_on_the_answers_line(capfd, tmp_path, layers):
    """Issue 53 item 14's rule, for --find-max too (streamed and resident files): an optimizer the estimator's table
    lacks is charged as an upper bound, and the line with this tool's longest says so where it is read."""
    path = tmp_path / "soup.yaml"
    path.write_text("base: meta-llama/Llama-3.2-1B\ndata: {train: ./d.jsonl, max_length: 1024}\n"
                    f"training: {{batch_size: 1, stream_layers: {layers}, optimizer: adafactor, "
                    "lora: {r: 16, alpha: 32, target_modules: [q_proj, v_proj]}}\n")
    code, out, err = main(capfd, ["--find-max", "seq", "--config", path, "--card", "24GB", "--dry-run"])
    assert code == 0, err
    tool = next(line for line in out.splitlines() if line.startswith("  computed by this tool ("))
    assert "an UPPER BOUND: training.optimizer adafactor is not modelled" in tool


def test_a_full_fine_tunings_longest_is_labelled_as_far_as_it_is_measured(capfd, tmp_path):
    """Reviewer item 4: --find-max on a full fine-tuning file (lora.r 0) labels this tool's longest as the corrected
    resident estimate of a full fine-tuning, unmeasured on a release that loads the checkpoint's bf16 (0.73.3: no row
    of it exists), measured at one shape only on one that loads fp32 master weights (0.77.0: four rows at SFT
    1024x1); a LoRA file's line says neither."""
    import soup_cli

    words = ("measured at one shape only" if soup_cli.__version__ == "0.77.0" else "unmeasured")
    path = tmp_path / "soup.yaml"
    for lora, full in (("{r: 0}", True), ("{r: 16, alpha: 32, target_modules: [q_proj, v_proj]}", False)):
        path.write_text("base: meta-llama/Llama-3.2-1B\ndata: {train: ./d.jsonl, max_length: 1024}\n"
                        f"training: {{batch_size: 1, stream_layers: false, quantization: none, lora: {lora}}}\n")
        code, out, err = main(capfd, ["--find-max", "seq", "--config", path, "--card", "24GB", "--dry-run"])
        assert code == 0, err
        tool = next(line for line in out.splitlines() if line.startswith("  computed by this tool ("))
        assert tool.startswith("  computed by this tool (the corrected resident estimate")
        assert (f"of a full fine-tuning, {words}" in tool) is full, tool


def test_a_resident_file_with_dora_gets_no_answer_from_the_resident_estimate_of_a_plain_lora_run(capfd, tmp_path):
    """Sweep: a resident file with lora.use_dora was planned from the corrected estimate of the plain LoRA run;
    now the plan says the estimate does not answer (as --soup-patch's resident gate keeps Soup's formula) and
    starts from Soup's resident gate's longest. --dry-run on CPU: no probe runs."""
    path = resident_yaml(tmp_path)
    path.write_text(path.read_text().replace("target_modules: [q_proj, v_proj]", "target_modules: [q_proj, v_proj], "
                                             "use_dora: true"))
    code, out, err = main(capfd, ["--find-max", "seq", "--config", path, "--card", "A100-80GB", "--dry-run", "--json",
                                  tmp_path / "f.json"])
    assert code == 0, (out, err)
    data = json.loads((tmp_path / "f.json").read_text())
    why = "training.lora.use_dora true is not modelled resident (the estimator assumes false)"
    assert data["this_tool_longest"] is None and data["resident"]["estimate_refused"] == why
    assert data["resident"]["started_from"].startswith(f"this tool's estimate does not answer ({why})")
    assert f"the longest seq that fits A100-80GB: none (not estimated: {why})" in out


@pytest.mark.parametrize("card, hopper", [("H100", True), ("24GB", False)])
def test_a_dry_run_names_the_runtime_growth_its_own_answer_charges(capfd, tmp_path, card, hopper):
    """--find-max --dry-run on CPU: this tool's answer on the card asked charges that card's growth (cards.step_growth:
    a named Hopper card's the measured resident 176.9 MB, a plain size's the 262.1 MB bound); its line and the JSON
    say which, as the like-for-like answer's do."""
    from issue395.estimator.cards import GROWTH_BOUND, GROWTH_RESIDENT, RESIDENT_STEP_GROWTH_BYTES, STEP_GROWTH_BYTES

    growth, source = (RESIDENT_STEP_GROWTH_BYTES, GROWTH_RESIDENT) if hopper else (STEP_GROWTH_BYTES, GROWTH_BOUND)
    path = resident_yaml(tmp_path, gc="true")
    code, out, err = main(capfd, ["--find-max", "seq", "--config", path, "--card", card, "--dry-run", "--json",
                                  tmp_path / "f.json"])
    assert code == 0, err
    data = json.loads((tmp_path / "f.json").read_text())
    assert data["this_tool_growth"] == {"bytes": growth, "source": source}
    assert (f"bound context; the runtime's growth {growth / 1e6:.1f} MB ({source})): the longest seq that fits {card}: "
            f"{data['this_tool_longest']}") in out


def test_phi2s_7_5gb_search_answers_like_for_like_its_measured_limit_now_phi2_is_charged(tmp_path, monkeypatch):
    """Issue 51 (phi-2 charged: gc_sequence.MEASURED_RESERVE["phi"]): the committed H100 phi-2 bf16 gc search on an
    emulated 7.5GB (results/resident-findmax-gc-growth-h100-soup0.77.0-1a0b582: measured limit 1,024, first OOM 1,088;
    its like-for-like answers 768 with the bound's reserve, 832 with its probes' growth) answered again from its own
    file with the box's context (623,706,112 B), sm_90's growth (176.9 MB, what its probes measured too) and the
    replayed charge: 1,024, the measured limit, never past it; 1,088 charged over the card. No CUDA is faked: dry run."""
    import shutil

    import transformers

    from issue395.estimator.cards import step_growth
    from issue395.estimator.sequence import SEQUENCE_TRANSFORMERS
    from issue395.run import find_max_mode as M

    if transformers.__version__ != SEQUENCE_TRANSFORMERS:  # the replay (so the charge) is the checked stack's alone
        pytest.skip(f"gc_sequence is replayed on transformers {SEQUENCE_TRANSFORMERS}, not {transformers.__version__}")
    from issue395.run.parser import build_parser

    folder = ROOT / "results/resident-findmax-gc-growth-h100-soup0.77.0-1a0b582"
    record = json.loads((folder / "find-max-resident-phi2-sft-bf16-gc-7.5GB.json").read_text(encoding="utf-8"))
    shutil.copy(folder / "configs/resident-phi2-sft-bf16-gc.yaml", tmp_path / "soup.yaml")
    (tmp_path / "data.jsonl").write_text("", encoding="utf-8")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    argv = ["--find-max", "seq", "--config", str(tmp_path / "soup.yaml"), "--emulate-card", "7.5GB", "--dry-run"]
    a = M.resident_answers(M.settle(build_parser().parse_args(argv), argv))
    box, grown = record["box_context_bytes"], record["runtime_growth_bytes"]
    assert step_growth(True, (9, 0)) == grown == 176_947_200
    assert (record["measured"]["limit"], record["measured"]["oom_above"]) == (1024, 1088)
    answer = a.tool_with_context(a.like_budget(box, (9, 0), grown))
    assert answer == a.tool_with_context(a.like_budget(box, (9, 0))) == record["measured"]["limit"] == 1024
    over = a.charged_at(1088, a.like_budget(box, (9, 0), grown))
    assert sum(over.values()) > record["card"]["bytes"] and over["reserve"] == 87_923_200
