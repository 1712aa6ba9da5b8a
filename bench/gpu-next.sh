#!/usr/bin/env bash
# The device calls left to run, one 10-minute call each, sourced from the repo root on a lent GPU box with .whl/
# carried (bench/README.md); each packs $R into $OUT/results.tar.gz after every command (bench/gpu-box.sh). A call
# leaves this file once a results folder's commands.txt records it (git history keeps it).
#   source bench/gpu-next.sh resident-findmax [TAG ...]   issue 51 item 4: --find-max on resident soup.yamls
#   source bench/gpu-next.sh resident-anatomy             issue 51 item 3: the resident rows over 1.02x, their live sets
#   source bench/gpu-next.sh segments52                   issue 52 item 1: which adapter blocks hold rests, at the steady state
#   bash bench/gpu-next.sh configs DIR                    CPU: write resident-findmax's soup.yamls into DIR, only
#
# resident-findmax, issue 51 item 4 (run again: results/resident-findmax-h200-soup0.77.0-faaa21d probed the default
# allocator; the probes now run on expandable segments, the setting the answer holds under): --find-max on resident
# soup.yamls (training.stream_layers false), each probe the real
# `soup train --allow-oom-attempt` (Soup's own lift of its resident gate) under the ballast of an emulated card, so
# each search stays short: the resident soup.yamls below, written into $R/configs (Llama-3.2-1B bf16 DPO; Phi-3-mini bf16 SFT with gradient
# checkpointing; Gemma-2B bf16 SFT; Mistral-7B NF4 QLoRA SFT). The claim it tests: on each, this tool's longest
# (like for like: the box's own context) is the measured limit or one step below it.
# TAGs: the searches below (default: all, in the order listed). Done: llama-dpo-bf16, phi3-sft-bf16-gc, gemma-sft-bf16
# and mistral-sft-nf4 on expandable segments in
# results/resident-findmax-expandable-h100-soup0.77.0-96b7b97 and resident-findmax-mistral-h100-soup0.77.0-927f7a2;
# phi3-sft-bf16-gc again and phi2-sft-bf16-gc (searched by nobody before) with the probes' exit hook reading the
# runtime's growth (each search's answer like for like with it in place of STEP_GROWTH_BYTES) in
# results/resident-findmax-gc-growth-h100-soup0.77.0-1a0b582; qwen-kto-bf16 (8GB) and qwen3-orpo-nf4 (16GB), two
# preference tasks at batch 2 nobody had searched resident, in results/resident-findmax-heldout-h100-soup0.77.0-3cbde2c. SOUP=0.73.3 for the pin.
#
# resident-anatomy, issue 51 item 3: the allocator's history (bench/task_peak_anatomy.py) of the committed resident
# rows the corrected estimate is most over (the Done-when asks 1.02x), to confirm on CUDA what the CPU saved-tensor
# count under CUDA's autocast lists named (estimator/layer.py autocast_upcasts, autocast_casts, mlp_records), first
# the rows over 1.02x (phi-2 NF4 512x1 with --trace, Phi-3-mini NF4 1024x1 and phi-2 bf16 2048x1 ran in
# results/anatomy-and-segments52-h100-* and segments52-and-anatomy-h100-*; left: Moonlight), and first SmolLM2 NF4
# 1024x4 with --trace (the fixed capture order leaves that row 24.4 MB under its real peak, unnamed, so batched NF4 llama keeps the bound, sequence.NF4_BATCHED_HELD_BACK: what the real step
# holds there that the sequence does not): phi-2 NF4 without checkpointing (1.0056x-1.0250x, its retained blocks' rests still a bound:
# the meta capture's peak, in the real order, is 10,362,880 B under the 512x1 row's: the loss's reduction scratch and the load's free blocks; --trace brought back the real request
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
# first (the first three ran, with --trace, in results/anatomy-and-segments52-h100-soup0.77.0-96b7b97 and
# segments52-and-anatomy-h100-soup0.77.0-96b7b97; left: Mistral-7B NF4 r256). The claim it tests: which adapter-shaped blocks hold rests past their 512 B rounding and how much, per
# class (1 MiB or less, 1-10 MiB, 10 MiB or more), at the steady state, beside the bound over the same blocks.
# --trace also brings back each arm's device history without its frames (task_peak_anatomy.save_trace): the real
# request sequence of the streamed steady state (torch's actions, the segments before and after), for a converter to
# replay through estimator/allocator.py on CPU and a synthetic sequence to match.
#
# Done (results/*-faaa21d, 2026-12-05): probe840 and findmax52 (their commands.txt), resident-findmax and
# resident-patch on the default allocator. Done (results/*-h100-soup0.77.0-96b7b97, 2026-12-05): resident-patch on
# expandable segments, resident-full, and the arms each call's note above names.

