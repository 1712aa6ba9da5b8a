"""Issue 34, measure first: the corrected estimate against the allocator's history of 11 streamed runs
(results/fit4-anatomy-findmax-*/call-1-2/anatomy-*.json: soup-cli 0.77.0 on one H200, 1 to 3 optimizer
steps, large adapters, gradient accumulation 1 against 4 or 2), then --find-max's measured limits
beside this tool's longest seq or batch (…/call-1-2 and …/call-3-4/find-max-*.json); then, from the next
session's calls (results/fit4-pages-findmax-stack-*/): the allocator's reserve at the peak under expandable
segments, read off the history of 8 more runs (call-1/pages-*.json, page_need), and three more --find-max
configs (call-2, call-4), every config's like-for-like longest both as its run printed it and as this tree's
estimator computes it now; and the twelfth session's five reruns under expandable segments of the arms the
default allocator read under (results/pages2-soup-patch-map4-modes-*/call-1-3/pages-*.json).

Three peaks per arm, each labelled:
  measured   torch.cuda.max_memory_allocated over the run (the allocator's own count: block sizes);
  replayed   the allocator's history replayed (its trace records each allocation's REQUESTED size,
             torch's CUDACachingAllocator record_trace(ALLOC, orig_size), while allocated_bytes counts
             the block's size);
  corrected  this tool's estimator, computed for the arm's task, quant, seq, batch, r, targets, steps and
             accumulation.
measured - replayed is what the trace cannot see: the bytes of blocks bigger than their request. Without
expandable segments (these anatomy processes: Soup printed "expandable_segments allocator hint not
enabled"), a large-pool block keeps a remainder of up to 1 MiB unsplit (should_split: remaining >
kSmallSize); with them (`soup train`, --cap, --emulate-card, --find-max) it splits at 512 B, so the
replayed peak is the one an expandable-segments run allocates. The replayed peak's base is the
allocated bytes when the window opened, so it still holds the setup's own remainders.

    .venv/bin/python bench/fit4_anatomy.py > results/fit4-anatomy-findmax-render.txt"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from issue395.estimator.estimate import estimate_key  # noqa: E402
from issue395.estimator.stacks import box_stack  # noqa: E402

FOLDER = next(ROOT.glob("results/fit4-anatomy-findmax-h200-soup0.77.0-*"))
PAGES = next(ROOT.glob("results/fit4-pages-findmax-stack-h200-soup0.77.0-*"))
#: the next session's expandable-segments reruns of the arms that read under with the default allocator
PAGES2 = next(ROOT.glob("results/pages2-soup-patch-map4-modes-h200-soup0.77.0-*"))
#: every folder of pages-*.json (bench/gpu-fit4-pages.sh, PART=1 then PART=2)
PAGE_CALLS = (PAGES / "call-1", PAGES2 / "call-1-3")
#: each folder's find-max calls, the later call first where one config ran twice (the run that answered)
FIND_MAX_CALLS = ((FOLDER, ("call-3-4", "call-1-2")), (PAGES, ("call-4", "call-2")))
#: the registry key each anatomy file's checkpoint was built from (bench/gpu-fit4-anatomy.sh's `an` lines)
FAMILY = {"llama32": "llama32-1b", "qwen": "qwen", "phi3": "phi3-mini", "qwen3": "qwen3-0.6b",
          "mistral": "mistral-7b", "gemma2": "gemma2-2b", "smol": "smol"}
#: the estimator's terms that are allocated before the first step (the replayed window's base)
RESIDENT_TERMS = ("pool", "extras", "lora_weights", "cublas_workspace", "resident_rounding")
STEP = {"seq": 64, "batch": 1}  # --find-max's resolution per axis


def anatomy(folder: Path = FOLDER / "call-1-2", prefix: str = "anatomy-") -> list[tuple[str, dict, object]]:
    out = []
    for path in sorted(folder.glob(f"{prefix}*.json")):
        d = json.loads(path.read_text(encoding="utf-8"))
        name = path.stem[len(prefix):]
        targets = tuple(d["targets"].split(",")) if d.get("targets") else None
        e = estimate_key(FAMILY[name.split("-")[1]], quant=d["quant"], seq=d["seq"], batch=d["batch"],
                         release="0.77.0", task=d["task"], targets=targets, lora_r=d.get("r") or 8,
                         steps=d.get("steps") or 1, accumulation=d.get("accum") or 1, soup=False,
                         transformers=box_stack((folder / "stack.txt").read_text())["transformers"])
        out.append((name, d, e))
    return out


def main() -> None:
    rows = anatomy()
    print(f"corrected estimate against the allocator's history (H200, soup-cli 0.77.0; {FOLDER.name}/call-1-2)")
    print(f"{'arm':<46}{'measured GB':>12}{'replayed GB':>12}{'unseen MB':>10}{'unsplit MB':>11}{'corrected GB':>13}"
          f"{'/measured':>10}{'split GB':>10}{'/replayed':>10}  phase")
    for name, d, e in rows:
        real, rep, c = d["real_peak"], d["replayed_peak"], e.corrected_predicted
        print(f"{name:<46}{real / 1e9:>12.4f}{rep / 1e9:>12.4f}{(real - rep) / 1e6:>10.1f}"
              f"{(c - e.split_allocated) / 1e6:>11.1f}{c / 1e9:>13.4f}"
              f"{c / real:>9.4f}x{e.split_allocated / 1e9:>10.4f}{e.split_allocated / rep:>9.4f}x  {e.phase}")
    print("measured: max_memory_allocated (the allocator's block bytes); replayed: the allocator's history replayed "
          "(requested sizes); unseen: measured - replayed (blocks larger than their request); corrected: computed by "
          "this tool's estimator, with unsplit (its bound on the adapter blocks' unsplit remainders, the term "
          "unsplit_remainders); split: corrected less unsplit (every block split to its request)")
    print("\nthe same peaks split at the window's start (allocated when the first step began: the resident), "
          "bytes; corrected's resident terms: pool, extras, lora_weights, cublas_workspace, resident_rounding")
    print(f"{'arm':<46}{'resident meas.':>15}{'resident est.':>15}{'diff':>13}{'step (replayed)':>17}"
          f"{'step (est.)':>15}{'est. - replayed':>17}")
    for name, d, e in rows:
        res = sum(e.terms.get(k, 0) for k in RESIDENT_TERMS)
        dyn, dyn_e = d["replayed_peak"] - d["resident_before"], e.corrected_predicted - res
        print(f"{name:<46}{d['resident_before']:>15,}{res:>15,}{d['resident_before'] - res:>13,}{dyn:>17,}"
              f"{dyn_e:>15,}{dyn_e - dyn:>17,}")
    by = {name: (d, e) for name, d, e in rows}
    print("\ngradient accumulation: the same arm at 1 micro-batch and at 4 (or 2); the difference is the adapter's "
          "held gradients (and, on the paired losses, nothing else)")
    print(f"{'pair':<44}{'measured MB':>12}{'replayed MB':>12}{'estimated MB':>13}")
    for a1 in sorted(n for n in by if n.endswith("-a1")):
        stem = a1[:-len("-s3-a1")]
        other = next((n for n in by if n.startswith(stem) and n != a1 and "-a" in n[len(stem):]), None)
        if other is None:
            continue
        (d1, e1), (d2, e2) = by[a1], by[other]
        print(f"{stem + ' ' + other[len(stem) + 1:] + ' - a1':<44}{(d2['real_peak'] - d1['real_peak']) / 1e6:>12.1f}"
              f"{(d2['replayed_peak'] - d1['replayed_peak']) / 1e6:>12.1f}"
              f"{(e2.corrected_predicted - e1.corrected_predicted) / 1e6:>13.1f}")
    print("\nthe held-gradient and moment terms the estimate charged (bytes, estimator terms)")
    for name, d, e in rows:
        t = e.terms
        print(f"{name:<46} adapter {t.get('lora_weights', 0):>13,}  held grads {t.get('held_gradients', 0):>13,}  "
              f"moments {t.get('adam_moments', 0):>13,}  transients {t.get('optimizer_transients', 0):>13,}")
    pages(rows)
    findmax()


def pages(default_rows: list[tuple[str, dict, object]]) -> None:
    """The reserve a card cannot do without, under expandable segments (what `soup train` runs): at the
    replayed peak, the 20 MiB (large pool) and 2 MiB (small pool) pages the live blocks touch; and each
    arm also among ``default_rows`` (the first table's, default allocator) set beside itself."""
    from issue395.constants import EXPANDABLE_PAGE_BYTES
    from issue395.estimator.estimate import EXPANDABLE_RESERVE_BYTES, EXPANDABLE_RESERVE_PAGES

    rows = [r for call in PAGE_CALLS for r in anatomy(call, "pages-")]
    print("\nunder expandable segments, as `soup train` runs (H200, soup-cli 0.77.0; "
          + ", ".join(f"{c.parent.name}/{c.name}" for c in PAGE_CALLS) + "): the allocated "
          "peak, and the pages its live blocks touch at the replayed peak (measured, page_need)")
    print(f"{'arm':<46}{'allocated GB':>13}{'corrected GB':>13}{'/allocated':>11}{'pages GB':>10}{'reserve MB':>11}"
          f"{'in pages':>9}{'charged MB':>11}{'needs free - pages MB':>22}")
    for name, d, e in rows:
        p, c = d["page_need"], e.split_allocated  # expandable segments split every block to its request
        print(f"{name:<46}{p['allocated'] / 1e9:>13.4f}{c / 1e9:>13.4f}{c / p['allocated']:>10.4f}x{p['pages'] / 1e9:>10.4f}"
              f"{p['reserve'] / 1e6:>11.1f}{p['reserve'] / EXPANDABLE_PAGE_BYTES['large']:>9.2f}{(e.needs_free - c) / 1e6:>11.1f}"
              f"{(e.needs_free - p['pages']) / 1e6:>22.1f}")
    print(f"allocated: the replayed peak (requested sizes at 512 B; under expandable segments a block splits to its "
          f"request, so it equals max_memory_allocated to the difference below); reserve: pages - allocated; "
          f"charged: {EXPANDABLE_RESERVE_PAGES} pages of {EXPANDABLE_PAGE_BYTES['large'] // 2**20} MiB ({EXPANDABLE_RESERVE_BYTES:,} B), the whole pages above "
          "the most measured here and in torch's OOM messages below")
    unseen = max(d["real_peak"] - d["requested_peak"] for _, d, _ in rows)
    print(f"max_memory_allocated - the requested peak, the most on these arms: {unseen:,} B")
    default = {name: d for name, d, _ in default_rows}
    print("\nthe same arm under the default allocator (the first table: its max_memory_allocated counts unsplit block "
          "remainders) and under expandable segments (above): corrected / max_memory_allocated")
    for name, d, e in rows:
        if name in default:
            c = e.corrected_predicted
            print(f"{name:<46} default {c / default[name]['real_peak']:.4f}x  expandable {e.split_allocated / d['real_peak']:.4f}x")


def findmax() -> None:
    print("\n--find-max on emulated cards (the real `python -m soup_cli train`, 3 steps a probe, Soup's gate lifted): "
          "the measured limit beside this tool's longest (computed) and Soup's gate's longest (computed by Soup)")
    print(f"{'config':<34}{'axis':<6}{'card':<22}{'limit':>7}{'OOM at':>8}{'like (run)':>11}{'like (now)':>11}"
          f"{'bound ctx':>10}{'Soup gate':>10}{'under (now)':>12}{'probes':>7}")
    seen = set()
    for folder, calls in FIND_MAX_CALLS:
        for call in calls:
            for path in sorted((folder / call).glob("find-max-*.json")):
                d = json.loads(path.read_text(encoding="utf-8"))
                m = d.get("measured") or {}
                if path.name in seen or m.get("limit") is None:
                    continue
                seen.add(path.name)
                axis, limit, above = m["axis"], m["limit"], m.get("oom_above")
                like, soup = d.get("this_tool_longest_like_for_like"), d.get("soup_gate_longest")
                now, bound = longest_now(d)
                under = (limit - now) // STEP[axis] if now is not None else None
                print(f"{path.stem[len('find-max-'):]:<34}{axis!s:<6}{d['card']['card']:<22}{limit!s:>7}{above!s:>8}"
                      f"{like!s:>11}{now!s:>11}{bound!s:>10}{soup!s:>10}{under!s:>12}{len(m.get('probes') or ()):>7}")
    print("like (run): this tool's longest with the box's own context, as the run printed it (the tree of its day); "
          "like (now): the same, computed by this tree's estimator; bound ctx: now, with the card's bound context; "
          "under: (limit - like (now)) / the resolution (64 tokens, 1 row); 0 is exact; never above the limit is the claim")
    oom_readings()


def run_kwargs(d: dict, value: int | None = None) -> tuple[dict, dict]:
    """A find-max JSON's config file read by Soup's own loader, as --estimate reads it
    (issue395.run.userconfig), as the estimator's arguments (the JSON's stack and steps; the axis at
    ``value``, else the file's): the family's config.json and the keyword arguments."""
    from issue395.model.registry import by_hub_id, config_json
    from issue395.run.userconfig import read_soup_config

    u = read_soup_config(str(ROOT / d["config"]))
    kw = dict(quant=u.quant, seq=u.seq, batch=u.batch, task=u.task, targets=u.targets, lora_r=u.lora_r,
              steps=d["steps"], **u.settings.estimator(), soup=False,
              release=d["stack"]["packages"]["soup-cli"], transformers=d["stack"]["packages"]["transformers"],
              stream=dict(u.stream_options))
    if value is not None:
        kw[d["measured"]["axis"]] = value
    return config_json(by_hub_id(u.base)), kw


def longest_now(d: dict) -> tuple[int | None, int | None]:
    """This tree's longest along the run's axis on its card: with the box's own context (like for like),
    and with the card's bound context."""
    from issue395.estimator.cards import budget, parse_card
    from issue395.estimator.fits import longest

    config, kw = run_kwargs(d)
    card = parse_card(d["card"]["card"])
    axis = d["measured"]["axis"]
    return tuple(longest(axis, config, budget(card, ctx).step_free_bytes, workspace=card.workspace(), **kw)
                 for ctx in (d["box_context_bytes"], None))


def oom_readings() -> None:
    """Each OOM probe whose Soup console holds torch's own out-of-memory message: the margin's parts
    at that moment, measured inside Soup's process, beside what this tool charges at that seq."""
    from issue395.estimator.cards import STEP_GROWTH_BYTES
    from issue395.estimator.estimate import estimate
    from issue395.constraints.findmax import oom_reading

    print("\ntorch's out-of-memory message in Soup's own process (measured, as torch printed it) against this tool's "
          "charge at that seq (computed; context: the box's, measured by the probing process)")
    print(f"{'probe':<40}{'allocated+tried GB':>19}{'corrected GB':>13}{'reserve MB':>11}{'charged MB':>11}"
          f"{'outside MB':>11}{'charged MB':>11}")
    seen = set()  # a config run twice (FIND_MAX_CALLS: the later call first) is read once, as findmax() reads it
    for folder, calls in FIND_MAX_CALLS:
        for call in calls:
            for logs in sorted((folder / call).glob("find-max-*-logs")):
                name = logs.name[len("find-max-"):-len("-logs")]
                if name in seen:
                    continue
                seen.add(name)
                d = json.loads((logs.parent / f"find-max-{name}.json").read_text(encoding="utf-8"))
                for log in sorted(logs.glob("soup-find-max-seq-*.log")):
                    r = oom_reading(log.read_text(encoding="utf-8", errors="replace"))
                    if r is None:
                        continue
                    seq = int(log.stem.rsplit("-", 1)[1])
                    config, kw = run_kwargs(d, seq)
                    e = estimate(config, **kw)
                    charged = e.needs_free - e.split_allocated
                    outside = d["box_context_bytes"] + STEP_GROWTH_BYTES
                    print(f"{name + ' seq ' + str(seq):<40}{(r.allocated + r.tried) / 1e9:>19.4f}"
                          f"{e.split_allocated / 1e9:>13.4f}{r.reserved_unallocated / 1e6:>11.1f}{charged / 1e6:>11.1f}"
                          f"{r.outside_allocator / 1e6:>11.1f}{outside / 1e6:>11.1f}")
    print("allocated+tried: the allocated bytes when the request failed plus the request; reserve: torch's reserved but "
          "unallocated (expandable segments, after the allocator released what it could); outside: this process's memory "
          "in use less both (the CUDA context and the runtime's growth). Accumulation: the file's, else Soup's default 4")


if __name__ == "__main__":
    main()
