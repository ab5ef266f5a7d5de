#!/usr/bin/env bash
# A/B of one reference control on one machine, in one run: the same matrix and rollout frozen without (A) and with
# (B) PERTURBATION, every case judged under each. Prints each case's closest passing value/bound under A and B side
# by side, and how much B's bounds moved against A's (bound B / bound A per entry, per bound file).
# The rollout is reused (--rollout), so no vLLM is needed: a GPU machine runs it with the engines' wheels alone.
# Usage: bash benchmarks/control_ab.sh MATRIX ROLLOUT_DIR WORK_DIR [PERTURBATION]   (default PERTURBATION: combined)
set -euo pipefail
cd "$(dirname "$0")/.."
matrix=${1:?usage: control_ab.sh MATRIX ROLLOUT_DIR WORK_DIR [PERTURBATION]} rollout=${2:?} work=${3:?}
extra=${4:-combined}
py=${PYTHON:-python3}
qualify() { "$py" -c 'import sys; from qualify.cli.app import main; sys.argv[0] = "qualify"; main()' "$@"; }
mkdir -p "$work"
"$py" - "$matrix" "$work" "$extra" <<'PY'
import sys, yaml
src, work, extra = sys.argv[1:]
data = yaml.safe_load(open(src))
base = [p for p in data["reference"].get("perturbations", []) if p != extra]
for name, perturbations in (("A", base), ("B", base + [extra])):
    data["reference"]["perturbations"] = perturbations
    data["name"] = f"{data['name']}-{name}"
    open(f"{work}/{name}.yaml", "w").write(yaml.safe_dump(data, sort_keys=False))
    data["name"] = data["name"][: -len(name) - 1]
    print(f"{name}: perturbations {perturbations}")
PY
for side in A B; do
  start=$EPOCHREALTIME
  rm -rf "$work/$side"
  qualify reference "$work/$side.yaml" --run "$work/$side" --rollout "$rollout" > "$work/$side-reference.log" 2>&1
  qualify freeze "$work/$side" > "$work/$side-freeze.log" 2>&1
  rc=0; qualify candidate "$work/$side.yaml" --run "$work/$side" > "$work/$side-candidate.log" 2>&1 || rc=$?
  qualify report "$work/$side" --format json > "$work/$side-report.json"
  awk -v s="$start" -v e="$EPOCHREALTIME" -v n="$side" -v rc=$rc \
    'BEGIN{printf "== %s: reference, freeze and candidates in %.1f s (candidate exit %s)\n", n, e - s, rc}'
done
"$py" - "$work" "$extra" <<'PY'
import json, statistics, sys
from pathlib import Path
work, extra = Path(sys.argv[1]), sys.argv[2]
rep = {s: json.loads((work / f"{s}-report.json").read_text()) for s in "AB"}
print(f"\n| case | A: without {extra} | B: with {extra} | B worst row |")
print("| --- | ---: | ---: | --- |")
cases = rep["A"]["candidates"]["cases"]
for name in sorted(cases, key=lambda n: -cases[n]["worst"]["ratio"]):
    a, b = cases[name], rep["B"]["candidates"]["cases"][name]
    mark = lambda c: f"{c['worst']['ratio']:.3f}" + ("" if c["passed"] else " FAIL")
    w = b["worst"]
    print(f"| {name} | {mark(a)} | {mark(b)} | {w['tensor']} {w['metric']} ({w['comparison']}) |")
closest = {s: max(c["worst"]["ratio"] for c in rep[s]["candidates"]["cases"].values()) for s in "AB"}
print(f"\nclosest value/bound: A {closest['A']:.3f}, B {closest['B']:.3f}")
print("\n| bound file | entries | bound B / A median | p90 | max |")
print("| --- | ---: | ---: | ---: | ---: |")
for f in sorted((work / "A" / "acceptance" / "bounds").glob("*.json")):
    a = json.loads(f.read_text())["bounds"]
    b = json.loads((work / "B" / "acceptance" / "bounds" / f.name).read_text())["bounds"]
    r = sorted(b[k][m]["bound"] / v["bound"] for k, ms in a.items() for m, v in ms.items()
               if v["bound"] > 0 and m in b.get(k, {}))
    print(f"| {f.stem} | {len(r)} | {statistics.median(r):.3f} | {r[int(0.9 * len(r))]:.3f} | {r[-1]:.3f} |")
PY
