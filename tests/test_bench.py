"""bench/: the GPU-box and report scripts run against the package as it is now (bench/carried.py
called names the split had moved off the script and failed on its first line), and the committed
findings report is what bench/findings.py renders from the committed results now. CPU: only the CUDA
step and the allocator's history are faked, and say so."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, checked_stack


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_carried_runs_an_arm_through_the_harness_and_reports_what_it_left(fake_cuda, monkeypatch, tmp_path, capsys):
    carried = load("carried")
    fake_cuda()
    # Fakes: the allocator's history and what stays allocated (CUDA only).
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)
    carried.main(str(tmp_path), order=(("smol", "none"),), seq=128)
    out = capsys.readouterr().out
    assert out.startswith("smol none: real peak ") and "failure None" in out
    assert out.rstrip().endswith("after teardown 0 bytes allocated")


def test_the_committed_findings_report_is_what_the_results_render_to_now():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "findings.py")], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out == (ROOT / "results" / "FINDINGS.md").read_text()


def test_the_findings_read_the_patched_resident_gates_figures_in_its_old_and_current_wording(tmp_path):
    """Reviewer item 1 (issue 51 item 6): a resident-patch run renders the need and free memory the patched gate
    printed, in the committed runs' wording and in the wording estimator/soup_gate.py resident_preflight prints now
    (its admitted line and its refusal panel, "under expandable segments (the patch sets them)"), and a run whose
    figures cannot be read says so rather than render as plain "patched"."""
    import yaml
    from soup_cli.config.loader import load_config_from_string

    from issue395.estimator.soup_gate import resident_preflight
    from issue395.model.registry import config_json

    findings = load("findings")
    committed = sorted((ROOT / findings.RESIDENT_PATCH[0]).glob("patched-*.txt"))
    assert committed
    for path in committed:  # the old wording: "needs X GB free; Y GB free on the card" and "..., more than the Y"
        run = findings.resident_patch_run(path)
        text = path.read_text(encoding="utf-8")
        assert run["need"] and f"needs {run['need']} GB free" in text and f"{run['free']} GB free on the card" in text
    raw = {"base": "Qwen2.5-0.5B", "task": "sft", "data": {"train": "train.jsonl", "max_length": 1024},
           "training": {"batch_size": 1, "quantization": "none", "stream_layers": False,
                        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}}}
    cfg = load_config_from_string(yaml.safe_dump(raw))
    head = "qwen sft none seq 1024 batch 1, 2 step(s), as 12GB (12,000,000,000 B); training.stream_layers: False\n"
    for free, key, places in ((10**11, "line", 0.005), (10**9, "panel", 0.05)):  # admitted; refused
        gate = resident_preflight(cfg, config_json("qwen"), free=free, total=2 * 10**11, formula=(1.0, 1.1, True))
        assert "under expandable segments (the patch sets them)" in gate[key]
        (tmp_path / "patched-X.txt").write_text(head + f"  Soup: {gate[key].splitlines()[0]}\n  outcome: "
                                                "refused by Soup's gate; soup exit code 1\n")
        run = findings.resident_patch_run(tmp_path / "patched-X.txt")
        assert run["model"] == "qwen" and abs(float(run["need"]) - gate["gate_bytes"] / 1e9) <= places, key
        assert abs(float(run["free"]) - free / 1e9) <= places, key
        assert findings.resident_patch_gate(run) == f"patched, needs {run['need']} GB free of {run['free']} GB"
    (tmp_path / "patched-Y.txt").write_text(head + "  Soup: Hardware-fit: a wording no regex knows\n")
    run = findings.resident_patch_run(tmp_path / "patched-Y.txt")
    assert run["need"] is None and "not read" in findings.resident_patch_gate(run)
    assert not run["admitted"] and "no outcome" in run["outcome"]


def test_the_findings_render_a_search_and_a_resident_patch_call_cut_short_and_say_what_is_missing(tmp_path, capsys):
    """Reviewer item 6: a --find-max search with no OOM, no like-for-like answer (the resident estimate refused it)
    and no Soup gate at the first OOM, a rerun's text whose JSON is missing without a timeout, and a resident-patch
    folder cut after its stock run's first line all render without a traceback, each saying what is not there;
    a resident search on expandable segments names that allocator and gets no default-allocator cause."""
    import json
    import shutil

    findings = load("findings")
    d = json.loads((ROOT / findings.FIND_MAX_RUNS[0]).read_text(encoding="utf-8"))
    m = d["measured"]
    m["probes"] = [p for p in m["probes"] if p["outcome"] != "OOM"]
    m.update(oom_above=None, proven=False)
    d.update(this_tool_longest_like_for_like=None, this_tool_longest=None, soup_gate_above_limit=None,
             margin_at_first_oom=None, box_context_bytes=None)
    d["resident"].update(estimate_refused="a MoE base", allocator_conf="expandable_segments:True")
    (tmp_path / "results/resident-findmax-expandable-x").mkdir(parents=True)
    (tmp_path / "results/resident-findmax-expandable-x/find-max-a.json").write_text(json.dumps(d))
    text = (ROOT / findings.FIND_MAX_RUNS[0]).with_suffix(".txt").read_text(encoding="utf-8")
    (tmp_path / "results/resident-findmax-expandable-x/find-max-b.txt").write_text(
        text.replace("--allow-oom-attempt, a fresh", "--allow-oom-attempt with PYTORCH_CUDA_ALLOC_CONF=x (why), a fresh"))
    (tmp_path / "results/resident-findmax-expandable-x/commands.txt").write_text(
        "exit 0, wall 1.0 s: python3 x.py --find-max seq --json /tmp/r/find-max-b.json\n")
    patch = tmp_path / "results/resident-patch-x"
    patch.mkdir(parents=True)
    first = (ROOT / findings.RESIDENT_PATCH[0] / "stock-A.txt").read_text(encoding="utf-8").splitlines()[0]
    (patch / "stock-A.txt").write_text(first + "\n")
    shutil.copy(ROOT / findings.RESIDENT_PATCH[0] / "corrected-preflight.diff", patch)
    findings.ROOT, findings.RESIDENT_PATCH = tmp_path, ["results/resident-patch-x"]
    findings.FIND_MAX_RUNS = ["results/resident-findmax-expandable-x/find-max-a.json"]
    findings.find_max_searches()
    findings.resident_patch_proof()
    out = capsys.readouterr().out
    assert "resident, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True |" in out
    assert "none (its estimate refused the run)" in out and "default caching allocator" not in out
    assert "no answer or no limit to set beside it on" in out and "the box's context: not measured" in out
    assert "exited 0" in out and "cut by its call's budget" not in out
    assert "no outcome" in out and "On stock Soup, `--estimate` (`est-A.txt`): not run." in out
    assert "The patched gate admitted no run here (no patched run in the folder)." in out


def test_the_findings_growth_column_says_why_a_search_has_no_growth_and_labels_an_answer_above_the_limit():
    """Issue 51 item 4's column (bench/findings.py grown): a committed search whose probes read the runtime's growth
    renders its answer beside the limit in steps; one whose probes predate the exit hook's reading (no free_held)
    says so; one whose probes ran with it but none of which read the growth (each failed before its exit hook) does
    not claim to predate it; an answer past the measured limit reads ABOVE."""
    import json

    findings = load("findings")
    path = next(p for p in findings.FIND_MAX_RUNS if "gc-growth" in p and "phi2" in p)
    d = json.loads((ROOT / path).read_text(encoding="utf-8"))
    res = d["measured"]["resolution"]
    assert findings.grown(d, res, "none") == "832 (3 steps under), growth 176.9 MB"
    assert findings.grown({**d, "this_tool_longest_like_for_like_measured_growth": 1088}, res, "none").startswith(
        "1088 (1 step ABOVE)")
    unread = {k: v for k, v in d.items() if k not in ("runtime_growth_bytes",
                                                     "this_tool_longest_like_for_like_measured_growth")}
    assert findings.grown(unread, res, "none") == "not read (no probe's process read it)"
    old = {**unread, "measured": {**d["measured"], "probes": [{k: v for k, v in p.items() if k != "free_held"}
                                                              for p in d["measured"]["probes"]]}}
    assert findings.grown(old, res, "none") == "not read (its probes predate the reading)"


@pytest.mark.parametrize("script", sorted(p.stem for p in (ROOT / "bench").glob("*.py")
                                           if "issue395" in p.read_text(encoding="utf-8")))
def test_every_bench_script_imports_what_the_package_holds_now(script):
    """A bench script runs only on a GPU box, where a name the package has moved costs device
    time to find: loading it here resolves every import it makes (its main never runs)."""
    load(script)


@pytest.mark.parametrize("script", ["estimator_checks", "rerenders"])
def test_a_render_script_refuses_a_missing_or_unknown_subcommand_in_one_line(script, capsys):
    """Issue 50 item 5: the merged render scripts take exactly one subcommand; none, an unknown one or two is
    one line on stderr naming the subcommands, exit 2, and nothing rendered."""
    module = load(script)
    for argv in ([], ["nope"], [next(iter(module.COMMANDS)), "extra"]):
        assert module.main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and "|".join(module.COMMANDS) in err, (argv, err)


def test_the_committed_task_estimates_are_what_the_task_anatomy_arms_give_now():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "estimator_checks.py"), "tasks"], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    assert out == (ROOT / "results" / "estimator-tasks.txt").read_text()
    # the map arms were measured after the terms were written (out of sample but for SmolLM2 and
    # Qwen2.5); the two Qwen2.5 KTO 512x2 arms once under by 0.36 and 0.28 MB held the cuBLASLt
    # workspace of Qwen2.5's biased projections, charged since: none is under. The closest sits 1.0000x
    # since the allowance's refit to 3.0 MB (docs/PEAK.md, "ALLOCATED_ALLOWANCE_BYTES")
    assert "corrected under on 0;" in out and "min 1.0000x" in out


def test_soup_train_card_writes_a_soup_yaml_soups_loader_takes_for_the_task_and_refuses_bad_input(tmp_path, capsys):
    """The real-client bench on CPU: its soup.yaml is read back by Soup's own loader (the task, its
    data.format, one epoch of exactly --steps batches, the gate's override); bad input exits 2."""
    import json

    import yaml

    bench = load("soup_train_card")
    assert bench.main(["--family", "qwen", "--task", "kto", "--seq", "256", "--batch", "2", "--steps", "3",
                       "--card", "12GB", "--override", "5000000000", "--work", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "-m soup_cli train --config" in out and "Soup's loader takes it" in out
    config = yaml.safe_load((tmp_path / "soup.yaml").read_text())
    assert (config["task"], config["data"]["format"], config["data"]["val_split"]) == ("kto", "kto", 0.0)
    assert config["training"]["stream_vram_override"] == 5_000_000_000 and config["training"]["batch_size"] == 2
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {r["label"] for r in rows} == {True, False}
    # issue 51 item 6: a resident run (its gate: commands/train.py's), gradient checkpointing on, Soup's gate kept
    assert bench.main(["--family", "qwen", "--seq", "256", "--card", "24GB", "--train", "stream_layers=false",
                       "--train", "gradient_checkpointing=true", "--work", str(tmp_path / "r"), "--dry-run"]) == 0
    training = yaml.safe_load((tmp_path / "r" / "soup.yaml").read_text())["training"]
    assert (training["stream_layers"], training["gradient_checkpointing"]) == (False, True)
    assert "stream_vram_override" not in training and "training.stream_layers: False" in capsys.readouterr().out
    for bad in (["--task", "kto", "--batch", "1"], ["--family", "nope"], ["--card", "huge"], ["--train", "x"]):
        argv = ["--family", "qwen", "--seq", "256", "--card", "12GB", *bad]
        with pytest.raises(SystemExit) as exc:
            bench.main(argv)
        assert exc.value.code == 2


def test_the_committed_full_077_map_render_is_what_its_row_file_gives_now():
    """The 0.77.0 full map stopped at its time limit before writing its JSON: its row file and stack.txt are
    what it left, and bench/rerenders.py map-077 renders them through --from-json; the committed render is what
    the script prints now, and it never counts an arm the row file lacks."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "rerenders.py"), "map-077"], capture_output=True,
                         text=True, check=True, timeout=300).stdout
    assert out == (ROOT / "results" / "map-077-full-h200-soup0.77.0-684477c-render.txt").read_text()
    assert "planned 277 arms; 246 reported (241 measured" in out and "not run (31:" in out
    assert "corrected estimate: never under on the 241 measured row(s)" in out


@pytest.mark.slow
def test_the_committed_schedule_simulation_is_what_the_committed_map_timings_give_now():
    """bench/schedule_sim.py replays the committed full map's timings through host/schedule's ledger (a
    simulation, said so in its first line); Soup's own number for each arm is 0.77.0's, so it runs where
    0.77.0's code is."""
    from issue395.estimator.releases import release_source

    if release_source("0.77.0") is None:
        pytest.skip("soup-cli 0.77.0's own code is not here (its venv runs it)")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "schedule_sim.py")], capture_output=True, text=True,
                         check=True, timeout=300).stdout
    assert out.startswith("A SIMULATION, not a measurement")
    assert out == (ROOT / "results" / "schedule-sim-map-077.txt").read_text()


