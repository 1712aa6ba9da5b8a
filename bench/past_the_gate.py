"""One arm on an emulated card with Soup's gate overridden (bench only; not the harness).

Why: on the emulated cards Soup's gate refuses the arms this tool says fit between Soup's
longest seq and this tool's (Soup's number is over; results/README.md, "The emulated-card
proof"), so whether those runs would complete is never seen. Here Soup's own override
(training.stream_vram_override, which REPLACES the free memory its gate reads) is set to the
physical GPU's total, so the gate admits the arm, and the step runs on the card the ballast leaves:
completed or OOM is this tool's verdict tested, not Soup's.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python3 bench/past_the_gate.py FAMILY QUANT SEQ CARD [CACHE_DIR]

One arm a fresh process (the ballast and the allocator setting must come before CUDA starts).
"""
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

import issue395_second_stack_vram as h  # noqa: E402
from issue395.model.arm import Arm  # noqa: E402
from issue395.estimator.cards import step_free  # noqa: E402
from issue395.run.checkpoints import quant_base, synthetic_checkpoint  # noqa: E402
from issue395.constraints.emulation import EmulateCard, arm_config, tool_needs_free  # noqa: E402
from issue395.model.registry import family_of  # noqa: E402
from issue395.run.scratch import Scratch  # noqa: E402
from issue395.measure.shapes import family_shape  # noqa: E402


def main(key: str, quant: str, seq: int, card: str, cache: str | None) -> None:
    shape = family_shape(key)
    emulation = EmulateCard(card)
    needs = tool_needs_free(arm_config(family_of(key), None), emulation.budget, quant=quant, seq=seq, batch=1,
                            targets=tuple(shape.targets))
    physical = int(torch.cuda.mem_get_info()[1])  # above any Soup number an emulated card can meet
    gated = replace(shape, stream=tuple(shape.stream) + (("stream_vram_override", physical),))
    with Scratch(cache) as scratch:
        base = quant_base(scratch, str(synthetic_checkpoint(shape, scratch.checkpoint_root())[0]), quant)
        free = emulation.hold()
        try:
            m = h.measure_arm(Arm(key, seq, 1, 0, quant), gated, base, scratch.path("arm"))
        finally:
            emulation.release()
        # Read with the ballast gone: held, it is outside the allocator too (the first run of this
        # script read it there: results/past-the-gate-h200-soup0.77.0-1e6bde4, about 135 GB).
        torch.cuda.synchronize()
        free_now, total = (int(n) for n in torch.cuda.mem_get_info())
        outside = total - free_now - int(torch.cuda.memory_reserved())
    card_free = emulation.budget.free_bytes
    verdict = "fits" if needs is not None and needs <= step_free(card_free) else "does not fit"
    outcome = (f"completed, real peak {m.real_peak:,} B" if m.real_peak is not None else
               f"{type(m.error).__name__}: {str(m.error).strip().splitlines()[-1] if m.error else ''}")
    print(f"{key} {quant} {seq}x1 on {card} (Soup's gate overridden: stream_vram_override = this GPU's total)")
    print(f"  card free {card_free:,} B (free measured with the ballast held: {free:,}); "
          f"the step's free {step_free(card_free):,}")
    print(f"  Soup's own {m.soup_predicted:,} B; this tool's needs free {needs:,} B: {verdict}")
    print(f"  outcome: {outcome}; outside the allocator after the step: {outside:,} B")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5] if len(sys.argv) > 5 else None)
