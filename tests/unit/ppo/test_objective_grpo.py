"""qualify.ppo.objective's GRPO objective (what the reference and every candidate run) against an obvious loop:
group-relative advantages of the step's rewards, the clipped surrogate with the KL term, each aggregation; the
shares of a step's slices (micro-batches, reordered rows) add up to the step; GRPO refuses the critic."""

from __future__ import annotations

import math

import pytest
import torch

from qualify.matrix import GRPO, PPO
from qualify.ppo.objective import GRPOShare, grpo_share, role_objective

ROWS, POS, G = 8, 6, 4


def inputs(seed: int = 7):
    gen = torch.Generator().manual_seed(seed)
    mask_BT = torch.rand(ROWS, POS, generator=gen) > 0.3
    mask_BT[3] = False  # a row without an active token
    logp_BT = -torch.rand(ROWS, POS, generator=gen) * 3
    targets = {"old_logprobs_BT": logp_BT + 0.3 * torch.randn(ROWS, POS, generator=gen),
               "ref_logprobs_BT": logp_BT + 0.2 * torch.randn(ROWS, POS, generator=gen),
               "score_B": torch.randn(ROWS, generator=gen)}
    targets["score_B"][4:] = 0.5  # group 1: identical rewards, advantages exactly 0
    return mask_BT, logp_BT, targets


def loop_loss(grpo: GRPO, clip_eps: float, mask_BT, logp_BT, targets) -> float:
    """The GRPO loss, one element at a time."""
    r = targets["score_B"].tolist()
    adv = []
    for b in range(ROWS):
        group = r[b // G * G: b // G * G + G]
        mean = sum(group) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (G - 1 if grpo.std_estimator == "unbiased" else G))
        a = 0.0 if all(x == group[0] for x in group) else r[b] - mean
        adv.append(a / (std + grpo.eps) if grpo.scale_std and a != 0.0 else a)
    seq_sums, seq_counts = [], []
    for b in range(ROWS):
        total, n = 0.0, 0
        for t in range(POS):
            if not mask_BT[b, t]:
                continue
            lp, old, ref = (float(x[b, t]) for x in (logp_BT, targets["old_logprobs_BT"], targets["ref_logprobs_BT"]))
            ratio = math.exp(lp - old)
            pg = max(-adv[b] * ratio, -adv[b] * min(max(ratio, 1 - clip_eps), 1 + clip_eps))
            d = ref - lp
            total += pg + grpo.kl_coef * (math.exp(d) - d - 1)
            n += 1
        seq_sums.append(total)
        seq_counts.append(n)
    active_rows = sum(n > 0 for n in seq_counts)
    if grpo.aggregation == "token_mean":
        return sum(seq_sums) / sum(seq_counts)
    if grpo.aggregation == "seq_mean_token_mean":
        return sum(s / n for s, n in zip(seq_sums, seq_counts) if n) / active_rows
    return sum(seq_sums) / (grpo.constant * active_rows)


@pytest.mark.parametrize("grpo", [GRPO(group_size=G), GRPO(group_size=G, scale_std=False, std_estimator="population"),
                                  GRPO(group_size=G, aggregation="seq_mean_token_mean"),
                                  GRPO(group_size=G, aggregation="seq_mean_token_sum_norm", constant=6.0)],
                         ids=["token_mean", "dr-centred", "seq_mean_token_mean", "dr_grpo"])
def test_role_objective_is_the_obvious_loop(grpo):
    mask_BT, logp_BT, targets = inputs()
    ppo = PPO(clip_eps=0.2)
    loss, out = role_objective("actor", ppo, logp_BT.double(), mask_BT,
                               {k: v.double() for k, v in targets.items()}, grpo=grpo)
    assert float(loss) == pytest.approx(loop_loss(grpo, 0.2, mask_BT, logp_BT, targets), rel=1e-9, abs=1e-12)
    assert torch.equal(out["advantages_B"][4:8], torch.zeros(4, dtype=torch.float64))
    assert float(out["seq_loss_B"].sum()) == pytest.approx(float(loss), rel=1e-12)
    assert not out["ratio_BT"][~mask_BT].any() and not out["kl_BT"][~mask_BT].any()
    assert set(out) == {"logprobs_BT", "ratio_BT", "kl_BT", "kl_mean", "policy_loss", "clip_frac", "advantages_B",
                        "seq_loss_B"}


def test_slices_of_a_step_are_shares_of_it():
    """Micro-batches (and reordered rows) take the step's advantages and normalizers: per-row values are bitwise the
    step's, scalars and gradients add up to it."""
    grpo, ppo = GRPO(group_size=G, aggregation="seq_mean_token_mean"), PPO()
    mask_BT, logp_BT, targets = inputs(3)
    whole = logp_BT.clone().requires_grad_()
    loss, out = role_objective("actor", ppo, whole, mask_BT, targets, grpo=grpo)
    loss.backward()
    share = grpo_share(grpo, targets["score_B"], mask_BT)
    order = torch.tensor([5, 0, 7, 2, 1, 6, 3, 4])
    parts = logp_BT.clone().requires_grad_()
    total, seq = torch.zeros(()), torch.zeros(ROWS)
    for rows in (order[:3], order[3:]):
        part = GRPOShare(share.advantages_B[rows], share.normalizers)
        l_, o = role_objective("actor", ppo, parts[rows], mask_BT[rows], {k: v[rows] for k, v in targets.items()},
                               grpo=grpo, share=part)
        l_.backward()
        total += l_.detach()
        seq[rows] = o["seq_loss_B"]
    assert torch.equal(seq, out["seq_loss_B"])
    assert float(total) == pytest.approx(float(loss.detach()), rel=1e-6)
    assert torch.allclose(parts.grad, whole.grad, rtol=0, atol=1e-7)


def test_zero_active_tokens_give_zero_loss_and_gradient():
    grpo = GRPO(group_size=G)
    _, logp_BT, targets = inputs()
    logp = logp_BT.clone().requires_grad_()
    loss, _out = role_objective("actor", PPO(), logp, torch.zeros(ROWS, POS, dtype=torch.bool), targets, grpo=grpo)
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.equal(logp.grad, torch.zeros_like(logp)) and not logp.grad.isnan().any()


def test_grpo_has_no_critic():
    mask_BT, logp_BT, targets = inputs()
    with pytest.raises(ValueError, match="GRPO trains the actor alone, not the critic"):
        role_objective("critic", PPO(), logp_BT, mask_BT, targets, grpo=GRPO(group_size=G))
