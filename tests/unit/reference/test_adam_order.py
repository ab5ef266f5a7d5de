"""The optimizer_order control's AdamW: torch's mathematics (checked against AdamW written out in float64), another
rounding (not bitwise torch's in fp32, within a few fp32 rounding steps of it)."""

from __future__ import annotations

import math

import pytest
import torch

from qualify.reference.adam_order import ReorderedAdamW
from qualify.reference.step import Control, controls_of
from tests.unit._runs import synthetic_matrix

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.1


def _adamw_loop(p0: list[float], grads: list[list[float]]) -> list[float]:
    """Decoupled-decay AdamW, element by element in Python floats (float64), as the paper and torch's docs state it."""
    p, m, v = list(p0), [0.0] * len(p0), [0.0] * len(p0)
    b1, b2 = BETAS
    for t, g in enumerate(grads, start=1):
        for i in range(len(p)):
            p[i] = p[i] * (1 - LR * WD)
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i]
            m_hat, v_hat = m[i] / (1 - b1 ** t), v[i] / (1 - b2 ** t)
            p[i] -= LR * m_hat / (math.sqrt(v_hat) + EPS)
    return p


def _grads(n: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(steps)]


def test_reordered_adamw_is_adamw_in_float64():
    p0 = torch.randn(40, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grads = _grads(40, 5)
    p = torch.nn.Parameter(p0.clone())
    opt = ReorderedAdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    expect = _adamw_loop(p0.tolist(), [g.tolist() for g in grads])
    assert p.detach().tolist() == pytest.approx(expect, rel=1e-12, abs=1e-15)
    assert float(opt.state[p]["step"]) == 5.0 and set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
    m = [0.0] * 40
    for g in grads:
        m = [BETAS[0] * a + (1 - BETAS[0]) * b for a, b in zip(m, g.tolist())]
    assert opt.state[p]["exp_avg"].tolist() == pytest.approx(m, rel=1e-12, abs=1e-18)


def test_reordered_adamw_rounds_otherwise_than_torch_in_fp32_by_a_few_steps():
    p0 = torch.randn(4096, generator=torch.Generator().manual_seed(4))
    a, b = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    ta = torch.optim.AdamW([a], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    tb = ReorderedAdamW([b], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for g in _grads(4096, 4):
        a.grad, b.grad = g.float(), g.float()
        ta.step()
        tb.step()
    differ = (a.detach() != b.detach()).sum().item()
    # in rounding steps of what moves: the parameter, or an update (about LR a step) where the parameter is near 0
    ulps = (a.detach() - b.detach()).abs() / torch.finfo(torch.float32).eps / a.detach().abs().clamp_min(LR)
    assert differ > 100  # not bitwise torch's: the control samples another rounding
    assert float(ulps.max()) < 16  # but only a few fp32 rounding steps apart


def test_reordered_adamw_refuses_a_closure():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="no closure"):
        ReorderedAdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD).step(lambda: 0.0)


def test_the_matrix_names_the_control(tmp_path):
    import dataclasses

    matrix = synthetic_matrix(tmp_path)
    matrix = dataclasses.replace(matrix, reference=dataclasses.replace(matrix.reference,
                                                                       perturbations=("optimizer_order",)))
    names = {c.name: c for c in controls_of(matrix.reference, matrix.candidates.tp)}
    assert names["optimizer_order"] == Control(name="optimizer_order", adam_form="reordered")
    assert not any(c.adam_form != "torch" for n, c in names.items() if n != "optimizer_order")


def test_fused_form_adamw_is_adamw_in_float64():
    from qualify.reference.adam_order import FusedFormAdamW

    p0 = torch.randn(40, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grads = _grads(40, 5)
    p = torch.nn.Parameter(p0.clone())
    opt = FusedFormAdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    assert p.detach().tolist() == pytest.approx(_adamw_loop(p0.tolist(), [g.tolist() for g in grads]), rel=1e-12,
                                                abs=1e-15)
    assert float(opt.state[p]["step"]) == 5.0 and set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
    with pytest.raises(ValueError, match="no closure"):
        opt.step(lambda: 0.0)


def test_fused_form_adamw_shifts_fp32_parameters_coherently_where_torch_rounds_twice():
    """In fp32 the fused form rounds the parameter once where torch's AdamW rounds it twice: after two steps most
    entries sit a few rounding steps (of |p| + lr, the step's own size) from torch's, none further."""
    from qualify.reference.adam_order import FusedFormAdamW

    p0 = torch.randn(4096, generator=torch.Generator().manual_seed(4))
    a, b = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    ta = torch.optim.AdamW([a], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    tb = FusedFormAdamW([b], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for g in _grads(4096, 2):
        a.grad, b.grad = g.float(), g.float()
        ta.step()
        tb.step()
    diff = (b.detach().double() - a.detach().double())
    ulp = torch.finfo(torch.float32).eps * (a.detach().double().abs() + LR)
    assert not torch.equal(a, b) and float((diff.abs() / ulp).max()) <= 4  # a few rounding steps, no more
    assert (diff != 0).float().mean() > 0.1  # most entries moved


def test_the_fused_adam_perturbation_is_a_control_and_the_combined_takes_the_last_form(tmp_path):
    from qualify.reference.step import combined_control

    assert combined_control(("optimizer_order", "fused_adam", "combined"), 1).adam_form == "fused"
    assert combined_control(("fused_adam", "optimizer_order", "combined"), 1).adam_form == "reordered"
    import dataclasses

    matrix = synthetic_matrix(tmp_path)
    matrix = dataclasses.replace(matrix, reference=dataclasses.replace(matrix.reference, perturbations=("fused_adam",)))
    names = {c.name: c for c in controls_of(matrix.reference, matrix.candidates.tp)}
    assert names["fused_adam"] == Control(name="fused_adam", adam_form="fused")
