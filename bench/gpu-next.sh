#!/usr/bin/env bash
# The device calls left to run, one 10-minute call each, sourced from the repo root on a lent GPU box with .whl/
# carried (bench/README.md); each packs $R into $OUT/results.tar.gz after every command (bench/gpu-box.sh). A call
# leaves this file once a results folder's commands.txt records it (git history keeps it).
#   source bench/gpu-next.sh resident-findmax [TAG ...]   issue 51 item 4: --find-max on resident soup.yamls
#   bash bench/gpu-next.sh configs DIR                    CPU: write resident-findmax's soup.yamls into DIR, only
#
# resident-findmax, issue 51 item 4 (run again: results/resident-findmax-h200-soup0.77.0-faaa21d probed the default
# allocator; the probes now run on expandable segments, the setting the answer holds under): --find-max on resident
# soup.yamls (training.stream_layers false), each probe the real
# `soup train --allow-oom-attempt` (Soup's own lift of its resident gate) under the ballast of an emulated card, so
# each search stays short: the resident soup.yamls below, written into $R/configs (Llama-3.2-1B bf16 DPO; Phi-3-mini bf16 SFT with gradient
# checkpointing; Gemma-2B bf16 SFT; Mistral-7B NF4 QLoRA SFT). The claim it tests: on each, this tool's longest
# (like for like: the box's own context) is the measured limit or one step below it.
# TAGs: the searches below (default: all, in the order listed). Every one has run on expandable segments (Done, below);
# the call stays to search again once the estimate's reserve or growth changes, and as the template for a new config
# (a new `cat > resident-TAG.yaml` and `search TAG AXIS CARD`: tests/test_bench.py settles each on CPU). The probes'
# exit hook reads the runtime's growth after the box's context (from -1a0b582 on). SOUP=0.73.3 for the pin.
#
# Done (results/*-faaa21d, 2026-12-05): probe840 and findmax52 (their commands.txt), resident-findmax and
# resident-patch on the default allocator. Done (results/*-h100-soup0.77.0-96b7b97, 2026-12-05): resident-patch on
# expandable segments, resident-full, resident-anatomy and segments52's arms (git history keeps those calls).
# Done (results/*-h100-soup0.77.0-927f7a2, -1a0b582, -3cbde2c): resident-anatomy's SmolLM2 NF4 trace and Moonlight,
# segments52's Mistral-7B NF4 r256, every resident-findmax search above (the runtime growth read from -1a0b582 on).

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
  cat > "$1/resident-llama8b-sft-bf16-gc.yaml" <<'YAML'
base: meta-llama/Llama-3.1-8B
data: {train: data.jsonl, chat_template: chatml, max_length: 2048}
training: {batch_size: 1, gradient_accumulation_steps: 1, quantization: none, stream_layers: false, gradient_checkpointing: true, lora: {r: 8, alpha: 16, target_modules: [q_proj, v_proj]}}
YAML
  cat > "$1/resident-llama1b-sft-bf16-gc.yaml" <<'YAML'
base: meta-llama/Llama-3.2-1B
data: {train: data.jsonl, chat_template: chatml, max_length: 2048}
training: {batch_size: 1, gradient_accumulation_steps: 1, quantization: none, stream_layers: false, gradient_checkpointing: true, lora: {r: 8, alpha: 16, target_modules: [q_proj, v_proj]}}
YAML
  cat > "$1/resident-phi2r32-sft-bf16-gc.yaml" <<'YAML'
base: microsoft/phi-2
data: {train: data.jsonl, chat_template: chatml, max_length: 2048}
training: {batch_size: 1, gradient_accumulation_steps: 1, quantization: none, stream_layers: false, gradient_checkpointing: true, lora: {r: 32, alpha: 64, target_modules: [q_proj, k_proj, v_proj, dense]}}
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
  search llama8b-sft-bf16-gc seq 24GB
  search llama1b-sft-bf16-gc seq 6GB
  search phi2r32-sft-bf16-gc seq 8GB
}



call=${1:-}; shift 2>/dev/null
case "$call" in
  configs) resident_configs "$1" ;;
  resident-findmax) resident_findmax "$@" ;;
  *) echo "gpu-next.sh: say which call: resident-findmax (or configs DIR)" >&2; false ;;
esac
