"""The critic's value-head bias gradient as a sum over tokens (qualify.ppo.decisions.bias_terms) and freeze's raise of
its control error to the sum of |per-token contribution differences| (qualify.bounds.control_error.raise_bias):
each against autograd of the value loss through a linear head, and what the raise is for (controls whose sums cancel
by chance; a shift of every value the same way)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from qualify.bounds.control_error import BIAS_TEXT, raise_bias, step_family_bounds
from qualify.bounds.records import BIAS_GRAD, means_of
from qualify.bounds.rule import BoundRule
from qualify.compare import RunTensors
from qualify.ppo.decisions import bias_terms, loss_terms
from tests.unit._runs import OPT


def _ppo(normalizer: str) -> SimpleNamespace:
    return SimpleNamespace(clip_eps=0.2, value_clip_eps=0.2, token_normalizer=normalizer, normalizer_constant=None)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(4, 9, generator=g) > 0.25
    mask[3, :] = False
    mask[0, 0] = True
    old = torch.randn(4, 9, generator=g, dtype=torch.float64)
    ret = old + 0.5 * torch.randn(4, 9, generator=g, dtype=torch.float64)
    return g, mask, {"old_values_BT": old, "returns_BT": ret}


@pytest.mark.parametrize("normalizer", ["global", "per_sequence"])
def test_the_bias_gradient_is_the_sum_of_the_per_token_terms(normalizer):
    """v = h . w + b through a linear head, loss = the value loss's per-token contributions summed (loss_terms):
    autograd's gradient of b is the sum of bias_terms, and each term is autograd's d loss / d v at that token, with
    values inside, at and beyond the clip range."""
    g, mask, targets = _batch(1)
    ppo = _ppo(normalizer)
    h = torch.randn(4, 9, 5, generator=g, dtype=torch.float64)
    w = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    values = (h @ w + b).detach()
    values = targets["old_values_BT"] + 0.6 * (values - values.mean())  # many tokens beyond the 0.2 clip range
    h_shift = (values - (h @ w.detach() + b.detach())).detach()
    v = h @ w + b + h_shift
    v.retain_grad()
    loss = loss_terms("critic", ppo, None, {"values_BT": v}, targets, mask).sum()
    loss.backward()
    terms = bias_terms("critic", ppo, None, {"values_BT": v.detach()}, targets, mask)
    assert terms.dtype == torch.float64 and terms.shape == (4, 9)
    clipped = mask & ((v.detach() - targets["old_values_BT"]).abs() > 0.2)
    assert clipped.any() and (mask & ~clipped).any()
    assert torch.allclose(terms, v.grad, rtol=1e-12, atol=1e-15)
    assert math.isclose(float(terms.sum()), float(b.grad), rel_tol=1e-12, abs_tol=1e-15)
    assert float(terms[~mask].abs().sum()) == 0.0


def test_the_actor_and_unreadable_outputs_have_no_bias_terms():
    _, mask, targets = _batch()
    assert bias_terms("actor", _ppo("global"), None, {"values_BT": torch.zeros(4, 9)}, targets, mask) is None
    assert bias_terms("critic", _ppo("global"), None, {}, targets, mask) is None


def test_means_of_keeps_the_bias_terms_only_where_they_sum_to_the_recorded_gradient():
    _, mask, targets = _batch(2)
    ppo = _ppo("global")
    values = targets["old_values_BT"] + 0.1
    terms = bias_terms("critic", ppo, None, {"values_BT": values}, targets, mask)
    inputs = SimpleNamespace(masks=[mask], targets=[targets])
    means = means_of(SimpleNamespace(ppo=ppo, grpo=None), "critic", inputs)
    right = RunTensors({"values_BT": values.float()}, {"score.bias": terms.sum().float().reshape(1)}, {}, {})
    assert torch.equal(means(0, right)[BIAS_GRAD], bias_terms("critic", ppo, None, right.outputs, targets, mask))
    other = RunTensors({"values_BT": values.float()}, {"score.bias": (terms.sum() + 1.0).float().reshape(1)}, {}, {})
    assert BIAS_GRAD not in means(0, other)  # not the sum: that head's bias is not (only) on the value
    assert BIAS_GRAD not in means(0, RunTensors({"values_BT": values.float()}, {}, {}, {}))
    assert BIAS_GRAD not in means(1, right)  # a step without inputs


def test_the_raise_is_the_largest_sum_of_absolute_differences_never_lowers_and_needs_every_control():
    errors = {BIAS_GRAD: {"max_abs": 0.01, "rel_l2": 0.02, "p99_abs": 0.01}}
    assert sorted(raise_bias(errors, [0.5, 2.0], 4.0)) == ["max_abs", "p99_abs", "rel_l2"]
    assert errors[BIAS_GRAD] == {"max_abs": 2.0, "rel_l2": 0.5, "p99_abs": 2.0}
    big = {BIAS_GRAD: {"max_abs": 9.0}}
    raise_bias(big, [1.0], 1.0)
    assert big[BIAS_GRAD]["max_abs"] == 9.0  # never lowers
    same = {BIAS_GRAD: {"max_abs": 0.01}}
    assert raise_bias(same, [1.0, None], 1.0) == [] and same[BIAS_GRAD]["max_abs"] == 0.01
    assert raise_bias({}, [1.0], 1.0) == [] and raise_bias(same, [], 1.0) == []
    zero = {BIAS_GRAD: {"rel_l2": 0.0}}
    assert raise_bias(zero, [1.0], 0.0) == [] and zero[BIAS_GRAD]["rel_l2"] == 0.0  # no magnitude to divide by


def test_a_control_whose_bias_sum_cancels_sets_the_bound_from_its_terms_and_a_common_shift_fails_it():
    """A control whose per-token d loss / d value differences cancel in the sum: the plain control error of the bias
    gradient is 0 and its bound the floor; with the terms it is their absolute sum, marked as such. An engine whose
    values all sit higher by as much as the control's per-token differences moves the bias gradient by that sum,
    which the raised bound still fails (k = 4 > 1)."""
    n = 64
    mask = torch.ones(1, n, dtype=torch.bool)
    ppo = _ppo("global")
    targets = {"old_values_BT": torch.zeros(1, n, dtype=torch.float64),
               "returns_BT": torch.full((1, n), 0.05, dtype=torch.float64)}
    inputs = SimpleNamespace(masks=[mask], targets=[targets])
    means = means_of(SimpleNamespace(ppo=ppo, grpo=None), "critic", inputs)

    def run(values: torch.Tensor) -> RunTensors:
        terms = bias_terms("critic", ppo, None, {"values_BT": values}, targets, mask)
        return RunTensors({"values_BT": values.float()}, {"score.bias": terms.sum().float().reshape(1)}, {}, {})

    v0 = torch.zeros(1, n, dtype=torch.float64)
    delta = 1e-3 * torch.tensor([1.0, -1.0] * (n // 2), dtype=torch.float64)[None]
    base, control = run(v0), run(v0 + delta)
    rule = BoundRule(4.0, {"grad": 0.0, "relative": 0.0, "value": 0.0}, 0.0, "fp32", False)
    plain = step_family_bounds(base, {"c": control}, rule, {"r0": {}, "c": {}}, "r0", OPT, 1)
    assert plain[BIAS_GRAD]["max_abs"]["control_error"] < 1e-9
    raised = step_family_bounds(base, {"c": control}, rule, {"r0": {}, "c": {}}, "r0", OPT, 1,
                                means=lambda r, by=None: means(0, r, by))
    entry = raised[BIAS_GRAD]["max_abs"]
    assert math.isclose(entry["control_error"], 1e-3, rel_tol=1e-6) and entry["control_error_of"] == BIAS_TEXT
    assert raised[BIAS_GRAD]["rel_l2"]["control_error_of"] == BIAS_TEXT
    shifted = run(v0 + 4.5e-3)  # every value 4.5e-3 higher: the gradient moves by 4.5e-3 x n x (1 / n)
    moved = abs(float(shifted.grads["score.bias"][0]) - float(base.grads["score.bias"][0]))
    assert moved > entry["bound"] and math.isclose(moved, 4.5e-3, rel_tol=1e-4)


def test_a_run_replayed_on_another_runs_decisions_takes_those_decisions():
    """r0 replayed on a control's clip decisions (qualify.ppo.math.clipped_value_loss with decided_BT): each token's
    d loss / d value is autograd's of that forced loss when bias_terms is given the control's values to decide by; its
    own decisions would differ on the tokens the two runs decided otherwise."""
    g, mask, targets = _batch(3)
    ppo = _ppo("global")
    old, ret = targets["old_values_BT"], targets["returns_BT"]
    v_control = old + 0.3 * torch.randn(4, 9, generator=g, dtype=torch.float64)
    v_replay = (v_control + 0.2 * torch.randn(4, 9, generator=g, dtype=torch.float64)).requires_grad_(True)
    clip = old + torch.clamp(v_control - old, -0.2, 0.2)
    decided = mask & ((clip - ret) ** 2 > (v_control - ret) ** 2)
    from qualify.ppo.math import clipped_value_loss

    loss, _ = clipped_value_loss(v_replay, old, ret, mask, 0.2, "global", None, decided_BT=decided)
    loss.backward()
    forced = bias_terms("critic", ppo, None, {"values_BT": v_replay.detach()}, targets, mask, decided_by=v_control)
    assert torch.allclose(forced, v_replay.grad, rtol=1e-12, atol=1e-15)
    own = bias_terms("critic", ppo, None, {"values_BT": v_replay.detach()}, targets, mask)
    assert not torch.equal(own, forced)  # the two runs decided some token otherwise
