"""The scalar means' per-token contributions (qualify.ppo.decisions.mean_terms) and freeze's random-sign scale of
their differences (qualify.bounds.control_error.means_scale_error): each against an obvious loop or the objective's own aggregate,
and what the scale is for (controls whose mean differences cancel by chance)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from qualify.bounds.control_error import MEANS_TEXT, means_scale_error, step_family_bounds
from qualify.bounds.rule import BoundRule
from qualify.compare import RunTensors
from qualify.ppo.decisions import mean_terms
from qualify.ppo.grpo import grpo_loss, token_advantages
from qualify.ppo.share import count_normalizers
from tests.unit._runs import OPT

PPO = SimpleNamespace(clip_eps=0.2, value_clip_eps=0.2, token_normalizer="per_sequence", normalizer_constant=None)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(4, 7, generator=g) > 0.3
    mask[3] = False  # a row with no active token
    mask[0, 0] = True
    return g, mask


def test_ppo_kl_mean_contributions_are_each_tokens_kl_over_the_active_tokens():
    """PPO's kl_mean is the masked global mean whatever the loss's token normalizer: token t's contribution is
    kl_t / N (an obvious loop), they sum to the recorded kl_mean, and a PPO actor has no policy_loss mean."""
    g, mask = _batch()
    kl = torch.rand(4, 7, generator=g)
    kl_mean = (kl * mask).sum() / mask.sum()
    outputs = {"kl_BT": kl, "kl_mean": kl_mean.float(), "ratio_BT": torch.ones(4, 7)}
    got = mean_terms("actor", PPO, None, outputs, {"advantages_BT": torch.ones(4, 7)}, mask)
    assert set(got) == {"kl_mean"} and got["kl_mean"].dtype == torch.float64
    n = int(mask.sum())
    for b in range(4):
        for t in range(7):
            want = float(kl[b, t]) / n if mask[b, t] else 0.0
            assert math.isclose(float(got["kl_mean"][b, t]), want, rel_tol=1e-12, abs_tol=1e-15)
    assert math.isclose(float(got["kl_mean"].sum()), float(kl_mean), rel_tol=1e-6)


@pytest.mark.parametrize("aggregation,constant", [("token_mean", None), ("seq_mean_token_mean", None),
                                                  ("seq_mean_token_sum_norm", 8.0)])
def test_grpo_contributions_sum_to_the_objectives_own_kl_and_policy_loss(aggregation, constant):
    """GRPO's kl_mean and policy_loss are the objective's aggregates (qualify.ppo.grpo.grpo_loss, computed here in
    float64 on the same tokens): their contributions sum to them for every aggregation."""
    g, mask = _batch(1)
    grpo = SimpleNamespace(kl_coef=0.04, aggregation=aggregation, constant=constant, kl_estimator="k3")
    logp = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(4, 7, generator=g, dtype=torch.float64)
    ref = logp + 0.2 * torch.randn(4, 7, generator=g, dtype=torch.float64)
    adv_B = torch.randn(4, generator=g, dtype=torch.float64)
    out = grpo_loss(logp, old, ref, token_advantages(adv_B, mask), mask, clip_eps=PPO.clip_eps, kl_coef=grpo.kl_coef,
                    kl_estimator="k3", aggregation=aggregation, normalizers=count_normalizers(mask),
                    constant=constant)
    from qualify.ppo.grpo import kl_estimate

    outputs = {"kl_BT": kl_estimate(logp, ref, mask, "k3"), "kl_mean": out.kl, "policy_loss": out.policy_loss,
               "ratio_BT": torch.where(mask, out.ratio_BT, 0.0), "advantages_B": adv_B}
    got = mean_terms("actor", PPO, grpo, outputs, {}, mask)
    assert set(got) == {"kl_mean", "policy_loss"}
    assert math.isclose(float(got["kl_mean"].sum()), float(out.kl), rel_tol=1e-12, abs_tol=1e-15)
    assert math.isclose(float(got["policy_loss"].sum()), float(out.policy_loss), rel_tol=1e-12, abs_tol=1e-15)
    assert float(got["kl_mean"][~mask].abs().sum()) == 0.0 and float(got["policy_loss"][~mask].abs().sum()) == 0.0


def test_a_mean_that_is_not_that_aggregation_or_cannot_be_read_is_left_out():
    g, mask = _batch(2)
    kl = torch.rand(4, 7, generator=g)
    kl_mean = float((kl * mask).sum() / mask.sum())
    assert mean_terms("actor", PPO, None, {"kl_BT": kl, "kl_mean": torch.tensor(kl_mean + 1e-3)}, {}, mask) == {}
    assert mean_terms("actor", PPO, None, {"kl_BT": kl}, {}, mask) == {}  # no recorded mean to decompose
    assert mean_terms("actor", PPO, None, {"kl_mean": torch.tensor(kl_mean)}, {}, mask) == {}  # no kl_BT
    assert mean_terms("critic", PPO, None, {"kl_BT": kl, "kl_mean": torch.tensor(kl_mean)}, {}, mask) == {}


def test_the_scale_is_the_largest_pairs_l2_norm_only_raises_and_needs_every_pair():
    base = torch.zeros(2, 3, dtype=torch.float64)
    near = torch.tensor([[0.3, -0.3, 0.0], [0.0, 0.4, -0.4]], dtype=torch.float64)  # sums to 0: cancels by chance
    far = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, -1.0]], dtype=torch.float64)
    table = {"b": {"kl_mean": base}, "n": {"kl_mean": near}, "f": {"kl_mean": far}, "x": {}}
    errors = {"outputs/kl_mean": {"max_abs": 0.0}}
    assert means_scale_error([("n", "b"), ("f", "b")], table.__getitem__, errors) == ["outputs/kl_mean"]
    # the obvious sums: sqrt(0.09 + 0.09 + 0.16 + 0.16) and sqrt(1 + 1)
    assert math.isclose(errors["outputs/kl_mean"]["max_abs"], math.sqrt(2.0), rel_tol=1e-12)
    errors = {"outputs/kl_mean": {"max_abs": 0.0}}
    assert means_scale_error([("n", "b")], table.__getitem__, errors) == ["outputs/kl_mean"]
    assert math.isclose(errors["outputs/kl_mean"]["max_abs"], math.sqrt(0.5), rel_tol=1e-12)
    big = {"outputs/kl_mean": {"max_abs": 5.0}}
    assert means_scale_error([("f", "b")], table.__getitem__, big) == ["outputs/kl_mean"]
    assert big["outputs/kl_mean"]["max_abs"] == 5.0  # never lowers
    untouched = {"outputs/kl_mean": {"max_abs": 0.25}}
    assert means_scale_error([("n", "b"), ("x", "b")], table.__getitem__, untouched) == []
    assert untouched == {"outputs/kl_mean": {"max_abs": 0.25}}
    assert means_scale_error([], table.__getitem__, untouched) == [] and untouched["outputs/kl_mean"]["max_abs"] == 0.25
    assert means_scale_error([("n", "b")], table.__getitem__, {}) == []  # no kl_mean row to raise


def test_step_bounds_of_controls_whose_means_cancel_take_the_scale_and_say_so():
    """Two controls whose per-token KL differences cancel exactly in the mean: the plain control error of kl_mean is
    0 and its bound would be the floor; with the contributions it is their L2 scale, marked as such, and a systematic
    shift of every token by the same amount (what the mean is there to catch) is sqrt(tokens) times that scale."""
    n = 64
    mask = torch.ones(1, n, dtype=torch.bool)
    kl0 = torch.full((1, n), 0.5, dtype=torch.float64)
    delta = 1e-3 * torch.tensor([1.0, -1.0] * (n // 2), dtype=torch.float64)[None]

    def run(kl: torch.Tensor) -> RunTensors:
        return RunTensors({"kl_BT": kl.float(), "kl_mean": torch.tensor(float(kl.mean()))}, {}, {}, {})

    base, other = run(kl0), run(kl0 + delta)
    rule = BoundRule(4.0, {"loss": 0.0, "logprob": 0.0}, 0.0, "fp32", False)
    plain = step_family_bounds(base, {"c": other}, rule, {"r0": {}, "c": {}}, "r0", OPT, 1)
    assert plain["outputs/kl_mean"]["max_abs"]["control_error"] == 0.0

    def means(r: RunTensors, decided_by: RunTensors | None = None) -> dict[str, torch.Tensor]:
        return mean_terms("actor", PPO, None, r.outputs, {}, mask)

    scaled = step_family_bounds(base, {"c": other}, rule, {"r0": {}, "c": {}}, "r0", OPT, 1, means=means)
    entry = scaled["outputs/kl_mean"]["max_abs"]
    scale = float(((other.outputs["kl_BT"].double() - base.outputs["kl_BT"].double()) / n).norm())
    assert math.isclose(entry["control_error"], scale, rel_tol=1e-9) and entry["control_error_of"] == MEANS_TEXT
    shift = 1e-3  # every token 1e-3 higher, as large as each control difference: the mean moves by 1e-3
    assert math.isclose(shift / scale, math.sqrt(n), rel_tol=1e-3)
    assert shift > 1.9 * entry["bound"]  # k = 4 < sqrt(64): the shift fails the mean's bound by about 2x
