#!/usr/bin/env bash
# Re-measures the #395 record on a lent GPU box and packs what the program wrote,
# unedited, into $OUT/results-<part>.tar.gz. Part "a": the full default run cold and
# warm, the batch axis with peak attribution, and one GPU against two. Part "b":
# isolated arms and determinism repeats. Needs the carried wheels (bench/device-setup.sh).
# Usage: bash bench/h200-record.sh a|b
source bench/device-setup.sh
S="python3 issue395_second_stack_vram.py"
R=/tmp/results; C=/tmp/issue395-cache; D=$(date -u +%Y-%m-%d)
mkdir -p "$R"
pack() { tar -czf "$OUT/results-$1.tar.gz" -C "$R" .; }
step() {  # step NAME ARGS...: stdout+stderr and wall time to $R/NAME.txt
  local name=$1; shift
  local t0=$(date +%s.%N)
  $S "$@" > "$R/$name.txt" 2>&1
  local rc=$?
  echo "exit $rc, wall $(awk -v a="$t0" -v b="$(date +%s.%N)" "BEGIN{printf \"%.1f\", b-a}") s: $S $*" >> "$R/commands.txt"
  pack "$PART"
}
PART=$1
{ nvidia-smi; python3 -m pip list 2>/dev/null | grep -iE "^(torch|transformers|trl|peft|soup-cli|datasets|accelerate) "; } > "$R/stack-$PART.txt" 2>&1
if [ "$PART" = a ]; then
  step "h200-$D-full-cold" --sweep --measure --sdpa --cache-dir "$C" --json "$R/h200-$D-full-cold.json" \
       --markdown "$R/h200-$D-full-cold.md" --plot "$R/h200-$D-full-cold.png" --log-dir "$R"
  step "h200-$D-full-warm" --sweep --measure --sdpa --cache-dir "$C" --json "$R/h200-$D-full-warm.json"
  step "h200-$D-batch-snapshot" --batch 1,2,4 --seq 4096 --snapshot --cache-dir "$C" \
       --json "$R/h200-$D-batch-snapshot.json" --markdown "$R/h200-$D-batch-snapshot.md"
  step "h200-$D-sweep-1gpu" --cache-dir "$C" --json "$R/h200-$D-sweep-1gpu.json"
  step "h200-$D-sweep-2gpu" --gpus 0,1 --cache-dir "$C" --json "$R/h200-$D-sweep-2gpu.json"
  step "h200-$D-smol-2048" --models smol --seq 2048
else
  step "h200-$D-sweep-isolated" --isolate --cache-dir "$C" --json "$R/h200-$D-sweep-isolated.json"
  step "h200-$D-determinism" --determinism --cache-dir "$C" --json "$R/h200-$D-determinism.json"
fi
ls -la "$R" > "$OUT/listing-$PART.txt"
