"""The reference's gradient clipping (qualify.reference.step.clip_grad_norm): torch's clip_grad_norm_ semantics with
the total norm accumulated in float64, checked against math.fsum; torch's own fp32 norm on the CPU is the negative
control (it adds serially and drifts with the element count)."""

from __future__ import annotations

import math

import pytest
import torch

from qualify.reference.step import clip_grad_norm


def params_with(grads):
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        out.append(p)
    return out


def fsum_norm(grads) -> float:
    return math.sqrt(math.fsum(float(x) ** 2 for g in grads for x in g.double().flatten().tolist()))


@pytest.mark.parametrize("max_norm", [0.5, 1e9, float("inf")])
def test_clipping_follows_clip_grad_norm_with_an_exact_norm(max_norm):
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(37, 11, generator=g), torch.randn(5, generator=g) * 1e-3, torch.randn(300, generator=g)]
    params = params_with(grads)
    total = clip_grad_norm(params, max_norm)
    assert total.dtype == torch.float32 and float(total) == float(torch.tensor(fsum_norm(grads), dtype=torch.float32))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p, grad in zip(params, grads):
        assert torch.equal(p.grad, grad * coef)
    if max_norm == 0.5:
        assert float(coef) < 1.0  # the clip took effect
    else:
        assert all(torch.equal(p.grad, grad) for p, grad in zip(params, grads))


def test_no_gradient_is_a_zero_norm():
    p = torch.nn.Parameter(torch.zeros(3))
    assert float(clip_grad_norm([p], 1.0)) == 0.0 and p.grad is None


def test_a_serial_fp32_sum_drifts_where_the_reference_does_not():
    """The negative control: squares added one after another in fp32 (numpy's cumsum is strictly in order, on any
    CPU) lose the small terms' low bits as the sum grows; torch's CPU vector_norm drifts the same way (6e-4 at 16M
    elements here, 2% at 155M). The reference's norm is the exact one rounded once."""
    import numpy as np

    big = torch.randn(16_000_000, generator=torch.Generator().manual_seed(1))
    exact = float(torch.linalg.vector_norm(big.double()))  # a pairwise float64 sum: within 1e-12 of fsum here
    ours = float(clip_grad_norm(params_with([big]), float("inf")))
    serial = math.sqrt(float(np.cumsum(np.square(big.numpy()), dtype=np.float32)[-1]))
    assert abs(ours - exact) / exact < 1e-7  # one fp32 rounding of the exact norm
    assert abs(serial - exact) / exact > 1e-5
