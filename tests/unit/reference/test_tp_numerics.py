"""The TP reduction-order control computes what a TP engine's ranks compute, summed in rank order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qualify.errors import EngineError
from qualify.reference.tp_numerics import (
    column_parallel_linear,
    row_parallel_linear,
    shard_bounds,
    split_like_tp,
)


def test_shard_bounds_even_and_padded():
    assert shard_bounds(8, 2) == [(0, 4), (4, 8)]
    assert shard_bounds(10, 4, padded=True) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    with pytest.raises(ValueError, match="does not divide"):
        shard_bounds(10, 4)


def _obvious_row_parallel(x, w, tp):
    """Each rank's partial product, rounded to x's dtype, added one after another."""
    width = w.shape[1] // tp
    total = None
    for r in range(tp):
        part = (x[..., r * width:(r + 1) * width].double() @ w[:, r * width:(r + 1) * width].double().T).to(x.dtype)
        total = part if total is None else (total + part)
    return total


def test_row_parallel_rounds_each_partial_before_adding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g).to(torch.bfloat16)
    w = torch.randn(32, 256, generator=g).to(torch.bfloat16)
    split = row_parallel_linear(x, w, None, 2)
    whole = F.linear(x, w)
    # bf16 partial sums rounded before the add: not the unsplit result everywhere, but within a few bf16 steps of it
    assert not torch.equal(split, whole)
    assert torch.allclose(split.float(), whole.float(), rtol=0.05, atol=0.5)
    obvious = _obvious_row_parallel(x, w, 2)
    assert (split.float() - obvious.float()).abs().max() <= 2 * (obvious.float().abs().max() * 2 ** -7)


def test_column_parallel_is_exact_per_output_and_sums_the_input_gradient():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 64, generator=g, requires_grad=True)
    w = torch.randn(48, 64, generator=g)
    b = torch.randn(48, generator=g)
    y = column_parallel_linear(x, w, b, 3)
    assert torch.equal(y, torch.cat([F.linear(x, w[i * 16:(i + 1) * 16], b[i * 16:(i + 1) * 16]) for i in range(3)], -1))
    dy = torch.randn(16, 48, generator=g)
    (y * dy).sum().backward()
    expected = sum(dy[:, i * 16:(i + 1) * 16] @ w[i * 16:(i + 1) * 16] for i in range(3))
    assert torch.allclose(x.grad, expected, rtol=1e-5, atol=1e-5)


def test_split_model_keeps_its_parameters_and_stays_close_in_fp32(tmp_path):
    from qualify.matrix import TinyModel
    from qualify.models.tiny import build_tiny_model

    spec = TinyModel(vocab_size=128, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=32, max_position_embeddings=64, seed=3)
    plain = build_tiny_model(spec, "actor")
    split = build_tiny_model(spec, "actor")
    params_before = [id(p) for p in split.parameters()]
    assert split_like_tp(split, 2) == 7 * 2 + 1  # q, k, v, o, gate, up, down per layer, and lm_head
    assert [id(p) for p in split.parameters()] == params_before
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(4))
    a, b = plain(input_ids=ids).logits, split(input_ids=ids).logits
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    a.sum().backward()
    b.sum().backward()
    for (name, p), q in zip(plain.named_parameters(), split.parameters()):
        # fp32 reduction-order noise: a few ulps of the gradient's own magnitude, never more
        assert (p.grad - q.grad).abs().max() <= 1e-5 * p.grad.abs().max(), name


def test_tp_one_changes_nothing_and_a_non_decoder_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert split_like_tp(model, 1) == 0
    with pytest.raises(EngineError, match="no tensor-parallel linear"):
        split_like_tp(model, 2)


def test_fused_projections_compute_one_gemm_per_group_and_sum_the_input_gradient_in_it(tmp_path, monkeypatch):
    """Each layer's q/k/v and gate/up become one F.linear over the concatenated weights (counted), the parameters
    stay the module's own, the forward and every gradient stay within fp32 noise of the plain model's, and the
    input gradient is the fused GEMM's: one product over the summed output gradient (an obvious computation)."""
    from qualify.matrix import TinyModel
    from qualify.models.tiny import build_tiny_model
    from qualify.reference import tp_numerics
    from qualify.reference.tp_numerics import fuse_projections

    spec = TinyModel(vocab_size=128, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=32, max_position_embeddings=64, seed=3)
    plain, fused = build_tiny_model(spec, "actor"), build_tiny_model(spec, "actor")
    params_before = [id(p) for p in fused.parameters()]
    assert fuse_projections(fused) == 2 * 2  # attention and MLP groups of each layer
    assert [id(p) for p in fused.parameters()] == params_before
    widths = []
    real_linear = F.linear

    def counting(x, w, b=None):
        widths.append(w.shape[0])
        return real_linear(x, w, b)

    monkeypatch.setattr(F, "linear", counting)  # every linear of the model goes through it
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(4))
    a = plain(input_ids=ids).logits
    assert len(widths) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    widths.clear()
    b = fused(input_ids=ids).logits
    qkv = 4 * 32 + 2 * 32 + 2 * 32
    # per layer: the fused q/k/v, o_proj, the fused gate/up, down_proj; then the head: no member computed alone
    assert widths == [qkv, 64, 2 * 64, 64] * 2 + [128]
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    a.sum().backward()
    b.sum().backward()
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        assert (p.grad - q.grad).abs().max() <= 1e-5 * p.grad.abs().max(), name
    # a lone group: the input gradient is dY_fused @ W_fused, one product
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).requires_grad_(True)
    members = [torch.nn.Linear(64, n, bias=False).to(torch.bfloat16) for n in (32, 16, 16)]
    tp_numerics._fuse(members)
    outs = [m(x) for m in members]
    dys = [torch.randn(o.shape, generator=torch.Generator().manual_seed(7 + i)).to(torch.bfloat16)
           for i, o in enumerate(outs)]
    torch.autograd.backward(outs, dys)
    expected = torch.cat(dys, dim=-1) @ torch.cat([m.weight for m in members], dim=0)
    assert torch.equal(x.grad, expected)
    assert members[1](x.detach()).shape == (5, 16)  # another input: the member computes alone


