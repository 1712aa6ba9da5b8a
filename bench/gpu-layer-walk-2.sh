#!/usr/bin/env bash
# Issue 38, call 2 of the layer walk (the same box): Phi-3-mini NF4 512x1 again with its protocol target
# (bench/gpu-layer-walk.sh ran it on task_peak_anatomy's default q_proj,v_proj, which Phi-3 lacks), and two
# more held-out arms: Gemma-2-2B NF4 512x1 at r 64, Qwen3.5 bf16 2048x1 with a 512-token chunked loss.
source bench/gpu-box.sh 0.77.0
export TMPDIR=/dev/shm
END=$(( $(date +%s) + ${BUDGET_S:-240} ))
an() { anatomy walk "$1" "$2" --stacks all "${@:3}"; }
an sft-phi3-nf4-512x1-qkv phi3-mini --task sft --seq 512 --quant nf4 --targets qkv_proj
an sft-gemma2-nf4-512x1-r64 gemma2-2b --task sft --seq 512 --quant nf4 --r 64
an sft-qwen35-bf16-2048x1-chunk512 qwen3.5 --task sft --seq 2048 --stream stream_loss_chunk=512
tar -czf "$OUT/results.tar.gz" -C "$R" .
