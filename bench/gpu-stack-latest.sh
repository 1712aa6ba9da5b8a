#!/usr/bin/env bash
# Issue 37 item 3 (soup-cli 0.77.0, one H200): the stack a fresh `pip install soup-cli==0.77.0` resolves
# today (transformers 5.24.0, peft 0.21.2, carried in .whlnew/, installed ahead of the pinned .whl/),
# beside the pinned stack's committed rows, arm by arm: gemma-2-2b DPO bf16 1024x1 with the allocator's
# history (the arm an independent probe found 8 MiB higher there), then the task map's families and
# tasks at 512 and 2048 (the committed task-map-*.json rows are the pinned side).
# Sourced from the repo root with .whl and .whlnew carried.
source bench/gpu-box.sh
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site-new .whlnew/*.whl
export PYTHONPATH=/tmp/site-new:/tmp/site TMPDIR=/dev/shm
{ echo "--- the stack of this call (ahead of the pinned one) ---"; python3 -c "
import importlib.metadata as m
for p in ('torch','transformers','peft','trl','soup-cli','bitsandbytes','datasets','accelerate'): print(p, m.version(p))"; } >> "$R/stack.txt"
END=$(( $(date +%s) + 575 ))
git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null
G=$(python3 -c "
from pathlib import Path; from issue395.measure.shapes import family_shape; from issue395.run.checkpoints import synthetic_checkpoint
print(synthetic_checkpoint(family_shape('gemma2-2b'), Path('$C/checkpoints'))[0])")
cmd anatomy-dpo-gemma2-bf16-1024x1-r8-latest timeout -s INT 90 python3 bench/task_peak_anatomy.py --base "$G" --task dpo \
    --seq 1024 --work /dev/shm/w --json "$R/anatomy-dpo-gemma2-bf16-1024x1-r8-latest.json"
rm -rf /dev/shm/w "$G"
H="python3 issue395_second_stack_vram.py"
cmd task-map-latest timeout -s INT -k 60 "$(left 130)" $H --map --task sft,dpo,orpo,simpo --families smol,qwen,llama32-1b,phi-2,moonlight \
    --quant none,nf4 --seq 512,2048 --batch 1 --lanes 4 --cache-dir $C --shard-dir /dev/shm/s --json $R/task-map-latest.json
rm -rf /dev/shm/s
cmd task-map-kto-latest timeout -s INT -k 45 "$(left 50)" $H --map --task kto --families smol,qwen,llama32-1b,phi-2,moonlight \
    --quant none,nf4 --seq 512,2048 --batch 2 --lanes 4 --cache-dir $C --shard-dir /dev/shm/s --json $R/task-map-kto-latest.json
tar -czf "$OUT/results.tar.gz" -C "$R" .
