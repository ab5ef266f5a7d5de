"""DeepSpeed ZeRO plugin engines with known bugs, named in matrices as 'tests.integration.zero_plugins:<factory>'.

Each is the correct deepspeed adapter at a ZeRO stage with one sharding bug from the field put back in;
qualification must fail naming the tensor the bug changes.
"""

from __future__ import annotations

import torch

from qualify.engines.deepspeed_engine import DeepSpeedEngine


class StaleAfterStep(DeepSpeedEngine):
    """ZeRO-3 with a parameter used stale after the step: the parameters gathered before each step (as a cached
    gather would keep them) are what the next step's forward and backward run with, instead of the stepped
    partitions gathered again. The FP32 masters, the moments and the updates are DeepSpeed's own."""

    name = "deepspeed-zero3-stale-after-step"

    def __init__(self) -> None:
        super().__init__(zero_stage=3)

    def step(self) -> torch.Tensor:
        import deepspeed

        params = list(self.engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params):  # read-only: every rank gathers the whole parameters
            before = [p.detach().clone() for p in params]
        norm = super().step()
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
            for p, old in zip(params, before):  # the pre-step values back into the partitions DeepSpeed stepped
                p.copy_(old)
        return norm


def stale_after_step() -> DeepSpeedEngine:
    return StaleAfterStep()
