#!/usr/bin/env bash
# Issue 28's map, again: bench/gpu-tasks-077.sh's two map commands stopped at the options ("--seq 4096
# is beyond phi-2's maximum positions (2048)": the map refuses a seq past a named family's positions),
# so phi-2 runs its own command at 512 and 2048. Sourced after `source bench/gpu-box.sh 0.77.0`.
export TMPDIR=/dev/shm
F=smol,qwen,llama32-1b,moonlight
run task-map-sft-dpo --map --task sft,dpo --families $F --quant none,nf4 --seq 512,2048,4096 --batch 1,2 \
    --lanes 4 --cache-dir $C --shard-dir /dev/shm/s --json $R/task-map-sft-dpo.json --markdown $R/task-map-sft-dpo.md
run task-map-kto --map --task kto --families $F --quant none,nf4 --seq 512,2048,4096 --batch 2,4 --lanes 4 \
    --cache-dir $C --shard-dir /dev/shm/s --json $R/task-map-kto.json --markdown $R/task-map-kto.md
run task-map-phi2 --map --task sft,dpo,kto --families phi-2 --quant none,nf4 --seq 512,2048 --batch 1,2,4 \
    --lanes 2 --cache-dir $C --shard-dir /dev/shm/s --json $R/task-map-phi2.json --markdown $R/task-map-phi2.md
