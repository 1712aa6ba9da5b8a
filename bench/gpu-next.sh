#!/usr/bin/env bash
# The device calls left to run, one 10-minute call each, sourced from the repo root on a lent GPU box with .whl/
# carried (bench/README.md); each packs $R into $OUT/results.tar.gz after every command (bench/gpu-box.sh). A call
# leaves this file once a results folder's commands.txt records it (git history keeps it).
#   source bench/gpu-next.sh resident-patch [SOUP]        issue 51 item 6: the patched resident gate, real soup train
#   source bench/gpu-next.sh resident-findmax [TAG ...]   issue 51 item 4: --find-max on resident soup.yamls
#   source bench/gpu-next.sh resident-full [SOUP]         issue 51 item 1: resident full fine-tuning, first measured
#   source bench/gpu-next.sh resident-anatomy             issue 51 item 3: the resident rows over 1.02x, their live sets
#   source bench/gpu-next.sh segments52                   issue 52 item 1: which adapter blocks hold rests, at the steady state
#   bash bench/gpu-next.sh configs DIR                    CPU: write resident-findmax's soup.yamls into DIR, only
#   bash bench/gpu-next.sh edge CARD true|false           CPU: resident-patch's starting seq on CARD (gc on or off)
#
# resident-patch, issue 51 item 6 (run again: results/resident-patch-h200-soup0.77.0-faaa21d ran the patch before it
# set expandable segments, and runs the patched gate admitted died on the default allocator): Soup's RESIDENT gate (commands/train.py's _hardware_fit_preflight), fixed by
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
#
# resident-findmax, issue 51 item 4 (run again: results/resident-findmax-h200-soup0.77.0-faaa21d probed the default
# allocator; the probes now run on expandable segments, the setting the answer holds under): --find-max on resident
# soup.yamls (training.stream_layers false), each probe the real
# `soup train --allow-oom-attempt` (Soup's own lift of its resident gate) under the ballast of an emulated card, so
# each search stays short: the resident soup.yamls below, written into $R/configs (Llama-3.2-1B bf16 DPO; Phi-3-mini bf16 SFT with gradient
# checkpointing; Gemma-2B bf16 SFT; Mistral-7B NF4 QLoRA SFT). The claim it tests: on each, this tool's longest
# (like for like: the box's own context) is the measured limit or one step below it.
# TAGs: the searches below (default: all, cheapest first). All four do not fit one call: call 1 `llama-dpo-bf16 phi3-sft-bf16-gc gemma-sft-bf16`, call 2 `mistral-sft-nf4`
# (its 7B synthetic checkpoint is built first, then NF4-quantised at each probe's load). SOUP=0.73.3 for the pin.
#
# resident-full, issue 51 item 1: full fine-tuning (training.lora.r 0, SFT bf16, 1024x1), Qwen2.5-0.5B and
# Llama-3.2-1B, checkpointing off and on, one measured arm each (the harness's own step, --config): the first
# measured rows of estimate_full / estimate_master (0.77.0's fp32 master weights), every figure of which is
# unmeasured so far. `resident-full 0.73.3` for the pin's bf16 build (its own call).
#
# resident-anatomy, issue 51 item 3: the allocator's history (bench/task_peak_anatomy.py) of the committed resident
# rows the corrected estimate is most over (the Done-when asks 1.02x), to confirm on CUDA what the CPU saved-tensor
# count under CUDA's autocast lists named (estimator/layer.py autocast_upcasts, autocast_casts, mlp_records), first
# the rows over 1.02x: phi-2 NF4 without checkpointing (1.0056x-1.0250x, its retained blocks' rests still a bound:
# the meta capture's peak is 15,343,616 B under the 512x1 row's, unnamed; --trace brings back the real request
# sequence for sequence.py's phi NF4 step to be held against), Phi-3-mini NF4 1024x1 (v is SDPA's own bf16 copy of
# the fp32 fused qkv output), phi-2 bf16 (now replayed, 1.0000x-1.0007x: layer 0's LayerNorm and parallel MLP record
# nothing; autocast's fp32 LayerNorm weight copies, resident.norm_casts), Moonlight 2048x4 without checkpointing
# (1.0023x-1.0048x on its bf16 rows: layer.latent_retained). The CPU count is `python bench/allocator_replay.py saved KEY`.
#
# segments52, issue 52 item 1: the estimator charges unsplit_remainders, a BOUND of 1 MiB for every adapter-shaped
# block over 1 MiB live at once; on the four arms below that bound is 253.8, 455.1, 335.5 and 2,013.3 MB against
# 0.0, 6.7, 21.6 and 174.1 MB measured past the requests (max_memory_allocated - the replayed history, `python
# bench/rerenders.py fit4`'s unsplit and unseen columns). The history records requests only, so it cannot say
# which block holds a rest. bench/task_peak_anatomy.py --segments reads the allocator's segments right before and right after
# the last optimizer step (step 3), gradients and states live, on four fit4 anatomy arms with the arguments they
# ran with (results/fit4-anatomy-findmax-h200-soup0.77.0-2de65db-and-f2319d3/call-1-2/commands.txt), cheapest
# first. The claim it tests: which adapter-shaped blocks hold rests past their 512 B rounding and how much, per
# class (1 MiB or less, 1-10 MiB, 10 MiB or more), at the steady state, beside the bound over the same blocks.
# --trace also brings back each arm's device history without its frames (task_peak_anatomy.save_trace): the real
# request sequence of the streamed steady state (torch's actions, the segments before and after), for a converter to
# replay through estimator/allocator.py on CPU and a synthetic sequence to match.
#
# Done (results/*-faaa21d, 2026-12-05): probe840 and findmax52 (their commands.txt), resident-findmax and
# resident-patch on the default allocator: both run again, now that the probes and the patch set expandable segments.

