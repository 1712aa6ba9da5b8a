#!/usr/bin/env bash
# Issue 23, first pass (sourced after bench/gpu-box.sh with soup-cli 0.77.0 in .whl/): soup-cli
# 0.77.0's new families and streaming modes, measured before anything is modelled.
#  1. the new families at full width, reduced depth: bf16 and NF4, fused and per-expert layouts
#  2. the chunked loss on a dense and a MoE family; the recompute off on the same two
#  3. depth: Llama-3.2-1B at 16 and at 4 layers, to read a reduced-depth row against
# Each part is its own invocation (its own JSON), so a part cut off by the box's limit loses only itself.
cmd context python3 -c "import torch, json; torch.cuda.init(); torch.ones(1, device='cuda') @ torch.ones(1, 1, device='cuda'); f, t = torch.cuda.mem_get_info(); print(json.dumps({'total': t, 'free': f, 'context': t - f, 'name': torch.cuda.get_device_name(0), 'capability': torch.cuda.get_device_capability(0)}))"
cmd kernels python3 -c "import importlib.util as u; print({m: bool(u.find_spec(m)) for m in ('fla', 'causal_conv1d')})"
run moe-map --map --families moonlight,qwen3.5,qwen3.5-moe --quant none,nf4 --seq 512,2048 --batch 1 \
    --expert-layout fused,per_expert --cache-dir $C --json $R/moe-map.json --markdown $R/moe-map.md
run loss-chunk --map --families smol,moonlight --quant none --seq 2048,4096 --batch 1 --loss-chunk off,512 \
    --cache-dir $C --json $R/loss-chunk.json
run recompute --map --families smol,moonlight --quant none --seq 512,2048 --batch 1 --recompute on,off \
    --cache-dir $C --json $R/recompute.json
run depth --map --families llama32-1b,llama32-1b-d4 --quant none,nf4 --seq 2048 --batch 1 --cache-dir $C \
    --json $R/depth.json
