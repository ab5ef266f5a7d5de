"""qualify.metrics: what mutation testing found unpinned.

One-element tensors (an edge the empty-tensor shortcuts must not swallow), a reference whose norm lies
in (0, 1], and AdamW's bias correction at a step other than the first, against Python floats.
"""

from __future__ import annotations

import math

import pytest
import torch

from qualify import metrics

T = torch.tensor


def test_one_element_tensors_are_measured():
    assert metrics.max_abs(T([3.0]), T([1.0])) == 2.0
    assert metrics.mean_abs(T([3.0]), T([1.0])) == 2.0
    assert metrics.quantile_abs(T([3.0]), T([1.0]), 0.5) == 2.0
    assert metrics.flip_frac(T([-3.0]), T([1.0])) == 1.0
    assert metrics.bf16_exact_fraction(T([1.5])) == 1.0  # 1.5: bf16-exact, not a power of two


def test_rel_l2_divides_by_a_reference_norm_below_one():
    assert metrics.rel_l2(T([0.5]), T([0.25])) == 1.0
    assert metrics.rel_l2(T([0.75, 0.0]), T([0.5, 0.0])) == 0.5
    assert metrics.rel_l2(T([1.5]), T([1.0])) == 0.5  # a norm of exactly one


@pytest.mark.parametrize("n, q, rank", [(4, 0.5, 2), (4, 0.25, 1), (4, 0.01, 1), (3, 0.99, 3), (10, 0.5, 5),
                                        (200, 0.99, 198)])
def test_quantile_by_nearest_rank(n, q, rank):
    reference = torch.zeros(n, dtype=torch.float64)
    candidate = torch.arange(n, 0, -1, dtype=torch.float64)  # |diff| = n, n-1, ..., 1: the k-th smallest is k
    assert metrics.quantile_abs(candidate, reference, q) == float(rank)
    assert math.ceil(q * n) == rank


def test_p99_is_the_099_quantile():
    reference = torch.zeros(300, dtype=torch.float64)
    candidate = torch.arange(1, 301, dtype=torch.float64)
    assert metrics.p99_abs(candidate, reference) == 297.0  # ceil(0.99 * 300) = 297
    assert metrics.p99_abs(candidate, reference) == metrics.quantile_abs(candidate, reference, metrics.P99)


def python_adamw(p, m, v, *, lr, betas, eps, weight_decay, step):
    """AdamW's update at Adam step `step` from its own moments, element by element in Python floats."""
    out = []
    for pi, mi, vi in zip(p, m, v):
        m_hat = mi / (1 - betas[0] ** step)
        v_hat = vi / (1 - betas[1] ** step)
        out.append(pi * (1 - lr * weight_decay) - lr * m_hat / (math.sqrt(v_hat) + eps) - pi)
    return out


@pytest.mark.parametrize("step", [1, 2, 5])
def test_adamw_update_bias_correction_at_later_steps(step):
    p, m, v = [1.0, -2.0, 0.5], [1e-3, -2e-3, 4e-4], [1e-6, 4e-6, 2e-7]
    adamw = {"lr": 1e-2, "betas": (0.8, 0.9), "eps": 1e-8, "weight_decay": 0.1}
    p64, m64, v64 = (T(x, dtype=torch.float64) for x in (p, m, v))
    got = metrics.adamw_update(p64, m64, v64, step=step, **adamw).tolist()
    assert got == pytest.approx(python_adamw(p, m, v, step=step, **adamw), rel=1e-12, abs=1e-15)
    update = T(python_adamw(p, m, v, step=step, **adamw), dtype=torch.float64)
    assert metrics.replay_max_abs(update, p64, m64, v64, step=step, **adamw) < 1e-15
