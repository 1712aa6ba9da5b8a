#!/usr/bin/env bash
# The last device call of the session (soup-cli 0.77.0, one H200), in priority order, each command under its
# own limit (SIGINT, then time to write its outputs):
# 1. issue 29 items 5/7: --find-max seq on Qwen2.5-0.5B DPO, an emulated 12 GB card, 3 steps a probe, the
#    real `python -m soup_cli train` in each probe (bench/find-max/qwen-dpo.yaml);
# 2. issues 28/29: what each phase of Mistral-7B NF4 512x1 DPO's step holds (task_peak_anatomy's phase
#    markers), where the corrected estimate charged a reference-forward phase 1.158x the real peak;
# 3. issue 30 item 3: Kimi K2 at full width (2 of 61 layers, 384 experts), NF4 512x1, fused then per-expert,
#    its checkpoint on the disk (--cache-dir /tmp/kc) and Soup's shards in RAM (--shard-dir under TMPDIR),
#    the shards of the first layout removed before the second;
# 4. the 1,048,576 B block of every Qwen2.5 arm, with C++ frames (task_peak_anatomy --stacks all).
# Sourced from the repo root.
source bench/gpu-box.sh 0.77.0
export TMPDIR=/dev/shm
END=$(( $(date +%s) + 555 ))
git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null; df -h /tmp /dev/shm >> "$R/stack.txt"
H="python3 issue395_second_stack_vram.py"
cmd find-max-qwen-dpo-12GB timeout -s INT -k 40 "$(left 330)" $H --find-max seq --config bench/find-max/qwen-dpo.yaml \
    --emulate-card 12GB --steps 3 --cache-dir $C --shard-dir /dev/shm/s --log-dir $R/find-max-qwen-dpo-12GB-logs \
    --json $R/find-max-qwen-dpo-12GB.json
MISTRAL=$(python3 -c "
from pathlib import Path; from issue395.measure.shapes import family_shape; from issue395.run.checkpoints import synthetic_checkpoint
print(synthetic_checkpoint(family_shape('mistral-7b'), Path('$C/checkpoints'))[0])"); echo "mistral=$MISTRAL" >> $R/commands.txt
cmd anatomy-077-dpo-mistral-nf4-512x1-phases timeout -s INT 80 python3 bench/task_peak_anatomy.py --task dpo \
    --base "$MISTRAL" --seq 512 --batch 1 --quant nf4 --json $R/anatomy-077-dpo-mistral-nf4-512x1-phases.json
rm -rf "$MISTRAL" /dev/shm/s
cmd kimi-k2-fused timeout -s INT -k 60 "$(left 150)" $H --map --families kimi-k2 --quant nf4 --seq 512 --batch 1 \
    --cache-dir /tmp/kc --shard-dir /dev/shm/s --json $R/kimi-k2-fused.json
rm -rf /dev/shm/s
cmd kimi-k2-per-expert timeout -s INT -k 40 "$(left 40)" $H --map --families kimi-k2 --quant nf4 --seq 512 \
    --batch 1 --expert-layout per_expert --cache-dir /tmp/kc --shard-dir /dev/shm/s --json $R/kimi-k2-per-expert.json
QWEN=$(python3 -c "import json,glob; print([d for d in glob.glob('$C/checkpoints/*') if json.load(open(d+'/config.json')).get('hidden_size')==896][0])")
[ "$(left)" -gt 30 ] && cmd anatomy-077-kto-qwen-512x2-stacks timeout -s INT "$(left 3)" python3 bench/task_peak_anatomy.py \
    --task kto --base "$QWEN" --seq 512 --batch 2 --stacks all --json $R/anatomy-077-kto-qwen-512x2-stacks.json
tar -czf "$OUT/results.tar.gz" -C "$R" .
