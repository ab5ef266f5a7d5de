"""Which of the reference's controls comes closest to a case's difference from r0, tensor by tensor.

For a run whose reference kept every control (`reference.evidence: full`), each listed tensor of one candidate case
at one step: max |case - r0| beside max |control - r0| for every control of r0's precision, and max |case - control|
(a control that computes as the engine does sits near 0 there). A case whose difference from r0 is well past every
control's, and far from each of them, differs from the reference in a way no control samples.

Usage: python benchmarks/control_probe.py RUN CASE STEP KEY [KEY ...]   (KEY: outputs/logprobs_BT, grads/lm_head.weight)
"""

from __future__ import annotations

import sys
from pathlib import Path

from qualify.compare import load_run
from qualify.layout import RunLayout


def group_of(run, key: str):
    group, _, name = key.partition("/")
    return getattr(run, group).get(name)


def main(run_dir: str, case: str, step: int, keys: list[str]) -> None:
    layout = RunLayout(Path(run_dir))
    precision = "bf16" if "-bf16-" in case else "fp32"
    role = "critic" if case.endswith("critic") else "actor"
    cand = load_run(layout.case(case), step)
    runs = sorted(p.name for p in (Path(run_dir) / "reference" / "scores").iterdir() if p.name.startswith(precision))
    controls = {name: load_run(layout.scores(precision, name.split("-", 1)[1], role), step) for name in runs}
    r0 = controls.pop(f"{precision}-r0")
    for key in keys:
        c, r = group_of(cand, key), group_of(r0, key)
        if c is None or r is None:
            print(f"{key}: not in both runs")
            continue
        print(f"{key} (step {step}): max |case - r0| {float((c.double() - r.double()).abs().max()):.4g}")
        for name, run in controls.items():
            t = group_of(run, key)
            if t is None or t.shape != r.shape:
                print(f"  {name}: not kept")
                continue
            print(f"  {name}: max |control - r0| {float((t.double() - r.double()).abs().max()):.4g}, "
                  f"max |case - control| {float((c.double() - t.double()).abs().max()):.4g}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:])
