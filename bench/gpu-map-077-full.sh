#!/usr/bin/env bash
# Issue 30 item 2: soup-cli 0.77.0's full default map (277 arms: 14 families, bf16 and NF4, seq 512-16384
# within positions, batch 1 and 4) in one device call on one H200, with the tool's own lanes (bare
# --lanes: cores/4). Checkpoints stay on the disk (the scratch folder under /tmp, each family's freed after
# its last arm); Soup's shards go to RAM: Soup accepts a shard cache under $HOME, so HOME=/dev/shm/h and
# --shard-dir inside it. The map has its own time limit (SIGINT: the rows so far are saved, the rest are
# named as not run); then, if time is left, the record's ten arms at --lanes 4 (the lanes proof, against
# the committed serial 0.77.0 sweep). Disk and RAM use are sampled every 15 s. Sourced from the repo root.
source bench/gpu-box.sh 0.77.0
END=$(( $(date +%s) + 575 ))
git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null; nproc >> "$R/stack.txt"; df -h /tmp /dev/shm >> "$R/stack.txt"
mkdir -p /dev/shm/h
( while true; do echo "$(date +%s) $(df -B1 --output=used /tmp | tail -1) $(df -B1 --output=used /dev/shm | tail -1) $(free -b | awk '/Mem:/{print $3}')"; sleep 15; done ) > "$R/usage-tmp-shm-ram.txt" 2>&1 &
SAMPLER=$!
cmd map-077-full env HOME=/dev/shm/h timeout -s INT -k 25 "$(left 45)" python3 issue395_second_stack_vram.py --map \
    --lanes --shard-dir /dev/shm/h/s --json $R/map-077-full.json --markdown $R/map-077-full.md
kill $SAMPLER
rm -rf /dev/shm/h/s
[ "$(left)" -gt 40 ] && cmd sweep-077-lanes4 env HOME=/dev/shm/h timeout -s INT "$(left 5)" python3 \
    issue395_second_stack_vram.py --sweep --lanes 4 --shard-dir /dev/shm/h/s --json $R/sweep-077-lanes4.json
tar -czf "$OUT/results.tar.gz" -C "$R" .