def test_the_fit4_render_is_what_the_anatomy_and_find_max_files_give_now():
    """Issue 34's measured runs against the estimator as it stands: the committed render is the script's
    output; the held gradients the estimate adds at 4 (or 2) micro-batches match the replayed history's
    difference to 0.5 MB on every pair whose peak phase holds them; under expandable segments the corrected
    peak is within [1.00, 1.02] of the allocated peak and needs-free covers the pages live blocks touch, on
    every arm; on every --find-max config this tree's like-for-like longest is the measured limit or one
    resolution step below it, never above; and at every OOM torch printed, the reserve charged covers the
    reserve torch held. The reserve (11 pages) was chosen to cover the first 8 pages arms and the OOM
    readings, so "needs free covers the pages" holds by construction there; the 5 reruns of the next call
    (PART=2, among them the arms the default allocator read under) were not used to choose it."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "rerenders.py"), "fit4"], capture_output=True,
                         text=True, check=True, timeout=300).stdout
    assert out == (ROOT / "results" / "fit4-anatomy-findmax-render.txt").read_text()
    pairs = out.split("\npair ")[1].split("\n\n")[0].splitlines()[1:]
    held = [ln for ln in pairs if "mistral" not in ln]  # Mistral r256's peak is the optimizer's: no held gradients
    assert len(held) == 3
    for ln in held:
        *_, replayed, estimated = ln.split()
        assert abs(float(replayed) - float(estimated)) <= 0.5, ln
    pages = out.split("needs free - pages MB\n")[1].split("\nallocated: ")[0].splitlines()
    assert len(pages) == 13
    for ln in pages:
        ratio, needs_minus_pages = ln.split()[3], ln.split()[-1]
        assert 1.0 <= float(ratio.rstrip("x")) <= 1.02 and float(needs_minus_pages) >= 0, ln
    reruns = out.split("corrected / max_memory_allocated\n")[1].split("\n\n")[0].splitlines()
    assert len(reruns) == 6 and all(1.0 <= float(ln.split()[-1].rstrip("x")) <= 1.02 for ln in reruns), reruns
    fm = out.split("\nconfig ")[1].split("\n\n")[0].splitlines()[1:-1]
    assert len(fm) == 8 and all(int(ln.split()[-2]) in (0, 1) for ln in fm), fm
    # at each OOM whose message torch printed in Soup's process: the corrected peak covers the allocated
    # bytes plus the failed request, within 1%, and the charges cover the reserve and what was outside
    ooms = out.split("\nprobe ")[1].splitlines()[1:-1]
    assert len(ooms) == 7
    for ln in ooms:
        *_, would_be, corrected, reserve, reserve_charged, outside, outside_charged = ln.split()
        assert 1 <= float(corrected) / float(would_be) <= 1.01, ln
        assert float(reserve_charged) >= float(reserve) and float(outside_charged) >= float(outside), ln


def test_the_stack_render_is_what_both_stacks_rows_give_now():
    """Issue 37's comparison, pinned against latest: the committed render is the script's output; every arm
    both stacks measured is equal to the byte or apart by 1,024 B, and the arm apart measured alone in one
    process on each stack is equal to the byte there (the difference is the map's process, not the stack);
    the corrected estimate is never under on any latest-stack arm; and on Gemma-2 the bytes the estimator
    charges for eager attention's masks on transformers 5.24.0 are the replayed difference the history shows,
    held by eager_mask's blocks."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "rerenders.py"), "stack-latest"], capture_output=True,
                         text=True, check=True, timeout=300).stdout
    assert out == (ROOT / "results" / "stack-latest-vs-pinned.txt").read_text()
    arms = out.split("corrected/latest\n")[1].split("\n\n")[0].splitlines()
    assert len(arms) == 60
    assert {ln.split()[-2] for ln in arms} <= {"0", "1,024"}
    assert all(float(ln.split()[-1].rstrip("x")) >= 1 for ln in arms)
    alone = [ln for ln in out.splitlines() if ln.startswith("    ") and "max_memory_allocated pinned" in ln]
    assert len(alone) == 2 and all(ln.count("(+0)") == 2 for ln in alone), alone
    assert ", 0 under" in out
    latest = out.split("  latest: max_memory_allocated")[1].splitlines()[0]
    charged = int(latest.split("eager masks charged ")[1].split(" B")[0].replace(",", ""))
    diff = out.split("replayed latest - pinned: ")[1]
    assert int(diff.split(" B")[0].replace(",", "").lstrip("+")) == charged == 8_388_608
    assert diff.count("block(s)") == 1 and "eager_mask" in diff


