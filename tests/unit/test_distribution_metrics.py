"""The distribution metrics against slow, obvious loops over Python floats."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from qualify.metrics import INF, bf16_exact_fraction, mean_abs, p99_abs, quantile_abs


def _diffs(c, r):
    return [abs(float(a) - float(b)) for a, b in zip(c.flatten().tolist(), r.flatten().tolist())]


def _slow_mean(c, r):
    d = _diffs(c, r)
    return sum(d) / len(d)


def _slow_quantile(c, r, q):
    d = sorted(_diffs(c, r))
    return d[max(1, math.ceil(q * len(d))) - 1]


@pytest.mark.parametrize("n", [1, 2, 99, 100, 101, 1000, 4097])
def test_mean_and_p99_equal_the_obvious_loop(n):
    g = torch.Generator().manual_seed(n)
    r = torch.randn(n, generator=g)
    c = r + 1e-3 * torch.randn(n, generator=g)
    assert mean_abs(c, r) == pytest.approx(_slow_mean(c, r), rel=1e-12)
    assert p99_abs(c, r) == _slow_quantile(c, r, 0.99)
    assert quantile_abs(c, r, 0.5) == _slow_quantile(c, r, 0.5)
    assert quantile_abs(c, r, 1.0) == max(_diffs(c, r))


def test_a_shift_under_one_outlier_moves_mean_and_p99_but_not_max():
    r = torch.zeros(1000)
    noisy = r.clone()
    noisy[0] = 1.0                       # one outlier: the control's max_abs is 1
    shifted = r + 0.01                   # every element off by 0.01: far below max_abs 1
    assert p99_abs(shifted, r) == pytest.approx(0.01) and p99_abs(noisy, r) == 0.0
    assert mean_abs(shifted, r) == pytest.approx(0.01) and mean_abs(noisy, r) == pytest.approx(0.001)


def test_non_finite_candidates_are_inf_and_empty_tensors_zero():
    r = torch.zeros(4)
    for bad in (torch.tensor([0.0, math.nan, 0, 0]), torch.tensor([0.0, 0, math.inf, 0])):
        assert mean_abs(bad, r) == INF and p99_abs(bad, r) == INF
    assert mean_abs(torch.zeros(0), torch.zeros(0)) == 0.0 == p99_abs(torch.zeros(0), torch.zeros(0))


def _bf16_exact(x: float) -> bool:
    """fp32 bits with the low 16 mantissa bits zero: bf16 holds it exactly."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return bits & 0xFFFF == 0


def test_bf16_exact_fraction_counts_what_bf16_holds_exactly():
    g = torch.Generator().manual_seed(7)
    fp32 = torch.randn(1000, generator=g)
    widened = fp32.to(torch.bfloat16).float()
    mixed = torch.cat([fp32[:300], widened[300:], torch.zeros(50), torch.tensor([math.nan])])
    counted = [x for x in mixed.tolist() if x != 0 and math.isfinite(x) and math.frexp(x)[0] not in (0.5, -0.5)]
    expected = sum(_bf16_exact(x) for x in counted) / len(counted)
    assert bf16_exact_fraction(mixed) == pytest.approx(expected, abs=1e-12)
    assert bf16_exact_fraction(widened) == 1.0
    assert bf16_exact_fraction(fp32) < 0.01  # an fp32 value lands on a bf16 one about once in 2^16
    assert bf16_exact_fraction(torch.zeros(5)) == 0.0
    # powers of two are bf16 values for exact reasons (a ratio of 1, a fraction of 0.5): not counted
    assert bf16_exact_fraction(torch.tensor([1.0, 0.5, -2.0, 1.0 + 2 ** -20])) == 0.0


def test_the_sorted_selection_is_the_kth_element_kthvalue_selects():
    """kth_smallest sorts on a GPU (CUDA's kthvalue selects with one thread block per slice); the element is the
    same as kthvalue's for every rank, with ties, zeros and a single element."""
    import torch

    from qualify.metrics import kth_smallest

    g = torch.Generator().manual_seed(3)
    for x in (torch.randn(1001, generator=g, dtype=torch.float64).abs(),
              torch.randint(0, 5, (777,), generator=g).double(),  # ties
              torch.zeros(64, dtype=torch.float64), torch.tensor([2.5], dtype=torch.float64)):
        for k in sorted(k for k in {1, 2, x.numel() // 2, x.numel() - 1, x.numel()} if 1 <= k <= x.numel()):
            want = x.kthvalue(k).values
            assert torch.equal(kth_smallest(x, k, by_sort=True), want)
            assert torch.equal(kth_smallest(x, k, by_sort=False), want)
