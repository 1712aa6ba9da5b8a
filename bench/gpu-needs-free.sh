#!/usr/bin/env bash
# Issue 16, second pass (sourced after bench/gpu-box.sh): --cap at the corrected needs-free with its
# allocator allowance refitted on the first pass, then the map's new seqs (512, 1024) on two GPUs,
# cut at 300 s by SIGTERM (the rows measured by then are printed and saved, marked interrupted).
run cap-needs-free --map --families smol,qwen,llama32-1b,mistral-7b,phi-2,phi3-mini --quant none,nf4 \
    --seq 512 --batch 1 --cap needs-free --gpus 0,1 --cache-dir $C --json $R/cap-needs-free.json
cmd map-512-1024 timeout -s TERM 300 python3 issue395_second_stack_vram.py --map --seq 512,1024 \
    --families smol,qwen,llama32-1b,qwen3-0.6b,mistral-7b,gemma-2b,gemma2-2b,gemma3-1b,phi-2,phi3-mini \
    --gpus 0,1 --json $R/map-512-1024.json
