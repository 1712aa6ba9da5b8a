"""Facts shared by the measurement and the estimator, each defined once: the units, the CUDA
caching allocator's rounding, the cuBLAS workspace, and the sizes past which a config is a typo.
Stdlib only, imports nothing of the package: the estimator must stay importable without torch.
"""

from typing import Any

MiB = 2**20
GB = 1e9  # the unit every table and published figure states sizes in
#: A size's unit as a message words it (torch's out-of-memory text: binary units), in bytes
SIZE_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
              "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}

# -- CUDA caching allocator (default config, as measured): constants as in the torch wheel's
# c10/core/AllocatorConfig.h; rules: CUDACachingAllocator.cpp get_allocation_size, shouldSplit --
K_MIN_BLOCK_SIZE, K_SMALL_SIZE = 512, 1 * MiB  # 512 B rounding; small pool up to 1 MiB
K_MIN_LARGE_ALLOC, K_ROUND_LARGE = 10 * MiB, 2 * MiB  # own segment from 10 MiB, in 2 MiB steps
K_LARGE_BUFFER = 20 * MiB  # the segment requests from 1 MiB up to 10 MiB are cut from
#: What expandable segments (`soup train`'s allocator) map physical memory in, per pool: 20 MiB pages
#: in the large pool, 2 MiB in the small one (torch's kLargeBuffer and kSmallBuffer, ExpandableSegment's
#: segment size in c10/cuda/CUDACachingAllocator.cpp). At an OOM the allocator unmaps every wholly free
#: page and retries, so the pages a live block touches are what a card cannot do without: the
#: measurement reads them (measure.cuda.page_need), the estimator charges them (EXPANDABLE_RESERVE_PAGES).
EXPANDABLE_PAGE_BYTES = {"large": K_LARGE_BUFFER, "small": 2 * MiB}
#: The allocator setting every needs-free of this tool holds under (torch reads it once, at context creation).
#: `soup train` sets it for a streamed run only (soup-cli 0.77.0 utils/gpu.py configure_cuda_alloc_hint; 0.73.3
#: in its streamed setup): a resident run is on the default allocator, whose fragmentation this tool does not
#: bound (measured: Gemma-2B SFT 3136x1 died holding 3.31 GB reserved but unallocated, one step past the
#: answer under this setting; results/resident-findmax-h200-soup0.77.0-faaa21d). Soup keeps a value exported.
ALLOC_CONF_VAR, EXPANDABLE_SEGMENTS = "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"
#: Every variable torch reads an allocator setting from: torch 2.9 on reads PYTORCH_ALLOC_CONF as well as
#: PYTORCH_CUDA_ALLOC_CONF, so either may carry a setting (what the estimator's replay asks of a run's
#: environment, estimator.sequence.default_allocator); this tool and Soup set ALLOC_CONF_VAR.
ALLOC_CONF_VARS = (ALLOC_CONF_VAR, "PYTORCH_ALLOC_CONF")


def allocator_setting(environ) -> str:
    """The allocator setting a process started under ``environ`` should run on: the value the user exported (it
    is theirs), else expandable segments where the variable is unset or empty (Soup's own rule)."""
    return environ.get(ALLOC_CONF_VAR) or EXPANDABLE_SEGMENTS


