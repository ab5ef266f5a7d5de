"""Whether the data-parallel ranks' fragments of a sharded tensor cover it exactly once: the completeness check of the
sharded optimizer state that ZeRO (qualify.engines.deepspeed_zero) and Megatron's distributed optimizer
(qualify.engines.megatron_distopt) export through their own gathers."""

from __future__ import annotations

from typing import Any

import torch


def coverage_problem(fragments: list[tuple[int, int]], numel: int) -> str | None:
    """Why the ranks' fragments (start, numel) of a flattened tensor of numel elements do not cover it exactly once
    (None: they do). Empty fragments are ignored."""
    end = 0
    for start, count in sorted(f for f in fragments if f[1] > 0):
        if start > end:
            return f"elements [{end}, {start}) are held by no rank"
        if start < end:
            return f"elements [{start}, {min(end, start + count)}) are held by two ranks"
        end = start + count
    if end < numel:
        return f"elements [{end}, {numel}) are held by no rank"
    if end > numel:
        return f"the fragments reach element {end} of {numel}"
    return None


def complete_state(state: dict[str, dict[str, torch.Tensor]], shapes: dict[str, Any],
                   incomplete: dict[str, str]) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, str]]:
    """state ({'exp_avg': {name: whole tensor}, ...}) without every parameter named in incomplete ({name: why}) or
    whose gathered tensor of some key lacks the parameter's full shape (shapes: {name: shape}); and why each parameter
    left out is."""
    why = dict(incomplete)
    for key, by_name in state.items():
        for name, t in by_name.items():
            if name not in why and tuple(t.shape) != tuple(shapes[name]):
                why[name] = f"its gathered {key} has shape {tuple(t.shape)}, the parameter {tuple(shapes[name])}"
    kept = {key: {n: t for n, t in by_name.items() if n not in why} for key, by_name in state.items()}
    return kept, {n: why[n] for n in sorted(why)}
