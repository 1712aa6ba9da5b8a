#!/usr/bin/env bash
# Issue 28, the map of the preference losses (sourced after `source bench/gpu-box.sh 0.77.0`):
# SFT, DPO and KTO (the losses Soup under-predicts, measured first in
# results/task-anatomy-h200-soup0.77.0-and-0.73.3-3f5620a) on five families, dense (tied and
# untied) and one MoE, bf16 and NF4, seq 512/2048/4096 (within positions), batch 1/2 (KTO 2/4, its
# smallest batch is 2), in 4 lanes; then the real `soup train` CLI on an emulated 12 GB card
# (bench/soup_train_card.py); then Soup's own number as a cap on one DPO and one KTO arm per family.
# Soup's shards go to /dev/shm (TMPDIR there, so Soup honours the folder), checkpoints to $C.
export TMPDIR=/dev/shm
F=smol,qwen,llama32-1b,phi-2,moonlight
run task-map-kto --map --task kto --families $F --quant none,nf4 --seq 512,2048,4096 --batch 2,4 --lanes 4 \
    --cache-dir $C --shard-dir /dev/shm/s --json $R/task-map-kto.json --markdown $R/task-map-kto.md
run task-map-sft-dpo --map --task sft,dpo --families $F --quant none,nf4 --seq 512,2048,4096 --batch 1,2 \
    --lanes 4 --cache-dir $C --shard-dir /dev/shm/s --json $R/task-map-sft-dpo.json --markdown $R/task-map-sft-dpo.md
# The real client: Soup's gate admits qwen DPO 2048x1 on 12 GB (its 9.34 GB) and the run dies; this
# tool's longest seq that fits there (1792, --estimate --model qwen --task dpo --card 12GB) with Soup's
# gate lifted by its own override completes; one step (64) above it.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
cmd soup-train-dpo-qwen-2048-12GB python3 bench/soup_train_card.py --family qwen --task dpo --seq 2048 --batch 1 \
    --card 12GB --steps 3 --work /tmp/w1
cmd soup-train-dpo-qwen-1792-12GB-override python3 bench/soup_train_card.py --family qwen --task dpo --seq 1792 \
    --batch 1 --card 12GB --steps 3 --override total --work /tmp/w2
cmd soup-train-dpo-qwen-1856-12GB-override python3 bench/soup_train_card.py --family qwen --task dpo --seq 1856 \
    --batch 1 --card 12GB --steps 3 --override total --work /tmp/w3
unset PYTORCH_CUDA_ALLOC_CONF
run cap-soup-tasks --map --task dpo,kto --families $F --quant none --seq 2048 --batch 2 --cap soup \
    --cache-dir $C --shard-dir /dev/shm/s --json $R/cap-soup-tasks.json
