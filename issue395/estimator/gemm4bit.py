"""Which kernel bitsandbytes' NF4 gemm_4bit runs for a decoder linear: its fused kernel (the output alone) or its
dequantising fallback (the fp32 absmax and the bf16 weight made, then F.linear). The choice is per card, per
weight shape and per token count, so it decides which requests an NF4 forward makes (decoder_nf4.linear4bit, the
streamed layer walk). Stdlib only.

The pinned stack's bitsandbytes (SEQUENCE_BITSANDBYTES) decides in backends/cuda/ops.py's gemm_4bit: past
``_gemm_4bit_custom_max_m`` rows (GEMM_4BIT_FUSED_MAX_ROWS) or an inner dimension that is not a multiple of the
block, the fallback; else ``_gemm_4bit_use_custom_cuda(device, dtype, M, N, K)``, a per-architecture ladder on M
(the rows: batch x seq), N (out), K (in), the card's SM count and its compute capability. ``uses_fused`` is that
ladder, line for line, for a bf16 input (Soup's NF4 compute dtype); tests/estimator/test_gemm4bit.py holds it to
the installed bitsandbytes' own function over every branch. Where the card is known (a ``Dispatch``: a named card
with its SM count, or the device a run measured on) the one answer is taken (``fused_shapes``); unknown, every
subset of the shapes some card may fuse (``may_fuse``) is a choice, and the callers take the largest replay.

Known limitations: the port is of one bitsandbytes release, for a bf16 input; another release, or a card without
bf16 (before compute capability 8: Soup's compute dtype there is fp16, whose sm75 branches fuse far more) keeps the
card-agnostic choices (``dispatch_for`` gives no Dispatch). The ROCm heuristic is not ported.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from .arch import NF4_BLOCK, Arch

#: The bitsandbytes release whose CUDA gemm_4bit dispatch this module reads (the pinned stack's).
SEQUENCE_BITSANDBYTES = "0.50.2"
#: Its CUDA gemm_4bit runs the fused kernel up to this many rows where the heuristic says so, and past it always
#: dequantises the weight (``_gemm_4bit_custom_max_m``).
GEMM_4BIT_FUSED_MAX_ROWS = 1536
#: ...and a weight of at least GEMM_4BIT_LARGE_WEIGHT elements (N x K: "Non-small-weight") it dequantises on every
#: CUDA card past GEMM_4BIT_LARGE_MAX_ROWS rows ("if M > 512: return False"): only its M <= 4 floor, the fp32 and
#: pre-sm75 cards' M < 8, sm87's and sm110's no and sm100's early exit (M <= 32 at most) come before it, and none
#: of them fuses there.
GEMM_4BIT_LARGE_WEIGHT = 4 * 1024 * 1024
GEMM_4BIT_LARGE_MAX_ROWS = 512
#: ``_GEMM_4BIT_CUSTOM_FLOOR_M``: at this many rows or fewer every card fuses.
GEMM_4BIT_FLOOR_ROWS = 4


class Dispatch(NamedTuple):
    """What bitsandbytes' heuristic reads of a card (``_gpu_dispatch_props``): its SM count and compute capability."""

    sms: int
    major: int
    minor: int


def dispatch_for(sms: Optional[int], cc: Optional[tuple], bitsandbytes: Optional[str] = SEQUENCE_BITSANDBYTES
                 ) -> Optional[Dispatch]:
    """The Dispatch of a card whose SM count and compute capability are both known, with bf16 (compute capability 8
    and up: below it Soup computes in fp16, whose branches are not ported), where the run's bitsandbytes is the
    release ported here (None: the installed one is assumed); else None (every card's choices)."""
    if sms is None or cc is None or int(cc[0]) < 8 or bitsandbytes not in (None, SEQUENCE_BITSANDBYTES):
        return None
    return Dispatch(int(sms), int(cc[0]), int(cc[1]))


def gemm_shapes(a: Arch) -> tuple:
    """The decoder linears' distinct (out, in) shapes, on which the heuristic chooses (one answer a shape at a
    token count, every layer alike; Llama-3.2-1B's four, Qwen3-0.6B's five)."""
    return tuple(sorted({(fo, fi) for fi, fo, _ in a.modules.values()}))


