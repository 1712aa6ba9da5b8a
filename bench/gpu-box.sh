#!/usr/bin/env bash
# The one GPU-box script. Source it on a lent, air-gapped GPU box from the repo root:
#
#   source bench/gpu-box.sh [SOUP_VERSION]     # installs .whl/ (and .whl077/ for 0.77.0)
#   run NAME [harness args...]                 # the harness, stdout+stderr to $R/NAME.txt
#   cmd NAME command...                        # any other command (pytest, nvidia-smi), likewise
#
# Each run/cmd appends "exit CODE, wall SECONDS s: COMMAND" to $R/commands.txt and packs $R
# into $OUT/results.tar.gz at once, so a command cut off by the box's time limit still brings
# back everything that finished. What the programs wrote is packed unedited.
# Wheels: bench/README.md (.whl/ holds the release carried: 0.73.3, or 0.77.0 in place of it). $R defaults to /tmp/results, the cache to /tmp/issue395-cache.
set -e
R=${R:-/tmp/results}; C=${C:-/tmp/issue395-cache}; D=$(date -u +%Y-%m-%d)
# 0.77.0 from .whl077/ beside .whl/'s 0.73.3, or (the carry since the fit4 calls) from .whl/ itself
if [ "${1:-0.73.3}" = 0.77.0 ] && [ -d .whl077 ]; then
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/*.whl | grep -v soup_cli) .whl077/*.whl
else
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
set +e
if [ -n "${1:-}" ]; then  # a release asked for is the release installed, or nothing runs on the wrong one
  got=$(python3 -c "import importlib.metadata as m; print(m.version('soup-cli'))" 2>/dev/null)
  if [ "$got" != "$1" ]; then echo "gpu-box.sh: soup-cli ${got:-none} is installed, $1 was asked" >&2; return 1 2>/dev/null || exit 1; fi
fi
mkdir -p "$R"
{ nvidia-smi; python3 -m pip list 2>/dev/null |
  grep -iE "^(torch|transformers|trl|peft|soup-cli|datasets|accelerate|bitsandbytes) "; } > "$R/stack.txt" 2>&1
cmd() {  # cmd NAME command...: its output to $R/NAME.txt, exit and wall time to commands.txt
  local name=$1; shift
  local t0; t0=$(date +%s.%N)
  "$@" > "$R/$name.txt" 2>&1
  local rc=$?
  echo "exit $rc, wall $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s: $*" >> "$R/commands.txt"
  tar -czf "$OUT/results.tar.gz" -C "$R" .
  return $rc
}
run() { local name=$1; shift; cmd "$name" python3 issue395_second_stack_vram.py "$@"; }
# The scripts' budget and anatomy helpers. The sourcing script sets END (epoch seconds) after sourcing.
left() { local l=$(( END - $(date +%s) - ${1:-0} )); [ $l -lt 5 ] && l=5; echo $l; }  # seconds to END, less $1
ck() { python3 -c "
from pathlib import Path; from issue395.measure.shapes import family_shape; from issue395.host.checkpoints import synthetic_checkpoint
print(synthetic_checkpoint(family_shape('$1'), Path('$C/checkpoints'))[0])"; }  # FAMILY's checkpoint under $C, built if need be
anatomy() {  # anatomy PREFIX TAG FAMILY ARGS...: bench/task_peak_anatomy.py on FAMILY's checkpoint, to $R/PREFIX-TAG.*
  local prefix=$1 tag=$2 fam=$3; shift 3
  if [ "$(left)" -lt 45 ]; then echo "not run (time): $tag" >> "$R/commands.txt"; return; fi
  local base; base=$(ck "$fam") || { echo "checkpoint $fam: its build failed, $tag not run" >> "$R/commands.txt"; return; }
  echo "checkpoint $fam: $base" >> "$R/commands.txt"
  cmd "$prefix-$tag" timeout -s INT -k 15 "$(left 20)" python3 bench/task_peak_anatomy.py --base "$base" "$@" \
      --work /dev/shm/w --json "$R/$prefix-$tag.json"
  rm -rf /dev/shm/w
}