def block_bytes(requested: int) -> int:
    """What the allocator counts for a request: rounded up to 512 B (an allocator history
    records the requested size)."""
    return max(K_MIN_BLOCK_SIZE, -(-requested // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE)


def unsplit_bound(requested: int) -> int:
    """The most a live block of ``requested`` bytes can hold past its 512 B rounding under the default
    allocator: a large-pool request (over kSmallSize) is handed a free block whole when the block's rest
    would be kSmallSize or less (CUDACachingAllocator shouldSplit: remaining > kSmallSize), and a fresh
    segment's tail is under kRoundLarge - kSmallSize; the allocated-bytes stat counts the whole block, the
    history only the request. A small-pool request (kSmallSize or less) always splits at 512 B: nothing.
    Under expandable segments every block splits at 512 B (shouldSplit: remaining >= kMinBlockSize)."""
    return K_SMALL_SIZE if block_bytes(requested) > K_SMALL_SIZE else 0


def unsplit_rests(sizes) -> int:
    """unsplit_bound over blocks of ``sizes`` requested bytes: the most they hold past their 512 B rounding where
    each may be a cached block handed over whole."""
    return sum(map(unsplit_bound, sizes))


def cut_remainders(sizes) -> int:
    """What the blocks of ``sizes`` requested bytes under kMinLargeAlloc, live at once, hold past their 512 B
    rounding when cut from fresh kLargeBuffer segments: a large-pool request (over kSmallSize: a request of
    exactly kSmallSize is the small pool's, get_pool's ``size <= kSmallSize``) under kMinLargeAlloc gets a
    20 MiB segment, cut block by block, and only its last block keeps its rest (kSmallSize or less: shouldSplit
    splits where more would remain), so kSmallSize a segment those blocks fill. The small pool splits at 512 B:
    nothing. Blocks of kMinLargeAlloc or more are not this rule's (layer_remainders, segment_tail).
    Evidence: docs/PEAK.md, "loss_remainders"."""
    cut = sum(s for s in map(block_bytes, sizes) if K_SMALL_SIZE < s < K_MIN_LARGE_ALLOC)
    return -(-cut // K_LARGE_BUFFER) * K_SMALL_SIZE


def layer_remainders(sizes) -> int:
    """What the blocks of ``sizes`` requested bytes, live at once, can hold past their 512 B rounding under the
    default allocator where any of them may have been made after others were freed: those under kMinLargeAlloc
    by cut_remainders' rule, each of kMinLargeAlloc or more up to kSmallSize (unsplit_bound), which bounds both
    a fresh segment's tail (under kRoundLarge - kSmallSize is split off: segment_tail's rest is at most
    kSmallSize) and a larger cached block's rest. Where a block is known fresh (nothing cached is as large: the
    loss's logits, the weights as they load), its own segment's tail is the figure, not this bound.
    Evidence: docs/PEAK.md, "layer_remainders"."""
    sizes = list(map(block_bytes, sizes))
    return cut_remainders(sizes) + unsplit_rests(s for s in sizes if s >= K_MIN_LARGE_ALLOC)


#: PyTorch's default cuBLAS workspace per handle, one a thread (aten/src/ATen/cuda/CublasHandlePool.cpp,
#: parseChosenWorkspaceSize): ":4096:8" on compute capability 9.x to 12.x (Hopper, Blackwell),
#: ":4096:2:16:8" below. Each ':SIZE_KiB:COUNT' pair adds SIZE x 1024 x COUNT, and the sum is ONE
#: request to the caching allocator (allocateCUDABlasWorkspace), so a history shows one block of
#: the sum: 33,554,432 B on Hopper, 8,519,680 B = 8 MiB + 128 KiB before it.
#: Evidence: docs/PEAK.md, "CUBLAS_WORKSPACE".
CUBLAS_WORKSPACE = 4096 * 1024 * 8
CUBLAS_WORKSPACE_PRE_HOPPER = 4096 * 1024 * 2 + 16 * 1024 * 8
#: The variable whose ':SIZE_KiB:COUNT' pairs replace either default (estimator/cards.py cublas_workspace).
WORKSPACE_CONFIG_VAR = "CUBLAS_WORKSPACE_CONFIG"
#: A linear with a bias runs through cuBLASLt (the bias epilogue of addmm), which keeps its own
#: workspace, 1 MiB, from the first such matmul on, the same at every seq and task.
#: Evidence: docs/PEAK.md, "CUBLASLT_WORKSPACE".
CUBLASLT_WORKSPACE = 1024 * 1024

#: Sizes no real model comes near (the largest public configs: 128 heads, 126 layers, hidden
#: 16,384, intermediate 53,248, vocab 262,144): past them a config is a typo, and would reach
#: torch as a model of terabytes. The measured path and the estimator refuse the same configs.
CONFIG_LIMITS = {"num_hidden_layers": 1024, "vocab_size": 2**22, "hidden_size": 2**16,
                 "intermediate_size": 2**18, "num_attention_heads": 1024}

#: soup-cli 0.77.0's streaming modes as its training keys: what a soup.yaml may set and the
#: estimator models (the expert layout, the chunked loss, recompute), the measured arm's too.
STREAM_KEYS = ("stream_expert_layout", "stream_loss_chunk", "stream_recompute")


def is_whole(value: Any, minimum: int) -> bool:
    """A whole number (an int, never a bool) at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def comma_list(text: str) -> tuple[str, ...]:
    """Every list option's items: split on commas, each stripped (an empty item stays, for the
    caller to name)."""
    return tuple(item.strip() for item in text.split(","))