def may_fuse(shape: tuple, T: int) -> bool:
    """Whether gemm_4bit may run its fused kernel on some CUDA card for an (out, in) ``shape`` at ``T`` rows:
    never past GEMM_4BIT_FUSED_MAX_ROWS, nor a weight of GEMM_4BIT_LARGE_WEIGHT elements or more past
    GEMM_4BIT_LARGE_MAX_ROWS."""
    return T <= GEMM_4BIT_FUSED_MAX_ROWS and (T <= GEMM_4BIT_LARGE_MAX_ROWS
                                              or shape[0] * shape[1] < GEMM_4BIT_LARGE_WEIGHT)


def fuses(card: Dispatch, shape: tuple, T: int) -> bool:
    """Whether gemm_4bit runs its fused kernel for an (out, in) ``shape`` at ``T`` rows on ``card`` (ops.py's
    gemm_4bit: the row cap, the block alignment, then uses_fused)."""
    n, k = shape
    return T <= GEMM_4BIT_FUSED_MAX_ROWS and k % NF4_BLOCK == 0 and uses_fused(card, T, n, k)


def uses_fused(card: Dispatch, M: int, N: int, K: int) -> bool:
    """``_gemm_4bit_use_custom_cuda`` for a bf16 input, its branches in its order (each part below one of its
    blocks)."""
    if M <= GEMM_4BIT_FLOOR_ROWS:
        return True
    num_sms, major, minor = card
    n_blocks = (N + 63) // 64
    if major <= 7:  # no MMA kernel, or sm75's fp16-only one: a bf16 input fuses only below 8 rows
        return M < 8
    if (major == 8 and minor == 7) or major == 11:
        return False
    if major == 10:
        if n_blocks >= num_sms * 3:
            return M <= 32
        if n_blocks >= num_sms:
            return False if K >= N else M <= 8
        return False
    if N * K < GEMM_4BIT_LARGE_WEIGHT:
        return _small_weight(card, M, N, K, n_blocks)
    if M > GEMM_4BIT_LARGE_MAX_ROWS:
        return False
    if M < 8:
        return _below_8_rows(card, M, N, K, n_blocks)
    ladder = {(8, 0): _sm80, (8, 6): _sm86, (12, 0): _sm120}.get((major, minor), _sm90 if major == 9 else None)
    if ladder is not None:
        return ladder(num_sms, M, N, K, n_blocks)
    if (major, minor) == (12, 1) and n_blocks >= num_sms:
        return M <= 256
    return _sm89(num_sms, M, N, K, n_blocks)


def _small_weight(card: Dispatch, M: int, N: int, K: int, n_blocks: int) -> bool:
    """A weight under GEMM_4BIT_LARGE_WEIGHT elements: dequantising dominates."""
    num_sms, major, minor = card
    sm80 = (major, minor) == (8, 0)
    hbm = sm80 or major == 9
    if K * 2 < N:
        if hbm:
            low_wave = n_blocks * 3 < num_sms
            return M <= ((1536 if low_wave else 512) if sm80 else (512 if low_wave else 320))
        if n_blocks >= num_sms:
            return M <= 320
        return M <= 192 if n_blocks * K > num_sms * 320 else M <= 320
    quarter_wave = n_blocks * 4 <= num_sms
    if sm80 and quarter_wave:
        if K >= N:
            return M <= (32 if n_blocks * 8 <= num_sms else 128)
        return M <= 384
    if quarter_wave:
        return M <= (32 if (K < N or hbm) else 23)
    if n_blocks * 2 <= num_sms:
        return M <= 16
    return False


def _below_8_rows(card: Dispatch, M: int, N: int, K: int, n_blocks: int) -> bool:
    """A large weight at 5-7 rows: fused but where K-tiling or MMA occupancy favours dequantising on HBM."""
    num_sms, major, minor = card
    sm80, sm90 = (major, minor) == (8, 0), major == 9
    if (sm80 or sm90) and M >= 6 and n_blocks >= (36 if sm90 else 48):
        lt_75, lt_60 = n_blocks * 4 < num_sms * 3, n_blocks * 5 < num_sms * 3
        if K > N and lt_75:
            return False
        if K == N and (sm80 and lt_60 or sm90 and lt_75 and not lt_60):
            return False
    return True


