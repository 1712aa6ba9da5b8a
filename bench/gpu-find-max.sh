#!/usr/bin/env bash
# Issue 29 items 5 and 7 (sourced after `source bench/gpu-box.sh 0.77.0`): --find-max seq on two
# families, the real `python -m soup_cli train` on an emulated card, each probe a fresh process under a
# ballast, Soup's gate lifted by its own training.stream_vram_override, 3 optimizer steps a probe:
# Qwen2.5-0.5B DPO on 12 GB (this tool's longest seq that fits: 1792; bench/find-max/qwen-dpo.yaml) and
# Llama-3.2-1B SFT on an 8 GB laptop card (3840; bench/find-max/llama-sft.yaml). Each result holds the
# limit that completes, the seq one resolution step (64) above it that raised OOM, every probe, and
# Soup's unlifted gate at both. The bases are registry hub ids: synthetic checkpoints built here.
# Soup's shards go to /dev/shm (TMPDIR there, so Soup honours the folder), checkpoints to $C.
export TMPDIR=/dev/shm
for arm in "qwen-dpo 12GB" "llama-sft RTX4060-Laptop-8GB"; do
  set -- $arm
  run find-max-$1-$2 --find-max seq --config bench/find-max/$1.yaml --emulate-card $2 --steps 3 \
      --cache-dir $C --shard-dir /dev/shm/s --log-dir $R/find-max-$1-$2-logs --json $R/find-max-$1-$2.json
done
