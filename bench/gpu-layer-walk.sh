#!/usr/bin/env bash
# Issue 38, the modes and the layer phase's walk (soup-cli 0.77.0, one H200, about 8 min).
# The claim it tests: issue395.estimator.layer's walk (each layer's forward end and MLP backward, its saved
# weights and the gradients made before it) is what binds, on arms nobody modelled it on. It reads the
# allocator's history at the peak (bench/task_peak_anatomy.py --stacks all, the map's allocator) on:
# - the rows the walk leaves outside [1.00, 1.02] on CPU: Phi-3-mini NF4 512x1 (0.998x), the recompute-off
#   arms (SmolLM2 512, Moonlight bf16 2048: 1.022x, 1.026x) and Qwen3.5 with a 256-token chunked loss at
#   4096 (1.024x);
# - held out: Mistral-7B NF4 768x2, Qwen3.5-MoE per-expert NF4 1024, Kimi K2 per-expert NF4 1024 (last: its
#   checkpoint is about 40 GB).
# Sourced from the repo root with .whl carried (bench/README.md).
source bench/gpu-box.sh 0.77.0
export TMPDIR=/dev/shm
END=$(( $(date +%s) + ${BUDGET_S:-540} ))
git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null; df -h /tmp /dev/shm >> "$R/stack.txt"
an() { anatomy walk "$1" "$2" --stacks all "${@:3}"; }  # an TAG FAMILY ARGS... (gpu-box.sh)
an sft-phi3-nf4-512x1 phi3-mini --task sft --seq 512 --quant nf4
an sft-smol-bf16-512x1-recompute-off smol --task sft --seq 512 --stream stream_recompute=off
an sft-qwen35-bf16-4096x1-chunk256 qwen3.5 --task sft --seq 4096 --stream stream_loss_chunk=256
an sft-moonlight-bf16-2048x1-recompute-off moonlight --task sft --seq 2048 --stream stream_recompute=off
an sft-mistral-nf4-768x2 mistral-7b --task sft --seq 768 --batch 2 --quant nf4
rm -rf "$C/checkpoints"/mistral-7b-* "$C/checkpoints"/moonlight-*  # the disk, before Kimi K2's
an sft-qwen35moe-nf4-1024x1-per-expert qwen3.5-moe --task sft --seq 1024 --quant nf4 --stream stream_expert_layout=per_expert
rm -rf "$C/checkpoints"/qwen3.5-moe-*
an sft-kimi-nf4-1024x1-per-expert kimi-k2 --task sft --seq 1024 --quant nf4 --targets q_b_proj,kv_b_proj \
   --stream stream_expert_layout=per_expert
tar -czf "$OUT/results.tar.gz" -C "$R" .
