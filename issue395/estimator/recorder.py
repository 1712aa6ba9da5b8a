"""The request recorder every replayed step shares (this wing's sequence, full_sequence, gc_sequence and
streamed_sequence): ``Requests``, each large-pool request and free in order, replayed as it comes through
estimator/allocator.py (a request of 1 MiB or less is the small pool's and no event), with the bytes an element of
each dtype takes and the two blocks every step's backward or loss makes alike: SDPA's backward workspace and TRL's
entropy chunks. Stdlib only."""

from __future__ import annotations

from contextlib import contextmanager

from ..constants import K_SMALL_SIZE, block_bytes
from .allocator import CachingAllocator
from .arch import Arch


class Requests:
    """The large pool's requests in order, replayed as they come; a small-pool request is no event."""

    def __init__(self, trace: bool = False, fused: frozenset = frozenset()):
        self.alloc = CachingAllocator()
        self.held: dict = {}
        self.n = 0
        self.trace = [] if trace else None  # ("alloc", bytes) and ("free", bytes), to set beside a capture
        self.fused = fused  # the (out, in) shapes whose NF4 gemm_4bit runs bitsandbytes' fused kernel (gemm_choices)
        # micro-batch 2 on under accumulation: AccumulateGrad adds each new gradient into .grad in place and frees it
        self.accumulating = False
        # autograd records (what an op saves is kept); off under torch.no_grad, where each block goes with its last
        # Python reference (KTO's KL forward: kl_forward)
        self.graph = True

    def get(self, nbytes: int):
        if block_bytes(nbytes) <= K_SMALL_SIZE:
            return None
        self.n += 1
        self.held[self.n] = self.alloc.malloc(nbytes)
        if self.trace is not None:
            self.trace.append(("alloc", nbytes))
        return self.n

    def put(self, *keys) -> None:
        for k in keys:
            if k is not None:
                b = self.held.pop(k)
                if self.trace is not None:
                    self.trace.append(("free", b.requested))
                self.alloc.free(b)

    def unsaved(self, *keys) -> None:
        """Frees what autograd would have saved: only without a graph (``graph`` off), where a block goes with its
        last Python reference."""
        if not self.graph:
            self.put(*keys)

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache: every wholly free segment back to the driver."""
        self.alloc.empty_cache()
        if self.trace is not None:
            self.trace.append(("empty_cache",))

    def rests(self, keys) -> int:
        return sum(self.held[k].rest for k in keys if k is not None and k in self.held)

    @contextmanager
    def no_graph(self, off: bool = True):
        """Autograd records nothing inside (``off``): torch.no_grad's forward, or ops no input of which needs a
        gradient; ``graph`` as it was after."""
        graph, self.graph = self.graph, self.graph and not off
        try:
            yield
        finally:
            self.graph = graph

    def saves_input(self, name: str, lora: tuple) -> bool:
        """Whether the LoRA target ``name``'s lora_A saves the layer's input itself (``lora``: the targets, r,
        dropout): with no dropout and a graph, there is no new tensor between them."""
        return self.graph and name in lora[0] and not lora[2]


#: bytes an element of each dtype the request sequences name (every sequence module reads these)
FP32, BF16 = 4, 2


#: SDPA's backward workspace past its fp32 accumulators and row sums (sdpa_workspace), as every committed H100 history
#: requests it, streamed and checkpointed alike.
SDPA_WORKSPACE_PAD = 256


def sdpa_workspace(a: Arch, T: int) -> int:
    """SDPA's backward workspace on the H100 (one fp32 block: a gradient accumulator per head and token, a second
    where k and v have fewer heads, the softmax's row sums, and SDPA_WORKSPACE_PAD), as every committed H100 history
    requests it: the four streamed ones (GQA and not), Phi-3-mini checkpointed past its window (25,428,224 B at
    2,048), phi-2 at 1,088 and 1,216, Llama-3.2-1B at 2,048 and SmolLM2-135M at 4,096 (GQA: 9 heads, so the pad is
    not per head)."""
    return FP32 * T * a.heads * (a.head_dim * (2 if a.kv != a.heads else 1) + 1) + SDPA_WORKSPACE_PAD


#: TRL's SFTTrainer metric entropy_from_logits (trl/trainer/utils.py, chunk_size=128): rows of the flattened logits
#: a chunk takes, its log_softmax, exp and their product live at once (PEAK "Loss phase": the entropy moment)
ENTROPY_CHUNK_ROWS = 128


def entropy_chunks(q: Requests, rows: int, V: int) -> None:
    """TRL's entropy_from_logits under no grad, ENTROPY_CHUNK_ROWS rows at a time: each chunk's log-probabilities
    (the last chunk's freed as the next comes), its exp and their product (freed); the last freed at the end."""
    last = None
    for n in [min(ENTROPY_CHUNK_ROWS, rows - j) for j in range(0, rows, ENTROPY_CHUNK_ROWS)]:
        logps = q.get(FP32 * n * V)
        q.put(last)
        ex, prod = q.get(FP32 * n * V), q.get(FP32 * n * V)
        q.put(ex, prod)
        last = logps
    q.put(last)
