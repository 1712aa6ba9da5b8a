"""The report for Soup maintainers, rendered from committed results: every arm where Soup's own
pre-flight is below the measured peak, with its physical cause in bytes, the missing term as a
formula, Soup's number, the corrected number and the real peak, and the --cap evidence.

    .venv/bin/python bench/findings.py > results/FINDINGS.md

Every figure is read from a committed result (measured there, or computed by Soup in that run's
setup) or computed by this tool's estimator (issue395.estimator.estimate) from the family's public config;
each is labelled. tests/test_findings.py holds the committed file to what this prints."""

from __future__ import annotations

import functools
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from issue395.estimator.estimate import estimate, estimate_key  # noqa: E402
from issue395.estimator.arch import lora_params  # noqa: E402
from issue395.estimator.soup_number import arch_of  # noqa: E402
from issue395.results.result import Result  # noqa: E402
from issue395.constraints.cap import Cap  # noqa: E402
from issue395.model.registry import config_json  # noqa: E402
from issue395.constants import ALLOC_CONF_VAR, EXPANDABLE_SEGMENTS  # noqa: E402

CAP_DIR = "results/cap-proof-and-seq512-1024-map-h200x2-soup0.73.3-b5bee37"
MAPS = ("results/margin-map-h200x2-soup0.73.3-f3ad9d2/map-2gpu.json", f"{CAP_DIR}/map-512-1024.json")
CAPS = (f"{CAP_DIR}/cap-soup.json", f"{CAP_DIR}/cap-needs-free.json", f"{CAP_DIR}/cap-control.json")
#: Each corrected term Soup's estimator has no counterpart for, as a formula (h hidden, i
#: intermediate, L layers, T = seq x batch tokens, W = a decoder layer's linear weight elements).
FORMULAS = {
    "dequantised_layer": "W16 = 2 B x W: the streamed NF4 layer dequantised to bf16, which F.linear saves for backward",
    "layer_per_token": "T x (what the recomputed layer saves per token + the MLP backward's transients), "
                       "counted op by op (issue395.estimate.layer_per_token); Soup charges 4 (h + i) per token",
    "autograd_workspace": "32 MiB: the autograd thread's own cuBLAS workspace",
    "checkpointed_inputs": "2 h L B per token; (4 L - 2) h on phi under NF4 (its residual stream is fp32 after layer 0)",
}


TABLE_HEAD = ("| arm | Soup's own GB | corrected GB | real peak GB | Soup/real | short by MB | phase | cap evidence |\n"
              "|---|---:|---:|---:|---:|---:|---|---|")


def gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.4f}"


def load(path: str) -> Result:
    return Result.from_json(json.loads((ROOT / path).read_text(encoding="utf-8")))


def cap_evidence(caps: list[Result]) -> dict[tuple, list[str]]:
    out: dict[tuple, list[str]] = {}
    for res in caps:
        for r in res.rows:
            what = ("completed" if r.measured else r.status) + (
                f" (allocated {gb(r.real_peak)}, reserved {gb(r.reserved)} GB)" if r.measured else "")
            at, limit = (r.constraint.at, r.constraint.bytes) if Cap.carries(r) else (None, None)
            cap = "no cap (control)" if at == "off" else f"capped at {at} = {gb(limit)} GB"
            out.setdefault(r.arm, []).append(f"{cap}: {what}")
    return out


def main() -> None:
    maps = [load(p) for p in MAPS]
    caps = cap_evidence([load(p) for p in CAPS])
    print("# Where Soup's stream pre-flight under-predicts: findings for Soup maintainers\n")
    print("Rendered by `bench/findings.py` from committed results (" + ", ".join(f"`{p}`" for p in MAPS + CAPS)
          + "). Real peaks: `torch.cuda.max_memory_allocated()` over one optimizer step, measured on an H200 "
          "(soup-cli 0.73.3, synthetic weights). Soup's number: its own pre-flight, computed by Soup in that "
          "arm's setup. Corrected: this tool's estimator (`issue395.estimate`) from the family's public config "
          "alone. Caps: the arm re-run in a fresh process with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` "
          "and `torch.cuda.set_per_process_memory_fraction` at the number named.\n")
    under = [(res, r) for res in maps for r in res.rows
             if r.measured and r.soup_predicted and r.soup_predicted < r.real_peak]
    print(f"{len(under)} of {sum(r.measured for res in maps for r in res.rows)} measured map arms are "
          "under Soup's own number.\n")
    print(TABLE_HEAD)
    details = []
    for res, r in under:
        e = estimate(config_json(r.model_key), quant=r.quant, seq=r.seq, batch=r.batch, targets=r.targets,
                     release=res.environment["soup_cli"], transformers=res.environment.get("transformers"),
                     soup=False)  # Soup's number is the row's
        key = r.arm
        arm = f"{r.model} {r.quant} {r.seq}x{r.batch}"
        print(f"| {arm} | {gb(r.soup_predicted)} | {gb(e.corrected_predicted)} | {gb(r.real_peak)} | "
              f"{r.soup_predicted / r.real_peak:.3f}x | {(r.real_peak - r.soup_predicted) / 1e6:.1f} | {e.phase} | "
              + ("; ".join(caps.get(key, [])) or "not capped") + " |")
        a = arch_of(config_json(r.model_key))
        T = r.seq * r.batch
        soup_act = 4 * (a.h + a.i) * T
        missing = [t for t in (("dequantised_layer", "layer_per_token", "autograd_workspace") if e.phase == "layer"
                               else ("checkpointed_inputs",)) if e.terms.get(t)]
        lines = [f"### {arm}", "",
                 f"- Soup's own pre-flight {gb(r.soup_predicted)} GB (computed by Soup); real peak "
                 f"{gb(r.real_peak)} GB (measured); corrected {gb(e.corrected_predicted)} GB allocated, "
                 f"{gb(e.needs_free)} GB free needed (this tool's estimator).",
                 f"- The peak is in the {e.phase} phase"
                 + (" (inside the first layer's recompute and backward), which Soup does not model: it adds "
                    "its logits and activations terms as if both were live at once." if e.phase == "layer" else
                    " (the loss).")]
        for t in missing:
            lines.append(f"- `{t}` = {e.terms[t] / 1e6:,.1f} MB: {FORMULAS[t]}.")
        if e.phase == "layer":
            lines.append(f"- Soup's per-token charge for the recomputed layer, 4 (h + i) x T = {soup_act / 1e6:,.1f} MB, "
                         f"against {e.terms['layer_per_token'] / 1e6:,.1f} MB counted op by op; Soup has no term "
                         "for the dequantised layer at all.")
        elif r.model_key == "phi-2" and r.quant == "nf4":
            extra = (2 * a.L - 2) * a.h * T
            lines.append(f"- Missing: (2 L - 2) h T = {extra / 1e6:,.1f} MB. Soup charges the checkpointed layer "
                         "inputs at 2 h L B per token (bf16); phi under NF4 keeps them in fp32 after layer 0.")
        lines.append(f"- LoRA parameters: {lora_params(a, tuple(r.targets), 8):,}; cap evidence: "
                     + ("; ".join(caps.get(key, [])) or "not capped in this session") + ".")
        details += lines + [""]
    print("\n## Each arm\n")
    print("\n".join(details))
    soup077()


#: soup-cli 0.77.0's new families and streaming modes, measured on one H200 (three passes and the
#: out-of-sample arms), and the cap proofs of their UNDER arms.
NEW_RUNS = sorted(str(p.relative_to(ROOT)) for d in ("moe-and-stream-modes-h200-soup0.77.0-fcde6d3",
                                                       "depth-and-cap-proof-h200-soup0.77.0-6f45ab3",
                                                       "deepseek-fla-map512-h200-soup0.77.0-6a3069a",
                                                       "out-of-sample-and-fit-proof-h200-soup0.77.0-95d9ed3")
                  for p in (ROOT / "results" / d).glob("*.json") if not p.name.startswith("estimate-"))
