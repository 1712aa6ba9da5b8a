#!/usr/bin/env bash
# A short check of the final harness's process paths on a two-GPU box: --gpus, --isolate,
# --determinism and --snapshot, each on a few arms. Packs what they wrote, unedited.
source bench/device-setup.sh
S="python3 issue395_second_stack_vram.py"
R=/tmp/results; C=/tmp/issue395-cache; D=$(date -u +%Y-%m-%d)
mkdir -p "$R"
nvidia-smi > "$R/stack-final-check.txt" 2>&1
step() {
  local name=$1; shift
  local t0=$(date +%s.%N)
  $S "$@" > "$R/$name.txt" 2>&1
  echo "exit $?, wall $(awk -v a="$t0" -v b="$(date +%s.%N)" "BEGIN{printf \"%.1f\", b-a}") s: $S $*" >> "$R/commands.txt"
  tar -czf "$OUT/results-final-check.tar.gz" -C "$R" .
}
step "h200-$D-final-gpus" --gpus 0,1 --seq 2048,4096 --cache-dir "$C" --json "$R/h200-$D-final-gpus.json"
step "h200-$D-final-isolate-snapshot" --isolate --snapshot --models smol,qwen --seq 2048 \
     --cache-dir "$C" --json "$R/h200-$D-final-isolate-snapshot.json"
step "h200-$D-final-determinism" --determinism 2 --models qwen --seq 4096 --cache-dir "$C" \
     --json "$R/h200-$D-final-determinism.json"
