#!/usr/bin/env bash
# Issue 51, call 3 (the session's last device minutes): the resident map's families call 2 did not reach
# (its time limit stopped it, costliest families first), and the four preference tasks resident on three families.
R=/tmp/resident-map3
source bench/gpu-box.sh 0.77.0
END=$(( $(date +%s) + ${BUDGET_S:-380} ))
mkdir -p /dev/shm/h
H="env HOME=/dev/shm/h python3 issue395_second_stack_vram.py"
S="--shard-dir /dev/shm/h/s"
cmd resident-map-rest timeout -s INT -k 30 "$(left 140)" $H --map --stream-layers off \
    --families smol,qwen,llama32-1b,qwen3-0.6b,gemma-2b,gemma3-1b --quant none,nf4 --seq 512,1024,2048 --batch 1,4 \
    --lanes 4 $S --json $R/resident-map-rest.json
cmd resident-tasks timeout -s INT -k 30 "$(left 30)" $H --map --stream-layers off --families qwen,llama32-1b,gemma3-1b \
    --task dpo,orpo,simpo,kto --quant none --seq 512,1024 --batch 2 --lanes 4 $S --json $R/resident-tasks.json