#: What each streaming mode or family adds that Soup's formula has no term for (the corrected terms).
NEW_TERMS = {"retained_activations": "stream_recompute off: every layer from the first that holds a LoRA target "
                                     "keeps its activations, T x what that layer saves per token (before it autograd "
                                     "records nothing); Soup's docstring says its formula does not count them",
             "chunked_loss": "stream_loss_chunk: a backward's cuBLAS workspace inside the loss (32 MiB) and Soup's "
                             "two [batch, seq, hidden] tensors; and the chunk's logits at 14 B (3 fp32 + its bf16 "
                             "logits) that Soup charges",
             "dequantised_layer": FORMULAS["dequantised_layer"], "layer_per_token": FORMULAS["layer_per_token"],
             "autograd_workspace": FORMULAS["autograd_workspace"],
             "expert_in_flight": "per_expert: one routed expert's packed copy and bf16 weights, twice (Soup charges it)"}


def soup077() -> None:
    runs = [(p, load(p)) for p in NEW_RUNS]
    caps = cap_evidence([res for p, res in runs if "cap-soup" in p])
    measured = [(res, r) for p, res in runs if "cap-soup" not in p for r in res.rows if r.measured]
    seen, under = set(), []
    for res, r in measured:
        key = r.arm
        if key not in seen and r.soup_predicted and r.soup_predicted < r.real_peak:
            seen.add(key)
            under.append((res, r))
    print("## soup-cli 0.77.0: its new families and streaming modes\n")
    print("Rendered from " + ", ".join(f"`{p}`" for p in NEW_RUNS) + ". Families at full width, reduced "
          "depth (the row names the depth); every arm's Soup number is its setup's own.\n")
    print(f"{len(under)} of {len({r.arm for _, r in measured})} distinct measured "
          "arms are under Soup's own number: the contract fails there.\n")
    print(TABLE_HEAD)
    lines = []
    for res, r in under:
        e = estimate_key(r.model_key, quant=r.quant, seq=r.seq, batch=r.batch, targets=r.targets,
                         release="0.77.0", soup=False)  # its Soup number is the row's
        key = r.arm
        arm = f"{r.model} {r.quant} {r.seq}x{r.batch}"
        print(f"| {arm} | {gb(r.soup_predicted)} | {gb(e.corrected_predicted)} | {gb(r.real_peak)} | "
              f"{r.soup_predicted / r.real_peak:.3f}x | {(r.real_peak - r.soup_predicted) / 1e6:.1f} | {e.phase} | "
              + ("; ".join(caps.get(key, [])) or "not capped") + " |")
        terms = [t for t in NEW_TERMS if e.terms.get(t) and (t in ("retained_activations", "chunked_loss") or
                                                              e.phase == "layer")]
        lines += [f"### {arm}", ""] + [f"- `{t}` = {e.terms[t] / 1e6:,.1f} MB: {NEW_TERMS[t]}." for t in terms]
        lines += ["- Cap evidence: " + ("; ".join(caps.get(key, [])) or "not capped in this session") + ".", ""]
    print("\n" + "\n".join(lines))


TASK_MAP = sorted(str(p.relative_to(ROOT)) for pattern in ("results/task-map-h200-*/task-map-*.json",
                                                           "results/tasks-rest-h200-*/task-map-*.json",
                                                           "results/tasks-rest-h200-*/mistral-*.json",
                                                           "results/tasks-rest-h200-*/sweep-dpo-*.json")
                  for p in ROOT.glob(pattern))
TASK_CAPS = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("results/task-map-h200-*/cap-soup-tasks.json"))
ANATOMY = sorted(ROOT.glob("results/task-anatomy-*/anatomy-077-*.json"))


def live_blocks(d: dict, at_least: int) -> str:
    """The blocks live at an anatomy arm's peak of at least ``at_least`` bytes, as 'count x bytes
    (bytes per logits element)', from its allocator history."""
    return "; ".join(f"{g['count']} x {g['size']:,} B ({g['bytes_per_E'] / g['count']:.2f} B per logits element each)"
                     for g in d["groups"] if g["size"] >= at_least)


def preference() -> None:
    runs = [(p, load(p)) for p in TASK_MAP]
    caps = cap_evidence([load(p) for p in TASK_CAPS])
    def label(r, res) -> str:  # a row of another release than the section's says so
        release = res.environment.get("soup_cli")
        return r.task if release == "0.77.0" else f"{r.task} (soup-cli {release})"
    tasked = [(r, label(r, res)) for _, res in runs for r in res.rows if r.task and r.measured]
    under = [r for r, _ in tasked if r.soup_predicted and r.soup_predicted < r.real_peak]
    print("\n## The preference losses: DPO, KTO, ORPO and SimPO (soup-cli 0.77.0; DPO on 0.73.3 too)\n")
    print("Rendered from " + ", ".join(f"`{p}`" for p in TASK_MAP + TASK_CAPS) + " and the allocator histories "
          "in `results/task-anatomy-h200-soup0.77.0-and-0.73.3-3f5620a/`. Soup budgets a paired loss as the "
          "SFT formula at 2 x batch rows and KTO at batch rows, with 14 B per logits element; what is live "
          "at the step's peak is more.\n")
    print(f"{len(under)} of {len(tasked)} measured preference-task arms are under Soup's own number.\n")
    print("| family | task | arms under | Soup/real, lowest | Soup/real, highest | cap evidence (2048x2, bf16) |")
    print("|---|---|---:|---:|---:|---|")
    for fam in dict.fromkeys(r.model for r, _ in tasked):
        for task in dict.fromkeys(t for _, t in tasked):
            mine = [r for r, t in tasked if r.model == fam and t == task]
            if not mine:
                continue
            ratios = [r.soup_predicted / r.real_peak for r in mine]
            cap = next(("; ".join(v) for k, v in caps.items() if k[:1] == (mine[0].arm[0],) and task in k), "-")
            print(f"| {fam} | {task} | {sum(x < 1 for x in ratios)} of {len(mine)} | {min(ratios):.3f}x | "
                  f"{max(ratios):.3f}x | {cap} |")
    print("\n### What is live at the peak (the allocator's history, one streamed step)\n")
    for path in ANATOMY:
        d = json.loads(path.read_text(encoding="utf-8"))
        if d["task"] not in ("dpo", "kto") or d.get("step_error"):
            continue
        dyn = d["real_peak"] - d["resident_before"]
        print(f"- **{d['task']} {path.stem.split('-')[3]} {d['quant']} {d['seq']}x{d['batch']}** (E = {d['E']:,} "
              f"logits elements over the {d['realised']['rows']} rows the model runs): real peak "
              f"{gb(d['real_peak'])} GB, Soup's own {gb(d['soup_predicted'])} GB "
              f"({d['soup_predicted'] / d['real_peak']:.3f}x); the step's dynamic peak is "
              f"{dyn / d['E']:.2f} B per logits element, where Soup charges 14. Blocks of 1 MB or more live "
              f"there: {live_blocks(d, 1_000_000)}.")
    print("\nThe terms, in bytes of live tensors (this tool's estimator, `issue395/estimator/estimate.py` "
          "`task_loss_blocks`; `results/estimator-tasks.txt` holds it to every arm above):\n")
    print("- DPO: the policy's fp32 logits and their shifted copy, the reference forward's fp32 logits and "
          "their shifted copy (4 x 4 B per element over 2 x batch rows), plus one row's log-softmax "
          "temporary or the chosen half's masked copy: about 18 B per element. 0.77.0 also keeps TRL's "
          "\"ref\" adapter (4 B per LoRA parameter) and, on an untied model, a private copy of the head.")
    print("- KTO: the policy's and the reference's fp32 logits, each with its chosen/rejected row copies: "
          "16 B per element over batch rows; its KL batch adds its ids.")
    paired = [r for r, _ in tasked if r.task in ("orpo", "simpo")]
    low = [r for r in paired if r.soup_predicted < r.real_peak]
    print("- ORPO and SimPO: one forward, the chosen half's saved log-softmax and the per-row backward "
          "gradients: about 14 B per element over 2 x batch rows, which Soup's 14 B covers at the loss; "
          f"measured, Soup is {min(r.soup_predicted / r.real_peak for r in paired):.3f}x-"
          f"{max(r.soup_predicted / r.real_peak for r in paired):.3f}x on {len(paired)} arms and under on "
          f"{len(low)}: " + "; ".join(sorted({f"{r.model} {r.quant}" for r in low})) + ", where its non-logits "
          "terms fall short as they do for SFT on the same arms (the sections above). These arms were not "
          "capped (the device time went to the map).\n")


