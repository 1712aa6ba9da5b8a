#!/usr/bin/env bash
# Issue 34's last claim (soup-cli 0.77.0, one H200; not yet run): the corrected estimate within [1.00, 1.02] of the
# real peak on every committed large-adapter arm at the steady state and with accumulation 4. The arms of
# results/fit4-anatomy-findmax-*/call-1-2/ that read under there ran the default allocator (max_memory_allocated
# counts unsplit block remainders the history cannot see; the replayed base holds the setup's): Qwen2.5 DPO bf16
# r64 all-linear 0.9986x-0.9988x, Phi-3 NF4 r64 fused 0.989x-0.993x, Mistral-7B NF4 r256 s2-a4 0.970x. Here each
# again as `soup train` runs it, under expandable segments (task_peak_anatomy.py --expandable), with page_need.
# About 4 minutes. Sourced from the repo root with .whl carried.
source bench/gpu-box.sh
export TMPDIR=/dev/shm
END=$(( $(date +%s) + ${BUDGET_S:-300} ))
left() { local l=$(( END - $(date +%s) - ${1:-0} )); [ $l -lt 5 ] && l=5; echo $l; }
git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null; df -h /tmp /dev/shm >> "$R/stack.txt"
ck() { python3 -c "
from pathlib import Path; from issue395.measure.shapes import family_shape; from issue395.run.checkpoints import synthetic_checkpoint
print(synthetic_checkpoint(family_shape('$1'), Path('$C/checkpoints'))[0])"; }
an() {  # an TAG FAMILY ARGS...
  local tag=$1 fam=$2; shift 2
  if [ "$(left)" -lt 45 ]; then echo "not run (time): $tag" >> "$R/commands.txt"; return; fi
  local base; base=$(ck "$fam"); echo "checkpoint $fam: $base" >> "$R/commands.txt"
  cmd "pages-$tag" timeout -s INT -k 15 "$(left 20)" python3 bench/task_peak_anatomy.py --expandable --base "$base" "$@" \
      --work /dev/shm/w --json "$R/pages-$tag.json"
  rm -rf /dev/shm/w
}
L7=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
an dpo-qwen-bf16-2048x1-r64-all-s3-a1 qwen --task dpo --seq 2048 --r 64 --targets $L7 --steps 3 --accum 1
an dpo-qwen-bf16-2048x1-r64-all-s3-a4 qwen --task dpo --seq 2048 --r 64 --targets $L7 --steps 3 --accum 4
an sft-phi3-nf4-2048x1-r64-fused-s3-a1 phi3-mini --task sft --seq 2048 --quant nf4 --r 64 --targets qkv_proj,o_proj,gate_up_proj,down_proj --steps 3 --accum 1
an sft-phi3-nf4-2048x1-r64-fused-s3-a4 phi3-mini --task sft --seq 2048 --quant nf4 --r 64 --targets qkv_proj,o_proj,gate_up_proj,down_proj --steps 3 --accum 4
an sft-mistral-nf4-1024x1-r256-all-s2-a4 mistral-7b --task sft --seq 1024 --quant nf4 --r 256 --targets $L7 --steps 2 --accum 4
tar -czf "$OUT/results.tar.gz" -C "$R" .
