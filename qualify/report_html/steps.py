"""Worst value/bound per case and optimizer step, for the report's per-step heatmap (multi-step cases only)."""

from __future__ import annotations

from typing import Any

from qualify.junit import step_of
from qualify.report_verify import number


def step_cells(rows: list[dict[str, Any]]) -> tuple[list[str], list[str], dict[tuple[str, str], tuple[float, bool]]]:
    """Rows: cases; columns: 'step k'; cells: (largest value/bound among bounded rows, every row passed).

    Empty when no case took more than one step (the case heatmap already says everything then).
    """
    worst: dict[tuple[str, str], float] = {}
    passed: dict[tuple[str, str], bool] = {}
    for r in rows:
        step = step_of(r)
        if step is None:
            continue
        key = (r["case"], f"step {step}")
        passed[key] = passed.get(key, True) and r["passed"]
        ratio = number(r["ratio"]) if number(r["bound"]) > 0 else 0.0
        worst[key] = max(worst.get(key, 0.0), ratio)
    steps = sorted({k[1] for k in worst}, key=lambda s: int(s.split()[1]))
    if len(steps) < 2:
        return [], [], {}
    cases = list(dict.fromkeys(k[0] for k in worst))
    return cases, steps, {k: (worst[k], passed[k]) for k in worst}
