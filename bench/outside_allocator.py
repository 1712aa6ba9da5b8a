"""Device memory outside the caching allocator across one streamed arm (bench only; not the harness).

Why: on the emulated 16 GB card Soup's gate read about 90 MB less free memory than the ballast
left (15.151 GB measured, "only 15.06 GB is free" in Soup's refusal), and the #395 arm on an
emulated 1.981 GB card died creating a cuBLAS handle. The card verdict charges the CUDA context
as measured after CUDA init and the first cuBLAS handle (issue395.results.stack.measure_context). This
asks whether that context grows during the arm, and by how much: at each moment it reads
mem_get_info (free, total) and the allocator's reserved bytes; outside = total - free - reserved
is what no allocator counter sees (the context, loaded kernel modules, library handles).

    python3 bench/outside_allocator.py FAMILY QUANT SEQ [CACHE_DIR]

prints one line per moment (init, Soup's gate, before the step, after the step and teardown)
and the arm's row figures. Run each arm in a fresh process: loaded modules never unload.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

import issue395_second_stack_vram as h  # noqa: E402
from issue395.run.checkpoints import quant_base, synthetic_checkpoint  # noqa: E402
from issue395.measure.measurement import ArmHooks  # noqa: E402
from issue395.model.arm import Arm  # noqa: E402
from issue395.run.scratch import Scratch  # noqa: E402
from issue395.measure.shapes import family_shape  # noqa: E402

MOMENTS: list[tuple[str, int, int, int, int]] = []


def sample(moment: str) -> None:
    torch.cuda.synchronize()
    free, total = (int(n) for n in torch.cuda.mem_get_info())
    reserved, allocated = int(torch.cuda.memory_reserved()), int(torch.cuda.memory_allocated())
    MOMENTS.append((moment, free, total, reserved, allocated))


def watch_gate() -> None:
    """Sample at Soup's gate: its setup calls decide_stream_fit right after its mem_get_info."""
    from soup_cli.utils import layer_stream

    decide = layer_stream.decide_stream_fit

    def at_gate(*args, **kwargs):
        sample(f"Soup's gate (it read {kwargs.get('available_bytes')} free)")
        return decide(*args, **kwargs)

    layer_stream.decide_stream_fit = at_gate


def main(key: str, quant: str, seq: int, cache: str | None) -> None:
    torch.cuda.init()
    torch.cuda.current_blas_handle()  # the moment measure_context reads
    sample("init + first cuBLAS handle")
    watch_gate()
    shape = family_shape(key)
    with Scratch(cache) as scratch:
        base = quant_base(scratch, str(synthetic_checkpoint(shape, scratch.checkpoint_root())[0]), quant)
        hooks = ArmHooks(before_setup=lambda: sample("before Soup's setup"),
                         before_step=lambda m: sample("setup done, before the step"))
        m = h.measure_arm(Arm(key, seq, 1, 0, quant), shape, base, scratch.path("arm"), hooks=hooks)
        sample("after the step and teardown")
    error = f"; stopped by {type(m.error).__name__}: {str(m.error).splitlines()[-1:]}" if m.error else ""
    print(f"arm {key} {quant} seq {seq}: real peak {m.real_peak}, Soup's own {m.soup_predicted}{error}")
    print(f"CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', '(default)')} "
          f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '(default)')}")
    print(f"{'moment':<52} {'free':>15} {'reserved':>15} {'allocated':>15} {'outside':>13} {'vs init':>12}")
    first = None
    for moment, free, total, reserved, allocated in MOMENTS:
        outside = total - free - reserved
        first = outside if first is None else first
        print(f"{moment:<52} {free:>15,} {reserved:>15,} {allocated:>15,} {outside:>13,} {outside - first:>+12,}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
