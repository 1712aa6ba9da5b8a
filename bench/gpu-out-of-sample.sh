#!/usr/bin/env bash
# Issue 23, out of sample (sourced after bench/gpu-box.sh with soup-cli 0.77.0 in .whl/): six arms
# nobody measured, whose estimates were committed first
# (results/estimator-predictions-before-out-of-sample-arms.txt). Each with --snapshot: the
# attribution of its own peak, no margin re-run. DeepSeek-V3 last, only while time is left.
run oos-moonlight-per-expert --map --families moonlight --quant nf4 --seq 1024 --batch 4 \
    --expert-layout per_expert --snapshot --cache-dir $C --json $R/oos-moonlight-per-expert.json
run oos-moonlight-recompute --map --families moonlight --quant nf4 --seq 1024 --batch 1 --recompute off \
    --snapshot --cache-dir $C --json $R/oos-moonlight-recompute.json
run oos-moonlight-chunk --map --families moonlight --quant none --seq 8192 --batch 1 --loss-chunk 1024 \
    --snapshot --cache-dir $C --json $R/oos-moonlight-chunk.json
run oos-qwen35-moe --map --families qwen3.5-moe --quant nf4 --seq 4096 --batch 1 --snapshot \
    --cache-dir $C --json $R/oos-qwen35-moe.json
run oos-qwen35-chunk --map --families qwen3.5 --quant none --seq 4096 --batch 1 --loss-chunk 256 \
    --snapshot --cache-dir $C --json $R/oos-qwen35-chunk.json
rm -rf $C
