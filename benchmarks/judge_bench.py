"""Judging time per case, and the rows it gives: every case of a run's verdict judged again from its sealed evidence
(as `qualify report` does), with whichever qualify is first on the path. The rows go to OUT (sorted JSON, one row a
line), so that two trees' rows can be compared byte for byte (`cmp`): run it once from this tree and once with
PYTHONPATH pointing at a tree of another commit (`git archive COMMIT qualify | tar -x -C DIR`). A qualify whose
judge_case takes a Resident (qualify.resident) is given one for the whole run, as the candidate stage and report do.

Usage: python benchmarks/judge_bench.py RUN OUT
"""

from __future__ import annotations

import inspect
import json
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    from qualify.judge.case import judge_case
    from qualify.matrix import Case, Matrix
    from qualify.models.checkpoint import initial_parameters
    from qualify.reference.context import ScoringContext
    from qualify.report import load_docs
    from qualify.report_verify import CASE_NAME, load_bounds
    from qualify.schema import from_dict

    started = time.monotonic()
    docs = load_docs(Path(argv[0]))
    layout, reference = docs.layout, docs.reference
    matrix = from_dict(Matrix, reference["matrix"], str(layout.reference_summary))
    ctx = ScoringContext.of(matrix, layout, reference["rollout_digest"], reference["targets_digest"])
    bounds = load_bounds(layout, docs.acceptance)
    extra = {}
    if "resident" in inspect.signature(judge_case).parameters:
        from qualify.resident import Resident

        extra["resident"] = Resident()
    names = sorted(docs.verdict["cases"])
    befores, lines = {}, []
    print(f"set-up {time.monotonic() - started:.1f} s", flush=True)
    for name in names:
        parts = CASE_NAME.match(name)
        case = Case(engine=parts["engine"], precision=parts["precision"], tp=int(parts["tp"]), role=parts["role"],
                    dp=int(parts["dp"] or 1))
        t0 = time.monotonic()
        if case.role not in befores:
            befores[case.role] = initial_parameters(ctx.models[case.role])
        rows = judge_case(ctx, case, bounds, befores[case.role], frozenset(names), **extra)
        lines += [json.dumps(r.to_json(), sort_keys=True) for r in rows]
        print(f"judge {name}: {len(rows)} rows in {time.monotonic() - t0:.1f} s", flush=True)
    Path(argv[1]).write_text("\n".join(lines) + "\n")
    print(f"total {time.monotonic() - started:.1f} s, {len(lines)} rows -> {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