FIND_MAX = "results/findmax-kimi-anatomy-h200-soup0.77.0-f6c944f/find-max-qwen-dpo-12GB.json"
PATCH_PROOF = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("results/*/*/soup-patch-gate-*.json"))


def gate_growth() -> tuple[float, float, int]:
    """What Soup's gate did not see as free in `soup train`'s own process: the card's total less the box's
    context (measured by the probing process) less the free memory Soup's gate printed (two decimals, so
    +-5 MB), MB, the least and the most over every --find-max JSON that has the context; and how many."""
    seen = []
    for path in sorted(ROOT.glob("results/*/find-max-*.json")) + sorted(ROOT.glob("results/*/*/find-max-*.json")):
        d = json.loads(path.read_text(encoding="utf-8"))
        if d.get("box_context_bytes"):
            seen += [(d["card"]["bytes"] - d["box_context_bytes"]) / 1e6 - p["driver_free_gb"] * 1e3
                     for p in d["measured"]["probes"] if p.get("driver_free_gb")]
    return min(seen), max(seen), len(seen)


def soup_patch() -> None:
    """The fix, for a maintainer: what --soup-patch changes, the evidence, how to apply and test it."""
    soup_patch_changes()
    soup_patch_evidence()
    soup_patch_gate_on_card()
    soup_patch_gpu_proof()
    resident_patch_proof()
    print("\nHow to apply it, in the environment that runs `soup train`:\n")
    print("```bash\npython issue395_second_stack_vram.py --soup-patch soup-corrected-preflight.diff\n"
          "cd \"$(python -c 'import os, soup_cli; print(os.path.dirname(os.path.dirname(soup_cli.__file__)))')\"\n"
          "patch -p1 --dry-run < soup-corrected-preflight.diff && patch -p1 < soup-corrected-preflight.diff\n```\n")
    print("How to test it: `tests/estimator/test_soup_patch.py` applies the diff with `patch -p1` to a copy of the "
          "installed soup_cli (and of every release unpacked under `ISSUE395_RELEASE_SOURCES`), loads the module in "
          "an isolated interpreter, runs the patched `_stream_budget_lines` on CPU on Soup's own loader and "
          "transformers' AutoConfig, and holds the patched number to [1.00, 1.05] of the real peak on every committed "
          "arm; on a GPU, `bench/gpu-soup-patch.sh` (bench/soup_patch_gate.py). With the patch installed, this tool "
          "reads the patched soup_cli as it reads any release: `--estimate`, the tables and the map then show the "
          "patched gate's number as Soup's own, with Soup's formula beside it in the row's terms.")


def soup_patch_changes() -> None:
    """What the patch changes in each file it touches, the gate's terms quoted from the estimator's own
    constants and the runtime's growth before Soup's gate from the committed --find-max probes."""
    from issue395.estimator.soup_gate import GATE_STEPS
    from issue395.estimator.cards import STEP_GROWTH_BYTES
    from issue395.estimator.estimate import EXPANDABLE_RESERVE_BYTES, EXPANDABLE_RESERVE_PAGES

    lo, hi, n = gate_growth()
    calls, deaths = resident_patch_calls(), [f for f, _, default in resident_patch_deaths() if default]
    before, after = [f for f, _, sets in calls if sets is False], [f for f, _, sets in calls if sets]
    print("\n## The fix: `--soup-patch`, a patch to soup-cli whose own gate compares the corrected peak\n")
    print("`python issue395_second_stack_vram.py --soup-patch OUT.diff` writes a unified diff against the installed "
          "soup-cli release's own source (each release 0.73.3 to 0.77.0 gets its own, generated from its source; "
          "the 0.77.0 diff applies to 0.77.0 only). What it changes:\n")
    print("- It adds `soup_cli/utils/corrected_peak.py`: this tool's estimator (`issue395/estimator/`), generated "
          "from the tool's own source with `ast` (the functions `soup_gate.preflight` reaches, bundled in their "
          "modules' order, comments and evidence kept), standard library only, importing nothing of the tool or "
          "of soup_cli; its header names the tool's commit. It is regenerated, never edited.")
    print("- In `soup_cli/trainer/stream_setup.py`, `_stream_budget_lines` (the one pre-flight every streamed "
          "task's wrapper reaches: sft, dpo, orpo, simpo, kto), right after `predicted = "
          "estimate_stream_peak_vram(...)`: the number the gate compares becomes the corrected pre-flight's, the "
          f"allocated peak of the run's steady state ({GATE_STEPS} steps: from step 2 on the optimizer's states are "
          f"live) + {EXPANDABLE_RESERVE_BYTES / 1e6:.1f} MB (the allocator's reserve under expandable segments: "
          f"{EXPANDABLE_RESERVE_PAGES} pages of 20 MiB, the partial pages live blocks touch) + {STEP_GROWTH_BYTES / 1e6:.1f} MB (what the "
          "CUDA runtime adds outside the allocator by the step's end: in `soup train`'s own process nearly all of it "
          f"after Soup's gate reads free memory, {lo:.0f} to {hi:.0f} MB before it, measured on {n} --find-max probes: the "
          "card's total less the box's context less the free memory Soup printed). It is fed what the "
          "setup already holds: the model's config (`model_config.to_dict()`), `task`, `data.max_length`, "
          "`training.quantization`, `batch_size`, `gradient_accumulation_steps`, the LoRA targets, r and dropout "
          "(at 0 no dropout mask is charged), the streaming modes, `stream_buffers` (the pool's slots), `optimizer`. The "
          "panel prints the corrected peak beside Soup's formula.")
    print("- Soup's gate stays Soup's: the free memory it reads (`mem_get_info`), `training.stream_vram_override`, "
          "the probe and its deferral ceiling, every refusal message. A setting the estimator does not model "
          "(`stream_recompute: auto`, NF4 without "
          "double quantisation, `stream_nf4_scale_cache`, `moe_lora`, `use_galore`, `activation_offloading`, "
          "`auto_mixed_precision`, an optimizer it has no table for) keeps Soup's "
          "formula, and the panel says why in one line. `gradient_accumulation_steps` (Soup's default is 4) reaches "
          "the estimate, which charges the adapter's gradients held from the second micro-batch on.")
    print("- In `soup_cli/commands/train.py`, `_hardware_fit_preflight` (Soup's resident gate, `training.stream_layers` "
          "false; 0.73.3 and 0.77.0 have it, a release without it gets one line and its streamed gate alone), before "
          "Soup's formula: the corrected resident estimate (`issue395/estimator/resident.py`, bundled with the rest) "
          "of the run `soup train` builds from the file (the model's config, read by transformers' `AutoConfig` from "
          "`base`; `task`, `training.quantization`, `data.max_length`, `batch_size`, the LoRA targets, r and dropout, "
          "`optimizer`, `gradient_accumulation_steps`, `gradient_checkpointing`), charged as the streamed gate charges "
          "(the same reserve and runtime growth), compared with the free memory torch reads on the card "
          "(`torch.cuda.mem_get_info`), where Soup compares its formula with the card's total. A run that does not "
          "fit is refused in Soup's own panel (its title and advice; `--allow-oom-attempt` still launches it) with "
          "the corrected number, what it charges and Soup's formula beside it; one that fits is admitted with one "
          "line. A run the resident estimate does not model (MoE, latent attention, hybrid layers, phi, past a "
          "sliding window without checkpointing, full fine-tuning, DoRA, another backend) goes on to Soup's formula, "
          "and the line says why. In `train` itself, before `detect_device` creates the CUDA context (torch's "
          "allocator reads the variable then), it sets `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` where it "
          "is unset or empty (Linux; a value the user exported is kept), which Soup sets for a streamed run only: the "
          "resident gate's need is the allocated peak plus the reserve under expandable segments (docs/PEAK.md, "
          "EXPANDABLE_RESERVE_PAGES)" + (f", and runs it admitted on the default allocator died by OOM "
                                         f"({', '.join(deaths)}; the cause not measured on those runs; the "
                                         f"fragmentation measured on that allocator: {fragmentation_words()})"
                                         if deaths else "")
          + ". Its GPU proof with the real `soup train` is `bench/gpu-next.sh resident-patch` ("
          + (f"{', '.join(before)}, run before this setting; " if before else "")
          + (f"{', '.join(after)}, on it" if after else "not re-run since" if before else "not run") + ").\n")


