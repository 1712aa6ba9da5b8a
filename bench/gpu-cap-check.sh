#!/usr/bin/env bash
# Issue 15's timing bar and issue 16's cap at Soup's own number, in one device command (sourced
# after bench/gpu-box.sh). The record on GPU 0: cold (builds), then the tree after and before the
# split back to back, warm; then --cap on the NF4 arms Soup under-predicts, and the control.
export CUDA_VISIBLE_DEVICES=0
run full-cold --sweep --measure --sdpa --cache-dir $C --json $R/full-cold.json
run full-warm-new --sweep --measure --sdpa --cache-dir $C --json $R/full-warm-new.json
cmd full-warm-old python3 .old/issue395_second_stack_vram.py --sweep --measure --sdpa --cache-dir $C \
    --json $R/full-warm-old.json
unset CUDA_VISIBLE_DEVICES
run cap-soup --map --families mistral-7b,phi-2,phi3-mini --quant nf4 --seq 512,1024,2048 --batch 1 \
    --cap soup --gpus 0,1 --cache-dir $C --json $R/cap-soup.json
run cap-control --map --families mistral-7b,smol --quant none,nf4 --seq 512 --batch 1 \
    --cap off --gpus 0,1 --cache-dir $C --json $R/cap-control.json
