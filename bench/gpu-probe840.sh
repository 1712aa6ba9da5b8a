#!/usr/bin/env bash
# Issue 51 item 5 (Soup's #840): Soup's training.stream_vram_probe per task, through the harness itself
# (--map --stream-vram-probe on): three families x the five tasks x seq 512,1024,2048,4096 x batch 1,2,4, bf16
# (KTO's batch 1 is planned and SKIPPED: Soup's schema refuses it). Each row: the real step's peak, Soup's probe
# number (SFT: Soup's own setup ran it, the key set; DPO, ORPO, SimPO, KTO: Soup refuses the key, so the harness
# calls Soup's measure_step_peak_bytes on the task's streamed model after Soup's setup) and Soup's verdict on it
# (decide_measured_fit against the free memory its gate read). The table "Soup's stream_vram_probe per task" is the
# answer. Seq 512 and 2048 first (every task and batch), then 1024 and 4096 while the call has time; rows are kept
# on a timeout (SIGINT). The lanes pack by the measured step's needs-free; an arm Soup's own probe refuses beside
# neighbours (its probe's OOM) is measured again holding the whole card. Packed into $OUT/results.tar.gz after
# each command (bench/gpu-box.sh). One 10-minute device call:
#   run(command="bash bench/gpu-probe840.sh", timeout_s=600)   (.whl/ and .whl077/ carried, bench/README.md)
R=/tmp/probe840
source bench/gpu-box.sh "${SOUP:-0.77.0}"
END=$(( $(date +%s) + ${BUDGET_S:-560} ))
git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null; nproc >> "$R/stack.txt"
mkdir -p /dev/shm/h
H="env HOME=/dev/shm/h python3 issue395_second_stack_vram.py"
A="--map --families smol,qwen,llama32-1b --stream-vram-probe on --task sft,dpo,orpo,simpo,kto --quant none \
  --batch 1,2,4 --lanes 4 --shard-dir /dev/shm/h/s --cache-dir $C"
cmd probe-512-2048 timeout -s INT -k 60 "$(left 260)" $H $A --seq 512,2048 \
    --json $R/probe-512-2048.json --markdown $R/probe-512-2048.md
cmd probe-1024-4096 timeout -s INT -k 40 "$(left 45)" $H $A --seq 1024,4096 \
    --json $R/probe-1024-4096.json --markdown $R/probe-1024-4096.md
