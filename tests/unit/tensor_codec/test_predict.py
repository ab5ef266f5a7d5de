"""qualify.tensor_codec.predict: AdamW's arithmetic in fp32, the same bits on every machine."""

from __future__ import annotations

import numpy as np
import torch

from qualify.tensor_codec.predict import Adam, f32, predict_moment, predict_param
from tests.unit.tensor_codec.test_decode import OPT


def test_adam_clip_coefficient_is_torchs_fp32_arithmetic():
    adam = Adam.of(OPT)
    for norm in (0.1, 0.5, 0.50000006, 2.3036222, 1e30, float("inf")):
        t = torch.tensor(norm, dtype=torch.float32)
        want = 1.0 if not torch.isfinite(t) else float(torch.clamp(OPT["max_grad_norm"] / (t + 1e-6), max=1.0))
        assert float(adam.clip(float(t))) == want


def test_the_predictions_are_the_same_bits_at_any_thread_count_and_in_numpy():
    """What makes a coded file read back alike on every machine: each prediction is one correctly rounded IEEE
    operation at a time. torch's at 1 and at several threads, and an independent numpy re-implementation (fp32 ufuncs,
    the fused multiply-add through float64), give the same bits."""
    rng = np.random.default_rng(11)
    n = 1 << 16
    g = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    prev = (rng.standard_normal(n) * 1e-4).astype(np.float32)
    prev_sq = np.abs(prev) * np.float32(1e-3)
    p = (rng.standard_normal(n) * 0.02).astype(np.float32)
    adam = Adam.of(OPT)
    b1, b2 = OPT["betas"]
    clip = adam.clip(2.3036222)

    def torch_side():
        t = torch.from_numpy
        m = predict_moment("exp_avg", t(g), t(prev), f32(b1), f32(1 - b1), clip)
        v = predict_moment("exp_avg_sq", t(g), t(prev_sq), f32(b2), f32(1 - b2), clip)
        first = predict_moment("exp_avg_sq", t(g), None, f32(b2), f32(1 - b2), clip)
        return [x.numpy().view(np.int32) for x in (m, v, first, predict_param(t(p), m, v, 3, adam))]

    def numpy_side():
        f64 = np.float64
        cg = g * clip
        m = (f64(f32(1 - b1)) * (cg - prev).astype(f64) + prev.astype(f64)).astype(np.float32)
        v = ((cg * f32(1 - b2)).astype(f64) * cg.astype(f64) + (prev_sq * f32(b2)).astype(f64)).astype(np.float32)
        first = (cg * f32(1 - b2)) * cg
        size, bc2 = f32(OPT["lr"] / (1 - b1 ** 3)), f32(np.sqrt(1 - b2 ** 3))
        new = p * f32(1 - OPT["lr"] * OPT["weight_decay"]) - (m * size) / (np.sqrt(v) * (f32(1) / bc2) + f32(OPT["eps"]))
        return [x.astype(np.float32).view(np.int32) for x in (m, v, first, new)]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch_side()
        torch.set_num_threads(max(2, threads))
        many = torch_side()
    finally:
        torch.set_num_threads(threads)
    for a, b, c in zip(one, many, numpy_side()):
        assert np.array_equal(a, b) and np.array_equal(a, c)
