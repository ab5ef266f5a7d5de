"""AdamW's moments and new parameters predicted in fp32, one correctly rounded operation at a time, so that any
machine (the CPU or a GPU) makes the same bits."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def f32(x: float) -> np.float32:
    return np.float32(x)



@dataclass(frozen=True)
class Adam:
    """What the predictions take of the optimizer (from the case's spec), as the fp32 scalars the arithmetic uses."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    max_grad_norm: float | None

    @classmethod
    def of(cls, optimizer: Any) -> Adam:
        get = (lambda k: optimizer.get(k)) if isinstance(optimizer, Mapping) else (lambda k: getattr(optimizer, k))
        b1, b2 = get("betas")
        return cls(float(get("lr")), (float(b1), float(b2)), float(get("eps")), float(get("weight_decay")),
                   None if get("max_grad_norm") is None else float(get("max_grad_norm")))

    def clip(self, norm: float) -> np.float32:
        """The clip coefficient of a reported norm, min(1, max_norm / (norm + 1e-6)) in fp32 as torch's
        clip_grad_norm_ computes it (the predictions' only use of it)."""
        if not self.max_grad_norm or not math.isfinite(norm):
            return f32(1.0)
        with np.errstate(all="ignore"):
            return min(f32(1.0), f32(self.max_grad_norm) / (f32(norm) + f32(1e-6)))


def fma(a: np.float32 | torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a x b + c rounded once to fp32 (as a fused multiply-add), through float64: the product of two fp32 values is
    exact there, the sum rounds twice (a different last bit about once in 2^29 elements: a residual, never an error)."""
    a64 = float(a) if isinstance(a, np.floating) else a.double()
    return (b.double() * a64 + c.double()).float()


def predict_moment(kind: str, g: torch.Tensor, prev: torch.Tensor | None, beta: np.float32, one_minus: np.float32,
                   clip: np.float32) -> torch.Tensor:
    """AdamW's moment of the clipped gradient c g in torch's form: lerp(m, c g, 1 - beta) (m + (1 - beta)(c g - m),
    fused), or fma((1 - beta) c g, c g, beta v) (1 - beta: the fp32 of the double difference, as an optimizer takes
    its scalars). CPU tensors, fp32 and float64 elementwise operations, each correctly rounded."""
    cg = g * _scalar(clip)
    if prev is None:  # the first step, from zero: one fp32 product (the fused forms' value but for the sign of a 0)
        return cg * _scalar(one_minus) if kind == "exp_avg" else (cg * _scalar(one_minus)) * cg
    if kind == "exp_avg":
        return fma(one_minus, cg - prev, prev)
    return fma(cg * _scalar(one_minus), cg, prev * _scalar(beta))


def predict_param(p: torch.Tensor, m: torch.Tensor | None, v: torch.Tensor | None, adam_step: int,
                  adam: Adam) -> torch.Tensor:
    """AdamW's new parameter in torch's form, fp32: p (1 - lr wd) - ((lr / bc1) m) / (sqrt(v) / sqrt(bc2) + eps), the
    division by sqrt(bc2) a product with its fp32 reciprocal (as torch takes a scalar divisor). CPU tensors; only
    multiplications, additions, subtractions, tensor divisions and numpy's square root: each correctly rounded."""
    b1, b2 = adam.betas
    decayed = p * _scalar(f32(1 - adam.lr * adam.weight_decay))
    if m is None or v is None:
        return decayed
    size, bc2 = f32(adam.lr / (1 - b1 ** adam_step)), f32(math.sqrt(1 - b2 ** adam_step))
    # torch divides by a scalar as a product with its fp32 reciprocal: written so here, never left to torch's choice;
    # the square root is numpy's (the CPU's instruction, correctly rounded): torch 2.13's CPU sqrt is not (11,064 of
    # 65,536 fp32 roots a bit off here), so it could differ between machines
    root = _sqrt(v)
    denom = root * _scalar(f32(1.0) / bc2) + _scalar(f32(adam.eps))
    return decayed - (m * _scalar(size)) / denom


def _sqrt(v: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root: numpy's on the CPU (the instruction; torch 2.13's CPU sqrt is not correctly
    rounded), CUDA's own on a GPU (IEEE-rounded sqrt, as torch is built without fast math): the same bits, which
    tests/gpu/test_codec_gpu.py measures against numpy for every fp32 value."""
    if v.device.type == "cpu":
        return torch.from_numpy(np.sqrt(v.contiguous().numpy()))
    return torch.sqrt(v)


def _scalar(x: np.float32) -> torch.Tensor:
    """An fp32 scalar as a 0-d fp32 tensor: the arithmetic stays fp32 whatever the operand (a Python float would be
    rounded to the tensor's dtype too, but a tensor says so)."""
    return torch.tensor(float(x), dtype=torch.float32)

