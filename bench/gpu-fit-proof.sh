#!/usr/bin/env bash
# Issue 20, "does it fit?" answered on a real card (sourced after bench/gpu-box.sh, soup-cli 0.73.3):
# each arm runs with --emulate-card: a fresh process (expandable segments) whose free memory a
# ballast outside the allocator takes down to the card's (total - context), so Soup's own gate
# decides; the row says refused by Soup / admitted and completed / admitted and OOM beside this
# tool's verdict (fits / does not fit). Families NF4, cards 24GB, 16GB and 8GB, Mistral first:
#  1. issue #395 end to end: Mistral-7B NF4 seq 512 on a card whose free memory lies between Soup's
#     own number and this tool's corrected peak: Soup's gate admits, the step should OOM
#  2. per card, from --estimate --json: the longest seq that fits AND Soup admits (must complete)
#     and one step (64) above the longest that fits (this tool says no; what happens is recorded)
#  3. --min-free for Mistral-7B NF4 512x1 (a bisection over fresh capped processes)
#  4. while time is left: the tool's longest seq where Soup refuses it (Mistral), then llama31-8b,
#     then gemma2-2b (where Soup admits seqs this tool says do not fit)
# Each step is skipped once the script has run BUDGET seconds (default 330), so the whole stays
# inside one 600 s device call; commands.txt says what ran and for how long.
H=issue395_second_stack_vram.py
BUDGET=${BUDGET:-330}
T0=$(date +%s)
CARDS="24GB 16GB 8GB"
left() { [ $(( $(date +%s) - T0 )) -lt "$BUDGET" ] || { echo "skipped (budget): $*" >> "$R/commands.txt"; return 1; }; }

estimate() {  # estimate FAMILY: the fit rows for every card, as text and JSON
  cmd "estimate-$1" python3 $H --estimate --model "$1" --quant nf4 --seq 512 --card 24GB,16GB,8GB \
      --json "$R/estimate-$1.json"
}

seqs() {  # seqs FAMILY CARD WHICH: from the estimate's JSON; WHICH: both | above | tool
  python3 - "$R/estimate-$1.json" "$2" "$3" <<'EOF'
import json, sys
data, card, which = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
c = next(c for c in data["rows"][0]["cards"] if c["card"] == card)
fit, soup = c["longest_seq"], c["longest_seq_soup_admits"]
from issue395.model.registry import max_positions
out = {"both": min(fit or 0, soup or 0) or None,
       "above": fit + 64 if fit and fit + 64 <= max_positions(data["model"]) else None,
       "tool": fit if fit and soup is not None and soup < fit else None}[which]
print(out or "")
EOF
}

emulated() {  # emulated NAME FAMILY CARD SEQS: the arms on the emulated card, in fresh processes
  [ -n "$4" ] || { echo "nothing to run: $1" >> "$R/commands.txt"; return 0; }
  left "$1" && run "$1" --map --families "$2" --quant nf4 --seq "$4" --batch 1 --emulate-card "$3" \
      --cache-dir "$C" --log-dir "$R/logs-$1" --json "$R/$1.json"
}

family() {  # family FAMILY: both and above on every card (its estimate first, unless there is one)
  [ -s "$R/estimate-$1.json" ] || { left "estimate-$1" && estimate "$1"; } || return 0
  for card in $CARDS; do
    both=$(seqs "$1" $card both); above=$(seqs "$1" $card above)
    emulated "fit-$1-$card" "$1" $card "$(echo $both $above | tr ' ' ',')"
  done
}

left estimate-mistral-7b && estimate mistral-7b
# issue #395: free = halfway between Soup's own number (computed by Soup's code) and this tool's
# corrected allocated peak, plus the context the card is charged (Soup's 0.85 GB)
card395=$(python3 -c "
import json; r = json.load(open('$R/estimate-mistral-7b.json'))['rows'][0]
print(f\"{((r['soup_predicted'] + r['corrected_predicted']) / 2 + 850_000_000) / 1e9:.3f}GB\")")
emulated issue395-mistral-7b-512 mistral-7b "$card395" 512
family mistral-7b
left min-free && run min-free-mistral-7b-512 --map --families mistral-7b --quant nf4 --seq 512 --batch 1 \
    --min-free --cache-dir "$C" --json "$R/min-free-mistral-7b-512.json"
for card in $CARDS; do
  emulated "soup-refuses-mistral-7b-$card" mistral-7b $card "$(seqs mistral-7b $card tool)"
done
rm -rf "$C"  # the next family's checkpoint needs the disk
family llama31-8b
rm -rf "$C"
family gemma2-2b
