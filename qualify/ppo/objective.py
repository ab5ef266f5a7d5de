"""The PPO and GRPO objectives per role and the optimizer-step schedule, shared by the reference and the candidates.

A case is K = epochs x minibatches optimizer steps over the fixed rollout: epoch e, minibatch m
is step k = e * minibatches + m and trains on a contiguous slice of the rows. Old logprobs stay
the rollout's and advantages, returns and old values stay the frozen targets', so from step 1 on
the policy is off the rollout's and the ratio, the clips and Adam's later steps are exercised.

A slice of a step (a micro-batch of the reference, a DP rank's rows) gets what it needs from the whole step (its
share): PPO's the step's normalizers (PPOShare), GRPO's also its rows' advantages (GRPOShare). Its loss and its
scalars (clip fractions, KL mean, policy loss) are then its exact shares of the step's: the shares of a step sum
to its values, and gradients summed over the slices are the step's.

GRPO (qualify.ppo.grpo) has the actor alone: advantages are group-relative, computed per step from the frozen
rewards (score_B) of the step's rows (whole groups), and the loss is aggregated with the step's normalizers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from qualify.ppo.grpo import (
    all_gather_rewards,
    group_advantages,
    group_stats,
    grpo_loss,
    kl_estimate,
    token_advantages,
)
from qualify.ppo.math import clipped_policy_loss, clipped_value_loss, kl_terms, masked_mean, policy_settings
from qualify.ppo.share import Normalizers, all_reduce_normalizers, count_normalizers

DECIDED_KEY = "decided_clipped_BT"
"""A target a replayed reference carries: the clip decision imposed on every token (qualify.ppo.decisions)."""


def step_rows(num_rows: int, epochs: int, minibatches: int) -> list[slice]:
    """Rows trained at each optimizer step, in order: epochs x minibatches contiguous, equal slices."""
    if epochs < 1 or minibatches < 1 or num_rows % minibatches:
        raise ValueError(f"{num_rows} rows do not split into {minibatches} equal minibatches (epochs {epochs})")
    size = num_rows // minibatches
    return [slice(m * size, (m + 1) * size) for _ in range(epochs) for m in range(minibatches)]


def role_objective(role: str, ppo: Any, scores_BT: torch.Tensor, mask_BT: torch.Tensor,
                   targets: dict[str, torch.Tensor], *, grpo: Any = None,
                   share: GRPOShare | PPOShare | None = None,
                   entropy_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, judged outputs) of one role on one (mini)batch; targets are already sliced to its rows.

    scores_BT are the actor's sampler-formula logprobs or the critic's values. share: what these rows need from the
    whole step when they are a slice of it (a micro-batch, a DP rank's rows): PPOShare (PPO) or GRPOShare (GRPO);
    None: the rows are the whole step. With grpo (the matrix's GRPO section) the objective is GRPO's
    (grpo_objective). With targets[DECIDED_KEY] the clip decision of every token is imposed instead of taken (a
    replayed reference). entropy_BT: the actor's entropy per token from the same forward (qualify.ppo.entropy),
    differentiable; read (and judged, as outputs entropy_BT) only with ppo.entropy_coef > 0.
    """
    if grpo is not None:
        if role != "actor":
            raise ValueError(f"GRPO trains the actor alone, not the {role}")
        return grpo_objective(ppo, grpo, scores_BT, mask_BT, targets,
                              share if share is not None else grpo_share(grpo, targets["score_B"], mask_BT), entropy_BT)
    norms = None if share is None else share.normalizers
    scores_BT = scores_BT * mask_BT
    if role == "actor":
        loss, ratio_BT, clip_frac = clipped_policy_loss(scores_BT, targets["old_logprobs_BT"],
                                                        targets["advantages_BT"], mask_BT,
                                                        policy_settings(ppo).low, ppo.token_normalizer,
                                                        ppo.normalizer_constant, targets.get(DECIDED_KEY), norms,
                                                        **policy_clip(ppo, entropy_BT))
        kl_BT = kl_terms(scores_BT.detach(), targets["ref_logprobs_BT"]) * mask_BT
        return loss, {"logprobs_BT": scores_BT.detach(), "ratio_BT": (ratio_BT * mask_BT).detach(), "kl_BT": kl_BT,
                      "kl_mean": masked_mean(kl_BT, mask_BT, "global", normalizers=norms),
                      "clip_frac": clip_frac.detach(), **entropy_output(ppo, entropy_BT, mask_BT)}
    loss, clip_frac = clipped_value_loss(scores_BT, targets["old_values_BT"], targets["returns_BT"], mask_BT,
                                         ppo.value_clip_eps, ppo.token_normalizer, ppo.normalizer_constant,
                                         targets.get(DECIDED_KEY), norms)
    return loss, {"values_BT": scores_BT.detach(), "clip_frac": clip_frac.detach()}