def soup_patch_evidence() -> None:
    """The patched number (computed) against the real peak (measured) on every committed H200 arm of
    every task, beside Soup's own number's ratio, as a table."""
    import statistics
    from types import SimpleNamespace as S

    from issue395.estimator.soup_gate import preflight
    from issue395.estimator.arch import arch_from_config, protocol_targets
    from issue395.estimator.attention import training_box
    from issue395.model.registry import stream_mode

    sys.path.insert(0, str(ROOT / "bench"))
    import estimator_checks

    rows = []
    for arm in estimator_checks.tasks_arms() + [dict(a, task="sft") for a in estimator_checks.load_arms()]:
        family, stream = stream_mode(arm["family"])
        config = config_json(family)
        kw = dict(quant=arm["quant"], seq=arm["seq"], batch=arm["batch"], task=arm["task"], stream=stream,
                  targets=tuple(arm.get("targets") or ()) or protocol_targets(arch_from_config(config)))

        lora = S(target_modules=list(kw["targets"]), r=8, dropout=0.05)
        tcfg = S(quantization={"none": "none", "nf4": "4bit"}[kw["quant"]], batch_size=kw["batch"], lora=lora,
                 optimizer="adamw_torch", stream_buffers=2, **kw["stream"])
        cfg = S(task=kw["task"], data=S(max_length=kw["seq"]))
        with training_box(arm.get("transformers")):  # the attention the arm's own box ran, not this machine's
            out = preflight(cfg, tcfg, config, steps=1, release=arm["release"])
        rows.append((arm, out["peak"] / arm["real_peak"], arm["soup_predicted"] / arm["real_peak"]))
    ratios, soup = [r for _, r, _ in rows], [s for *_, s in rows]
    print(f"Evidence, on every committed H200 arm of every task ({len(rows)} rows, as bench/estimator_checks.py's tasks and leave-one-out subcommands read them: "
          + ", ".join(f"{t} {sum(a['task'] == t for a, *_ in rows)}" for t in ("sft", "dpo", "orpo", "simpo", "kto"))
          + "; soup-cli 0.73.3 and 0.77.0; one optimizer step each, as measured), the patched number (the patched "
          "module's allocated peak, computed by this tool's estimator, which the module is) against the real peak "
          "(measured):\n")
    print("| | arms | under the real peak | above 1.05x | lowest | median | highest |\n|---|---:|---:|---:|---:|---:|---:|")
    print(f"| the patched number | {len(rows)} | {sum(r < 1 for r in ratios)} | {sum(r > 1.05 for r in ratios)} | "
          f"{min(ratios):.4f}x | {statistics.median(ratios):.4f}x | {max(ratios):.4f}x |")
    print(f"| Soup's own (its setup's, captured) | {len(rows)} | {sum(r < 1 for r in soup)} | "
          f"{sum(r > 1.05 for r in soup)} | {min(soup):.4f}x | {statistics.median(soup):.4f}x | {max(soup):.4f}x |\n")


def soup_patch_gate_on_card() -> None:
    """The gate on a measured card (the committed --find-max run): Soup's stock gate against the patched
    gate (computed) at the measured limit and the first OOM, and the longest the patched gate admits."""
    from types import SimpleNamespace as S

    from issue395.estimator.soup_gate import preflight

    found = json.loads((ROOT / FIND_MAX).read_text(encoding="utf-8"))
    m = found["measured"]
    free = max(p["driver_free_gb"] for p in m["probes"])
    def gate(seq: int) -> int:
        tcfg = S(quantization="none", batch_size=1, lora=S(target_modules=["q_proj", "v_proj"], r=8, dropout=0.05),
                 optimizer="adamw_torch", stream_buffers=2)
        return preflight(S(task="dpo", data=S(max_length=seq)), tcfg, config_json("qwen"), release="0.77.0")["gate_bytes"]

    stock = {p["value"]: p for p in m["probes"]}
    longest = max(s for s in range(64, m["oom_above"] + 1, 64) if gate(s) <= free * 1e9)
    print(f"The gate on a measured card (`{FIND_MAX}`: Qwen2.5-0.5B DPO on an emulated 12 GB card, the real "
          f"`soup train`, 3 steps a probe, Soup's gate lifted): seq {m['limit']} completes, {m['oom_above']} raises "
          f"OOM. Soup's stock gate admitted {m['oom_above']} ({stock[m['oom_above']]['soup_gb']:.2f} GB against the "
          f"{free:.2f} GB free its driver reported, as Soup printed them). The patched gate (computed) needs "
          f"{gate(m['limit']) / 1e9:.2f} GB free at {m['limit']} and {gate(m['oom_above']) / 1e9:.2f} GB at "
          f"{m['oom_above']}: on the same {free:.2f} GB it admits up to {longest} "
          + ("(one resolution step below the limit)." if longest == m["limit"] - 64 else
             "(the limit)." if longest == m["limit"] else f"(the limit is {m['limit']})."))


def soup_patch_gpu_proof() -> None:
    """The committed GPU proofs of the patched gate (the real soup train, gate not lifted), each probe's
    outcome; or that the proof has not run."""
    if PATCH_PROOF:
        print("\nThe GPU proof (the real `soup train`, patched, gate NOT lifted; `bench/gpu-soup-patch.sh`):\n")
        for path in PATCH_PROOF:
            d = json.loads((ROOT / path).read_text(encoding="utf-8"))
            probes = sorted(d["probes"], key=lambda p: p["seq"])
            print(f"- `{path}` ({d['config']}, {d['card']}, measured limit {d['limit']} with the gate lifted): " + "; ".join(
                f"seq {p['seq']} {p['outcome']} (patched number {p['patched_number'] / 1e9:.2f} GB, free "
                f"{p['free_gb']:.2f} GB as Soup printed it)" for p in probes) + f". Every admitted run completed: "
                f"{'yes' if d['never_oom'] else 'NO'}; longest admitted {d['longest_admitted']}"
                + (" (the limit)." if d["longest_admitted"] == d["limit"] else
                   " (one resolution step below the limit)." if d["longest_admitted"] == d["limit"] - 64 else
                   f" (the limit is {d['limit']})."))
    else:
        print("\nThe GPU proof is `bench/gpu-soup-patch.sh` (the real `soup train`, patched, its gate NOT lifted, on "
              "emulated cards at and around the measured limits); not yet run.")


RESIDENT = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("results/resident-map-*/call-*/*.json"))