def _sm80(num_sms: int, M: int, N: int, K: int, n_blocks: int) -> bool:
    if n_blocks >= num_sms * 3:
        return M <= 128
    if n_blocks >= num_sms:
        return M <= (64 if K < N else 32)
    if K >= N * 3 and n_blocks * 4 > num_sms:
        return False
    if K == N and n_blocks >= 48 and n_blocks * 5 < num_sms * 3:
        return False
    if n_blocks * 2 < num_sms:
        if K <= N:
            return M <= 128
        if n_blocks * 3 >= num_sms:
            return False
    if n_blocks >= num_sms // 2 and K < N:
        return M <= 128
    return M <= 16


def _sm86(num_sms: int, M: int, N: int, K: int, n_blocks: int) -> bool:
    if n_blocks >= num_sms:
        return M <= 128
    if n_blocks >= num_sms // 2:
        return M <= 64
    return M <= 16


def _sm90(num_sms: int, M: int, N: int, K: int, n_blocks: int) -> bool:
    if n_blocks >= num_sms * 3:
        return M <= 64
    if n_blocks >= num_sms * 2:
        return M <= 48
    if n_blocks >= num_sms:
        return M <= 32
    if n_blocks >= num_sms // 2:
        if K >= N and n_blocks * 4 < num_sms * 3:
            return False
        return M <= 16
    return False


def _sm120(num_sms: int, M: int, N: int, K: int, n_blocks: int) -> bool:
    if n_blocks >= num_sms * 3:
        return M <= 256
    if n_blocks >= num_sms * 2:
        return M <= 128
    if n_blocks * 5 >= num_sms * 4:
        return M <= (96 if K >= N else 64)
    if n_blocks >= num_sms:
        return M <= 64
    if n_blocks >= num_sms // 2:
        return M <= (64 if (K * 2 >= N and n_blocks >= 128) else 8)
    if K > N * 2 and n_blocks > 64:
        return M <= 16
    return M <= 8


def _sm89(num_sms: int, M: int, N: int, K: int, n_blocks: int) -> bool:
    """The fallback: sm89, sm121 below one wave, an architecture it does not name."""
    tall_k_2xn = K > N * 2
    if n_blocks >= num_sms * 3:
        return M <= 256
    if n_blocks >= num_sms * 2:
        return M <= 128
    if n_blocks * 5 >= num_sms * 4:
        if tall_k_2xn or n_blocks >= 200:
            return M <= 128
        if K >= N:
            return M <= (128 if num_sms >= 60 else 32)
        return M <= 64
    if n_blocks >= num_sms // 2:
        if tall_k_2xn:
            return M <= 64
        if n_blocks >= 64:
            return M <= 8
        return M <= 32
    if K > N and n_blocks <= 48:
        return M <= (12 if K >= N * 3 else 10)
    return M <= (16 if (tall_k_2xn or n_blocks < 48) else 8)


def fused_shapes(a: Arch, T: int, card: Dispatch) -> frozenset:
    """The shapes whose gemm_4bit runs fused at ``T`` rows on ``card``: its one answer."""
    return frozenset(s for s in gemm_shapes(a) if fuses(card, s, T))


def gemm_choices(a: Arch, T: int, card: Optional[Dispatch] = None) -> list:
    """Every set of shapes whose gemm_4bit may run fused at ``T`` tokens: on a known ``card`` its one answer
    (fused_shapes); unknown, each subset of the shapes some card may fuse there (may_fuse; none past
    GEMM_4BIT_FUSED_MAX_ROWS), a superset of what any card's answers can be, so the largest replay of them is never
    under the run's."""
    if card is not None:
        return [fused_shapes(a, T, card)]
    shapes = [s for s in gemm_shapes(a) if may_fuse(s, T)]
    return [frozenset(s for j, s in enumerate(shapes) if bits >> j & 1) for bits in range(1 << len(shapes))]


def any_fused(a: Arch, T: int, card: Optional[Dispatch] = None) -> bool:
    """Whether some decoder shape may run gemm_4bit fused at ``T`` tokens: on a known ``card`` its answer
    (fused_shapes), else on any card (may_fuse)."""
    return bool(fused_shapes(a, T, card) if card is not None else [s for s in gemm_shapes(a) if may_fuse(s, T)])
