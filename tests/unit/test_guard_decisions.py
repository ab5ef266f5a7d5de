"""qualify.ppo.decisions: what mutation testing (run N, at 1219bce) found unpinned.

Exact decisions and margins on hand-picked values exact in binary (old 0.5, return 1, eps 0.25: the critic's four
edges are old +- eps = 0.75 and 0.25, and 2R - old -+ eps = 1.25 and 1.75), the actor's margins for A > 0, A < 0,
A = 0 and off the mask (PPO and GRPO), and which outputs and targets each objective needs.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from qualify.ppo.decisions import Decisions, decisions, differing, loss_terms

PPO = SimpleNamespace(clip_eps=0.25, value_clip_eps=0.25, token_normalizer="global", normalizer_constant=None)
GRPO = SimpleNamespace(kl_coef=0.5, aggregation="token_mean", constant=None)
INF = math.inf


def test_critic_decisions_and_margins_to_the_nearest_of_four_edges():
    v = torch.tensor([[0.875, 0.0, 1.3125, 2.0, 0.5, 1.25, 9.0]])
    mask = torch.tensor([[True, True, True, True, True, True, False]])
    targets = {"old_values_BT": torch.full((1, 7), 0.5), "returns_BT": torch.ones(1, 7)}
    d = decisions("critic", PPO, None, {"values_BT": v}, targets, mask.int())
    assert (d.quantity, d.name) == ("values_BT", "value_clip")
    # 0.875: clipped to 0.75, (0.75 - 1)^2 = 1/16 > (0.875 - 1)^2 = 1/64; 0.0 and 1.3125 and 2.0 are beyond the edge
    # with the unclipped term the larger; 0.5 (= old) is inside the range; 1.25 = 2R - old - eps is beyond the edge
    # with both terms equal (0.75 - 1)^2 = (1.25 - 1)^2: a tie is not clipped (clip_frac's strict >); the last token
    # is off the mask
    assert d.clipped_BT.tolist() == [[True, False, False, False, False, False, False]]
    # nearest edges: 0.75, 0.25, 1.25, 1.75, 0.75 (or 0.25), 1.25 itself, none off the mask
    assert d.margin_BT.tolist() == [[0.125, 0.25, 0.0625, 0.25, 0.25, 0.0, INF]]


def test_actor_margins_for_each_sign_of_the_advantage_and_off_the_mask():
    ratio = torch.tensor([[1.5, 0.5, 1.125, 2.0, 1.0]])
    adv = torch.tensor([[1.0, -1.0, -2.0, 0.0, 1.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    d = decisions("actor", PPO, None, {"ratio_BT": ratio}, {"advantages_BT": adv}, mask)
    assert (d.quantity, d.name) == ("ratio_BT", "policy_clip")
    # A > 0 at 1.5: -1.25 > -1.5, clipped, 0.25 from 1.25; A < 0 at 0.5: 0.75 > 0.5, clipped, 0.25 from 0.75;
    # A < 0 at 1.125: inside, 0.375 from 0.75; A = 0 and off the mask: never decided, no edge
    assert d.clipped_BT.tolist() == [[True, True, False, False, False]]
    assert d.margin_BT.tolist() == [[0.25, 0.25, 0.375, INF, INF]]
    # GRPO: the advantages are the rows' (advantages_B), broadcast to the active tokens
    g = decisions("actor", PPO, GRPO, {"ratio_BT": ratio, "advantages_B": torch.tensor([-1.0])}, {}, mask)
    assert g.clipped_BT.tolist() == [[False, True, False, False, False]]  # A < 0: only 0.5 is clipped (to 0.75)
    assert g.margin_BT.tolist() == [[0.75, 0.25, 0.375, 1.25, INF]]


@pytest.mark.parametrize("role, grpo, outputs, targets", [
    ("critic", None, {"values_BT"}, {"old_values_BT"}),
    ("critic", None, {"values_BT"}, {"returns_BT"}),
    ("critic", None, {"ratio_BT"}, {"old_values_BT", "returns_BT"}),
    ("actor", None, {"ratio_BT"}, set()),
    ("actor", None, {"values_BT"}, {"advantages_BT"}),
    ("actor", GRPO, {"ratio_BT", "kl_BT"}, {"advantages_BT"}),
    ("actor", GRPO, {"advantages_B", "kl_BT"}, set()),
])
def test_no_decisions_and_no_loss_terms_without_what_the_objective_reads(role, grpo, outputs, targets):
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = {k: torch.ones(1) if k == "advantages_B" else torch.ones(1, 2) for k in outputs}
    tgt = {k: torch.ones(1, 2) for k in targets}
    assert decisions(role, PPO, grpo, out, tgt, mask) is None
    assert loss_terms(role, PPO, grpo, out, tgt, mask) is None


def test_grpo_loss_terms_need_the_kl_and_hold_each_tokens_weighted_term():
    ratio, mask = torch.tensor([[1.5, 0.5, 1.0]]), torch.tensor([[True, True, False]])
    outputs = {"ratio_BT": ratio, "advantages_B": torch.tensor([1.0])}
    assert decisions("actor", PPO, GRPO, outputs, {}, mask) is not None
    assert loss_terms("actor", PPO, GRPO, outputs, {}, mask) is None  # no kl_BT
    outputs["kl_BT"] = torch.tensor([[0.25, 0.5, 7.0]])
    terms = loss_terms("actor", PPO, GRPO, outputs, {}, mask)
    # token_mean over 2 tokens: (max(-1.5, -1.25) + 0.5 x 0.25) / 2, (max(-0.5, -0.75) + 0.5 x 0.5) / 2, 0 off the mask
    assert terms.dtype == torch.float64 and terms.tolist() == [[(-1.25 + 0.125) / 2, (-0.5 + 0.25) / 2, 0.0]]
    ppo_terms = loss_terms("actor", PPO, None, {"ratio_BT": ratio}, {"advantages_BT": torch.tensor([[1.0, -2.0, 3.0]])},
                           mask)
    # PPO, global over 2: max(-1.5, -1.25) / 2, max(1.0, 1.5) / 2, 0 off the mask
    assert ppo_terms.tolist() == [[-1.25 / 2, 1.5 / 2, 0.0]]
    critic = loss_terms("critic", PPO, None, {"values_BT": torch.tensor([[0.875, 0.0, 5.0]])},
                        {"old_values_BT": torch.full((1, 3), 0.5), "returns_BT": torch.ones(1, 3)}, mask)
    # 0.5 max((0.875 - 1)^2, (0.75 - 1)^2) / 2 and 0.5 max(1, (0.25 - 1)^2) / 2
    assert critic.tolist() == [[0.5 * 0.0625 / 2, 0.5 / 2, 0.0]]


def test_differing_lists_the_positions_in_order():
    a = Decisions(torch.tensor([[True, False, True], [False, False, True]]), torch.zeros(2, 3), "ratio_BT", "x")
    b = Decisions(torch.tensor([[False, False, True], [True, False, False]]), torch.zeros(2, 3), "ratio_BT", "x")
    assert differing(a, b) == [(0, 0), (1, 0), (1, 2)]
    assert differing(a, a) == []


def test_a_ratio_one_step_beyond_the_edge_whose_terms_round_equal_is_not_clipped():
    """The objective's own fp32 arithmetic: one float32 step beyond 1 + eps (A > 0) or 1 - eps (A < 0), -A x clamp(r)
    and -A x r can round to the same float32 (these A were found so): a tie, which clip_frac's strict > does not
    count, and neither does the decision."""
    eps = 0.2
    hi, lo = torch.tensor(1.0 + eps), torch.tensor(1.0 - eps)  # float32, as clamp takes them
    ratio = torch.stack([torch.nextafter(hi, torch.tensor(2.0)), torch.nextafter(lo, torch.tensor(0.0))])[None]
    adv = torch.tensor([[0.9194083213806152, -0.8488934636116028]])
    assert bool((ratio[0, 0] > hi) & (ratio[0, 1] < lo))  # both beyond the edge: the clamp is active
    assert torch.equal(-adv * torch.clamp(ratio, 1.0 - eps, 1.0 + eps), -adv * ratio)  # the two terms tie
    d = decisions("actor", SimpleNamespace(clip_eps=eps), None, {"ratio_BT": ratio}, {"advantages_BT": adv},
                  torch.ones(1, 2, dtype=torch.bool))
    assert d.clipped_BT.tolist() == [[False, False]]


def test_loss_terms_are_float64_throughout():
    """eps 0.2 and kl_coef 0.1 are not float32 values: the clamp's edge is 1.2 in float64 (not float32's 1.2000000477),
    and the KL term 0.1 x kl is a float64 product."""
    mask = torch.ones(1, 1, dtype=torch.bool)
    ppo = SimpleNamespace(clip_eps=0.2, token_normalizer="global", normalizer_constant=None)
    terms = loss_terms("actor", ppo, None, {"ratio_BT": torch.tensor([[1.5]])}, {"advantages_BT": torch.ones(1, 1)},
                       mask)
    assert terms.tolist() == [[-1.2]]  # max(-1.5, -1 x 1.2), one token
    grpo = SimpleNamespace(kl_coef=0.1, aggregation="token_mean", constant=None)
    kl = torch.tensor([[0.7]])  # 0.1 x 0.7f rounds differently in float32
    terms = loss_terms("actor", ppo, grpo, {"ratio_BT": torch.tensor([[1.0]]), "advantages_B": torch.ones(1),
                                            "kl_BT": kl}, {}, mask)
    assert terms.tolist() == [[-1.0 + 0.1 * float(kl)]]
