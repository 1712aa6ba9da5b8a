#!/usr/bin/env bash
# Issue 51 item 6 (sourced from the repo root on the GPU box, .whl carried: `source bench/gpu-resident-patch.sh`,
# or `... 0.77.0` with .whl077/): Soup's RESIDENT gate (commands/train.py's _hardware_fit_preflight), fixed by
# --soup-patch, proven by the real `python -m soup_cli train` (bench/soup_train_card.py: a synthetic Qwen2.5-0.5B,
# training.stream_layers false, Soup's gate NOT lifted, 2 optimizer steps, on an emulated card: a ballast leaves
# the card's total free before Soup's process starts). Stock Soup's gate compares its formula with the H200's own
# total (gpu_info), which a ballast does not change; the patched gate reads the free memory the ballast leaves.
#   A: SFT bf16 4096x4, no checkpointing, on an RTX 4090 (24 GB). --estimate prints Soup's own verdict on that
#      card's total (computed by Soup: its formula +10% is under it) and this tool's need. Claims: stock `soup
#      train` launches it and it dies (OOM); the patched gate refuses it, in Soup's panel.
#   B: SFT bf16 batch 1 with gradient checkpointing on 12 GB, from the longest seq whose corrected need fits the
#      card's total less the context bound (the estimator's, computed here) up in 64-token steps to the first the
#      patched gate refuses (at most 4 runs). C: the same without checkpointing, its longest only.
#      Claim: every run the patched gate admits completes its 2 steps.
# soup_train_card.py exits 0 where the run ends as Soup's gate said (refused, or admitted and completed), 1 where
# Soup admitted a run that died: stock-A's 1 is the finding; any patched 1 fails the claim.
source bench/gpu-box.sh "$@"
export TMPDIR=/dev/shm HF_HUB_OFFLINE=1
END=$(( $(date +%s) + ${BUDGET_S:-540} ))  # after the install: the device counts it too
git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null
W=/dev/shm/rp  # the work folder: the checkpoint is built once in it; each run's output is cleared
card() {  # card NAME CARD ARGS...: one resident `soup train` under the ballast; its soup.yaml kept as $R/NAME.soup.yaml
  local name=$1 c=$2; shift 2
  if [ "$(left)" -lt 60 ]; then echo "not run (time): $name" >> "$R/commands.txt"; return 2; fi
  rm -rf "$W/out"
  cmd "$name" timeout -s INT -k 30 "$(left 30)" python3 bench/soup_train_card.py --family qwen --task sft \
      --card "$c" --steps 2 --train stream_layers=false --work "$W" "$@"
  local rc=$?; cp "$W/soup.yaml" "$R/$name.soup.yaml" 2>/dev/null; return $rc
}
edge() {  # edge CARD GC: the longest seq (64-token steps) whose corrected resident need fits CARD's total - context bound
  python3 -c "
import sys; from issue395.estimator.cards import parse_card, CONTEXT_BOUND_BYTES as CB, STEP_GROWTH_BYTES as G
from issue395.estimator.estimate import needs_free; from issue395.estimator.resident import estimate_resident
from issue395.measure.shapes import family_shape; from issue395.model.registry import config_json
s, room = family_shape('qwen'), parse_card('$1').total_bytes - CB
need = lambda q: needs_free(estimate_resident(config_json('qwen'), seq=q, batch=1, targets=s.targets, lora_r=s.lora_r,
                                              steps=2, checkpointing='$2' == 'true').corrected_predicted) + G
q = 64
while need(q + 64) <= room: q += 64
print(q)"
}
card stock-A RTX4090 --seq 4096 --batch 4
run est-A --estimate --config "$R/stock-A.soup.yaml" --card RTX4090
cmd soup-patch python3 issue395_second_stack_vram.py --soup-patch "$R/corrected-preflight.diff"
cmd patch-apply bash -c "cd /tmp/site && patch -p1 < '$R/corrected-preflight.diff'"
card patched-A RTX4090 --seq 4096 --batch 4
s=$(edge 12GB true); echo "edge 12GB checkpointing: $s" >> "$R/commands.txt"
for i in 0 1 2 3; do
  card "patched-B-$((s + 64 * i))" 12GB --seq $((s + 64 * i)) --batch 1 --train gradient_checkpointing=true
  grep -q "refused by Soup's gate" "$R/patched-B-$((s + 64 * i)).txt" 2>/dev/null && break
done
s=$(edge 12GB false); echo "edge 12GB no checkpointing: $s" >> "$R/commands.txt"
card "patched-C-$s" 12GB --seq "$s" --batch 1
tar -czf "$OUT/results.tar.gz" -C "$R" .
