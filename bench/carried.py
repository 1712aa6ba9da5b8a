"""What an arm leaves allocated on the GPU after its teardown (bench only; not the harness).

On the H200 map, Qwen2.5's bf16 arms ran with 1,024 bytes more resident than in the sweep,
after SmolLM2's NF4 arms in the same process. This runs the same order (SmolLM2 bf16, SmolLM2
NF4, Qwen2.5 bf16, all 2048 x 1) through the harness's own protocol and run_arm, with the
allocator's history recorded, and after each teardown prints the bytes still allocated and,
for each block still live, the Python frames that allocated it.

    CUDA_VISIBLE_DEVICES=0 python3 bench/carried.py [CACHE_DIR]
"""
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

import issue395_second_stack_vram as h  # noqa: E402
from issue395.host.checkpoints import quant_base, synthetic_checkpoint  # noqa: E402
from issue395.model.arm import Arm  # noqa: E402
from issue395.model.registry import SHAPES  # noqa: E402
from issue395.host.scratch import Scratch  # noqa: E402

ORDER = (("smol", "none"), ("smol", "nf4"), ("qwen", "none"))


def live_blocks() -> None:
    """Each CUDA tensor still reachable, with what holds it, and each live block's frames."""
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            print(f"  live tensor {tuple(obj.shape)} {obj.dtype}, held by "
                  f"{[type(r).__name__ for r in gc.get_referrers(obj)][:6]}")
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for block in seg["blocks"]:
            if block["state"] != "active_allocated":
                continue
            print(f"  live block {block['size']} bytes (asked {block.get('requested_size')}):")
            for f in (block.get("frames") or [])[:14]:
                print(f"      {f['filename']}:{f['line']} {f['name']}")


def main(cache: str | None, order=ORDER, seq: int = 2048) -> None:
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    with Scratch(cache) as scratch:
        root = scratch.checkpoint_root()
        bases = {k: str(synthetic_checkpoint(SHAPES[k], root)[0]) for k in dict(order)}
        for i, (key, quant) in enumerate(order):
            arm = Arm.at(key, seq, 1, i, quant)
            base = quant_base(scratch, bases[key], quant)
            row = h.protocol().run_arm(arm, SHAPES[key], base, scratch.path("arms", str(i)))
            left = torch.cuda.memory_allocated()
            print(f"{key} {quant}: real peak {row.real_peak} resident {row.resident} "
                  f"failure {row.failure} {row.error or ''}; after teardown {left} bytes allocated")
            if left:
                live_blocks()
    torch.cuda.memory._record_memory_history(enabled=None)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
