"""The torch-tp engine's clip norm (qualify.engines.torch_tp.grad_norm) is the norm its gradients have, within what
the derived check allows any engine (qualify.judge.derived: 2^-24 x (2 log2(elements) + 8) x norm), at the
shape of a Qwen3 embedding gradient: a sparse (151936, 1024) tensor, rows of the batch's tokens nonzero. A strictly
serial fp32 sum of the squares (numpy's cumsum, in order on any CPU; torch's CPU fp32 vector_norm, which the engine
used on every device before, drifts the same way: 9e-5 here on the AMD EPYC host) is the negative control: the check
fails it."""

from __future__ import annotations

import math

import numpy as np
import torch

from qualify.engines.torch_tp import grad_norm

U = 2.0 ** -24


def allowance(grads: list[torch.Tensor], norm: float) -> float:
    """The derived check's bound on |reported norm - norm of the gradients|."""
    elements = sum(g.numel() for g in grads)
    return U * (2 * math.log2(elements) + 8) * norm


def embedding_like() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    embed = torch.zeros(151936, 1024)
    rows = torch.randint(0, embed.shape[0], (4000,), generator=g)
    embed[rows] = torch.randn(len(rows), 1024, generator=g) * 1e-2
    return [embed, torch.randn(1024, generator=g), torch.randn(3072, 1024, generator=g) * 1e-3]


def test_the_engine_norm_is_within_the_derived_allowance_at_a_qwen3_embedding_shape():
    grads = embedding_like()
    exact = math.sqrt(sum(float(torch.linalg.vector_norm(g.double())) ** 2 for g in grads))
    ours = float(grad_norm(grads))
    assert abs(ours - exact) <= 0.05 * allowance(grads, exact)  # one fp32 rounding: far inside the allowance
    serial = math.sqrt(sum(float(np.cumsum(np.square(g.numpy().ravel()), dtype=np.float32)[-1]) for g in grads))
    assert abs(serial - exact) > allowance(grads, exact)  # a serial fp32 sum fails the same check


def test_the_norm_is_fp32_and_exact_for_small_tensors():
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]
    total = grad_norm(grads)
    assert total.dtype == torch.float32 and float(total) == 13.0
    assert float(grad_norm([torch.zeros(5)])) == 0.0