resident_configs() {  # resident_configs DIR: the four resident soup.yamls resident-findmax searches
  mkdir -p "$1"
  cat > "$1/resident-gemma-sft-bf16.yaml" <<'YAML'
base: google/gemma-2b
data: {train: data.jsonl, chat_template: chatml, max_length: 2048}
training: {batch_size: 1, gradient_accumulation_steps: 1, quantization: none, stream_layers: false, lora: {r: 8, alpha: 16, target_modules: [q_proj, v_proj]}}
YAML
  cat > "$1/resident-llama-dpo-bf16.yaml" <<'YAML'
base: meta-llama/Llama-3.2-1B
task: dpo
data: {train: pairs.jsonl, max_length: 1024}
training: {batch_size: 1, gradient_accumulation_steps: 1, quantization: none, stream_layers: false, lora: {r: 8, alpha: 16, target_modules: [q_proj, v_proj]}}
YAML
  cat > "$1/resident-mistral-sft-nf4.yaml" <<'YAML'
base: mistralai/Mistral-7B-v0.3
data: {train: data.jsonl, chat_template: chatml, max_length: 2048}
training: {batch_size: 1, gradient_accumulation_steps: 1, quantization: 4bit, stream_layers: false, lora: {r: 16, alpha: 32, target_modules: [q_proj, k_proj, v_proj, o_proj]}}
YAML
  cat > "$1/resident-phi3-sft-bf16-gc.yaml" <<'YAML'
base: microsoft/Phi-3-mini-4k-instruct
data: {train: data.jsonl, chat_template: chatml, max_length: 2048}
training: {batch_size: 1, gradient_accumulation_steps: 1, quantization: none, stream_layers: false, gradient_checkpointing: true, lora: {r: 16, alpha: 32, target_modules: [qkv_proj, o_proj]}}
YAML
}

edge() {  # edge CARD GC: the longest seq (64-token steps) whose corrected resident need fits CARD's total - context bound
  python3 - "$1" "$2" <<'PY'
import sys
from issue395.estimator.cards import CONTEXT_BOUND_BYTES, STEP_GROWTH_BYTES, parse_card
from issue395.estimator.resident import estimate_resident
from issue395.measure.shapes import family_shape
from issue395.model.registry import config_json
s, room = family_shape("qwen"), parse_card(sys.argv[1]).total_bytes - CONTEXT_BOUND_BYTES
need = lambda q: estimate_resident(config_json("qwen"), seq=q, batch=1, targets=s.targets, lora_r=s.lora_r, steps=2,
                                   checkpointing=sys.argv[2] == "true").needs_free + STEP_GROWTH_BYTES
q = 64
while need(q + 64) <= room:
    q += 64
print(q)
PY
}

resident_patch() {
  R=${R:-/tmp/resident-patch}
  source bench/gpu-box.sh "${1:-0.77.0}" || return 1
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
}

resident_findmax() {
  WANT="$*"
  R=${R:-/tmp/resident-findmax}
  source bench/gpu-box.sh "${SOUP:-0.77.0}" || return 1
  resident_configs "$R/configs"
  END=$(( $(date +%s) + ${BUDGET_S:-560} ))
  git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null; df -h /tmp >> "$R/stack.txt"
  H="python3 issue395_second_stack_vram.py"
  search() {  # search TAG AXIS CARD: --find-max AXIS on $R/configs/resident-TAG.yaml on an emulated CARD
    local tag=$1 axis=$2 card=$3 name="find-max-resident-$1-$3"
    case " ${WANT:-$tag} " in *" $tag "*) ;; *) return ;; esac
    if [ "$(left)" -lt 90 ]; then echo "not run (time): $name" >> "$R/commands.txt"; return; fi
    cmd "$name" timeout -s INT -k 40 "$(left 45)" $H --find-max "$axis" --config "$R/configs/resident-$tag.yaml" \
        --emulate-card "$card" --cache-dir "$C" --log-dir "$R/$name-logs" --json "$R/$name.json"
  }
  search llama-dpo-bf16 seq 16GB
  search phi3-sft-bf16-gc seq 10GB
  search gemma-sft-bf16 seq 24GB
  search mistral-sft-nf4 seq 24GB
}

