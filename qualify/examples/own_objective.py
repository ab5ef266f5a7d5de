"""An engine that brings its own PPO objective, written from the formulas (not with qualify.ppo).

Name it in a matrix as `qualify.examples.own_objective:engine`. It is the torch-tp engine plus an
`objective()` hook: the worker then judges this loss code (its normalizer, masking, clipping and
KL) against the reference's instead of computing the loss itself. A team qualifies its trainer's
real loss the same way: implement objective() by calling that code.

    ratio_t   = exp(logp_t - logp_old_t)
    policy_t  = max(-A_t ratio_t, -A_t clip(ratio_t, 1 - eps, 1 + eps))
    value_t   = 1/2 max((v_t - R_t)^2, (v_old_t + clip(v_t - v_old_t, -eps_v, eps_v) - R_t)^2)
    loss      = reduce(term_t over response tokens), reduce = the matrix's token normalizer
    clip_frac = reduce(1[clipped term > unclipped term]),  kl_t = logp_t - logp_ref_t

On a DP rank (or whenever the worker gives it, DP1 included) the hook takes `share`: its `normalizers` are the
whole step's numbers of active tokens and of sequences with one, summed over the DP ranks, and reduce divides by
them instead of its own rows' counts. Each rank's loss is then its share of the step's, as the engine's DP gradient
sum requires.
"""

from __future__ import annotations

from typing import Any

import torch

from qualify.engines.torch_tp import TorchTPEngine


def reduce_tokens(x_BT: torch.Tensor, mask_BT: torch.Tensor, normalizer: str, constant: float | None,
                  counts: Any = None) -> torch.Tensor:
    """Average x over response tokens: all of them ('global'), per sequence then over sequences, or / constant.
    counts: the step's (num_active_tokens, num_active_sequences) when these rows are a slice of it; None: these
    rows' own."""
    x_BT = torch.where(mask_BT, x_BT, torch.zeros_like(x_BT))
    tokens, sequences = (int(mask_BT.sum()), int(mask_BT.any(dim=1).sum())) if counts is None else map(int, counts)
    if normalizer == "global":
        return x_BT.sum() / max(tokens, 1)
    if normalizer == "constant":
        return x_BT.sum() / constant
    count_B = mask_BT.sum(dim=1)
    seq_B = x_BT.sum(dim=1) / count_B.clamp(min=1)
    return (seq_B * (count_B > 0)).sum() / max(sequences, 1)


class OwnObjectiveEngine(TorchTPEngine):
    """torch-tp with its own loss code (see module docstring)."""

    name = "own-objective"

    def reduce(self, x_BT: torch.Tensor, mask_BT: torch.Tensor, normalizer: str,
               constant: float | None, counts: Any = None) -> torch.Tensor:
        return reduce_tokens(x_BT, mask_BT, normalizer, constant, counts)

    def normalizer(self, ppo: Any) -> tuple[str, float | None]:
        return ppo.token_normalizer, ppo.normalizer_constant

    def policy_clip(self, ppo: Any) -> float:
        return ppo.clip_eps

    def value_terms(self, values_BT, old_BT, returns_BT, ppo) -> tuple[torch.Tensor, torch.Tensor]:
        clipped_BT = old_BT + (values_BT - old_BT).clamp(-ppo.value_clip_eps, ppo.value_clip_eps)
        return (values_BT - returns_BT).square(), (clipped_BT - returns_BT).square()

    def objective(self, role: str, ppo: Any, scores_BT: torch.Tensor, mask_BT: torch.Tensor,
                  targets: dict[str, torch.Tensor], *, share: Any = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        normalizer, constant = self.normalizer(ppo)
        counts = None if share is None else share.normalizers
        zero = torch.zeros_like(scores_BT)
        scores_BT = torch.where(mask_BT, scores_BT, zero)
        if role == "actor":
            eps = self.policy_clip(ppo)
            adv_BT = torch.where(mask_BT, targets["advantages_BT"], zero)
            ratio_BT = torch.exp(torch.where(mask_BT, scores_BT - targets["old_logprobs_BT"], zero))
            plain_BT, clipped_BT = -adv_BT * ratio_BT, -adv_BT * ratio_BT.clamp(1 - eps, 1 + eps)
            loss = self.reduce(torch.maximum(plain_BT, clipped_BT), mask_BT, normalizer, constant, counts)
            clip_frac = self.reduce((clipped_BT > plain_BT).float(), mask_BT, normalizer, constant, counts)
            kl_BT = torch.where(mask_BT, scores_BT.detach() - targets["ref_logprobs_BT"], zero)
            return loss, {"logprobs_BT": scores_BT.detach(), "ratio_BT": torch.where(mask_BT, ratio_BT, zero).detach(),
                          "kl_BT": kl_BT, "kl_mean": self.reduce(kl_BT, mask_BT, "global", None, counts),
                          "clip_frac": clip_frac.detach()}
        old_BT = torch.where(mask_BT, targets["old_values_BT"], zero)
        returns_BT = torch.where(mask_BT, targets["returns_BT"], zero)
        plain_BT, clipped_BT = self.value_terms(scores_BT, old_BT, returns_BT, ppo)
        loss = self.reduce(0.5 * torch.maximum(plain_BT, clipped_BT), mask_BT, normalizer, constant, counts)
        clip_frac = self.reduce((clipped_BT > plain_BT).float(), mask_BT, normalizer, constant, counts)
        return loss, {"values_BT": scores_BT.detach(), "clip_frac": clip_frac.detach()}


def engine() -> OwnObjectiveEngine:
    return OwnObjectiveEngine()
