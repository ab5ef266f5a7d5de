"""qualify.ppo.math's imposed value-clip decisions: what mutation testing (run L, at 1219bce) found unpinned.

The clamp is active only strictly beyond old +- eps (a token exactly on the edge, or inside the range, keeps PPO's
max of the two terms when nothing is imposed on it), and a token decided clipped whose value sits exactly on old
takes the upper edge old + eps. Inside the range the two terms differ only by the rounding of old + (v - old): the
fp32 values below are chosen so that it rounds (to 0, where v is 2^-30), which makes the clipped term the larger one.
Expected values are worked out by hand in binary.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qualify.ppo.decisions import decisions
from qualify.ppo.math import clipped_value_loss

F32 = torch.float32
EPS32 = float(torch.tensor(0.2, dtype=F32))  # clamp and the comparisons use eps in the values' dtype
TINY, RET = 2.0 ** -30, 2.0 ** -28


@pytest.mark.parametrize("old, v, ret", [
    (-EPS32, TINY, RET),     # v - old rounds to +eps exactly: on the upper edge, not beyond it
    (EPS32, -TINY, -RET),    # v - old rounds to -eps exactly: on the lower edge
    (0.125, -TINY, -RET),    # inside the range
], ids=["on_upper_edge", "on_lower_edge", "inside"])
def test_a_token_not_beyond_the_edge_keeps_the_larger_term_under_its_own_decisions(old, v, ret):
    o, x, r = (torch.tensor([[a]], dtype=F32) for a in (old, v, ret))
    mask = torch.ones(1, 1, dtype=torch.bool)
    assert float(o + (x - o)) == 0.0 and float(x) != 0.0  # the clipped value rounds to 0, v does not
    # unclipped 0.5 (v - R)^2 = 0.5 x 9 x 2^-60; clipped 0.5 (0 - R)^2 = 0.5 x 2^-56: the clipped term is the larger
    natural_loss, natural_frac = clipped_value_loss(x, o, r, mask, 0.2, "global")
    assert float(natural_loss) == 2.0 ** -57 and float(natural_frac) == 1.0
    own = decisions("critic", SimpleNamespace(value_clip_eps=0.2), None, {"values_BT": x},
                    {"old_values_BT": o, "returns_BT": r}, mask)
    assert not bool(own.clipped_BT.any())  # not beyond the edge: not decided clipped
    loss, frac = clipped_value_loss(x, o, r, mask, 0.2, "global", decided_BT=own.clipped_BT)
    assert float(loss) == 2.0 ** -57 and float(frac) == 1.0  # bitwise the natural loss and clip_frac


def test_a_token_decided_clipped_exactly_at_old_takes_the_upper_edge():
    """v == old: no side; the edge is old + eps. v = old - 0.1 takes old - eps."""
    old, ret = torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    v = torch.tensor([[0.0, -0.1]], dtype=torch.float64, requires_grad=True)
    mask, decided = torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 2, dtype=torch.bool)
    loss, frac = clipped_value_loss(v, old, ret, mask, 0.25, "global", decided_BT=decided)
    # 0.5 (0.25 - 1)^2 = 0.28125 and 0.5 (-0.25 - 1)^2 = 0.78125, mean 0.53125 (all exact in binary)
    assert float(loss.detach()) == 0.53125 and float(frac) == 1.0
    (grad,) = torch.autograd.grad(loss, v)
    assert torch.equal(grad, torch.zeros(1, 2, dtype=torch.float64))  # the edge term is a constant


def test_a_surrogate_token_decided_clipped_takes_the_edge_of_its_advantages_sign():
    """-A x (1 + eps) for any A > 0 (0.5 as well as 2), -A x (1 - eps) for A < 0; no gradient through the ratio."""
    from qualify.ppo.math import clipped_policy_loss

    logp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)  # ratio 1: inside the range
    adv = torch.tensor([[0.5, 2.0, -0.5]], dtype=torch.float64)
    mask, decided = torch.ones(1, 3, dtype=torch.bool), torch.ones(1, 3, dtype=torch.bool)
    loss, _, frac = clipped_policy_loss(logp, torch.zeros(1, 3, dtype=torch.float64), adv, mask, 0.25, "global",
                                        decided_BT=decided)
    # (-0.5 x 1.25 - 2 x 1.25 + 0.5 x 0.75) / 3 = -2.75 / 3
    assert float(loss.detach()) == -2.75 / 3 and float(frac) == 1.0
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.equal(grad, torch.zeros(1, 3, dtype=torch.float64))


def test_a_surrogate_token_beyond_the_edge_decided_unclipped_takes_the_unclipped_term():
    """A candidate decided a token unclipped where this run's ratio (1.5, A = 1) is beyond 1 + eps: the token's term is
    -A x ratio with its gradient, not PPO's max (the clipped -1.25 without gradient), and clip_frac does not count it."""
    from qualify.ppo.math import clipped_policy_loss

    logp = torch.log(torch.tensor([[1.5, 1.0]], dtype=torch.float64)).requires_grad_(True)
    adv, mask = torch.tensor([[1.0, 1.0]], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    old = torch.zeros(1, 2, dtype=torch.float64)
    natural, _, natural_frac = clipped_policy_loss(logp, old, adv, mask, 0.25, "global")
    assert float(natural.detach()) == pytest.approx((-1.25 - 1.0) / 2, rel=1e-15) and float(natural_frac) == 0.5
    loss, _, frac = clipped_policy_loss(logp, old, adv, mask, 0.25, "global",
                                        decided_BT=torch.zeros(1, 2, dtype=torch.bool))
    assert float(loss.detach()) == pytest.approx((-1.5 - 1.0) / 2, rel=1e-15) and float(frac) == 0.0
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0, 0] == pytest.approx(-1.5 / 2, rel=1e-15) and grad[0, 1] == pytest.approx(-0.5, rel=1e-15)
