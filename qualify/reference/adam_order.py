"""AdamW with torch's mathematics and another order of its arithmetic: a reference control (`optimizer_order`).

Every engine steps its own optimizer (DeepSpeed's and Megatron's fused Adam, torch's on DTensors), each the same
AdamW on paper and a few fp32 rounding steps apart per update: moments by multiply-add or by lerp, the bias
corrections applied to the moments or folded into the step size and eps (the Adam paper's efficient form), the
decoupled decay before or beside the step. From step 1 on those rounding steps move the parameters, so every later
step's outputs and gradients differ too. Controls that all step torch's AdamW never sample this, and a correct engine
whose optimizer rounds otherwise lands beyond bounds calibrated without it (DeepSpeed's fp32 TP1 critic drifted
several fp32 ulps on a one-element bias gradient where every control stayed within one: benchmarks/LOG.md).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from qualify.ppo.adamw import param_after


class _FormAdamW(torch.optim.Optimizer):
    """AdamW whose moments are kept by multiply-add and whose parameter step is qualify.ppo.adamw.param_after's FORM;
    state keys as torch's ('step', 'exp_avg', 'exp_avg_sq'), so the reference records its moments the same way."""

    FORM = ""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):  # torch.optim.Optimizer's signature
        if closure is not None:
            raise ValueError(f"{type(self).__name__} takes no closure")
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])
                g, m, v = p.grad, state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1.0 - b1)
                v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
                p.copy_(param_after(self.FORM, p, m, v, int(t), group["lr"], (b1, b2), group["eps"],
                                    group["weight_decay"]))


class ReorderedAdamW(_FormAdamW):
    """p <- p - lr*wd*p - (lr*sqrt(1-b2^t)/(1-b1^t)) * m / (sqrt(v) + eps*sqrt(1-b2^t)), m and v by multiply-add.

    Mathematically torch's AdamW (decoupled weight decay, bias-corrected moments)."""

    FORM = "reordered"


class FusedFormAdamW(_FormAdamW):
    """AdamW in the form of apex's and Transformer Engine's FusedAdam (adam_w_mode), which Megatron steps: moments by
    multiply-add, then per element in fp32 m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t), update = m_hat /
    (sqrt(v_hat) + eps) + wd x p, and p - lr x update: the decay folded into the update, the parameter rounded once
    (torch's AdamW decays the parameter, then adds the step: two roundings of it). The `fused_adam` control.

    Adam's first steps move every entry by about lr, so where this form rounds otherwise every parameter shifts the same
    way; a gradient that sums a common shift over tokens (a bias, a norm weight) sees it whole, which the other
    controls' incoherent differences do not sample (the critic's score.bias gradient failed bounds made without it:
    benchmarks/LOG.md)."""

    FORM = "fused"


ADAM_FORMS = {"reordered": ReorderedAdamW, "fused": FusedFormAdamW}
"""Control.adam_form -> the optimizer a control steps in place of torch's AdamW."""
