#!/usr/bin/env bash
# Issue 51, call 1: what is live at the peak of RESIDENT (training.stream_layers false) LoRA and QLoRA steps, with
# Soup's own resident gate (commands/train.py's input, hardware_fit's estimate and verdict against the card) beside
# each real peak: task_peak_anatomy.py --train stream_layers=false [gradient_checkpointing=true]. The arms span
# the terms the corrected resident estimate needs: weights at bf16 and NF4, activations with checkpointing off
# and on, the logits and loss at small and large vocabularies, batch, a preference task of each shape (DPO
# paired, KTO with its KL batch) and a large adapter. Cheapest checkpoints first, so a cut call keeps the most.
source bench/gpu-box.sh 0.77.0
export TMPDIR=/dev/shm
END=$(( $(date +%s) + ${BUDGET_S:-500} ))
an() { anatomy res "$1" "$2" --train stream_layers=false "${@:3}"; }
an sft-smol-bf16-1024x1 smol --task sft --seq 1024
an sft-smol-bf16-1024x1-gc smol --task sft --seq 1024 --train gradient_checkpointing=true
an sft-qwen-bf16-2048x1 qwen --task sft --seq 2048
an sft-qwen-bf16-2048x2-gc qwen --task sft --seq 2048 --batch 2 --train gradient_checkpointing=true
an kto-qwen-bf16-1024x2 qwen --task kto --seq 1024 --batch 2
an sft-llama1b-bf16-2048x1 llama32-1b --task sft --seq 2048
an sft-llama1b-nf4-2048x1 llama32-1b --task sft --seq 2048 --quant nf4
an dpo-llama1b-bf16-1024x1 llama32-1b --task dpo --seq 1024
an sft-llama1b-bf16-2048x1-r64all-gc llama32-1b --task sft --seq 2048 --r 64 \
   --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --train gradient_checkpointing=true
an sft-qwen3-bf16-4096x1-gc qwen3-0.6b --task sft --seq 4096 --train gradient_checkpointing=true
an sft-gemma3-bf16-2048x1 gemma3-1b --task sft --seq 2048
an sft-gemma2-bf16-1024x1 gemma2-2b --task sft --seq 1024
an sft-gemma2-nf4-2048x1-gc gemma2-2b --task sft --seq 2048 --quant nf4 --train gradient_checkpointing=true
an sft-phi3-nf4-1024x1 phi3-mini --task sft --seq 1024 --quant nf4 --targets qkv_proj
tar -czf "$OUT/results.tar.gz" -C "$R" .
