#!/usr/bin/env bash
# Issue 23, third pass (sourced after bench/gpu-box.sh with soup-cli 0.77.0 in .whl/):
#  1. DeepSeek-V3, full width, NF4, the fused layout (the per-expert arm UNDER-predicted in pass 2)
#  2. the cap proof of that per-expert arm: capped at Soup's own number it should raise OOM
#  3. Qwen3.5 dense and MoE again with flash-linear-attention's fused kernels carried (.whlfla/);
#     causal-conv1d has no wheel to carry, so its torch fallback stays
#  4. soup-cli 0.77.0's default map at seq 512 batch 1, the ten dense families, as far as time allows
rm -rf $C
cmd deepseek-fused timeout -s TERM 190 python3 issue395_second_stack_vram.py --map --families deepseek-v3 \
    --quant nf4 --seq 512 --batch 1 --json $R/deepseek-fused.json
rm -rf $C
cmd deepseek-per-expert-cap-soup timeout -s TERM 130 python3 issue395_second_stack_vram.py --map \
    --families deepseek-v3 --quant nf4 --seq 512 --batch 1 --expert-layout per_expert --cap soup \
    --json $R/deepseek-per-expert-cap-soup.json
python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site-fla .whlfla/*.whl
PYTHONPATH=/tmp/site-fla:$PYTHONPATH cmd kernels-fla python3 -c "from transformers.utils import import_utils as u; print('fla', u.is_flash_linear_attention_available(), 'causal_conv1d', u.is_causal_conv1d_available())"
PYTHONPATH=/tmp/site-fla:$PYTHONPATH cmd qwen35-fla timeout -s TERM 100 python3 issue395_second_stack_vram.py \
    --map --families qwen3.5,qwen3.5-moe --quant none --seq 512,2048 --batch 1 --json $R/qwen35-fla.json
cmd map077-512 timeout -s TERM 110 python3 issue395_second_stack_vram.py --map --seq 512 --batch 1 \
    --families smol,qwen,llama32-1b,qwen3-0.6b,gemma-2b,gemma2-2b,gemma3-1b,phi-2,phi3-mini,mistral-7b \
    --quant none,nf4 --json $R/map077-512.json