def policy_clip(ppo: Any, entropy_BT: torch.Tensor | None) -> dict[str, Any]:
    """The policy loss's settings beyond its lower clip range: the upper range, the dual clip and the entropy bonus."""
    policy = policy_settings(ppo)
    return {"clip_eps_high": policy.high, "dual_clip_c": policy.dual_c, "entropy_BT": entropy_BT,
            "entropy_coef": policy.entropy_coef}


def entropy_output(ppo: Any, entropy_BT: torch.Tensor | None, mask_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    """{'entropy_BT': the entropy on response tokens, 0 elsewhere} with an entropy bonus, {} without one."""
    if policy_settings(ppo).entropy_coef == 0 or entropy_BT is None:
        return {}
    return {"entropy_BT": torch.where(mask_BT, entropy_BT.detach(), 0.0)}


def rows_of(targets: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    return {k: v[rows] for k, v in targets.items()}


class PPOShare(NamedTuple):
    """What a slice of one PPO step's rows needs from the whole step: its normalizers (advantages, returns and old
    values are the frozen targets' already)."""

    normalizers: Normalizers
    """The whole step's numbers of active tokens and active sequences."""


def ppo_share(mask_BT: torch.Tensor) -> PPOShare:
    """The share of a whole step (single process): the normalizers of these rows themselves."""
    return PPOShare(count_normalizers(mask_BT))


def ppo_dp_share(mask_bT: torch.Tensor, group: Any = None) -> PPOShare:
    """A DP rank's share of a step whose rows it holds a slice of: the normalizers summed over ranks (exact)."""
    return PPOShare(all_reduce_normalizers(count_normalizers(mask_bT), group))


class GRPOShare(NamedTuple):
    """What a slice of one step's rows needs from the whole step: its rows' advantages and the step's normalizers."""

    advantages_B: torch.Tensor
    """(b,) group-relative advantages of the slice's rows, from the whole step's group statistics."""
    normalizers: Normalizers
    """The whole step's numbers of active tokens and active sequences."""


def grpo_share(grpo: Any, rewards_B: torch.Tensor, mask_BT: torch.Tensor) -> GRPOShare:
    """The share of a whole step (single process): group statistics and normalizers of these rows themselves."""
    stats = group_stats(rewards_B, grpo.group_size, grpo.std_estimator)
    advantages_B = group_advantages(rewards_B, stats, grpo.group_size, scale_std=grpo.scale_std, eps=grpo.eps)
    return GRPOShare(advantages_B, count_normalizers(mask_BT))


def grpo_dp_share(grpo: Any, rewards_b: torch.Tensor, mask_bT: torch.Tensor, row_start: int,
                  group: Any = None) -> GRPOShare:
    """A DP rank's share of a step whose rows [row_start, row_start + b) it holds: the step's rewards gathered from
    every rank (a group may straddle ranks), the normalizers summed over ranks (exact integer sums)."""
    rewards_B = all_gather_rewards(rewards_b, group)
    stats = group_stats(rewards_B, grpo.group_size, grpo.std_estimator)
    advantages_b = group_advantages(rewards_b, stats, grpo.group_size, row_start=row_start,
                                    scale_std=grpo.scale_std, eps=grpo.eps)
    return GRPOShare(advantages_b, all_reduce_normalizers(count_normalizers(mask_bT), group))


def grpo_objective(ppo: Any, grpo: Any, logp_BT: torch.Tensor, mask_BT: torch.Tensor,
                   targets: dict[str, torch.Tensor], share: GRPOShare,
                   entropy_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, judged outputs) of GRPO on a slice of a step: qualify.ppo.grpo.grpo_loss with the rollout's logprobs as
    old logprobs, the reference policy's for the KL term, and the share's advantages and normalizers.

    Scalars (loss, policy_loss, kl_mean, clip_frac) are the slice's share: the shares of a step sum to its value.
    """
    logp_BT = torch.where(mask_BT, logp_BT, 0.0)
    ref_BT = targets["ref_logprobs_BT"]
    out = grpo_loss(logp_BT, targets["old_logprobs_BT"], ref_BT, token_advantages(share.advantages_B, mask_BT),
                    mask_BT, clip_eps=policy_settings(ppo).low, kl_coef=grpo.kl_coef, kl_estimator=grpo.kl_estimator,
                    aggregation=grpo.aggregation, normalizers=share.normalizers, constant=grpo.constant,
                    decided_BT=targets.get(DECIDED_KEY), clip_frac=grpo.clip_frac, **policy_clip(ppo, entropy_BT))
    kl_BT = kl_estimate(logp_BT.detach(), ref_BT, mask_BT, grpo.kl_estimator, out.ratio_BT.detach())
    return out.loss, {"logprobs_BT": logp_BT.detach(), "ratio_BT": torch.where(mask_BT, out.ratio_BT, 0.0).detach(),
                      "kl_BT": kl_BT, "kl_mean": out.kl.detach(), "policy_loss": out.policy_loss.detach(),
                      "clip_frac": out.clip_frac.detach(), "advantages_B": share.advantages_B.detach(),
                      "seq_loss_B": out.per_sequence_B.detach(), **entropy_output(ppo, entropy_BT, mask_BT)}