def resident() -> None:
    """Soup's resident gate (stream_layers off): its number over the real peak, from the committed resident rows."""
    if not RESIDENT:
        return
    from issue395.report.tables import resident_gate_table

    rows = [r for path in RESIDENT for r in load(path).rows]
    measured = [r for r in rows if r.measured]
    print("\n## Soup's resident gate (`training.stream_layers: false`): `hardware_fit.estimate_peak_vram_gb`\n")
    print("Rendered from " + ", ".join(f"`{p}`" for p in RESIDENT) + ". Soup's number: its own code "
          "(`commands/train.py:_build_hardware_fit_input` on the arm's config, `estimate_peak_vram_gb`, "
          "`decide_hardware_fit` against the card's total), computed in each arm's process; real peak: "
          "`torch.cuda.max_memory_allocated()` over one optimizer step on an H200 (soup-cli 0.77.0, synthetic weights). "
          "This tool's corrected resident estimate (issue395.estimator.resident) models LoRA and QLoRA on the dense "
          "families (past a sliding window only with checkpointing), one step of one micro-batch, so far.\n")
    print(f"{sum(1 for r in measured if r.status == 'UNDER')} of {len(measured)} measured resident arms are under "
          "Soup's resident number.\n")
    print("| arms | measured | Soup/real min | median | max |\n|---|---:|---:|---:|---:|")
    groups: dict = {}
    for r in measured:
        kind = ("QLoRA nf4" if r.quant == "nf4" else "LoRA bf16") + (" + checkpointing" if "+gc" in r.model_key else "")
        groups.setdefault((r.task or "sft") + " " + kind, []).append(r.margin_ratio)
    for name, got in sorted(groups.items()):
        got.sort()
        print(f"| {name} | {len(got)} | {got[0]:.3f}x | {got[len(got) // 2]:.3f}x | {got[-1]:.3f}x |")
    print("\nWhat Soup's formula charges, against what the anatomies of results/resident-anatomy-* hold at the peak: "
          "1% of the parameters as trainable for any LoRA (the adapters measured are far smaller, so this term "
          "over-charges); activations as seq x batch x a hidden size guessed from the parameter count x 4 B, halved "
          "for checkpointing, where without checkpointing every layer keeps its own (the MLP's i-wide tensors, the "
          "norms' fp32 copies, attention's inputs); no logits or loss term, where the loss's three fp32 logits blocks "
          "(12 B a logits element) are the largest live blocks at every resident peak measured; and NF4 weights at "
          "0.5 B a parameter, where the NF4 anatomy (Llama-3.2-1B) held an fp32 embedding and fp32 activations (the NF4 "
          "arms are its worst). The arms where its verdict is wrong on a named card (the measured peak alone past the "
          "card's total, which Soup admits; or inside a card Soup refuses):\n")
    print("```\n" + resident_gate_table(rows) + "\n```")


TASK_NAMES = {"sft": "SFT", "dpo": "DPO", "orpo": "ORPO", "simpo": "SimPO", "kto": "KTO"}
#: The weights a row's quant name means (this tool's --quant: none is LoRA on bf16 weights).
QUANT_WORDS = {"none": "bf16", "nf4": "nf4"}
PROBE840 = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("results/probe840-*/probe-*.json"))


def admitted_by_probe(r) -> bool:
    """Soup's verdict on a row's probe admits the run (computed by Soup)."""
    return bool(r.soup_probe.admits)


def dies_past_probe(r) -> bool:
    """Soup's verdict admits the row's run and its real peak is past the free memory Soup's gate read."""
    return admitted_by_probe(r) and r.real_peak > r.soup_probe.available


def stream_vram_probe() -> None:
    """Soup's training.stream_vram_probe per task (issue 51 item 5, Soup's #840): its probe's peak over the real
    step's, and what its verdict admits that dies, from the committed --map --stream-vram-probe rows."""
    if not PROBE840:
        return
    import statistics

    folders = sorted({str(Path(p).parent) for p in PROBE840})
    results = [load(path) for path in PROBE840]
    rows = [r for res in results for r in res.rows]
    soup = " and ".join(dict.fromkeys(res.environment["soup_cli"] for res in results))
    gpu = " and ".join(dict.fromkeys(res.environment.get("gpu", "GPU not recorded").removeprefix("NVIDIA ")
                                     for res in results))
    probed = [r for r in rows if r.measured and r.soup_probe and r.soup_probe.peak]
    exits = [int(x) for d in folders for x in re.findall(r"^exit (\d+),", (ROOT / d / "commands.txt").read_text(
        encoding="utf-8"), re.M)]
    print("\n## Soup's stream_vram_probe per task (Soup's #840)\n")
    print("Rendered from " + ", ".join(f"`{p}`" for p in PROBE840) + " (`--map --stream-vram-probe on`: "
          + ", ".join(dict.fromkeys(r.model for r in rows)) + " x " + ", ".join(dict.fromkeys(r.task or "sft" for r in rows))
          + f" x seq {', '.join(map(str, sorted({r.seq for r in rows})))} x batch "
          f"{', '.join(map(str, sorted({r.batch for r in rows})))}, "
          f"{', '.join(dict.fromkeys(QUANT_WORDS.get(r.quant, r.quant) for r in rows))}; soup-cli {soup} on an {gpu}). "
          "Real peak: "
          "`torch.cuda.max_memory_allocated()` over one optimizer step (measured). Soup's probe: the peak Soup's "
          "`measure_step_peak_bytes` measured on this card (computed by Soup): for SFT Soup's own setup ran it "
          "(`training.stream_vram_probe` set); Soup's schema refuses the key for DPO, ORPO, SimPO and KTO, so this "
          "tool called Soup's function right after Soup's setup, at the rows Soup's setup counts for the task, as "
          "#840 asks Soup to. Soup's verdict: its `decide_measured_fit`, which admits a run where the probe's peak is "
          f"at most the free memory its gate read. {len(rows) - len(probed)} of {len(rows)} rows have no probe, "
          f"{' and '.join(sorted({r.status for r in rows if r not in probed}))}: "
          f"{'; '.join(sorted({r.error or '-' for r in rows if r not in probed}))} (the rows' own words). The --map calls exited {' and '.join(map(str, exits))} (commands.txt): the "
          f"tool's verdict where Soup's own formula is under a row's real peak ({sum(r.status == 'UNDER' for r in probed)} "
          "rows), not a failure; every row was written.\n")
    print("| task | probed by | rows | probe/real min | median | max | probe under the real peak | "
          f"widest window, real - probe (arm) | its verdict on this {gpu}: admits, dies |")
    print("|---|---|---:|---:|---:|---:|---:|---|---:|")
    under_all, under_none = [], []
    for task in dict.fromkeys(r.task or "sft" for r in probed):
        mine = [r for r in probed if (r.task or "sft") == task]
        ratios = sorted(r.soup_probe.peak / r.real_peak for r in mine)
        under = [r for r in mine if r.soup_probe.peak < r.real_peak]
        (under_all if len(under) == len(mine) else under_none if not under else []).append(TASK_NAMES[task])
        wide = max(under, key=lambda r: r.real_peak - r.soup_probe.peak, default=None)
        window = "-" if wide is None else (f"{(wide.real_peak - wide.soup_probe.peak) / 1e9:.2f} GB ({wide.model} "
                                           f"{wide.seq}x{wide.batch})")
        admits, dies = sum(map(admitted_by_probe, mine)), sum(map(dies_past_probe, mine))
        who = " and ".join(sorted({"Soup's setup" if r.soup_probe.path == r.soup_probe.SOUP else "this tool" for r in mine}))
        print(f"| {task} | {who} | {len(mine)} | {ratios[0]:.4f}x | {statistics.median(ratios):.4f}x | {ratios[-1]:.4f}x "
              f"| {len(under)} of {len(mine)} | {window} | {admits} of {len(mine)}, {dies} |")
    free = min(r.soup_probe.available for r in probed)
    admitted, died = sum(map(admitted_by_probe, probed)), sum(map(dies_past_probe, probed))
    print(f"\nOn this {gpu} Soup's verdict admitted " + ("every row" if admitted == len(probed) else
                                                       f"{admitted} of {len(probed)} probed rows")
          + f" with at least {free / 1e9:.1f} GB free at its gate (read by Soup), "
          + ("so none died here" if not died else f"and {died} of them would die here (the real peak past the free "
                                                  "memory Soup read)")
          + "; but a probe under the real peak admits a run that dies on any card whose free "
          "memory lies in the window between the two. The probe is above the real peak on every "
          f"{', '.join(under_none) or 'no'} row and under it on every {', '.join(under_all) or 'no'} row: Soup's "
          "function runs one causal-LM forward and backward at the rows (`model(input_ids=ids, labels=ids)`, "
          "soup_cli/utils/layer_stream_runtime.py), not the task's loss, so as #840's extension it would need the "
          "task's own step.")


