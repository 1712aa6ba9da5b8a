#!/usr/bin/env bash
# The emulated-card arms this tool says fit and Soup refuses, run with Soup's gate overridden
# (bench/past_the_gate.py), then the arms one step (64) above this tool's longest seq: does the
# verdict hold on the card? Mistral-7B NF4 on 16, 24 and 8 GB (the seqs --estimate gave in
# results/emulated-card-proof-h200-soup0.77.0-9520654/estimate-mistral-7b.txt). Source
# bench/gpu-box.sh first.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
for arm in "20352 16GB" "31872 24GB" "8896 8GB" "20416 16GB" "31936 24GB" "8960 8GB"; do
  set -- $arm
  cmd "past-the-gate-mistral-7b-$1-$2" python3 bench/past_the_gate.py mistral-7b nf4 $1 $2 $C
done