resident_configs() {  # resident_configs DIR: the resident soup.yamls resident-findmax searches
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
  cat > "$1/resident-phi2-sft-bf16-gc.yaml" <<'YAML'
base: microsoft/phi-2
data: {train: data.jsonl, chat_template: chatml, max_length: 2048}
training: {batch_size: 1, gradient_accumulation_steps: 1, quantization: none, stream_layers: false, gradient_checkpointing: true, lora: {r: 16, alpha: 32, target_modules: [q_proj, k_proj, v_proj, dense]}}
YAML
  cat > "$1/resident-qwen-kto-bf16.yaml" <<'YAML'
base: Qwen/Qwen2.5-0.5B
task: kto
data: {train: kto.jsonl, max_length: 1024}
training: {batch_size: 2, gradient_accumulation_steps: 1, quantization: none, stream_layers: false, lora: {r: 8, alpha: 16, target_modules: [q_proj, v_proj]}}
YAML
  cat > "$1/resident-qwen3-orpo-nf4.yaml" <<'YAML'
base: Qwen/Qwen3-0.6B
task: orpo
data: {train: pairs.jsonl, max_length: 1024}
training: {batch_size: 2, gradient_accumulation_steps: 1, quantization: 4bit, stream_layers: false, lora: {r: 16, alpha: 32, target_modules: [q_proj, k_proj, v_proj, o_proj]}}
YAML
  cat > "$1/resident-phi3-sft-bf16-gc.yaml" <<'YAML'
base: microsoft/Phi-3-mini-4k-instruct
data: {train: data.jsonl, chat_template: chatml, max_length: 2048}
training: {batch_size: 1, gradient_accumulation_steps: 1, quantization: none, stream_layers: false, gradient_checkpointing: true, lora: {r: 16, alpha: 32, target_modules: [qkv_proj, o_proj]}}
YAML
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
  search phi2-sft-bf16-gc seq 7.5GB
  search gemma-sft-bf16 seq 24GB
  search mistral-sft-nf4 seq 24GB
  search qwen-kto-bf16 seq 8GB
  search qwen3-orpo-nf4 seq 16GB
}

resident_anatomy() {
  R=${R:-/tmp/resident-anatomy}
  source bench/gpu-box.sh "${1:-0.77.0}" || return 1
  export TMPDIR=/dev/shm HF_HUB_OFFLINE=1
  END=$(( $(date +%s) + ${BUDGET_S:-540} ))
  git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null
  anatomy res sft-smol-nf4-1024x4 smol --train stream_layers=false --task sft --seq 1024 --batch 4 --quant nf4 \
      --targets q_proj,v_proj --trace "$R/res-sft-smol-nf4-1024x4.trace.json.gz"
  anatomy res sft-moonlight-bf16-2048x4 moonlight --train stream_layers=false --task sft --seq 2048 --batch 4 \
      --targets q_proj,kv_b_proj
}

segments52() {
  R=${R:-/tmp/segments52}
  source bench/gpu-box.sh "${1:-0.77.0}" || return 1
  export TMPDIR=/dev/shm HF_HUB_OFFLINE=1
  END=$(( $(date +%s) + ${BUDGET_S:-540} ))
  git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null
  anatomy seg sft-mistral-nf4-1024x1-r256-all-s3-a1 mistral-7b --task sft --seq 1024 --quant nf4 --r 256 --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --steps 3 --accum 1 --segments --trace "$R/seg-sft-mistral-nf4-1024x1-r256-all-s3-a1.trace.json.gz"
}

call=${1:-}; shift 2>/dev/null
case "$call" in
  configs) resident_configs "$1" ;;
  resident-findmax) resident_findmax "$@" ;;
  resident-anatomy) resident_anatomy "$@" ;;
  segments52) segments52 "$@" ;;
  *) echo "gpu-next.sh: say which call: resident-findmax, resident-anatomy, segments52 (or configs DIR)" >&2; false ;;
esac
