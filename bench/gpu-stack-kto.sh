#!/usr/bin/env bash
# Issue 37 (soup-cli 0.77.0, one H200; ran as call 5 of results/fit4-pages-findmax-stack-*): the one difference left unattributed between the pinned
# stack and the latest (results/stack-latest-vs-pinned.txt): KTO NF4 at 512x2 measured +1,024 B on the latest
# stack on all five families, equal at 2048x2. Each arm here once per stack, with the allocator's history and
# the Python frames of each live block (task_peak_anatomy's groups), so the 1,024 B is read off the history, not inferred.
# About 2 minutes. Sourced from the repo root with .whl and .whlnew carried.
source bench/gpu-box.sh
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site-new .whlnew/*.whl
export TMPDIR=/dev/shm
git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null
S=$(python3 -c "
from pathlib import Path; from issue395.measure.shapes import family_shape; from issue395.run.checkpoints import synthetic_checkpoint
print(synthetic_checkpoint(family_shape('smol'), Path('$C/checkpoints'))[0])")
for seq in 512 2048; do
  cmd anatomy-kto-smol-nf4-${seq}x2-pinned timeout -s INT 120 python3 bench/task_peak_anatomy.py --base "$S" --task kto \
      --seq $seq --batch 2 --quant nf4 --work /dev/shm/w --json "$R/anatomy-kto-smol-nf4-${seq}x2-pinned.json"
  rm -rf /dev/shm/w
  cmd anatomy-kto-smol-nf4-${seq}x2-latest env PYTHONPATH=/tmp/site-new:/tmp/site timeout -s INT 120 python3 bench/task_peak_anatomy.py \
      --base "$S" --task kto --seq $seq --batch 2 --quant nf4 --work /dev/shm/w \
      --json "$R/anatomy-kto-smol-nf4-${seq}x2-latest.json"
  rm -rf /dev/shm/w
done
tar -czf "$OUT/results.tar.gz" -C "$R" .
