#!/usr/bin/env bash
# The record's sweep and a peak attribution under soup-cli 0.77.0 (the latest release,
# whose default training.rewind_log adds a per-row loss pass inside the step), with the
# same carried stack otherwise. Wheels: .whl/ as for bench/device-setup.sh, plus
# .whl077/ holding soup_cli-0.77.0 and click-8.4.2 (0.77.0 needs click<8.5).
set -e
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site \
  $(ls .whl/*.whl | grep -v soup_cli) .whl077/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
set +e
S="python3 issue395_second_stack_vram.py"
R=/tmp/results; C=/tmp/issue395-cache; D=$(date -u +%Y-%m-%d)
mkdir -p "$R"
{ nvidia-smi; python3 -m pip list 2>/dev/null | grep -iE "^(torch|transformers|trl|peft|soup-cli|datasets|click) "; } > "$R/stack-soup077.txt" 2>&1
t0=$(date +%s.%N)
$S --cache-dir "$C" --json "$R/h200-$D-soup077-sweep.json" --markdown "$R/h200-$D-soup077-sweep.md" \
   --log-dir "$R" > "$R/h200-$D-soup077-sweep.txt" 2>&1
echo "exit $?, wall $(awk -v a="$t0" -v b="$(date +%s.%N)" "BEGIN{printf \"%.1f\", b-a}") s: sweep" >> "$R/commands.txt"
tar -czf "$OUT/results-soup077.tar.gz" -C "$R" .
t0=$(date +%s.%N)
$S --seq 4096 --snapshot --cache-dir "$C" --json "$R/h200-$D-soup077-snapshot.json" \
   > "$R/h200-$D-soup077-snapshot.txt" 2>&1
echo "exit $?, wall $(awk -v a="$t0" -v b="$(date +%s.%N)" "BEGIN{printf \"%.1f\", b-a}") s: --seq 4096 --snapshot" >> "$R/commands.txt"
tar -czf "$OUT/results-soup077.tar.gz" -C "$R" .