resident_full() {  # issue 51 item 1: resident full fine-tuning (lora.r 0), measured for the first time
  # the cache under $TMPDIR: Soup keeps its shard cache only inside $HOME, the working directory or the temp dir (the harness refuses one elsewhere)
  R=${R:-/tmp/resident-full}
  source bench/gpu-box.sh "${1:-0.77.0}" || return 1
  export TMPDIR=/dev/shm HF_HUB_OFFLINE=1
  END=$(( $(date +%s) + ${BUDGET_S:-540} ))
  git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null; mkdir -p "$R/c"
  for m in qwen:Qwen/Qwen2.5-0.5B llama:meta-llama/Llama-3.2-1B; do
    for gc in false true; do
      n=full-${m%%:*}-gc$gc f=$R/c/full-${m%%:*}-gc$gc.yaml
      if [ "$(left)" -lt 60 ]; then echo "not run (time): $n" >> "$R/commands.txt"; continue; fi
      printf 'base: %s\ndata: {train: data.jsonl, chat_template: chatml, max_length: 1024}\ntraining: {batch_size: 1, gradient_accumulation_steps: 1, quantization: none, stream_layers: false, gradient_checkpointing: %s, lora: {r: 0}}\n' "${m#*:}" "$gc" > "$f"
      cmd "$n" timeout -s INT -k 30 "$(left 30)" python3 issue395_second_stack_vram.py --config "$f" --cache-dir "$TMPDIR/issue395-cache" --json "$R/$n.json"
    done
  done
}

resident_anatomy() {
  R=${R:-/tmp/resident-anatomy}
  source bench/gpu-box.sh "${1:-0.77.0}" || return 1
  export TMPDIR=/dev/shm HF_HUB_OFFLINE=1
  END=$(( $(date +%s) + ${BUDGET_S:-540} ))
  git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null
  anatomy res sft-phi2-nf4-512x1 phi-2 --train stream_layers=false --task sft --seq 512 --quant nf4 --targets q_proj,v_proj \
      --trace "$R/res-sft-phi2-nf4-512x1.trace.json.gz"
  anatomy res sft-phi3-nf4-1024x1 phi3-mini --train stream_layers=false --task sft --seq 1024 --quant nf4 --targets qkv_proj
  anatomy res sft-phi2-bf16-2048x1 phi-2 --train stream_layers=false --task sft --seq 2048 --targets q_proj,v_proj
  anatomy res sft-moonlight-bf16-2048x4 moonlight --train stream_layers=false --task sft --seq 2048 --batch 4 \
      --targets q_proj,kv_b_proj
}

segments52() {
  R=${R:-/tmp/segments52}
  source bench/gpu-box.sh "${1:-0.77.0}" || return 1
  export TMPDIR=/dev/shm HF_HUB_OFFLINE=1
  END=$(( $(date +%s) + ${BUDGET_S:-540} ))
  git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null
  anatomy seg sft-llama32-1b-bf16-2048x1-r64-all-s3-a1 llama32-1b --task sft --seq 2048 --r 64 --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --steps 3 --accum 1 --segments --trace "$R/seg-sft-llama32-1b-bf16-2048x1-r64-all-s3-a1.trace.json.gz"
  anatomy seg dpo-qwen-bf16-2048x1-r64-all-s3-a1 qwen --task dpo --seq 2048 --r 64 --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --steps 3 --accum 1 --segments --trace "$R/seg-dpo-qwen-bf16-2048x1-r64-all-s3-a1.trace.json.gz"
  anatomy seg sft-phi3-nf4-2048x1-r64-fused-s3-a4 phi3-mini --task sft --seq 2048 --quant nf4 --r 64 --targets qkv_proj,o_proj,gate_up_proj,down_proj --steps 3 --accum 4 --segments --trace "$R/seg-sft-phi3-nf4-2048x1-r64-fused-s3-a4.trace.json.gz"
  anatomy seg sft-mistral-nf4-1024x1-r256-all-s3-a1 mistral-7b --task sft --seq 1024 --quant nf4 --r 256 --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --steps 3 --accum 1 --segments --trace "$R/seg-sft-mistral-nf4-1024x1-r256-all-s3-a1.trace.json.gz"
}

call=${1:-}; shift 2>/dev/null
case "$call" in
  configs) resident_configs "$1" ;;
  edge) edge "$@" ;;
  resident-patch) resident_patch "$@" ;;
  resident-findmax) resident_findmax "$@" ;;
  resident-full) resident_full "$@" ;;
  resident-anatomy) resident_anatomy "$@" ;;
  segments52) segments52 "$@" ;;
  *) echo "gpu-next.sh: say which call: resident-patch, resident-findmax, resident-full, resident-anatomy, segments52 (or configs DIR)" >&2; false ;;
esac
