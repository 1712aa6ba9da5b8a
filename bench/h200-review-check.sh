#!/usr/bin/env bash
# After the review refactor of the measured step (one allocator-history helper for
# the step and the positive control): the same arms again, with --snapshot.
source bench/device-setup.sh
R=/tmp/results; mkdir -p "$R"
python3 issue395_second_stack_vram.py --seq 2048,4096 --snapshot \
  --json "$R/h200-$(date -u +%Y-%m-%d)-review-check.json" > "$R/h200-$(date -u +%Y-%m-%d)-review-check.txt" 2>&1
echo "exit $?" >> "$R/h200-$(date -u +%Y-%m-%d)-review-check.txt"
tar -czf "$OUT/results-review-check.tar.gz" -C "$R" .