#: --find-max's searches on the real `soup train`: resident soup.yamls (issue 51 item 4) and streamed ones nobody
#: built the estimate on (issue 52 items 3-4); a resident one run again on another allocator is a row of its own.
FIND_MAX_RUNS = [str(p.relative_to(ROOT)) for pattern in ("results/resident-findmax-*/find-max-*.json",
                                                         "results/findmax52-*/find-max-*.json")
                 for p in sorted(ROOT.glob(pattern))]
#: What a resident search's probes ran on where its JSON records no allocator setting: those searches ran before
#: the probes set one (their plan line names no PYTORCH_CUDA_ALLOC_CONF), so on torch's default caching allocator.
DEFAULT_ALLOCATOR = "default allocator"


def read_json(path: str) -> dict:
    return json.loads((ROOT / path).read_text(encoding="utf-8"))


@functools.cache
def find_max_found() -> tuple[tuple[str, dict], ...]:
    """The committed searches, each read once: (path, its JSON), in FIND_MAX_RUNS' order."""
    return tuple((p, read_json(p)) for p in FIND_MAX_RUNS)


def allocator(d: dict) -> str | None:
    """The allocator a resident search's probes ran on, as its JSON records it (None: a streamed search)."""
    if not d.get("resident"):
        return None
    if "allocator_conf" not in d["resident"]:
        return DEFAULT_ALLOCATOR
    conf = d["resident"]["allocator_conf"]
    return f"{ALLOC_CONF_VAR}={conf}" if conf else "allocator not recorded"


def first_oom(m: dict) -> dict | None:
    """The probe that decided a search's first OOM (one probed once more: the last); None where none raised it."""
    return next((p for p in reversed(m["probes"]) if p["value"] == m["oom_above"]), None)


def fragmented() -> list[tuple[str, dict, dict]]:
    """The resident searches on the default allocator whose first OOM's `oom` block (torch's message in Soup's
    process, measured) held more reserved but unallocated than this tool charges as the allocator's reserve:
    (path, search, that block)."""
    out = []
    for path, d in find_max_found():
        oom, margin = first_oom(d["measured"]), d.get("margin_at_first_oom")
        if allocator(d) == DEFAULT_ALLOCATOR and oom and oom.get("oom") and margin \
                and oom["oom"]["reserved_unallocated"] > margin["charged"]["reserve"]:
            out.append((path, d, oom["oom"]))
    return out


def fragmentation_words() -> str:
    """The fragmentation measured on the default allocator, in words (fragmented())."""
    return "; ".join(f"the {d['model']} {d['task']} resident search's first OOM ({d['measured']['axis']} "
                     f"{d['measured']['oom_above']}) held {o['reserved_unallocated'] / 1e9:.2f} GB reserved but "
                     f"unallocated, where this tool charges {d['margin_at_first_oom']['charged']['reserve'] / 1e6:.1f} "
                     f"MB of reserve (measured: `{p}`)" for p, d, o in fragmented()) or "none measured"


def against(answer: int | None, limit: int | None, step: int, none: str = "none (it admits no value)") -> str:
    """An answer beside the measured limit, in the search's resolution steps."""
    if answer is None:
        return none
    if limit is None:
        return f"{answer} (no value completed)"
    n = (limit - answer) // step
    return f"{answer} (" + ("the limit" if n == 0 else f"{abs(n)} step{'s' * (abs(n) > 1)} "
                            + ("under" if n > 0 else "ABOVE")) + ")"


def soup_gate_at(d: dict, key: str) -> str:
    """Soup's unlifted gate at one probed value (computed by Soup), as the search's JSON keeps it."""
    g = d.get(key)
    if g is None:
        return "not computed (no such value)"
    verdict = "admits" if g["admits"] else "refuses"
    if d.get("resident"):
        return (f"{verdict} {g['value']} ({g['peak'] / 1e9:.2f} GB, +10% {g['required'] / 1e9:.2f} GB, against the "
                f"card's {g['card_total'] / 1e9:.2f} GB total)")
    return f"{verdict} {g['value']} ({g['soup_predicted'] / 1e9:.2f} GB against {g['gate_free_bytes'] / 1e9:.2f} GB free)"


def weights_of(path: str) -> str:
    """The weights a search's probes ran, as its text says (find_max_mode.checkpoint_for builds a synthetic one)."""
    text = ROOT / Path(path).with_suffix(".txt")
    return ("weights not recorded" if not text.exists() else "synthetic weights"
            if "building the synthetic checkpoint of" in text.read_text(encoding="utf-8") else "the file's checkpoint")


def grown(d: dict, step: int, none: str) -> str:
    """The answer like for like with the runtime's growth the search's own probes measured (its JSON's
    runtime_growth_bytes), where its probes read it: a search whose probes carry no free_held predates the exit
    hook's reading; one whose probes do, but none of which read it (each failed before its exit hook could), says so."""
    if d.get("runtime_growth_bytes") is None:
        if any("free_held" in p for p in d["measured"]["probes"]):
            return "not read (no probe's process read it)"
        return "not read (its probes predate the reading)"
    return (against(d.get("this_tool_longest_like_for_like_measured_growth"), d["measured"]["limit"], step, none)
            + f", growth {d['runtime_growth_bytes'] / 1e6:.1f} MB")


def find_max_row(d: dict) -> str:
    """One search's row of the table: a resident one names the allocator its probes ran on."""
    m, res = d["measured"], d["measured"]["resolution"]
    run = ("resident" + (", checkpointing" if d["resident"]["checkpointing"] else "") + f", {allocator(d)}"
           if d.get("resident") else "streamed")
    refused = (d.get("resident") or {}).get("estimate_refused")
    mine = "none (its estimate refused the run)" if refused else "none (it admits no value)"
    return (f"| {Path(d['config']).name} | {d['task']} {d['quant']}, {run} | {d['card']['card']} | {d['steps']} | "
            f"{'none' if m['limit'] is None else m['limit']} | {'none' if m['oom_above'] is None else m['oom_above']} "
            f"| {len(m['probes'])} | {against(d['this_tool_longest_like_for_like'], m['limit'], res, mine)} | "
            f"{grown(d, res, mine)} | {against(d['this_tool_longest'], m['limit'], res, mine)} | "
            f"{against(d['soup_gate_longest'], m['limit'], res)} | "
            f"{soup_gate_at(d, 'soup_gate_at_limit')}; {soup_gate_at(d, 'soup_gate_above_limit')} |")


def find_max_searches() -> None:
    """--find-max against the real `soup train` (issue 51 item 4, issue 52 items 3-4): the measured limit, this
    tool's answers and Soup's gate's, from the committed searches."""
    if not FIND_MAX_RUNS:
        return
    found = list(find_max_found())
    soup = " and ".join(dict.fromkeys(f"soup-cli {(d.get('stack') or {}).get('packages', {}).get('soup-cli', 'not recorded')}"
                                      for _, d in found))
    print("\n## `--find-max` against the real `soup train`: resident and streamed soup.yamls\n")
    print("Rendered from " + ", ".join(f"`{p}`" for p in FIND_MAX_RUNS) + ". Each probe: the real `soup train` "
          f"({soup}, {' and '.join(dict.fromkeys(weights_of(p) for p, _ in found))}) in a fresh process under a "
          "ballast that leaves the emulated card's "
          "total free, Soup's gate lifted (a resident file's by `" + " and ".join(sorted({d["resident"]["gate_lifted_by"]
          for _, d in found if d.get("resident")})) + "`), completed or OOM (measured). This tool's longest: its corrected estimate "
          "with the context bound, like for like with the context the probes had (this box's own, measured), and "
          "like for like with the runtime's growth the probes measured too (each probe's memory outside the allocator "
          "as its process exited or at its OOM, less the box's context, the most of them, in place of the runtime "
          "growth's card-wide bound); "
          "Soup's gate's longest: Soup's own code, gate unlifted (computed by Soup).\n")
    print("| soup.yaml | run | card | steps a probe | measured limit | first OOM | probes | this tool, like for like "
          "| this tool, like for like with the probes' runtime growth (measured) | this tool, bound context | Soup's gate's longest | Soup's gate at the limit; at the first OOM |")
    print("|---|---|---|---:|---:|---:|---:|---|---|---|---|---|")
    cublas, above = [], []
    for path, d in found:
        m, like = d["measured"], d["this_tool_longest_like_for_like"]
        print(find_max_row(d))
        oom = first_oom(m)
        if oom and "CUBLAS_STATUS_ALLOC_FAILED" in (oom["line"] or ""):
            cublas.append(f"{d['model']} {d['task']} at {oom['value']}")
        if None not in (like, m["limit"]) and like > m["limit"] and oom and oom.get("oom") \
                and d.get("margin_at_first_oom"):
            above.append((d, oom))
    find_max_summary(found, cublas)
    for d, oom in above:
        print("\n" + above_limit_words(d, oom))
    expandable_reruns(found)


