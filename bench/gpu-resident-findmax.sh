#!/usr/bin/env bash
# Issue 51 item 4: --find-max on resident soup.yamls (training.stream_layers false), each probe the real
# `soup train --allow-oom-attempt` (Soup's own lift of its resident gate) under the ballast of an emulated card, so
# each search stays short: bench/find-max/resident-*.yaml (Llama-3.2-1B bf16 DPO; Phi-3-mini bf16 SFT with gradient
# checkpointing; Gemma-2B bf16 SFT; Mistral-7B NF4 QLoRA SFT). The claim it tests: on each, this tool's longest
# (like for like: the box's own context) is the measured limit or one step below it.
# Sourced from the repo root with .whl/ carried (bench/README.md), one device command of at most 10 minutes:
#   source bench/gpu-resident-findmax.sh [TAG ...]   # TAGs: the searches below (default: all, cheapest first)
# All four do not fit one call: call 1 `llama-dpo-bf16 phi3-sft-bf16-gc gemma-sft-bf16`, call 2 `mistral-sft-nf4`
# (its 7B synthetic checkpoint is built first, then NF4-quantised at each probe's load). SOUP=0.73.3 for the pin.
WANT="$*"
R=${R:-/tmp/resident-findmax}
source bench/gpu-box.sh "${SOUP:-0.77.0}" || return 1 2>/dev/null || exit 1
END=$(( $(date +%s) + ${BUDGET_S:-560} ))
git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null; df -h /tmp >> "$R/stack.txt"
H="python3 issue395_second_stack_vram.py"
search() {  # search TAG AXIS CARD: --find-max AXIS on bench/find-max/resident-TAG.yaml on an emulated CARD
  local tag=$1 axis=$2 card=$3 name="find-max-resident-$1-$3"
  case " ${WANT:-$tag} " in *" $tag "*) ;; *) return ;; esac
  if [ "$(left)" -lt 90 ]; then echo "not run (time): $name" >> "$R/commands.txt"; return; fi
  cmd "$name" timeout -s INT -k 40 "$(left 45)" $H --find-max "$axis" --config "bench/find-max/resident-$tag.yaml" \
      --emulate-card "$card" --cache-dir "$C" --log-dir "$R/$name-logs" --json "$R/$name.json"
}
search llama-dpo-bf16 seq 16GB
search phi3-sft-bf16-gc seq 10GB
search gemma-sft-bf16 seq 24GB
search mistral-sft-nf4 seq 24GB
tar -czf "$OUT/results.tar.gz" -C "$R" .