def test_fused_norms_compute_hf_rmsnorm_as_one_kernel_rounding_once():
    """fuse_norms replaces every RMSNorm of the decoder (counted) by F.rms_norm: the same function as Hugging Face's
    module (logits and every gradient within fp32 noise in a float64 model: Hugging Face's norm itself computes in
    fp32); in bf16 one rounding of the exact product where Hugging Face's
    module rounds twice, which is the difference the control samples (checked against the obvious float64
    computation rounded once)."""
    from qualify.matrix import TinyModel
    from qualify.models.tiny import build_tiny_model
    from qualify.reference.tp_numerics import fuse_norms

    spec = TinyModel(vocab_size=128, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=32, max_position_embeddings=64, seed=3)
    plain, fused = (build_tiny_model(spec, "actor").double() for _ in range(2))
    params_before = [id(p) for p in fused.parameters()]
    assert fuse_norms(fused) == 2 * 4 + 1  # input, post-attention, q and k norms per layer, and the final norm
    assert [id(p) for p in fused.parameters()] == params_before
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(4))
    a, b = plain(input_ids=ids).logits, fused(input_ids=ids).logits
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    a.pow(2).sum().backward()
    b.pow(2).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        assert (p.grad - q.grad).abs().max() <= 1e-5 * p.grad.abs().max(), name

    norm = next(m for m in build_tiny_model(spec, "actor").modules() if type(m).__name__.endswith("RMSNorm"))
    norm = norm.to(torch.bfloat16)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(norm.weight.shape, generator=g))
    x = torch.randn(6, 16, norm.weight.shape[0], generator=g).to(torch.bfloat16)
    hf = norm(x)
    xd, wd = x.double(), norm.weight.double()
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * wd
    once = exact.to(torch.bfloat16)
    wrapper = torch.nn.Sequential(norm)
    fuse_norms(wrapper)
    out = norm(x)
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().to(torch.bfloat16).double()
    assert ((out.double() - once.double()).abs() <= ulp).all()
    assert (out == once).double().mean() >= 0.99
    assert (hf != once).double().mean() >= 0.05  # Hugging Face's two roundings: what the control differs by


def test_fuse_norms_refuses_a_model_without_rmsnorm():
    from qualify.reference.tp_numerics import fuse_norms

    with pytest.raises(EngineError, match="fused_norm: no RMSNorm"):
        fuse_norms(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)))
