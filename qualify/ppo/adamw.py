"""AdamW's parameter step in the forms real optimizers compute it, each in the parameter's own dtype.

The same AdamW on paper, a few rounding steps apart: where the decoupled decay is applied (the parameter multiplied
by a factor cast to its dtype, the decay subtracted, or folded into the update) and how often the parameter is
rounded. Given the parameter a step starts from and the moments after the step, each form gives the parameter after
it, bit for bit as that optimizer does (on the CPU that computes it; a GPU may contract a multiply-add and round the
last step otherwise). The reference's optimizer controls step two of these forms (qualify.reference.adam_order); the
derivation check of a case's update (qualify.judge.derived) asks which form the case's update is nearest.

    torch      torch.optim.AdamW (for-loop and foreach bit for bit; its fused CPU kernel up to the step term's
               rounding): p x (1 - lr wd) rounded, then p + (-lr / bc1) x m / denom, denom = sqrt(v) / sqrt(bc2) + eps
    decayed    the decay subtracted (torch's fused CUDA kernel): p - p x (lr wd) rounded, then p - (lr / bc1) x m / denom
    fused      apex's and Transformer Engine's FusedAdam (adam_w_mode), which Megatron and DeepSpeed's FusedAdam step:
               update = (m / bc1) / (sqrt(v / bc2) + eps) + wd x p, then p - lr x update: rounded once
    reordered  the Adam paper's efficient form: bias corrections folded into the step size and eps, the decay
               subtracted last

An optimizer in one of these forms can still round its last step otherwise (a multiply-add contracted, the step size
applied before the division): those differences sit in the step term, about lr, far below the parameter's own
rounding, and move the result by one ulp only where the form's unrounded value lies that close to a rounding midpoint.
`unrounded` gives each form's value before its last rounding of the parameter, for that check.
"""

from __future__ import annotations

import math

import torch

FORMS = ("torch", "decayed", "fused", "reordered")


def param_after(form: str, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, lr: float, betas,
                eps: float, weight_decay: float) -> torch.Tensor:
    """The parameter after AdamW's step `step` (1-based) in `form`, from p and the step's moments m and v, in p's
    dtype (a new tensor; p is not changed)."""
    b1, b2 = betas
    bc1, bc2 = 1.0 - b1 ** step, 1.0 - b2 ** step
    if form == "torch":
        out = p.mul(1.0 - lr * weight_decay)
        denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
        return out.addcdiv_(m, denom, value=-lr / bc1)
    if form == "decayed":
        out = p - p * (lr * weight_decay)
        denom = v.sqrt() / math.sqrt(bc2) + eps
        return out - (lr / bc1) * m / denom
    if form == "fused":
        update = (m / bc1) / ((v / bc2).sqrt() + eps)
        update.add_(p, alpha=weight_decay)
        return p.sub(update, alpha=lr)
    if form == "reordered":
        root_bc2 = math.sqrt(bc2)
        decay = p * (lr * weight_decay)
        out = p.addcdiv(m, v.sqrt().add_(eps * root_bc2), value=-lr * root_bc2 / bc1)
        return out.sub_(decay)
    raise ValueError(f"unknown AdamW form {form!r}: one of {', '.join(FORMS)}")


def step_term(m: torch.Tensor, v: torch.Tensor, step: int, lr: float, betas, eps: float) -> torch.Tensor:
    """-lr x m_hat / (sqrt(v_hat) + eps) of the step's moments, in float64."""
    b1, b2 = betas
    return -lr * (m.double() / (1.0 - b1 ** step)) / ((v.double() / (1.0 - b2 ** step)).sqrt() + eps)


def unrounded(form: str, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, lr: float, betas,
              eps: float, weight_decay: float) -> torch.Tensor:
    """The form's new parameter before its last rounding, float64: the roundings of the parameter it makes before
    that one (torch's: the decay factor cast to p's dtype and the decayed parameter; decayed: the decayed parameter;
    the reordered form: the stepped one) made in p's dtype, as param_after makes them, the rest exact."""
    step_exact = step_term(m, v, step, lr, betas, eps)
    decay = lr * weight_decay * p.double()
    if form == "torch":
        return p.mul(1.0 - lr * weight_decay).double() + step_exact
    if form == "decayed":
        return (p - p * (lr * weight_decay)).double() + step_exact
    if form == "fused":
        return p.double() - decay + step_exact
    if form == "reordered":
        b1, b2 = betas
        root_bc2 = math.sqrt(1.0 - b2 ** step)
        stepped = p.addcdiv(m, v.sqrt().add_(eps * root_bc2), value=-lr * root_bc2 / (1.0 - b1 ** step))
        return stepped.double() - decay
    raise ValueError(f"unknown AdamW form {form!r}: one of {', '.join(FORMS)}")
