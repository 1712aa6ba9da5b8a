#!/usr/bin/env bash
# The CUDA context's growth across an arm (bench/outside_allocator.py): the two emulated-card arms
# that went wrong (Mistral-7B NF4 at 512, the #395 arm on 1.981GB; at 18304, refused on 16GB by
# about 90 MB), a bf16 record arm, and the 512 arm with every kernel module loaded at init
# (CUDA_MODULE_LOADING=EAGER), which tells lazily loaded modules from handles and buffers.
# Then the measured context at init, for the record. Source bench/gpu-box.sh 0.77.0 first.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # as --emulate-card's children run
cmd context python3 -c "from issue395.results.stack import measure_context; print(measure_context())"
cmd outside-mistral-nf4-512 python3 bench/outside_allocator.py mistral-7b nf4 512 $C
cmd outside-mistral-nf4-18304 python3 bench/outside_allocator.py mistral-7b nf4 18304 $C
cmd outside-smol-none-2048 python3 bench/outside_allocator.py smol none 2048 $C
cmd outside-llama32-none-4096 python3 bench/outside_allocator.py llama32-1b none 4096 $C
CUDA_MODULE_LOADING=EAGER cmd outside-mistral-nf4-512-eager python3 bench/outside_allocator.py mistral-7b nf4 512 $C
