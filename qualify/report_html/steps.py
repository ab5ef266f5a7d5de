"""Worst value/bound per case and optimizer step, for the report's per-step heatmap (multi-step cases only).

Many steps are binned into at most MAX_STEP_COLUMNS columns of consecutive steps, so the figure stays small.
"""

from __future__ import annotations

import math

from qualify.report_html.data import ratio_of
from qualify.report_verify import number
from qualify.verdict import Row

MAX_STEP_COLUMNS = 12  # more steps than this share columns ('steps a-b'), each the worst of its steps


def step_columns(steps: list[int]) -> dict[int, str]:
    """Each step's column (steps sorted): 'step k', or 'steps a-b' of equal runs of consecutive steps."""
    per = math.ceil(len(steps) / MAX_STEP_COLUMNS)
    if per == 1:
        return {s: f"step {s}" for s in steps}
    chunks = [steps[i:i + per] for i in range(0, len(steps), per)]
    return {s: f"steps {chunk[0]}-{chunk[-1]}" for chunk in chunks for s in chunk}


def step_cells(rows: list[Row]) -> tuple[list[str], list[str], dict[tuple[str, str], tuple[float, bool]]]:
    """Rows: cases; columns: 'step k' (or 'steps a-b'); cells: (largest value/bound among bounded rows, every row
    passed). Rows are readable verdict rows (qualify.report_html.data.readable_rows); a row's step is its Row.step.

    Empty when no case took more than one step (the case heatmap already says everything then).
    """
    worst: dict[tuple[str, int], float] = {}
    passed: dict[tuple[str, int], bool] = {}
    for r in rows:
        if r.step is None:
            continue
        key = (r.case, r.step)
        passed[key] = passed.get(key, True) and r.passed
        ratio = ratio_of(r) if number(r.bound) > 0 else 0.0
        worst[key] = max(worst.get(key, 0.0), ratio)
    steps = sorted({k[1] for k in worst})
    if len(steps) < 2:
        return [], [], {}
    column = step_columns(steps)
    cells: dict[tuple[str, str], tuple[float, bool]] = {}
    for (case, step), ratio in worst.items():
        old = cells.get((case, column[step]), (0.0, True))
        cells[(case, column[step])] = (max(old[0], ratio), old[1] and passed[(case, step)])
    cases = list(dict.fromkeys(k[0] for k in worst))
    return cases, list(dict.fromkeys(column[s] for s in steps)), cells
