"""Whether the data-parallel ranks' fragments of a sharded tensor cover it exactly once: the completeness check of the
sharded optimizer state that ZeRO (qualify.engines.deepspeed_zero) and Megatron's distributed optimizer
(qualify.engines.megatron_distopt) export through their own gathers."""

from __future__ import annotations


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