def test_the_resident_find_max_device_call_settles_each_of_its_searches_on_cpu(capfd, monkeypatch, tmp_path):
    """bench/gpu-next.sh resident-findmax (issue 51 item 4): each `search TAG AXIS CARD` it runs is a --find-max on a
    resident soup.yaml the script writes (`configs DIR`) that this tree settles and plans on CPU (--dry-run: Soup's own loader and checks on the
    probe's file, the resident estimate's first probe, Soup's gate lifted by --allow-oom-attempt), so a bad file or
    card costs no device time; the script names at least four, the resident-*.yaml files it writes, one of them checkpointed."""
    import re

    from conftest import main

    script = (ROOT / "bench" / "gpu-next.sh").read_text()
    searches = re.findall(r"^\s*search (\S+) (seq|batch) (\S+)$", script, re.MULTILINE)
    subprocess.run(["bash", str(ROOT / "bench" / "gpu-next.sh"), "configs", str(tmp_path)], check=True, timeout=30)
    files = sorted(p.name for p in tmp_path.glob("resident-*.yaml"))
    assert len(searches) >= 4 and sorted(f"resident-{t}.yaml" for t, _, _ in searches) == files
    monkeypatch.chdir(ROOT)
    for tag, axis, card in searches:
        code, out, err = main(capfd, ["--find-max", axis, "--config", str(tmp_path / f"resident-{tag}.yaml"),
                                      "--emulate-card", card, "--dry-run"])
        assert code == 0 and "a resident run, training.stream_layers false" in out, (tag, err)
        probe = out.split("each probe runs it with --allow-oom-attempt):\n", 1)[1]  # the first probe's soup.yaml
        assert "--yes --allow-oom-attempt" in out and "stream_layers: false" in probe and "stream_vram_override" not in probe
    assert any("gradient_checkpointing: true" in (tmp_path / f).read_text() for f in files)


