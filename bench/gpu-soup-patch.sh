#!/usr/bin/env bash
# Issue 39 item 3 (sourced from the repo root on the GPU box, .whl carried with soup-cli 0.77.0): Soup's gate,
# fixed, proven by the real `python -m soup_cli train`. --soup-patch writes the diff against the soup-cli 0.77.0
# that gpu-box.sh installs under /tmp/site; `patch -p1` applies it there; then bench/soup_patch_gate.py runs Soup
# with its gate NOT lifted (no training.stream_vram_override) on emulated cards, 3 optimizer steps a probe, at and
# around the measured --find-max limits (gate lifted; results/fit4-anatomy-findmax-render.txt):
#   Qwen2.5-0.5B DPO bf16 on 12 GB, limit 1856 (results/findmax-kimi-anatomy-h200-soup0.77.0-f6c944f/);
#   Phi-3-mini SFT NF4, r64 on qkv_proj, o_proj, gate_up_proj, down_proj, 4 micro-batches, on the RTX 3050
#     Laptop 4 GB, limit 3264 (results/fit4-anatomy-findmax-*/call-3-4/);
#   Mistral-7B ORPO NF4, r32 on q,k,v,o, on the RTX 3050 Laptop 6 GB, limit 2944 (results/fit4-pages-findmax-*/call-4/).
# Claims: every run the patched gate admits completes; its longest admitted seq is the limit or one step (64)
# below it. Predicted on CPU from the free memory Soup's gate printed in those probes: the limit on all three.
# (Phi-3 at 1 micro-batch, limit 3712: predicted 3584, two steps under: not part of the claim's set.)
source bench/gpu-box.sh
export TMPDIR=/dev/shm
END=$(( $(date +%s) + ${BUDGET_S:-540} ))  # after the install: the device counts it too
git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null
cmd soup-patch python3 issue395_second_stack_vram.py --soup-patch "$R/soup-cli-0.77.0-corrected-preflight.diff"
cmd patch-apply bash -c "cd /tmp/site && patch -p1 < '$R/soup-cli-0.77.0-corrected-preflight.diff'"
pg() {  # pg NAME YAML CARD LIMIT
  if [ "$(left)" -lt 90 ]; then echo "not run (time): $1" >> "$R/commands.txt"; return; fi
  cmd "soup-patch-gate-$1" timeout -s INT -k 40 "$(left 50)" python3 bench/soup_patch_gate.py \
      --config "bench/find-max/$2" --card "$3" --limit "$4" --steps 3 --cache-dir $C --shard-dir /dev/shm/s \
      --log-dir "$R/soup-patch-gate-$1-logs" --json "$R/soup-patch-gate-$1.json"
  rm -rf /dev/shm/s
}
pg qwen-dpo-12GB qwen-dpo.yaml 12GB 1856
pg phi3-sft-nf4-r64-fused-4GB phi3-sft-nf4-r64-fused.yaml RTX3050-Laptop-4GB 3264
pg mistral-orpo-nf4-6GB mistral-orpo-nf4-r32-attn.yaml RTX3050-Laptop-6GB 2944
tar -czf "$OUT/results.tar.gz" -C "$R" .
