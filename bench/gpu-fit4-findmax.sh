#!/usr/bin/env bash
# Issue 34's proof (soup-cli 0.77.0, one H200; not yet run: no device was lent in the session that wrote it).
# --find-max on emulated cards, the real `python -m soup_cli train` in every probe, for eight configs across
# the five tasks (bf16 and NF4, tied and untied, large adapters, an MoE, gradient accumulation 1, 2 and 4):
# the measured limit beside this tool's longest with the box's own context (like for like) and with the
# card's named one. Then the lowest cap that completes (--min-free) on two large-adapter arms, the
# allocator's reserve measured, not charged. Each find-max is about 6 probes of 20-40 s: run it in
# device calls PART=1, 2, 3 (find-max) and 4 (min-free) (each under 600 s). Sourced from the repo root with .whl carried.
source bench/gpu-box.sh
export TMPDIR=/dev/shm
END=$(( $(date +%s) + ${BUDGET_S:-570} ))
git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null; df -h /tmp /dev/shm >> "$R/stack.txt"
H="python3 issue395_second_stack_vram.py"
fm() {  # fm NAME AXIS YAML CARD
  if [ "$(left)" -lt 90 ]; then echo "not run (time): $1" >> "$R/commands.txt"; return; fi
  cmd "find-max-$1" timeout -s INT -k 60 "$(left 70)" $H --find-max "$2" --config "bench/find-max/$3" --emulate-card "$4" \
      --steps 3 --cache-dir $C --shard-dir /dev/shm/s --log-dir "$R/find-max-$1-logs" --json "$R/find-max-$1.json"
  rm -rf /dev/shm/s
}
case "${PART:-1}" in
# PART=3's two that did not answer: Mistral's second probe failed as CUBLAS_STATUS_ALLOC_FAILED (now read as
# OOM), llama-sft.yaml had no chat template (now chatml)
6) fm mistral-orpo-nf4-6GB seq mistral-orpo-nf4-r32-attn.yaml RTX3050-Laptop-6GB
   fm llama-sft-8GB seq llama-sft.yaml RTX4060-Laptop-8GB ;;
1) fm phi3-sft-nf4-r64-4GB seq phi3-sft-nf4-r64-fused.yaml RTX3050-Laptop-4GB
   fm qwen-dpo-nf4-r64-T4 seq qwen-dpo-nf4-r64-all.yaml T4
   fm smol-kto-batch-4GB batch smol-kto-bf16-batch.yaml RTX3050-Laptop-4GB ;;
# the Phi-3 arm again, first: its first run stopped at Soup's chat-template check (the file now names chatml)
2) fm phi3-sft-nf4-r64-4GB seq phi3-sft-nf4-r64-fused.yaml RTX3050-Laptop-4GB
   fm llama32-sft-r128-8GB seq llama32-1b-sft-bf16-r128-all.yaml RTX4060-Laptop-8GB
   fm qwen3-simpo-12GB seq qwen3-simpo-bf16-r16.yaml 12GB ;;
3) fm mistral-orpo-nf4-6GB seq mistral-orpo-nf4-r32-attn.yaml RTX3050-Laptop-6GB
   fm moonlight-sft-nf4-T4 seq moonlight-sft-nf4-r16.yaml T4
   fm llama-sft-8GB seq llama-sft.yaml RTX4060-Laptop-8GB ;;
# the two configs this tool answered two steps under, again: each probe now reads the allocator's peaks in
# Soup's own process (findmax.PEAKS_HOOK), so the margin's parts are measured, not inferred from completions
5) fm qwen-dpo-nf4-r64-T4-peaks seq qwen-dpo-nf4-r64-all.yaml T4
   fm llama32-sft-r128-8GB-peaks seq llama32-1b-sft-bf16-r128-all.yaml RTX4060-Laptop-8GB ;;
4) cmd min-free-phi3-r64 timeout -s INT -k 40 "$(left 45)" $H --config bench/find-max/phi3-sft-nf4-r64-fused.yaml --min-free \
       --steps 3 --cache-dir $C --shard-dir /dev/shm/s --json "$R/min-free-phi3-r64.json" ;;
esac
tar -czf "$OUT/results.tar.gz" -C "$R" .
