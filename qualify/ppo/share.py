"""The step's loss normalizers, shared by every slice of it: a micro-batch of the reference, a DP rank of a case.

A step's loss is normalized by counts of the whole step (its active tokens, its sequences with an active token). A
slice that divides by those counts, not by its own, computes its exact share of the step's loss: the shares of the
slices sum to the step's loss, and gradients summed over the slices are the step's. On DP ranks the counts are
summed over ranks (all_reduce_normalizers): integer sums, exact in any order. PPO (qualify.ppo.math.masked_mean) and
GRPO (qualify.ppo.grpo.per_sequence_loss) both take them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Normalizers(NamedTuple):
    """The step-level denominators of the loss: int64 0-d tensors, global over the slices (DP ranks) of the step."""

    num_active_tokens: torch.Tensor
    """sum_{b,t} m[b, t] over the step's rows."""
    num_active_sequences: torch.Tensor
    """number of the step's rows with at least one active token."""


def count_normalizers(mask_BT: torch.Tensor) -> Normalizers:
    """This batch's (or this rank's slice's) Normalizers. On a DP rank, sum them over ranks
    (all_reduce_normalizers) before use: integer sums are exact, in any order."""
    return Normalizers(num_active_tokens=mask_BT.sum(), num_active_sequences=mask_BT.any(-1).sum())


def all_reduce_normalizers(local: Normalizers, group=None) -> Normalizers:
    """Global Normalizers from every rank's count_normalizers, by one int64 all_reduce(SUM) over group."""
    import torch.distributed as dist

    counts_2 = torch.stack([local.num_active_tokens, local.num_active_sequences]).to(torch.int64)
    dist.all_reduce(counts_2, op=dist.ReduceOp.SUM, group=group)
    return Normalizers(num_active_tokens=counts_2[0], num_active_sequences=counts_2[1])
