"""The PPO objective per role and the optimizer-step schedule, shared by the reference and the candidates.

A case is K = epochs x minibatches optimizer steps over the fixed rollout: epoch e, minibatch m
is step k = e * minibatches + m and trains on a contiguous slice of the rows. Old logprobs stay
the rollout's and advantages, returns and old values stay the frozen targets', so from step 1 on
the policy is off the rollout's and the ratio, the clips and Adam's later steps are exercised.
"""

from __future__ import annotations

from typing import Any

import torch

from qualify.ppo.math import clipped_policy_loss, clipped_value_loss, kl_terms, masked_mean


def step_rows(num_rows: int, epochs: int, minibatches: int) -> list[slice]:
    """Rows trained at each optimizer step, in order: epochs x minibatches contiguous, equal slices."""
    if epochs < 1 or minibatches < 1 or num_rows % minibatches:
        raise ValueError(f"{num_rows} rows do not split into {minibatches} equal minibatches (epochs {epochs})")
    size = num_rows // minibatches
    return [slice(m * size, (m + 1) * size) for _ in range(epochs) for m in range(minibatches)]


def role_objective(role: str, ppo: Any, scores_BT: torch.Tensor, mask_BT: torch.Tensor,
                   targets: dict[str, torch.Tensor], normalizer: str | None = None,
                   constant: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, judged outputs) of one role on one (mini)batch; targets are already sliced to its rows.

    scores_BT are the actor's sampler-formula logprobs or the critic's values; the normalizer (and
    its constant) default to the matrix's, and a micro-batch control passes its own.
    """
    if normalizer is None:
        normalizer, constant = ppo.token_normalizer, ppo.normalizer_constant
    scores_BT = scores_BT * mask_BT
    if role == "actor":
        loss, ratio_BT, clip_frac = clipped_policy_loss(scores_BT, targets["old_logprobs_BT"],
                                                        targets["advantages_BT"], mask_BT, ppo.clip_eps,
                                                        normalizer, constant)
        kl_BT = kl_terms(scores_BT.detach(), targets["ref_logprobs_BT"]) * mask_BT
        return loss, {"logprobs_BT": scores_BT.detach(), "ratio_BT": (ratio_BT * mask_BT).detach(), "kl_BT": kl_BT,
                      "kl_mean": masked_mean(kl_BT, mask_BT, "global"), "clip_frac": clip_frac.detach()}
    loss, clip_frac = clipped_value_loss(scores_BT, targets["old_values_BT"], targets["returns_BT"], mask_BT,
                                         ppo.value_clip_eps, normalizer, constant)
    return loss, {"values_BT": scores_BT.detach(), "clip_frac": clip_frac.detach()}


def rows_of(targets: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    return {k: v[rows] for k, v in targets.items()}