def test_the_readmes_task_figures_are_what_results_estimator_tasks_says():
    """Reviewer item 6: every figure README.md quotes from results/estimator-tasks.txt (its arms, its corrected
    min, median and max over real) is the committed file's own 'all:' line, so a re-render cannot leave it stale."""
    import re

    line = next(x for x in (ROOT / "results" / "estimator-tasks.txt").read_text().splitlines() if x.startswith("all:"))
    n, low, mid, high = re.fullmatch(r"all: (\d+) arms; corrected under on 0; min (\S+); median (\S+); max (\S+); .*",
                                     line).groups()
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    quoted = [m.start() for m in re.finditer(re.escape("`results/estimator-tasks.txt`"), readme)]
    assert len(quoted) == 2
    assert f"over the {n} committed H200 task arms {low} to {high} of the real peak, median {mid}: " in readme
    assert f"({n} task arms:" in readme and f"never under, median {mid} (`results/estimator-tasks.txt`)" in readme


def test_the_segments_reading_counts_what_live_large_pool_blocks_hold_past_their_rounding_by_class():
    """Issue 52 item 1: task_peak_anatomy.py --segments reads the allocator's segments, where the history cannot
    say which live block a cached free block was handed to whole. Fake: only torch.cuda.memory._snapshot()'s dict,
    written by hand (segments of blocks: size, requested_size, address, state). A 2.5 MiB adapter-shaped request
    handed a 3 MiB block counts 0.5 MiB in the 1-10 MiB class; a block split at its 512 B rounding, a small-pool
    block and a large own-segment block cut to its request count 0; free and stream-pending blocks are not live."""
    A = load("task_peak_anatomy")
    MiB = 2**20
    adapter = {5 * MiB // 2, 5 * MiB // 2 + 100, 1000}
    snapshot = {"device_traces": [], "segments": [
        {"address": 1 << 32, "total_size": 20 * MiB, "segment_type": "large", "blocks": [
            {"address": (1 << 32), "size": 3 * MiB, "requested_size": 5 * MiB // 2, "state": "active_allocated"},
            {"address": (1 << 32) + 3 * MiB, "size": 5 * MiB // 2 + 512, "requested_size": 5 * MiB // 2 + 100,
             "state": "active_allocated"},
            {"address": (1 << 32) + 11 * MiB // 2 + 512, "size": 4 * MiB, "requested_size": 3 * MiB,
             "state": "inactive"},
            {"address": (1 << 32) + 19 * MiB // 2 + 512, "size": 3 * MiB, "requested_size": 2 * MiB,
             "state": "active_pending_free"}]},
        {"address": 1 << 33, "total_size": 2 * MiB, "segment_type": "small", "blocks": [
            {"address": (1 << 33) + 4096, "size": 1024, "requested_size": 1000, "state": "active_allocated"}]},
        {"address": 1 << 34, "total_size": 12 * MiB, "segment_type": "large", "blocks": [
            {"address": 1 << 34, "size": 12 * MiB, "requested_size": 12 * MiB - 300, "state": "active_allocated"}]}]}
    got = A.read_segments(snapshot, adapter)
    rows = [dict(zip(got["block_fields"], b)) for b in got["blocks"]]
    assert [(b["size"], b["offset"], b["segment_size"], b["pool"], b["adapter"]) for b in rows] == [
        (3 * MiB, 0, 20 * MiB, "large", True), (5 * MiB // 2 + 512, 3 * MiB, 20 * MiB, "large", True),
        (1024, 4096, 2 * MiB, "small", True), (12 * MiB, 0, 12 * MiB, "large", False)]
    assert rows[1]["requested_size"] == 5 * MiB // 2 + 100
    mid = got["rests"]["adapter"]["1-10MiB"]
    assert (mid["blocks"], mid["whole"], mid["rest"]) == (2, 1, MiB // 2)
    assert mid["rest"] <= mid["bound"]  # the estimator's bound holds over the same live blocks
    assert got["rests"]["adapter"]["<=1MiB"] == {"blocks": 1, "whole": 0, "rest": 0, "bound": 0}
    assert got["rests"]["other"][">=10MiB"]["rest"] == 0 and got["rest"] == {"adapter": MiB // 2, "other": 0}
    assert got["allocated"] == 3 * MiB + 5 * MiB // 2 + 512 + 1024 + 12 * MiB
    assert A.read_segments({"segments": []}, adapter)["blocks"] == []


def test_task_peak_anatomy_takes_segments_and_says_it_records_nothing_without_cuda(capsys):
    """Issue 52 item 1: --segments is accepted on a host without CUDA (this CPU one), which measures nothing and
    says the segments are not recorded either, exit 0."""
    A = load("task_peak_anatomy")
    assert not torch.cuda.is_available()
    assert A.main(["--task", "sft", "--base", "none", "--seq", "64", "--segments"]) == 0
    out = capsys.readouterr().out
    assert "nothing measured" in out and "--segments: no snapshot taken" in out
    assert A.parse(["--task", "sft", "--base", "none", "--seq", "64"]).segments is False


def test_the_trace_written_for_a_synthetic_sequence_is_the_device_historys_events_in_order(tmp_path):
    """Issue 52 item 1: --trace writes the longest device trace's events, in order, as [action, addr, size, stream]
    (frames dropped), so a committed call can be replayed through estimator.allocator on CPU. The snapshot is a
    hand-made dict in torch's _snapshot() shape: this host has no CUDA."""
    import gzip
    import json

    A = load("task_peak_anatomy")
    events = [{"action": "segment_alloc", "addr": 0, "size": 2 << 20, "stream": 0, "frames": [{"name": "f"}]},
              {"action": "alloc", "addr": 0, "size": 1000, "stream": 7, "frames": []},
              {"action": "free_requested", "addr": 0, "size": 1000, "stream": 7}]
    seg = {"address": 0, "total_size": 2 << 20, "stream": 0, "segment_type": "small",
           "blocks": [{"address": 0, "size": 1024, "requested_size": 1000, "state": "active_allocated",
                       "frames": [{"name": "f"}]}]}
    start = A.segments_of({"segments": [seg]})
    assert start == [{"address": 0, "total_size": 2 << 20, "stream": 0, "blocks": [
        {"address": 0, "size": 1024, "requested_size": 1000, "state": "active_allocated"}]}]
    A.save_trace({"device_traces": [events[:1], events], "segments": []}, tmp_path / "t.gz", start)
    with gzip.open(tmp_path / "t.gz", "rt") as f:
        assert json.load(f) == {"start_segments": start, "end_segments": [], "events": [
            ["segment_alloc", 0, 2 << 20, 0], ["alloc", 0, 1000, 7], ["free_requested", 0, 1000, 7]]}
    with pytest.raises(SystemExit):  # a path whose folder is missing is refused before anything runs
        A.parse(["--task", "sft", "--base", "x", "--seq", "64", "--trace", str(tmp_path / "no" / "t.gz")])


def test_a_run_that_died_under_soup_train_card_keeps_torchs_out_of_memory_figures():
    """The resident-patch proof's runs that died left only "admitted and died: OOM" (their reserve unrecorded): a
    died run now prints Soup's line, torch's out-of-memory figures read from it (the reserve held but not handed
    over) and the exit hook's allocator peaks; a completed or refused run prints none. The probe is built by the
    real judge from a console line torch writes (faked: a CUDA OOM cannot happen on CPU)."""
    from dataclasses import replace

    from issue395.constraints import findmax as F

    bench = load("soup_train_card")
    oom = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.99 GiB. GPU 0 has a total capacity of "
           "139.80 GiB of which 667.56 MiB is free. Process 2519 has 117.44 GiB memory in use. Including non-PyTorch "
           "memory, this process has 21.70 GiB memory in use. Of the allocated memory 17.88 GiB is allocated by "
           "PyTorch, and 3.08 GiB is reserved by PyTorch but unallocated.\n")
    died = F.judge(3136, oom, 1, None, 2, 30.0)
    died = replace(died, allocator=F.ProbeAllocator(22_368_572_928, 22_367_723_322, 22_502_440_960))
    lines = bench.died_lines(died)
    assert died.outcome == F.OOM and lines[0].startswith("Soup's line: ")
    assert "reserved but unallocated 3,307,124,817 B" in lines[1] and "reserved 22,502,440,960 B" in lines[2]
    assert bench.died_lines(F.judge(3072, "{'loss': 1}\n", 0, 2, 2)) == []


@checked_stack
def test_the_meta_capture_replays_the_committed_resident_anatomies_rests_within_a_tenth_of_a_megabyte():
    """Issue 52 item 1: bench/allocator_replay.py's request sequence of a resident LoRA SFT bf16 step, captured from
    the real transformers + peft model on the meta device and replayed through estimator/allocator.py, keeps at
    its peak the rests (allocated-bytes peak minus the history's replayed peak) the card's max_memory_allocated
    showed on the committed anatomy arms: Qwen2.5-0.5B 2048x1 107,741,184 B and Llama-3.2-1B 2048x1 25,088 B
    (results/resident-anatomy-*/call-1), each within 0.1 MB. No CUDA is faked: the card's figures are the JSON's."""
    replay = load("allocator_replay")
    got = {label: (measured, f) for label, measured, f in replay.validations()}
    for label, measured in (("res-sft-qwen-bf16-2048x1", 107_741_184), ("res-sft-llama1b-bf16-2048x1", 25_088)):
        held, f = got[label]
        assert held == measured, label  # the committed JSON's own figure
        assert abs(f["rests"] - measured) <= 100_000, (label, f)
        assert f["resident"] > 0 and f["peak_allocated"] == f["replayed_peak"] + f["rests"]


@checked_stack
def test_the_nf4_capture_keeps_the_committed_nf4_anatomys_blocks_and_peak():
    """Issue 52 item 1: bench/allocator_replay.py's emulation of Soup's resident NF4 step (bitsandbytes' own Python
    on the meta device, CUDA gemm_4bit's dequantising fallback substituted) against the committed Llama-3.2-1B
    NF4 2048x1 anatomy (results/resident-anatomy-*/call-1/res-sft-llama1b-nf4-2048x1.json): the blocks live at its
    requested peak are the card's (the anatomy's eight largest sizes, each count), its allocated-bytes peak within
    0.03 MB of max_memory_allocated (9,763,476,480 B), its rests 3,145,728 B beside the measured 2,122,240 B (over,
    by the 1 MiB the card held before its step beyond the capture's load). No CUDA is faked: the card's figures
    are the JSON's."""
    import collections
    import json

    from issue395.estimator.allocator import replaying

    replay = load("allocator_replay")
    d = json.loads((ROOT / replay.ANATOMY / "res-sft-llama1b-nf4-2048x1.json").read_text())
    events = replay.capture("llama32-1b", d["seq"], d["batch"], d["r"], tuple(d["targets"].split(",")), quant="nf4")
    f = replay.figures(events)
    assert abs(f["peak_allocated"] - d["real_peak"]) <= 30_000, f
    assert 0 <= f["rests"] - (d["real_peak"] - d["replayed_peak"]) <= 1_100_000, f
    start, top = None, (-1, None)
    for j, e, a, held in replaying(events):
        if e[0] == "reset_peak":
            start = j
        if start is not None and a.requested > top[0]:
            top = (a.requested, collections.Counter(b.requested for i, b in held.values() if i > start))
    card = next(p["live"] for p in d["phases"] if p["from"] == "forward 1 (grad) end")
    assert {int(k): v for k, v in card.items()} == {k: top[1][k] for k in map(int, card)}


FULL_ROWS = "results/resident-full-h100-soup0.77.0-96b7b97"


@pytest.mark.slow
@checked_stack
def test_the_meta_capture_of_a_full_fine_tuning_step_replays_to_the_committed_full_rows_peaks():
    """Issue 51 (full fine-tuning on fp32 master weights, soup-cli 0.77.0): bench/allocator_replay.py capture --full,
    the real transformers model's step on the meta device (fp32 weights, bf16 autocast, the Trainer's two foreach
    AdamW groups) replayed through estimator/allocator.py, peaks at the optimizer's step within the estimate's
    allowance under each committed full row's max_memory_allocated, never over (Qwen2.5-0.5B and Llama-3.2-1B
    1024x1, checkpointing off and on). Its rests are history, not a rule a block: Qwen's 3.0625 MiB q/o
    gradients and states land whole in the backward's freed 3.5 MiB fp32 blocks, many more of which are left
    without checkpointing (39,878,656 B) than with it (18,546,688 B), each far below the 1 MiB a block bound the
    estimate charges over the gradients, states and square roots. No CUDA is faked: the card's figures are the
    rows' JSON."""
    import json

    from issue395.constants import unsplit_rests
    from issue395.estimator.estimate import ALLOCATED_ALLOWANCE_BYTES
    from issue395.estimator.full import full_params
    from issue395.estimator.arch import arch_from_config
    from issue395.model.registry import config_json

    replay = load("allocator_replay")
    rests = {}
    for key, name in (("qwen", "qwen"), ("llama32-1b", "llama")):
        bound = 4 * unsplit_rests(4 * n for n in full_params(arch_from_config(config_json(key))))
        for gc in (False, True):
            row = json.loads((ROOT / FULL_ROWS / f"full-{name}-gc{str(gc).lower()}.json").read_text())["rows"][0]
            f = replay.figures(replay.capture_full(key, row["seq"], row["batch"], gc))
            assert f["resident"] == row["resident"], (key, gc, f)
            assert 0 <= row["real_peak"] - f["peak_allocated"] <= ALLOCATED_ALLOWANCE_BYTES, (key, gc, f)
            assert f["rests"] < bound / 10, (key, gc, f, bound)
            rests[key, gc] = f["rests"]
    assert rests["qwen", False] > rests["qwen", True] + 10_000_000 > 10_000_000


def test_a_dispatch_mode_turns_the_engines_in_place_gradient_sum_into_a_new_block_which_the_capture_undoes():
    """Issue 51 item 4: on CPU, a tensor read by two branches has its two gradients summed by autograd's
    InputBuffer in place (the sum's storage is one of theirs) with no Python dispatch mode, into a new tensor under
    any (the mode's reference): so the capture's Recorder, where allocator_replay.ENGINE_ORDER is on (the
    checkpointed LoRA capture), returns the engine's sum in place of a new block, and off keeps the new one."""
    import contextlib

    replay = load("allocator_replay")
    made = []

    class Branch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            out = torch.ones_like(g)
            made.append(out.data_ptr())  # not the tensor: a reference of the test's would stop the in-place sum
            return out

    def summed_in_place(mode, engine: bool = False) -> bool:
        made.clear()
        x = torch.ones(64, 64, requires_grad=True)
        y, seen = x * 2, []
        y.register_hook(lambda g: seen.append(g.data_ptr()))
        replay.ENGINE_ORDER["on"] = engine
        try:
            with mode:
                (Branch.apply(y).sum() + Branch.apply(y).sum()).backward()
        finally:
            replay.ENGINE_ORDER["on"] = False
        return seen[0] in made

    def recorder():
        rec = replay.Recorder()
        rec.thread = "bwd"
        return rec

    assert summed_in_place(contextlib.nullcontext())
    assert not summed_in_place(recorder())
    assert summed_in_place(recorder(), engine=True)


def test_the_allocator_replay_refuses_an_int8_capture_an_unknown_key_and_an_existing_events_file(tmp_path, capsys):
    """bad input to bench/allocator_replay.py capture is one line on stderr and exit 2, and a file it did not write
    is not overwritten: int8 (neither bf16 nor NF4), a key the registry lacks, --events on an existing file; and
    (review item 5) --gemm-4bit other than sm90 on a bf16 capture or past 1,536 tokens (1024x2), where no choice of
    gemm_4bit's is made and the capture would be labelled with one that never ran; (review, today) an adapter's
    --r or --targets with --full, which trains no adapter: dropped options are refused, not ignored; and (issue 51
    item 4) --checkpointing under NF4, whose kbit preparation's checkpointing set-up is not emulated."""
    replay = load("allocator_replay")
    kept = tmp_path / "kept.json"
    kept.write_text("mine")
    for argv in (["capture", "qwen", "512", "--quant", "int8"], ["capture", "nope", "512"],
                 ["capture", "qwen", "512", "--events", str(kept)],
                 ["capture", "qwen", "512", "--gemm-4bit", "fused", "--events", str(tmp_path / "bf16.json")],
                 ["capture", "qwen", "1024", "--batch", "2", "--quant", "nf4", "--gemm-4bit", "fallback"],
                 ["capture", "qwen", "512", "--checkpointing", "--quant", "nf4"],
                 ["capture", "qwen", "512", "--full", "--quant", "nf4"],
                 ["capture", "qwen", "512", "--full", "--r", "64"], ["capture", "qwen", "512", "--full", "--targets", "q_proj"]):
        assert replay.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("bench/allocator_replay.py: "), err
        assert ("--gemm-4bit" in argv) == ("--gemm-4bit" in err), err
    assert kept.read_text() == "mine" and not (tmp_path / "bf16.json").exists()


def test_the_allocator_replay_s_trace_replays_a_real_history_to_its_real_peak_and_refuses_a_broken_one(tmp_path,
                                                                                                     capsys):
    """Issue 52 item 1, issue 51 item 3: bench/allocator_replay.py trace on the committed H100 phi-2 NF4 history prints
    the model's allocated peak equal to the run's max_memory_allocated (its JSON beside it), no departure; a history
    freeing an address it never allocated is one line on stderr and exit 2."""
    import gzip
    import json

    replay = load("allocator_replay")
    path = ROOT / "results/anatomy-and-segments52-h100-soup0.77.0-96b7b97/res-sft-phi2-nf4-512x1.trace.json.gz"
    assert replay.main(["trace", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model_minus_real"] == 0 and out["real_peak"] == 6_346_460_160 and out["departures"] == 0
    bad = tmp_path / "bad.trace.json.gz"
    bad.write_bytes(gzip.compress(b'{"events": [["free_requested", 4096, 512, 0]]}'))
    assert replay.main(["trace", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "never allocated" in err



def test_the_allocator_replay_s_trace_splits_the_adapter_blocks_rests_by_where_each_block_came_from(capsys):
    """Issue 52 item 1 (which blocks hold the rests, and why): on the committed Mistral-7B NF4 r256 all-linear history
    bench/allocator_replay.py trace names, beside the peak, the rests its adapter-shaped blocks over 1 MiB keep there,
    split into those made before the history (the parameters) and those cut in it, by the request last freed at the
    block's address; the split adds up to every rest at that peak (no other block keeps one there), and the
    parameters and the blocks cut from freed 8 MiB requests each keep some."""
    import json

    replay = load("allocator_replay")
    path = ROOT / "results/segments52-mistral-r256-h100-soup0.77.0-927f7a2/seg-sft-mistral-nf4-1024x1-r256-all-s3-a1" \
        ".trace.json.gz"
    assert replay.main(["trace", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    by = out["adapter_rests_by_origin"]
    assert out["model_minus_real"] == 0 and sum(by.values()) == out["adapter_rests"] == out["rests_at_peak"]
    assert by["before the history"] > 0 and by[f"cut where {8 * 2**20} B was freed"] > 0
    assert 0 < out["adapter_blocks_with_rests"] < out["adapter_blocks_over_1_mib"]

#: Reduced widths of each structure the CPU-measured counts name (two layers, a 512-token vocabulary): Qwen2.5's
#: biased attention, Qwen3's q/k norms, phi's parallel block (bf16, and NF4: its fp32 residual; each with
#: microsoft/phi-2's own resid_pdrop 0.1, and with qk_layernorm, which the resident estimate refuses), Phi-3's fused
#: qkv and Llama under NF4, and DeepSeek-V3's latent attention with a dense layer 0 and routed experts.
PHI_WIDTHS = dict(hidden_size=128, intermediate_size=320, num_attention_heads=4, num_key_value_heads=4)
SAVED_CASES = [
    ("qwen", "none", dict(hidden_size=128, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2)),
    ("qwen3-0.6b", "none", dict(hidden_size=128, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=32)),
    ("phi-2", "none", dict(hidden_size=128, intermediate_size=320, num_attention_heads=4, num_key_value_heads=4)),
    ("phi-2", "nf4", dict(hidden_size=128, intermediate_size=320, num_attention_heads=4, num_key_value_heads=4)),
    ("phi-2", "none", dict(PHI_WIDTHS, resid_pdrop=0.1)), ("phi-2", "nf4", dict(PHI_WIDTHS, resid_pdrop=0.1)),
    ("phi-2", "none", dict(PHI_WIDTHS, qk_layernorm=True)), ("phi-2", "nf4", dict(PHI_WIDTHS, qk_layernorm=True)),
    ("phi3-mini", "nf4", dict(hidden_size=128, intermediate_size=320, num_attention_heads=4, num_key_value_heads=4)),
    ("llama32-1b", "nf4", dict(hidden_size=128, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=32)),
    ("moonlight", "none", dict(hidden_size=128, intermediate_size=320, moe_intermediate_size=64, n_routed_experts=8,
                               num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=64,
                               num_attention_heads=4, num_key_value_heads=4, qk_nope_head_dim=32, qk_rope_head_dim=16,
                               v_head_dim=32, first_k_dense_replace=1))]


def small_config(key: str, widths: dict) -> tuple:
    """A family's config at two layers, a 512 vocabulary and ``widths`` (the CPU saved counts' reduced shapes): the
    dict, its Arch, and transformers' config of it on SDPA."""
    from transformers import AutoConfig

    from issue395.estimator.arch import arch_from_config
    from issue395.model.registry import config_json

    c = {**config_json(key), "num_hidden_layers": 2, "vocab_size": 512, "pad_token_id": None, "bos_token_id": None,
         "eos_token_id": None, **widths}
    config = AutoConfig.for_model(**c)
    config._attn_implementation = "sdpa"
    return c, arch_from_config(c), config


@checked_stack
@pytest.mark.parametrize("key,quant,widths", SAVED_CASES, ids=[
    f"{k}-{q}" + "".join(f"-{n}" for n in ("resid_pdrop", "qk_layernorm") if n in w) for k, q, w in SAVED_CASES])
def test_each_layers_cpu_saved_count_under_cudas_autocast_is_what_the_resident_estimate_keeps(key, quant, widths):
    """Issue 51 item 3: bench/allocator_replay.py saved (the real transformers + peft layers on CPU under CUDA's
    autocast lists, fused dropout, memory-efficient SDPA; NF4 by bitsandbytes' CPU Linear4bit) counts what each
    decoder layer saves a token for its backward; the resident estimate's kept_per_layer is that count to the byte
    after layer 0; layer 0's count also holds the rotary tables (first saved there), which their own term charges:
    kept_per_layer and that term together are at or above it. The method behind layer.py's CPU-measured figures (Phi-3 NF4's v,
    phi's layer 0, phi NF4's bf16 casts of its fp32 residual's tensors: autocast_casts, DeepSeek-V3's latent_retained),
    run at reduced widths. phi's resid_pdrop (microsoft/phi-2's 0.1) keeps two 1 B masks h wide a layer from 1 on
    (layer.resid_masks), in the count to the byte. A run the resident estimate refuses (phi's qk_layernorm) saves
    more than the count, and is refused in one line, streamed too: never estimated as if the setting were off."""
    from issue395.estimator.layer import LORA_DROPOUT_MASK_BYTES
    from issue395.estimator.resident import estimate_resident, kept_per_layer, targets_of

    replay = load("allocator_replay")
    c, a, config = small_config(key, widths)
    targets = targets_of(a, None, c)
    got = replay.saved_per_token(config, quant, targets, 8, 0.05, (64, 128))
    kept = kept_per_layer(a, quant, targets, 8, LORA_DROPOUT_MASK_BYTES)
    if widths.get("qk_layernorm"):
        from issue395.errors import UsageError
        from issue395.estimator.estimate import estimate

        assert all(got[n] > kept[n] for n in range(1, a.L)), (got, kept)
        for run in (estimate_resident, estimate):
            with pytest.raises(UsageError, match="qk_layernorm"):
                run(c, quant=quant, seq=128, targets=targets)
        return
    rotary = estimate_resident(c, quant=quant, seq=128, targets=targets).terms["rotary_tables"] / 128
    assert [got[n] for n in range(1, a.L)] == kept[1:], (got, kept)
    assert got[0] <= kept[0] + rotary, (got, kept, rotary)


@checked_stack
@pytest.mark.parametrize("key,targets,widths", [
    ("llama32-1b", ("q_proj", "o_proj"), dict(hidden_size=128, intermediate_size=320, num_attention_heads=4,
                                                num_key_value_heads=2, head_dim=32)),
    ("qwen", ("q_proj", "v_proj", "o_proj", "down_proj"), dict(hidden_size=128, intermediate_size=320,
                                                                 num_attention_heads=4, num_key_value_heads=2)),
    ("phi3-mini", ("qkv_proj", "o_proj"), dict(hidden_size=128, intermediate_size=320, num_attention_heads=4,
                                               num_key_value_heads=4)),
    ("phi-2", ("q_proj", "k_proj", "v_proj", "dense"), dict(PHI_WIDTHS))])
def test_a_bf16_nf4_adapter_without_dropout_saves_no_copy_of_sdpas_output_for_o_proj_on_the_llama_type(key, targets,
                                                                                                       widths):
    """Issue 52 (the held-out resident survey's Llama-3.2-1B NF4 DPO on all seven linears, 1.0132x): under NF4 a bf16
    adapter (SFT's, DPO's) with no LoRA dropout (DPO turns it off) takes o_proj's input, SDPA's bf16 output, as it is:
    on the llama-type decoder it is already saved by SDPA, and the count's bf16 copy is not made
    (resident.SHARED_ATTENTION_OUTPUT); Phi-3's o_proj and phi's dense take a copy, which the count keeps. CPU
    (bench/allocator_replay.py saved, at reduced widths): kept_per_layer is the saved count to the byte after layer 0.
    (An fp32 adapter, KTO's and ORPO's, is held on the H100's histories instead: tests/estimator/test_resident.py.)"""
    from issue395.estimator.resident import kept_per_layer

    replay = load("allocator_replay")
    _, a, config = small_config(key, widths)
    got = replay.saved_per_token(config, "nf4", targets, 8, 0.0, (64, 128))
    assert got[1] == kept_per_layer(a, "nf4", targets, 8, 0)[1]


@checked_stack
@pytest.mark.parametrize("key,quant,targets,dropout", [
    ("llama32-1b", "none", ("gate_proj", "up_proj", "down_proj"), 0.05), ("llama32-1b", "nf4", ("up_proj",), 0.05),
    ("qwen", "nf4", ("down_proj",), 0.0), ("qwen3-0.6b", "nf4", ("gate_proj",), 0.05),
    ("llama32-1b", "nf4", ("o_proj", "gate_proj", "up_proj", "down_proj"), 0.0), ("qwen", "none", ("o_proj",), 0.05)])
def test_a_first_layer_with_lora_on_o_proj_and_its_mlp_alone_keeps_only_what_its_targets_need(key, quant, targets,
                                                                                             dropout):
    """Issue 52: with o_proj and the MLP's linears the only LoRA targets, layer 0's input needs no gradient and
    neither do its q, k, v or SDPA's output, so those save nothing (nor, with no o_proj target, its post-attention
    norm, and its MLP keeps only what its targets need: layer.quiet_layer); under NF4 with no dropout o_proj's lora_A
    keeps SDPA's output as its own. CPU (bench/allocator_replay.py saved, at reduced widths): kept_per_layer's layer 0
    is the saved count to the byte, bf16 and NF4 (it charged SDPA's tensors: 1.005x-1.016x the meta capture's
    peak); layer 1 saves the rotary tables first, which their own term charges."""
    from issue395.estimator.layer import LORA_DROPOUT_MASK_BYTES
    from issue395.estimator.resident import estimate_resident, kept_per_layer

    replay = load("allocator_replay")
    c, a, config = small_config(key, dict(hidden_size=128, intermediate_size=320, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=32))
    got = replay.saved_per_token(config, quant, targets, 8, dropout, (64, 128))
    kept = kept_per_layer(a, quant, targets, 8, LORA_DROPOUT_MASK_BYTES if dropout else 0)
    rotary = estimate_resident(c, quant=quant, seq=128, targets=list(targets)).terms["rotary_tables"] / 128
    assert [got[0], got[1]] == [kept[0], kept[1] + rotary], (got, kept, rotary)


@checked_stack
@pytest.mark.parametrize("targets", [("fc2",), ("q_proj", "fc2"), ("dense", "fc2")])
@pytest.mark.parametrize("dropout", [0.05, 0.0])
def test_phis_first_layer_with_lora_on_fc2_but_not_fc1_charges_no_mlp_it_does_not_record(targets, dropout):
    """Issue 52: phi's parallel MLP reads the LayerNorm's output, not the attention's, so in the first layer holding a
    target only an fc1 target gives gelu_new a graph (layer.mlp_records); an fc2 target records its own LoRA alone.
    CPU (bench/allocator_replay.py saved, at reduced widths): kept_per_layer's layer 0 is at or above the saved count
    (less the rotary tables, their own term's) and over it by less than the MLP's saved blocks (it charged them:
    1.018x the meta capture's peak on fc2 alone at 2048x1; what is still over is layer 0's attention, counted whole)."""
    from issue395.estimator.layer import LORA_DROPOUT_MASK_BYTES, MLP_BACKWARD_TRANSIENTS
    from issue395.estimator.resident import estimate_resident, kept_per_layer

    replay = load("allocator_replay")
    c, a, config = small_config("phi-2", dict(hidden_size=128, intermediate_size=320, num_attention_heads=4,
                                              num_key_value_heads=4))
    got = replay.saved_per_token(config, "none", targets, 8, dropout, (64, 128))
    kept = kept_per_layer(a, "none", targets, 8, LORA_DROPOUT_MASK_BYTES if dropout else 0)
    rotary = estimate_resident(c, quant="none", seq=128, targets=list(targets)).terms["rotary_tables"] / 128
    mlp = 2 * a.i * (a.quirks.mlp_saved - MLP_BACKWARD_TRANSIENTS)  # bf16 i-wide blocks
    assert got[0] <= kept[0] + rotary < got[0] + mlp, (got, kept, rotary, mlp)
