#!/usr/bin/env bash
# Issue 39 item 3 (sourced from the repo root on the GPU box): Soup's gate, fixed, proven by the real
# `python -m soup_cli train`. --soup-patch writes the diff against the soup-cli 0.77.0 that gpu-box.sh
# installs under /tmp/site; `patch -p1` applies it there; then bench/soup_patch_gate.py runs Soup with its
# gate NOT lifted (no training.stream_vram_override) on emulated cards, 3 optimizer steps a probe, at and
# around the measured --find-max limits (gate lifted): Qwen2.5-0.5B DPO on 12 GB, limit 1856, 1920 OOM
# (results/findmax-kimi-anatomy-h200-soup0.77.0-f6c944f/); Phi-3-mini SFT NF4, r64 on qkv_proj, o_proj,
# gate_up_proj, down_proj, on the RTX 3050 Laptop 4 GB, limit 3712, 3776 OOM (issue 34's measurement).
# Claims: every run the patched gate admits completes; its longest admitted seq is the limit or one step
# (64) below it. Each config: its checkpoint, then 5 probes of about 25 s (a refused one ends at Soup's gate).
source bench/gpu-box.sh 0.77.0
export TMPDIR=/dev/shm
git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null
cmd soup-patch python3 issue395_second_stack_vram.py --soup-patch "$R/soup-cli-0.77.0-corrected-preflight.diff"
cmd patch-apply bash -c "cd /tmp/site && patch -p1 < '$R/soup-cli-0.77.0-corrected-preflight.diff'"
cmd soup-patch-gate-qwen-dpo-12GB timeout -s INT -k 40 250 python3 bench/soup_patch_gate.py \
    --config bench/find-max/qwen-dpo.yaml --card 12GB --limit 1856 --steps 3 --cache-dir $C --shard-dir /dev/shm/s \
    --log-dir $R/soup-patch-gate-qwen-dpo-12GB-logs --json $R/soup-patch-gate-qwen-dpo-12GB.json
rm -rf /dev/shm/s
cmd soup-patch-gate-phi3-sft-nf4-r64-4GB timeout -s INT -k 40 280 python3 bench/soup_patch_gate.py \
    --config bench/find-max/phi3-sft-nf4-r64.yaml --card RTX3050-Laptop-4GB --limit 3712 --steps 3 --cache-dir $C \
    --shard-dir /dev/shm/s --log-dir $R/soup-patch-gate-phi3-logs --json $R/soup-patch-gate-phi3-sft-nf4-r64-4GB.json
tar -czf "$OUT/results.tar.gz" -C "$R" .
