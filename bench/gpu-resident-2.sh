#!/usr/bin/env bash
# Issue 51, call 2: the resident map through the harness itself (--map --stream-layers off): the ten default
# families x bf16/NF4 x seq 512,1024,2048 x batch 1,4 with Soup's default (no gradient checkpointing), then the
# same families with gradient checkpointing on at seq 1024,4096 x batch 1 while the call has time. Each row:
# the real peak, Soup's resident gate as its CLI runs it (its number, its margin, its verdict on this card).
# The lanes pack resident arms by an upper bound (run/spread.py: resident_packing_bound), never by Soup's number.
# Packed into $OUT/results.tar.gz after each command (bench/gpu-box.sh).
R=/tmp/resident-map
source bench/gpu-box.sh 0.77.0
END=$(( $(date +%s) + ${BUDGET_S:-560} ))
git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null; nproc >> "$R/stack.txt"
mkdir -p /dev/shm/h
H="env HOME=/dev/shm/h python3 issue395_second_stack_vram.py"
S="--shard-dir /dev/shm/h/s"
cmd resident-map timeout -s INT -k 60 "$(left 200)" $H --map --stream-layers off --quant none,nf4 \
    --seq 512,1024,2048 --batch 1,4 --lanes 4 $S --json $R/resident-map.json --markdown $R/resident-map.md
cmd resident-map-gc timeout -s INT -k 40 "$(left 45)" $H --map --stream-layers off --gradient-checkpointing on \
    --quant none,nf4 --seq 1024,4096 --batch 1 --lanes 4 $S --json $R/resident-map-gc.json

