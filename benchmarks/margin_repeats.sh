#!/usr/bin/env bash
# The false-alarm margin of the correct built-in engines, over N repeats of the embedded default's main job:
# each repeat is a fresh run directory (reference with its controls, freeze, every candidate case), and prints the
# passing row closest to its bound (value/bound) from the verified report. On one machine the chain is
# deterministic, so repeats there agree bit for bit; on another platform they are what differs.
# Usage: bash benchmarks/margin_repeats.sh [N] [MATRIX] [WORK_DIR]
set -uo pipefail
n=${1:-3}
matrix=${2:-matrices/tiny-qwen3.yaml}
work=${3:-/tmp/qualify-margin}
q=${QUALIFY:-.venv/bin/qualify}
mkdir -p "$work"
for i in $(seq 1 "$n"); do
  run="$work/run-$i"
  rm -rf "$run"
  start=$(date +%s)
  bash scripts/demo.sh "$matrix" "$run" > "$work/run-$i.log" 2>&1
  rc=$?
  "$q" report "$run" --format json > "$work/report-$i.json" 2>/dev/null
  .venv/bin/python - "$work/report-$i.json" "$i" "$rc" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
path, i, rc, seconds = sys.argv[1:]
doc = json.load(open(path))
cand = doc.get("candidates") or {}
c = cand.get("closest_passing") or {}
cases = cand.get("cases", {})
print(f"repeat {i}: exit {rc}, {seconds} s, {doc['status']}, {sum(x['passed'] for x in cases.values())}/{len(cases)} "
      f"cases pass, closest passing value/bound {c.get('ratio', float('nan')):.3f} "
      f"({c.get('case')}, {c.get('tensor')} {c.get('metric')})")
PY
done