def searched(d: dict) -> str:
    """A search as the summary names it: the model, task and quantization, and a resident one's allocator (the same
    file searched on two allocators is two searches)."""
    return f"{d['model']} {d['task']} {d['quant']}" + (f" on {allocator(d)}" if allocator(d) else "")


def find_max_summary(found: list[tuple[str, dict]], cublas: list[str]) -> None:
    """The searches' totals: proven limits, the box's context, cuBLAS's OOMs, Soup's gate at the first OOM, and
    this tool's like-for-like answer beside each limit (a search with no answer or no limit named apart)."""
    boxes = dict.fromkeys(d["box_context_bytes"] for _, d in found if d.get("box_context_bytes"))
    gated = [d for _, d in found if d.get("soup_gate_above_limit")]
    print(f"\n{sum(d['measured']['proven'] for _, d in found)} of {len(found)} searches proved their limit (a completed "
          f"probe and the next step's OOM), in {', '.join(str(len(d['measured']['probes'])) for _, d in found)} probes; "
          f"the box's context: {' and '.join(f'{b / 1e9:.3f} GB' for b in boxes) + ' (measured)' if boxes else 'not measured'}. "
          "Soup's "
          "line at the first OOM was `CUBLAS_STATUS_ALLOC_FAILED` (cuBLAS's own out-of-memory status, read as OOM) for "
          + ("; ".join(cublas) or "none") + f". Soup's gate admits the first OOM on "
          f"{sum(d['soup_gate_above_limit']['admits'] for d in gated)} of {len(gated)} searches" + "".join(
              dict.fromkeys(
                  f"; on {d['card']['card']} Soup's resident gate admits no {d['measured']['axis']} for {d['model']} (its "
                  f"CLI's input takes the model as {d['resident']['soup_input']['params_b']} B parameters, computed by "
                  "Soup)" for _, d in found if d.get("resident") and d["resident"].get("soup_input")
                  and d["soup_gate_longest"] is None)) + ".", end=" ")
    paired = [d for _, d in found if None not in (d["this_tool_longest_like_for_like"], d["measured"]["limit"])]
    short = [(searched(d), (d["measured"]["limit"] - d["this_tool_longest_like_for_like"])
              // d["measured"]["resolution"], d["measured"]["resolution"]) for d in paired]
    alone = [searched(d) for _, d in found if not any(d is x for x in paired)]
    print("Like for like, this tool's answer is the measured limit on " + f"{sum(n == 0 for _, n, _ in short)} of "
          f"{len(short)}; under it on " + (", ".join(f"{k} ({n} x {r} tokens)" for k, n, r in short if n > 0) or "none")
          + "; above it on " + (", ".join(f"{k} ({-n} x {r} tokens)" for k, n, r in short if n < 0) or "none")
          + (f"; no answer or no limit to set beside it on {', '.join(alone)}" if alone else "") + ".")


def above_limit_words(d: dict, oom: dict) -> str:
    """A search whose like-for-like answer is above the measured limit: its first OOM's reserve beside what this
    tool charges, and, for a resident search on the default allocator only, why that allocator."""
    cause = ""
    if allocator(d) == DEFAULT_ALLOCATOR:
        patched = [f for f, _, default in resident_patch_deaths() if default]
        cause = (" `soup train` runs a resident run on torch's default caching allocator: soup-cli 0.77.0's "
                 "`configure_cuda_alloc_hint` (soup_cli/utils/gpu.py) sets `PYTORCH_CUDA_ALLOC_CONF="
                 "expandable_segments:True` for a streamed run only, and this search's probes ran before this tool "
                 "set it (its JSON records no allocator setting)." + "".join(
                     f" The patched resident gate's GPU proof `{f}` (the `--soup-patch` section above) ran on the same "
                     "allocator; what killed its admitted runs was not measured there." for f in patched))
    return (f"{d['model']} {d['task']} {d['quant']} ({'resident, ' + allocator(d) if d.get('resident') else 'streamed'}):"
            f" this tool's like-for-like answer is above the measured limit. Its first OOM's `oom` block (torch's message "
            f"in Soup's process, measured) holds {oom['oom']['reserved_unallocated'] / 1e9:.2f} GB reserved but "
            f"unallocated, where this tool's needs-free charges {d['margin_at_first_oom']['charged']['reserve'] / 1e6:.1f} "
            "MB of reserve (computed by this tool: the allocator's reserve measured under expandable segments)." + cause)


def no_json_words(path: Path) -> str:
    """Why a search's text has no JSON beside it, as its call's commands.txt shows: the line that ran it (by the
    JSON it names) and its exit code; 124 is `timeout` cutting it at the call's budget."""
    commands = path.parent / "commands.txt"
    ran = re.findall(rf"^exit (\d+),.*--json (?:\S*/)?{re.escape(path.stem)}\.json(?:\s|$)",
                     commands.read_text(encoding="utf-8") if commands.exists() else "", re.M)
    if not ran:
        return "no JSON, and no line of its call's commands.txt ran it"
    return ("cut by its call's budget before the search ended and before its JSON was written (commands.txt: exit "
            "124)" if ran[-1] == "124" else f"no JSON, though its call's commands.txt says it exited {ran[-1]}")


def expandable_reruns(found: list[tuple[str, dict]]) -> None:
    """The resident searches run again with their probes on expandable segments (the setting the resident need holds
    under since commit a696bb7) whose JSON is not committed (one that is is a row of the table above), read from
    their text."""
    for path in sorted(ROOT.glob("results/resident-findmax-expandable-*/find-max-*.txt")):
        if path.with_suffix(".json").exists():
            continue
        text = path.read_text(encoding="utf-8")
        conf = re.search(r"with (PYTORCH_CUDA_ALLOC_CONF=\S+)", text)
        probes = re.findall(r"probe seq (\d+): (completed \d+ of \d+ step\(s\)|OOM)", text)
        model = re.search(r"--find-max seq: (\S+)", text)
        if not (conf and probes and model):
            continue
        before = "".join(f", where the search on the default allocator (`{p}`) completed {d['measured']['limit']}"
                         + ("" if d["measured"]["oom_above"] is None else
                            f" and raised OOM at {d['measured']['oom_above']}")
                         for p, d in found if Path(p).name == path.with_suffix(".json").name
                         and allocator(d) == DEFAULT_ALLOCATOR)
        print(f"\nRun again with each probe on `{conf.group(1)}` (`{path.relative_to(ROOT)}`, {no_json_words(path)}, "
              f"so no limit is claimed): {model.group(1)} " + "; ".join(f"seq {v} {w}" for v, w in probes)
              + f" (measured){before}.")


RESIDENT_PATCH = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("results/resident-patch-*") if p.is_dir())
#: The patched resident gate's need and the free memory it compared, as Soup printed them (estimator/soup_gate.py
#: resident_preflight): admitted, "needs X GB free; Y GB free on the card"; refused, its panel's "needs X GB free,
#: more than the Y GB free on the card"; since the patch sets expandable segments, "under expandable segments (the
#: patch sets them)" after the need, in both.
RESIDENT_NEED = re.compile(r"needs ([\d.]+) GB free(?: under expandable segments \(the patch sets them\))?[;,] "
                           r"(?:more than the )?([\d.]+) GB free on the card")


def resident_patch_run(path: Path) -> dict | None:
    """One resident `soup train` of bench/soup_train_card.py as its text keeps it: the arm, the card, the patched
    gate's need and the free memory as Soup printed them (absent on stock Soup, or not read), the outcome and
    Soup's exit code; None where the text has no run's first line."""
    text = path.read_text(encoding="utf-8")
    head = re.match(r"(\S+) (\S+) (\S+) seq (\d+) batch (\d+), (\d+) step\(s\), as (\S+) ", text)
    if head is None:
        return None
    soup = RESIDENT_NEED.search(text)
    outcome = re.search(r"outcome: (.*?); soup exit code (\d+)", text)
    said = outcome[1] if outcome else "no outcome (its text ends before one)"
    return dict(name=path.stem, model=head[1], task=head[2], quant=head[3], seq=int(head[4]), batch=int(head[5]),
                steps=int(head[6]), card=head[7], gc="gradient_checkpointing: True" in text,
                need=soup and soup[1], free=soup and soup[2],
                outcome=said, admitted=said.startswith("admitted"), died="died" in said)


def resident_patch_gate(r: dict) -> str:
    """A run's gate, as the list names it: stock Soup, or the patched gate's need and free memory as Soup printed
    them, or that its text does not give them."""
    if r["name"].startswith("stock"):
        return "stock Soup"
    return (f"patched, needs {r['need']} GB free of {r['free']} GB" if r["need"] else
            "patched; its need and free memory not read: no line of its text gives the patched gate's figures")


@functools.cache
def resident_patch_calls() -> tuple[tuple[str, list[dict], bool | None], ...]:
    """Each resident-patch call: its folder, its runs (stock first) and whether the patch it applied sets
    expandable segments (a line of code its diff adds names the setting; None: no diff kept); read once."""
    out = []
    for folder in RESIDENT_PATCH:
        runs = [r for p in sorted((ROOT / folder).glob("*.txt"), key=lambda p: (not p.stem.startswith("stock"), p.stem))
                if p.stem.startswith(("stock-", "patched-")) for r in [resident_patch_run(p)] if r]
        diff = ROOT / folder / "corrected-preflight.diff"
        sets = any(x.startswith("+") and EXPANDABLE_SEGMENTS in x and not x[1:].lstrip().startswith("#")
                   for x in diff.read_text(encoding="utf-8").splitlines()) if diff.exists() else None
        out.append((folder, runs, sets))
    # the default allocator's proofs first: they came first, and the patch that sets expandable segments answers them
    return tuple(sorted(out, key=lambda c: (c[2] is True, c[0])))


def resident_patch_deaths() -> list[tuple[str, list[dict], bool]]:
    """The resident-patch calls where a run the patched gate admitted died: folder, those runs, and whether the
    patch ran on torch's default allocator (its diff sets no allocator)."""
    return [(f, died, sets is False) for f, runs, sets in resident_patch_calls()
            for died in [[r for r in runs if r["name"].startswith("patched") and r["admitted"] and r["died"]]] if died]


def stock_estimate(folder: str, stock: dict | None) -> str:
    """Stock Soup's resident gate and this tool's need on the stock run's arm, as `--estimate` printed them."""
    path = ROOT / folder / "est-A.txt"
    est = path.read_text(encoding="utf-8") if path.exists() and stock else ""
    soup = re.search(r"Soup's resident gate: ([\d.]+) GB, \+10% margin ([\d.]+) GB", est)
    card = re.search(r"(\S+): needs ([\d.]+) of ([\d.]+) GB free; Soup (\w+) it .*?card's ([\d.]+) GB total", est)
    if not (soup and card):
        return ("On stock Soup: not run (no stock run in the folder)." if not stock else
                "On stock Soup, `--estimate` (`est-A.txt`): " + ("not run." if not est else "its figures not read."))
    return (f"On stock Soup, `--estimate` (`est-A.txt`): Soup's resident gate {card[4]} {arm_of(stock)} on the "
            f"{card[1]} (computed by Soup: {soup[1]} GB, +10% {soup[2]} GB against the card's {card[5]} GB total); this "
            f"tool needs {card[2]} GB free, where the card has {card[3]} GB (computed by this tool).")


def arm_of(r: dict) -> str:
    return f"{r['model']} {r['task']} {r['quant']} {r['seq']}x{r['batch']}"


def resident_patch_proof() -> None:
    """The GPU proofs of the patched resident gate (issue 51 item 6; bench/gpu-next.sh resident-patch): stock Soup
    and the patched gate on the real `soup train`, resident, on emulated cards, each run's outcome (measured)."""
    for folder, runs, sets in resident_patch_calls():
        if not runs:
            print(f"\nThe GPU proof of the patched resident gate (`{folder}`): not run (no run's text in it).")
            continue
        patched = [r for r in runs if r["name"].startswith("patched")]
        died = [r for r in patched if r["admitted"] and r["died"]]
        stock = next((r for r in runs if r["name"].startswith("stock")), None)
        twin = stock and next((r for r in patched if all(r[k] == stock[k] for k in ("seq", "batch", "card", "gc"))), None)
        print(f"\nThe GPU proof of the patched resident gate (`{folder}`: `bench/gpu-next.sh resident-patch`, the real "
              f"`soup train`, `training.stream_layers: false`, Soup's gate NOT lifted, "
              f"{' and '.join(dict.fromkeys(str(r['steps']) for r in runs))} optimizer steps a run, on an emulated card; "
              f"outcomes measured). {stock_estimate(folder, stock)} The runs (the patched gate's need and the free "
              "memory torch read, as Soup printed them):\n")
        for r in runs:
            print(f"- `{r['name']}`: {arm_of(r)}{', gradient checkpointing' if r['gc'] else ''} on {r['card']} "
                  f"({resident_patch_gate(r)}): {r['outcome']}.")
        cause = ("These runs ran on torch's default caching allocator (the patch they ran, `corrected-preflight.diff`, "
                 "sets none; soup-cli 0.77.0's `configure_cuda_alloc_hint` sets expandable segments for a streamed run "
                 "only), where the patched need charges the allocator's reserve measured under expandable segments. "
                 "What killed them is not measured on these runs (each one's text keeps its outcome, OOM, and no "
                 "reserved-but-unallocated figure); the fragmentation measured on that allocator, in the resident "
                 f"`--find-max` searches (the section below): {fragmentation_words()}."
                 + (" The next patch sets expandable segments for a resident run too, and must be proven again "
                    "(`bench/gpu-next.sh resident-patch`)." if not any(c[2] for c in resident_patch_calls()) else
                    " The patch that sets them was proven after these (below).")
                 if sets is False else "What killed them is not measured on these runs"
                 + (" (the patch they ran sets expandable segments)." if sets else "."))
        if not any(r["admitted"] for r in patched):
            print("\nThe patched gate admitted no run here" + ("." if patched else " (no patched run in the folder)."))
            continue
        print(f"\nEvery run the patched gate admitted completed: {'NO' if died else 'yes'} ({len(died)} of "
              f"{sum(r['admitted'] for r in patched)} admitted died)"
              + (". The claim of the patched resident gate fails: "
                 + (f"it refused {arm_of(stock)} on the {stock['card']}, which stock Soup admitted ({stock['outcome']}), "
                    "but " if twin and not twin["admitted"] and stock["admitted"] else "")
                 + "it admits runs that die by OOM on the card it read. " + cause if died else "."))


if __name__ == "__main__":
    main()
    preference()
    stream_vram_probe()
    soup_patch()
    resident()
    find_max_searches()
