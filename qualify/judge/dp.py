"""Data parallelism of a candidate case: which rows a DP rank holds, its process group, and the step's evidence
gathered from every DP rank (rows in rank order, loss shares summed).

Ranks are laid out dp_rank x tp + tp_rank: TP ranks are contiguous, and the DP group of a rank is every rank with
its TP rank. A DP rank holds a contiguous, equal slice of each optimizer step's rows (qualify.ppo.grpo.dp_slices:
a step that dp does not divide is an input error, never a dropped row).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from qualify.ppo.grpo import dp_slices

SHARE_OUTPUTS = ("loss", "kl_mean", "policy_loss", "clip_frac")
"""Scalar outputs that are a rank's share of the step's value (global normalizers): summed over DP ranks."""


def dp_group(tp: int, dp: int, rank: int) -> Any:
    """This rank's DP process group (None at DP1). Every rank creates every group, in the same order."""
    if dp == 1:
        return None
    groups = [dist.new_group([t + d * tp for d in range(dp)]) for t in range(tp)]
    return groups[rank % tp]


def rank_rows(step: slice, dp: int, dp_rank: int) -> tuple[slice, int]:
    """(rows of the rollout this DP rank trains at this step, their offset within the step)."""
    part = dp_slices(step.stop - step.start, dp)[dp_rank]
    return slice(step.start + part.start, step.start + part.stop), part.start


def gather_outputs(outputs: dict[str, torch.Tensor], group: Any) -> dict[str, torch.Tensor]:
    """The step's outputs from every DP rank's: per-row tensors concatenated in rank order (the rows' own order),
    loss shares summed; anything else (the same on every rank) as this rank has it."""
    if group is None:
        return outputs
    out = {}
    for name, t in outputs.items():
        t = t.detach().float().cpu().contiguous()
        if t.dim() >= 1:
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, t, group=group)
            out[name] = torch.cat(parts)
        elif name in SHARE_OUTPUTS:
            total = t.clone()
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
            out[name] = total
        else:
            out[name] = t
    return out
