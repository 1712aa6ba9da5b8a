#!/usr/bin/env bash
# Issue 34 item 1, measure first (soup-cli 0.77.0 on the pinned stack, one H200): what is live at the
# steady state of large adapters and under gradient accumulation, from the allocator's history split at
# every model forward, every optimizer step's start and end and every step's end
# (bench/task_peak_anatomy.py --steps --accum). Each pair of arms differs in one thing only
# (accumulation 1 against 4, or 2), so the difference is the held gradients and nothing else.
# Then gemma-2-2b DPO bf16 1024x1 on this stack, the pinned side of issue 37's +8 MiB arm.
# Sourced from the repo root with .whl carried (bench/README.md).
source bench/gpu-box.sh
export TMPDIR=/dev/shm
END=$(( $(date +%s) + 575 ))
git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null; df -h /tmp /dev/shm >> "$R/stack.txt"
an() { anatomy anatomy "$1" "$2" "${@:3}"; }  # an TAG FAMILY ARGS...: one anatomy run (gpu-box.sh)
L7=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
an sft-llama32-1b-bf16-2048x1-r64-all-s3-a1 llama32-1b --task sft --seq 2048 --r 64 --targets $L7 --steps 3 --accum 1
an sft-llama32-1b-bf16-2048x1-r64-all-s3-a4 llama32-1b --task sft --seq 2048 --r 64 --targets $L7 --steps 3 --accum 4
an dpo-qwen-bf16-2048x1-r64-all-s3-a1 qwen --task dpo --seq 2048 --r 64 --targets $L7 --steps 3 --accum 1
an dpo-qwen-bf16-2048x1-r64-all-s3-a4 qwen --task dpo --seq 2048 --r 64 --targets $L7 --steps 3 --accum 4
P3=qkv_proj,o_proj,gate_up_proj,down_proj
an sft-phi3-nf4-2048x1-r64-fused-s3-a1 phi3-mini --task sft --seq 2048 --quant nf4 --r 64 --targets $P3 --steps 3 --accum 1
an sft-phi3-nf4-2048x1-r64-fused-s3-a4 phi3-mini --task sft --seq 2048 --quant nf4 --r 64 --targets $P3 --steps 3 --accum 4
an orpo-qwen3-bf16-1024x2-r32-attn-s3-a1 qwen3-0.6b --task orpo --seq 1024 --batch 2 --r 32 --targets q_proj,k_proj,v_proj,o_proj --steps 3 --accum 1
an kto-llama32-1b-nf4-1024x2-r128-attn-s3-a2 llama32-1b --task kto --seq 1024 --batch 2 --quant nf4 --r 128 --targets q_proj,k_proj,v_proj,o_proj --steps 3 --accum 2
an dpo-gemma2-bf16-1024x1-r8-pinned gemma2-2b --task dpo --seq 1024 --steps 1
an sft-mistral-nf4-1024x1-r256-all-s3-a1 mistral-7b --task sft --seq 1024 --quant nf4 --r 256 --targets $L7 --steps 3 --accum 1
an sft-mistral-nf4-1024x1-r256-all-s2-a4 mistral-7b --task sft --seq 1024 --quant nf4 --r 256 --targets $L7 --steps 2 --accum 4
tar -czf "$OUT/results.tar.gz" -C "$R" .
