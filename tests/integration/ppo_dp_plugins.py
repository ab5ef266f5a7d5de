"""PPO plugin engines with known data-parallel bugs, named in matrices as 'tests.integration.ppo_dp_plugins:<factory>'.

Each is a correct engine (the torch-tp engine, or it with its own objective written from the formulas,
qualify.examples.own_objective) with one DP trap from the field put back in; at DP2 qualification must fail naming
the tensor the bug changes. At DP1 each is the correct engine.
"""

from __future__ import annotations

from qualify.engines.torch_tp import TorchTPEngine, local
from qualify.examples.own_objective import OwnObjectiveEngine


class MeanOfRankMeans(OwnObjectiveEngine):
    """Each rank averages over its own rows' tokens and the ranks' losses are averaged (DDP's average of rank-local
    token means): the step's loss is then the mean of per-rank token means, not the mean over the step's tokens. It
    is right only where every rank holds as many active tokens as the others."""

    name = "ppo-mean-of-rank-means"

    def reduce(self, x_BT, mask_BT, normalizer, constant, counts=None):
        return super().reduce(x_BT, mask_BT, normalizer, constant, None) / self.ctx.dp


class GradsDividedTwice(TorchTPEngine):
    """Divides its DP-summed gradients by dp (a DDP-style average) although each rank's loss is already its share of
    the step's: the gradients are the step's divided by dp."""

    name = "ppo-grads-divided-twice"

    def backward(self, loss):
        super().backward(loss)
        if self.ctx.dp > 1:
            for p in self.master.parameters():
                local(p.grad).div_(self.ctx.dp)


def mean_of_rank_means() -> OwnObjectiveEngine:
    return MeanOfRankMeans()


def grads_divided_twice() -> TorchTPEngine:
    return GradsDividedTwice()
