#!/usr/bin/env python
"""Where a block with no Python frames comes from (issue 28: every Qwen2.5 arm holds one 1,048,576 B
block at its peak that SmolLM2's do not, and the anatomy's Python stacks were empty for it).

Claim tested: a bf16 Linear WITH a bias run during backward (a checkpointed forward, recomputed by
the autograd engine's own thread, as Soup's streamed layers are) allocates a workspace through the
caching allocator from that thread, so its block has native frames only; the same Linear without a
bias does not. Qwen2.5's q/k/v projections have biases; SmolLM2's have none.

Arms (each in this one process, in order, the allocator's history on with C++ frames):
  nobias-checkpointed (the control: same shapes, no bias), bias-checkpointed, bias-plain (no recompute).
For each it prints every block allocated during forward+backward that has no Python frame, its size,
whether it was still live at the end, and its innermost native frames.

    python3 bench/frameless_block.py [--hidden 896] [--out 128] [--tokens 1024]

Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=896)  # Qwen2.5-0.5B
    ap.add_argument("--out", type=int, default=128)  # its k/v width: 2 kv heads x 64
    ap.add_argument("--tokens", type=int, default=1024)
    a = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("frameless_block: no CUDA device here; nothing measured.")
        return 0
    from torch.utils.checkpoint import checkpoint
    results = []
    # The control first: a workspace is kept per handle and thread once made, so the arm after it
    # shows only what a bias adds.
    for name, bias, ckpt in (("nobias-checkpointed", False, True), ("bias-checkpointed", True, True),
                             ("bias-plain", True, False)):
        torch.cuda.synchronize()
        lin = torch.nn.Linear(a.hidden, a.out, bias=bias, device="cuda", dtype=torch.bfloat16)
        lin.requires_grad_(False)  # frozen base, as under LoRA
        x = torch.randn(a.tokens, a.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="all",
                                                 max_entries=200_000)
        y = checkpoint(lin, x, use_reentrant=False) if ckpt else lin(x)
        y.float().sum().backward()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = max(snap.get("device_traces") or [[]], key=len)
        live: dict = {}
        frameless = []
        for e in trace:
            if e.get("action") == "alloc":
                frames = e.get("frames") or []
                live[e["addr"]] = e
                if not any(str(f.get("filename", "")).endswith(".py") for f in frames):
                    frameless.append(e)
            elif e.get("action") in ("free_completed", "free_requested") and e.get("addr") in live:
                live.pop(e["addr"])
        rows = []
        for e in frameless:
            names = [str(f.get("name", "?"))[:100] for f in e.get("frames") or []
                     if "CachingAllocator" not in str(f.get("name", ""))]
            rows.append({"size": int(e["size"]), "live_at_end": e["addr"] in live, "native": names[:12]})
        results.append({"arm": name, "bias": bias, "checkpointed": ckpt, "frameless_blocks": rows})
        print(f"{name}: {len(rows)} block(s) with no Python frame: "
              + ", ".join(f"{r['size']:,} B{' (live at end)' if r['live_at_end'] else ''}" for r in rows))
        for r in rows:
            print("   " + " <- ".join(r["native"][:8]))
        del lin, x, y
        torch.cuda.empty_cache()
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
