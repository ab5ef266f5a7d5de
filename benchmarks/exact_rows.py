"""Seed 002's counts from a run: each case's `rollout` row (its step-0 logprobs against the rollout's, bit
for bit) and `layout` row (its forward at micro-batch 1, 4 and reversed against its single batch), and `qualify
rounds`' count after each weight sync (the trainer's step-0 logprobs against the round's own rollout).

    python benchmarks/exact_rows.py RUN_DIR [ROUNDS_JSON]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    run = Path(sys.argv[1])
    verdict = json.loads((run / "candidates" / "verdict.json").read_text())
    rollout = json.loads((run / "reference" / "rollout" / "tp1" / "rollout.json").read_text())
    print(f"{run.name}: rollout dtype {rollout['sampling'].get('dtype')}, batch-invariant settings "
          f"{rollout.get('batch_invariant') or rollout['platform'].get('batch_invariant')}")
    for r in verdict["rows"]:
        if r["comparison"] in ("rollout", "layout"):
            print(f"  {r['case']} {r['comparison']}: {'PASS' if r['passed'] else 'FAIL'} | {r['note'][:200]}")
    if len(sys.argv) > 2 and Path(sys.argv[2]).is_file():
        rounds = json.loads(Path(sys.argv[2]).read_text())
        for r in rounds["rows"]:
            if "step-0 logprobs are the round's rollout" in r["tensor"]:
                print(f"  rounds, round {r['step']}: {r['note'][:160]}")


if __name__ == "__main__":
    main()
