"""Facts shared by the measurement and the estimator, each defined once: the CUDA caching
allocator's rounding, the cuBLAS workspace, and the sizes past which a config is a typo.
Stdlib only, imports nothing: the estimator must stay importable without torch.
"""

MiB = 2**20

# -- CUDA caching allocator (default config, as measured): constants as in the torch wheel's
# c10/core/AllocatorConfig.h; rules: CUDACachingAllocator.cpp get_allocation_size, shouldSplit --
K_MIN_BLOCK_SIZE, K_SMALL_SIZE = 512, 1 * MiB  # 512 B rounding; small pool up to 1 MiB
K_MIN_LARGE_ALLOC, K_ROUND_LARGE = 10 * MiB, 2 * MiB  # own segment from 10 MiB, in 2 MiB steps


def block_bytes(requested: int) -> int:
    """What the allocator counts for a request: rounded up to 512 B (an allocator history
    records the requested size)."""
    return max(K_MIN_BLOCK_SIZE, -(-requested // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE)


#: One cuBLAS workspace per thread on Hopper (docs/PEAK.md "Resident": resident = pool + extras +
#: 4 B x LoRA + 33,557,376 B; results/README.md "In-process against isolated arms": 32 MiB per
#: thread); about 8 MiB on Ampere.
CUBLAS_WORKSPACE = 32 * MiB
CUBLAS_WORKSPACE_AMPERE = 8 * MiB

#: Sizes no real model comes near (the largest public configs: 128 heads, 126 layers, hidden
#: 16,384, intermediate 53,248, vocab 262,144): past them a config is a typo, and would reach
#: torch as a model of terabytes. The measured path and the estimator refuse the same configs.
CONFIG_LIMITS = {"num_hidden_layers": 1024, "vocab_size": 2**22, "hidden_size": 2**16,
                 "intermediate_size": 2**18, "num_attention_heads": 1024}
