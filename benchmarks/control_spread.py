"""Where a case sits among the controls for one tensor, step by step (which control sets the bound of the
closest row, and how far the case is from each control's distance to r0).

For a run made with `reference.evidence: full` (every control's tensors kept), prints per step: max |control - r0|
for every control of the precision, the largest of them (what k x control error + floor + quantum is built from), the case's
max |case - r0|, their ratio, and how many elements of the case equal each control bit for bit (a control that
reproduces the case's numerics exactly, as tp_split does a TP2 case's lm_head gradient at step 0 on an AMD EPYC).
Usage: python benchmarks/control_spread.py RUN CASE TENSOR [PRECISION]
  e.g. python benchmarks/control_spread.py runs/tiny torch-tp-bf16-tp2-actor grads/lm_head.weight bf16
"""

from __future__ import annotations

import sys
from pathlib import Path

from qualify.compare import load_run, num_steps


def pick(run, tensor: str):
    group, _, name = tensor.partition("/")
    return getattr(run, group)[name]


def main() -> None:
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    run, case, tensor = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    precision = sys.argv[4] if len(sys.argv) > 4 else case.split("-")[-3]
    role = case.rsplit("-", 1)[-1]
    scores = run / "reference" / "scores"
    controls = sorted(p.name for p in scores.iterdir() if p.name.startswith(f"{precision}-") and p.name != f"{precision}-r0")
    r0_dir, case_dir = scores / f"{precision}-r0" / role, run / "candidates" / case
    for k in range(num_steps(case_dir)):
        r0, mine = pick(load_run(r0_dir, k), tensor), pick(load_run(case_dir, k), tensor)
        spread = {}
        for c in controls:
            other = pick(load_run(scores / c / role, k), tensor)
            spread[c] = (float((other - r0).abs().max()), int((other == mine).sum()))
        top = max(spread, key=lambda c: spread[c][0])
        err = float((mine - r0).abs().max())
        ratio = err / spread[top][0] if spread[top][0] else float("inf")
        print(f"step{k} {tensor}: case {err:.3g}; largest control {top} {spread[top][0]:.3g}; case/largest {ratio:.2f}")
        print("   " + ", ".join(f"{c.removeprefix(precision + '-')} {d:.3g} ({same}/{mine.numel()} bitwise the case)"
                                for c, (d, same) in spread.items()))


if __name__ == "__main__":
    main()
