#!/usr/bin/env bash
# Issue 28's rest on one H200, in one device call: ORPO and SimPO as harness map rows on soup-cli 0.77.0
# (the five families of the task map), the 1,048,576 B block every Qwen2.5 arm holds traced with C++
# frames (bench/task_peak_anatomy.py --stacks all; bench/frameless_block.py, the bias hypothesis and its
# control), Mistral-7B NF4 512 DPO/KTO (where the reference forward's layer phase is predicted to bind),
# then DPO on the record's two models on soup-cli 0.73.3 (--sweep --task dpo). Each command has its own
# time limit (SIGINT: the harness saves the rows so far) so the call ends inside the box's 600 s.
# Sourced from the repo root: source bench/gpu-tasks-077-b.sh
source bench/gpu-box.sh 0.77.0
export TMPDIR=/dev/shm
END=$(( $(date +%s) + 570 ))
trun() { local name=$1 reserve=$2; shift 2; cmd "$name" timeout -s INT -k 20 "$(left $reserve)" \
           python3 issue395_second_stack_vram.py "$@"; }
git log -1 --format=%H >> "$R/stack.txt" 2>/dev/null; df -h /tmp /dev/shm >> "$R/stack.txt"
F=smol,qwen,llama32-1b,phi-2,moonlight
trun task-map-orpo-simpo 330 --map --task orpo,simpo --families $F --quant none,nf4 --seq 512,2048,4096 \
    --batch 1,2 --lanes 4 --cache-dir $C --shard-dir /dev/shm/s --json $R/task-map-orpo-simpo.json \
    --markdown $R/task-map-orpo-simpo.md
ck() { python3 -c "import json,glob,sys; print([d for d in glob.glob('$C/checkpoints/*') if json.load(open(d+'/config.json')).get('hidden_size')==int(sys.argv[1])][0])" $1; }
QWEN=$(ck 896); SMOL=$(ck 576); echo "qwen=$QWEN smol=$SMOL" >> $R/commands.txt
an() { local tag=$1; shift; cmd "anatomy-$tag" timeout -s INT 60 python3 bench/task_peak_anatomy.py "$@" \
         --stacks all --json $R/anatomy-$tag.json; }
an 077-kto-qwen-512x2-stacks --task kto --base $QWEN --seq 512 --batch 2
an 077-sft-smol-512x2-stacks --task sft --base $SMOL --seq 512 --batch 2
cmd frameless-block timeout 60 python3 bench/frameless_block.py
trun mistral-nf4-512-dpo-kto 150 --map --task sft,dpo,kto --families mistral-7b --quant nf4 --seq 512 \
    --batch 1,2 --cache-dir $C --shard-dir /dev/shm/s --json $R/mistral-nf4-512-dpo-kto.json
cp "$R/stack.txt" "$R/stack-0.77.0.txt"
source bench/gpu-box.sh 0.73.3
trun sweep-dpo-073 0 --sweep --task dpo --cache-dir $C --shard-dir /dev/shm/s --json $R/sweep-dpo-073.json \
    --markdown $R/sweep-dpo-073.md
