#!/usr/bin/env bash
# Issue 23, second pass (sourced after bench/gpu-box.sh with soup-cli 0.77.0 in .whl/):
#  1. depth: Llama-3.2-1B at 16 and at 4 layers (the first pass ran out of disk before it)
#  2. the cap proof for every UNDER of the first pass: capped at Soup's own number, as its setup
#     computed it, the step should die with CUDA OOM (the run Soup's gate admits dies)
#  3. DeepSeek-V3 at full width (one MoE layer of 256 experts), per-expert layout, NF4
cmd depth python3 issue395_second_stack_vram.py --map --families llama32-1b,llama32-1b-d4 --quant none,nf4 \
    --seq 2048 --batch 1 --json $R/depth.json
cmd cap-soup-chunk python3 issue395_second_stack_vram.py --map --families smol --quant none \
    --seq 2048,4096 --batch 1 --loss-chunk 512 --cap soup --cache-dir $C --json $R/cap-soup-chunk.json
cmd cap-soup-recompute python3 issue395_second_stack_vram.py --map --families smol,moonlight --quant none \
    --seq 512,2048 --batch 1 --recompute off --cap soup --cache-dir $C --json $R/cap-soup-recompute.json
rm -rf $C; df -h /tmp > $R/df-before-deepseek.txt
cmd deepseek-per-expert timeout -s TERM 330 python3 issue395_second_stack_vram.py --map --families deepseek-v3 \
    --quant nf4 --seq 512 --batch 1 --expert-layout per_expert --json $R/deepseek-per-expert.json
