"""A packed case's step on one rank: the rank's rows of the step packed into micro-batches (qualify.case.packing), each
scored by the engine, unpacked to (row, position), its loss the micro-batch's exact share of the step's (the step's
normalizers; GRPO: the step's advantages of its rows), backward accumulated; the micro-batches' outputs merged into
the step's, as a padded case reports them.
"""

from __future__ import annotations

from typing import Any

import torch

from qualify.errors import EngineError
from qualify.judge.dp import SHARE_OUTPUTS


def require_packed(engine: Any, engine_name: str, case: str) -> None:
    """A packed case needs an engine that declares packed batches (a class attribute packed = True)."""
    if getattr(engine, "packed", False) is not True:
        raise EngineError(f"engine {engine_name} does not declare packed batches (packed = True: docs/plugins.md, "
                          f"'Packed batches'), so its packed case {case} cannot run")


def micro_batches_of_step(lengths_B: torch.Tensor, budget: int, group: Any) -> int:
    """How many micro-batches every DP rank runs at this step: the most any rank's plan has (one all_reduce MAX over
    the DP group; 0 at DP1, where the plan stands as it is)."""
    if group is None:
        return 0
    import torch.distributed as dist

    from qualify.case.packing import plan_packs

    count = torch.tensor([len(plan_packs([int(n) for n in lengths_B], budget))], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return int(count[0])


def micro_share(share: Any, index_S: torch.Tensor) -> Any:
    """The share of the step a micro-batch of the rank's rows index_S takes: the step's normalizers as they are, and
    under GRPO its rows' advantages (share: the rank's, qualify.ppo.objective)."""
    if share is None or not hasattr(share, "advantages_B"):
        return share
    return share._replace(advantages_B=share.advantages_B[index_S.to(share.advantages_B.device)])


def merge_microbatches(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The step's outputs from its micro-batches' (in row order): per-row tensors concatenated, the scalars that are a
    share of the step's value (qualify.judge.dp.SHARE_OUTPUTS) summed in micro-batch order, as the reference's
    micro-batched controls sum them; any other scalar is the same in every micro-batch."""
    out = {}
    for name in parts[0]:
        values = [p[name].detach() for p in parts]
        if values[0].dim() >= 1:
            out[name] = torch.cat(values)
        elif name in SHARE_OUTPUTS:
            total = torch.zeros((), dtype=values[0].dtype, device=values[0].device)
            for v in values:
                total = total + v
            out[name] = total
        else:
            out[name] = values[-1]
    return out


def worst_token(found: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The micro-batches' worst sampler-derivation token (qualify.judge.derived.sampler_check); None when any
    micro-batch's engine gave no logits."""
    if not found or any(w is None for w in found):
        return None
    return max(found, key=lambda w: w["ratio"])
