"""Comparison metrics between a candidate tensor and a reference tensor (pure functions).

Every metric returns a Python float and is +inf when the candidate holds NaN or Inf, so a broken
candidate can never pass. Adam's first step maps a gradient g to about -lr * sign(g), so two runs
whose gradients differ by a rounding error near zero can legitimately differ by 2 * lr in the
update. The update metrics therefore judge only elements whose sign the reference resolves
(|g_ref| above the frozen gradient bound), count sign flips separately, and check that each
update is what AdamW makes of the run's own gradient (replay), which no gradient noise excuses.
"""

from __future__ import annotations

import math
from typing import Any

import torch

INF = float("inf")


def _finite(candidate: torch.Tensor) -> bool:
    return bool(torch.isfinite(candidate).all())


def max_abs(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """max |c - r| in float64; +inf if c is not finite."""
    if not _finite(candidate):
        return INF
    if candidate.numel() == 0:
        return 0.0
    return float((candidate.double() - reference.double()).abs().max())


def rel_l2(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """||c - r|| / ||r|| in float64 (||c - r|| when r is zero); +inf if c is not finite."""
    if not _finite(candidate):
        return INF
    diff = float(torch.linalg.vector_norm(candidate.double() - reference.double()))
    norm = float(torch.linalg.vector_norm(reference.double()))
    return diff / norm if norm > 0 else diff


def mean_abs(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """mean |c - r| in float64 (0 for an empty tensor); +inf if c is not finite. A systematic shift of every element
    moves it as much as the largest error does, where one noisy outlier barely moves it."""
    if not _finite(candidate):
        return INF
    if candidate.numel() == 0:
        return 0.0
    return float((candidate.double() - reference.double()).abs().mean())


P99 = 0.99


def quantile_abs(candidate: torch.Tensor, reference: torch.Tensor, q: float = P99) -> float:
    """The q-quantile of |c - r| by nearest rank (the ceil(q * n)-th smallest; exact, any size); +inf if c is not
    finite."""
    if not _finite(candidate):
        return INF
    n = candidate.numel()
    if n == 0:
        return 0.0
    diff = (candidate.double() - reference.double()).abs().flatten()
    return float(kth_smallest(diff, min(n, max(1, math.ceil(q * n)))))


def kth_smallest(x_N: torch.Tensor, k: int, by_sort: bool | None = None) -> torch.Tensor:
    """The k-th smallest element (1-based) of a 1-D tensor, exactly: kthvalue on the CPU (a selection in linear time);
    on a GPU a sort, since CUDA's kthvalue selects with one thread block per slice (a flattened gradient is one slice
    of millions of elements: seconds a tensor at the Qwen3-0.6B shape). The same element either way (by_sort chooses)."""
    if not (x_N.device.type != "cpu" if by_sort is None else by_sort):
        return x_N.kthvalue(k).values
    return torch.sort(x_N).values[k - 1]


def p99_abs(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """99th percentile of |c - r| (nearest rank)."""
    return quantile_abs(candidate, reference, P99)


PAIR_METRICS = ("max_abs", "rel_l2", "mean_abs", "p99_abs")


def metrics_device() -> torch.device | None:
    """Where a pair's metrics are computed: the GPU when there is one (QUALIFY_METRICS_DEVICE=cpu keeps them on the
    host), else None (where the tensors are). max_abs and p99_abs are exact anywhere; a sum (rel_l2, mean_abs) may
    round differently in its last float64 bits on another device."""
    import os

    want = os.environ.get("QUALIFY_METRICS_DEVICE", "auto")
    if want == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else None
    return torch.device(want)


def pair_values(candidate: torch.Tensor, reference: torch.Tensor, names: tuple[str, ...],
                device: torch.device | None = None) -> dict[str, float]:
    """The metrics named (of PAIR_METRICS) of one tensor pair, with |c - r| formed once, on device when given: the
    same values as max_abs, rel_l2, mean_abs and p99_abs one by one (the same float64 operations)."""
    if device is not None:
        candidate, reference = candidate.to(device), reference.to(device)
    if not _finite(candidate):
        return {n: INF for n in names}
    n = candidate.numel()
    if n == 0:
        return {name: 0.0 for name in names}
    diff = (candidate.double() - reference.double()).abs().flatten()
    out = {}
    for name in names:
        if name == "max_abs":
            out[name] = float(diff.max())
        elif name == "mean_abs":
            out[name] = float(diff.mean())
        elif name == "p99_abs":
            out[name] = float(kth_smallest(diff, min(n, max(1, math.ceil(P99 * n)))))
        elif name == "rel_l2":
            norm = float(torch.linalg.vector_norm(reference.double()))
            d = float(torch.linalg.vector_norm(diff))
            out[name] = d / norm if norm > 0 else d
        else:
            raise ValueError(f"unknown metric {name!r} (known: {', '.join(PAIR_METRICS)})")
    return out


def bf16_exact_counts(t: torch.Tensor) -> tuple[int, int]:
    """(elements bf16 represents exactly, elements counted): the finite elements other than 0 and powers of two (a
    ratio of exactly 1, a clip fraction of 0.5 are bf16 values for exact reasons). NaN counts as not finite (judged
    elsewhere)."""
    device = metrics_device()  # counts are exact anywhere; a real model's gradients are hundreds of millions
    x = (t.detach() if device is None else t.detach().to(device)).float().flatten()
    x = x[torch.isfinite(x) & (x != 0) & (torch.frexp(x).mantissa.abs() != 0.5)]
    return int((x.to(torch.bfloat16).float() == x).sum()), int(x.numel())


def bf16_exact_fraction(t: torch.Tensor) -> float:
    """Fraction of the counted elements (bf16_exact_counts) that bf16 represents exactly (0 for a tensor without
    any): near 0 for a value computed in fp32, 1 for one computed in bf16 and widened."""
    exact, counted = bf16_exact_counts(t)
    return exact / counted if counted else 0.0


def flip_frac(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """Fraction of elements whose sign differs (reported, never a bound: flips near zero are legitimate)."""
    if not _finite(candidate):
        return INF
    if candidate.numel() == 0:
        return 0.0
    return float((torch.sign(candidate) != torch.sign(reference)).double().mean())


def adamw_update(param_before: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float, step: int = 1) -> torch.Tensor:
    """The update AdamW's step number `step` makes from its own (already updated) moments, in float64:

        p' = p * (1 - lr * wd) - lr * m_hat / (sqrt(v_hat) + eps),  m_hat = m / (1 - b1^step), v_hat = v / (1 - b2^step)
    """
    b1, b2 = betas
    p = param_before.double()
    m_hat = exp_avg.double() / (1 - b1 ** step)
    v_hat = exp_avg_sq.double() / (1 - b2 ** step)
    decayed = p * (1 - lr * weight_decay)
    return decayed - lr * m_hat / (v_hat.sqrt() + eps) - p


def replay_max_abs(update: torch.Tensor, param_before: torch.Tensor, exp_avg: torch.Tensor,
                   exp_avg_sq: torch.Tensor, **adamw: Any) -> float:
    """max |update - AdamW(own moments)|: the optimizer step was the declared one (computed on the metrics device,
    metrics_device(), when there is one: max of exact-enough float64 arithmetic, the same on either)."""
    device = metrics_device()
    if device is not None:
        update, param_before, exp_avg, exp_avg_sq = (t.to(device) for t in (update, param_before, exp_avg, exp_avg_sq))
    if not (_finite(update) and _finite(exp_avg) and _finite(exp_avg_sq)):
        return INF
    expected = adamw_update(param_before, exp_avg, exp_avg_sq, **adamw)
    return float((update.double() - expected).abs().max()) if update.numel() else 0.0
