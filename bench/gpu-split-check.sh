#!/usr/bin/env bash
# Issue 15's GPU checks in one device command (sourced after bench/gpu-box.sh): the record cold and
# warm on GPU 0, the tree before the split (.old/, carried) back to back with it, and a map subset.
export CUDA_VISIBLE_DEVICES=0
run full-cold --sweep --measure --sdpa --cache-dir $C --json $R/full-cold.json
run compare-cold --from-json $R/full-cold.json --compare results/record-h200x2-soup0.73.3-e7c26f7/h200-2026-11-30-full-cold.json
for i in 1 2; do
  run full-warm-new-$i --sweep --measure --sdpa --cache-dir $C --json $R/full-warm-new-$i.json
  cmd full-warm-old-$i python3 .old/issue395_second_stack_vram.py --sweep --measure --sdpa --cache-dir $C \
      --json $R/full-warm-old-$i.json
done
unset CUDA_VISIBLE_DEVICES
run map-subset --map --families smol,mistral-7b --seq 2048 --batch 1 --gpus 0,1 --cache-dir $C --json $R/map-subset.json
run compare-map-subset --from-json $R/map-subset.json --compare results/margin-map-h200x2-soup0.73.3-f3ad9d2/map-2gpu.json
