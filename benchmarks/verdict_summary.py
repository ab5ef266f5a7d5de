"""Summarize a verdict.json too large to read whole: every failing row, each case's closest passing row, and the
rows whose clip decisions differed from the reference's (benchmarks/gpu_vllm_chain.sh and gpu_chain.sh runs).

Usage: python benchmarks/verdict_summary.py RUN/candidates/verdict.json [TOP]
(TOP: how many of the closest passing bound rows to list; 10 when not given)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def finite_bound(r: dict) -> bool:
    """A passing row with a finite positive bound (non-finite numbers are written as strings in verdict.json)."""
    return r["passed"] and isinstance(r["bound"], (int, float)) and 0 < r["bound"] < float("inf") \
        and isinstance(r["value"], (int, float))


def main(path: str, top: int = 10) -> None:
    v = json.loads(Path(path).read_text())
    rows = v["rows"]
    print(f"{'PASSED' if v['passed'] else 'FAILED'}: {sum(c['passed'] for c in v['cases'].values())}/{len(v['cases'])}")
    failing = [r for r in rows if not r["passed"]]
    print(f"failing rows: {len(failing)}")
    for r in failing[:60]:
        print(f"  FAIL {r['case']} | {r['comparison']} | {r['tensor']} {r['metric']} {r['value']:.4g} > {r['bound']:.4g}"
              f" | {r['note'][:160]}")
    print("closest passing row per case (value/bound):")
    for case in v["cases"]:
        mine = [r for r in rows if r["case"] == case and finite_bound(r)]
        if mine:
            r = max(mine, key=lambda r: r["value"] / r["bound"])
            print(f"  {case}: {r['value'] / r['bound']:.3f} {r['comparison']} {r['tensor']} {r['metric']}")
    # the closest passing row of the whole run, bound rows (k x control error + floor + quantum) apart from derivation rows
    # (recomputed from the case's own values and held to their rounding: not a calibrated margin)
    for kind, mine in (("bound", [r for r in rows if r["comparison"] != "derived"]),
                       ("derivation", [r for r in rows if r["comparison"] == "derived"])):
        mine = [r for r in mine if finite_bound(r)]
        if mine:
            r = max(mine, key=lambda r: r["value"] / r["bound"])
            print(f"closest {kind} row: {r['value'] / r['bound']:.3f} {r['case']} | {r['comparison']} | {r['tensor']} "
                  f"{r['metric']}")
    bound_rows = sorted((r for r in rows if r["comparison"] != "derived" and finite_bound(r)),
                        key=lambda r: -r["value"] / r["bound"])
    print(f"the {min(top, len(bound_rows))} closest passing bound rows:")
    for r in bound_rows[:top]:
        print(f"  {r['value'] / r['bound']:.3f} {r['case']} | {r['comparison']} | {r['tensor']} {r['metric']}")
    flips = [r for r in rows if "/decisions/" in r["tensor"] and r["note"]]
    print(f"decision rows with a difference: {len(flips)}")
    for r in flips[:20]:
        print(f"  {r['case']} | {r['comparison']} | {r['tensor']} | {r['note'][:200]}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10)
