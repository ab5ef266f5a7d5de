"""Settings peer libraries ship, each in qualify's reference and checked against an independent computation written
the way the peer library writes it: verl's advantage whitening, TRL's bias-corrected KL (k3 times the
differentiable ratio), and the clip fraction as a plain token mean under the sequence-mean aggregations."""

from __future__ import annotations

import pytest
import torch
import yaml

from qualify.matrix import load_matrix
from qualify.ppo.grpo import grpo_loss
from qualify.ppo.math import masked_gae, whiten_advantages
from qualify.ppo.share import count_normalizers
from tests.unit._runs import REPO

gen = torch.Generator().manual_seed(3)
B, T = 6, 9
MASK = torch.zeros(B, T, dtype=torch.bool)
for b, (start, n) in enumerate([(2, 5), (3, 6), (1, 8), (4, 2), (2, 7), (5, 4)]):
    MASK[b, start:start + n] = True


def verl_masked_whiten(values, mask):
    """verl.utils.torch_functional.masked_whiten (shift_mean=True), written from its formula in float64."""
    mask = mask.double()
    mean = (values * mask).sum() / mask.sum()
    variance = (((values - mean) ** 2) * mask).sum() / mask.sum()
    variance = variance * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def test_whitening_is_verls_masked_whiten_and_leaves_the_returns_alone():
    rewards = torch.randn(B, T, generator=gen) * MASK
    values = torch.randn(B, T, generator=gen) * MASK
    adv, ret = masked_gae(rewards, values, MASK, 1.0, 0.95)
    white = whiten_advantages(adv, MASK)
    assert torch.equal(ret, torch.where(MASK, adv + values, 0.0))  # the returns are made from the raw advantages
    want = verl_masked_whiten(adv.double(), MASK)
    assert torch.allclose(white[MASK].double(), want[MASK], rtol=1e-6, atol=1e-6)
    assert (white[~MASK] == 0).all()
    assert abs(float(white[MASK].mean())) < 1e-6 and abs(float(white[MASK].std()) - 1) < 1e-4
    assert not torch.equal(white, adv)  # a negative control: the setting changes what the engine is judged on
    with pytest.raises(ValueError, match="at least 2 active positions"):
        whiten_advantages(adv, torch.zeros_like(MASK))


def test_whiten_advantages_is_a_matrix_setting_off_by_default(tmp_path):
    data = yaml.safe_load((REPO / "matrices" / "tiny-qwen3.yaml").read_text())
    assert load_matrix(REPO / "matrices" / "tiny-qwen3.yaml").ppo.whiten_advantages is False
    data["ppo"]["whiten_advantages"] = True
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(data))
    assert load_matrix(tmp_path / "m.yaml").ppo.whiten_advantages is True


def inputs():
    logp = (-torch.rand(B, T, generator=gen) * 2).requires_grad_(True)
    old = logp.detach() + torch.randn(B, T, generator=gen) * 0.3
    ref = logp.detach() + torch.randn(B, T, generator=gen) * 0.2
    adv = torch.randn(B, 1, generator=gen).expand(B, T) * MASK
    return logp, old, ref, adv


def trl_loss(logp, old, ref, adv, mask, beta, eps):
    """TRL's GRPO per-token loss with use_bias_correction_kl, token-mean aggregated ('dapo'/'bnpo' form)."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
    per_token_kl = per_token_kl * coef_1
    per_token_loss = per_token_loss + beta * per_token_kl
    return (per_token_loss * mask).sum() / mask.sum(), (per_token_kl * mask).sum() / mask.sum()


def test_k3_ratio_is_trls_bias_corrected_kl_with_its_gradient():
    logp, old, ref, adv = inputs()
    ours = grpo_loss(logp, old, ref, adv, MASK, clip_eps=0.2, kl_coef=0.04, kl_estimator="k3_ratio",
                     aggregation="token_mean", normalizers=count_normalizers(MASK))
    (grad,) = torch.autograd.grad(ours.loss, logp)
    x = logp.detach().double().requires_grad_(True)
    theirs, kl = trl_loss(x, old.double(), ref.double(), adv.double(), MASK.double(), 0.04, 0.2)
    (want,) = torch.autograd.grad(theirs, x)
    assert abs(float(ours.loss) - float(theirs)) < 1e-6 and abs(float(ours.kl) - float(kl)) < 1e-6
    assert torch.allclose(grad.double(), want, atol=1e-7)
    plain = grpo_loss(logp, old, ref, adv, MASK, clip_eps=0.2, kl_coef=0.04, kl_estimator="k3",
                      aggregation="token_mean", normalizers=count_normalizers(MASK))
    (plain_grad,) = torch.autograd.grad(plain.loss, logp)
    assert (plain_grad - grad).abs().max() > 1e-4  # k3 alone is another objective: a negative control


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_token_mean_clip_frac_is_the_plain_token_mean_under_sequence_aggregations(aggregation):
    logp, old, ref, adv = inputs()
    kw = {"clip_eps": 0.2, "kl_coef": 0.0, "aggregation": aggregation, "normalizers": count_normalizers(MASK),
          "constant": 16.0 if aggregation.endswith("norm") else None}
    token = grpo_loss(logp, old, ref, adv, MASK, clip_frac="token_mean", **kw)
    weighted = grpo_loss(logp, old, ref, adv, MASK, **kw)
    ratio = torch.exp(logp.detach() - old)
    clipped = (-adv * torch.clamp(ratio, 0.8, 1.2)) > (-adv * ratio)
    want = float((clipped & MASK).sum()) / float(MASK.sum())
    assert abs(float(token.clip_frac) - want) < 1e-6
    assert abs(float(weighted.clip_frac) - want) > 1e-3  # the loss-weighted one differs: the setting matters
    assert torch.equal(token.loss, weighted.loss)
