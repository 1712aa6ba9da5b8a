#!/usr/bin/env bash
# Issue 38 item 5, the layer phase of an NF4 dense layer read per phase (soup-cli 0.77.0, one H200, about 5 min).
# The claim it tests: where the layer phase binds, what is live at its peak is the dequantised layer beside
# the MLP's forward tensors, or (past some length) its backward's, not both at their maxima. Measured so far
# (results/pages2-soup-patch-map4-modes-*/call-5, the map's --snapshot): Kimi K2's dense first layer holds 4
# i-sized tensors beside the whole dequantised layer where the estimate charges the MLP backward's 6
# (1.030x at per-expert 512, 1.056x at per-expert + chunk 512 at 2048); Mistral-7B NF4 512x1 is 1.0166x.
# Each arm here runs bench/task_peak_anatomy.py (the allocator's history split at every forward; frames with
# --stacks all) in the map's allocator (no --expandable), so its rows compare with the map's.
# The pair the layer-phase question needs goes first (Mistral 512, then Kimi's worst row, 2048 chunk 512), so a
# short budget still brings it back; Kimi 512 next, Mistral 4096 last (its checkpoint built again: the disk
# cannot hold Mistral's and Kimi's at once).
# Sourced from the repo root with .whl carried (bench/README.md).
source bench/gpu-box.sh 0.77.0
export TMPDIR=/dev/shm
END=$(( $(date +%s) + ${BUDGET_S:-540} ))
git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null; df -h /tmp /dev/shm >> "$R/stack.txt"
an() { anatomy layer "$1" "$2" --stacks all "${@:3}"; }  # an TAG FAMILY ARGS... (gpu-box.sh)
an sft-mistral-nf4-512x1-r8 mistral-7b --task sft --seq 512 --quant nf4
rm -rf "$C/checkpoints"/mistral-7b-*  # the disk: Kimi K2's checkpoint is about 40 GB
an sft-kimi-nf4-2048x1-per-expert-chunk512 kimi-k2 --task sft --seq 2048 --quant nf4 --targets q_b_proj,kv_b_proj \
   --stream stream_expert_layout=per_expert --stream stream_loss_chunk=512
an sft-kimi-nf4-512x1-per-expert kimi-k2 --task sft --seq 512 --quant nf4 --targets q_b_proj,kv_b_proj \
   --stream stream_expert_layout=per_expert
rm -rf "$C/checkpoints"/kimi-k2-*
an sft-mistral-nf4-4096x1-r8 mistral-7b --task sft --seq 4096 --quant nf4
tar -czf "$OUT/results.tar.gz" -C "$R" .
