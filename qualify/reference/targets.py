"""PPO targets of the fixed rollout, computed once in fp32 and then frozen (GRPO: logprobs and rewards only).

Behaviour logprobs are the sampler's own (vLLM's processed logprobs), so the ratio measures the
train-vs-rollout policy. Reference-policy logprobs, old values and rewards come from the frozen
HF models in fp32; advantages and returns come from masked GAE. Every candidate replays exactly
these targets.

The targets also hold the actor's own logprobs of the rollout tokens under the rollout's sampling
settings, as evidence: the processed formula (vLLM's, renormalized over the tokens that survive
min-p/top-k/top-p), the full formula, the log kept mass and the kept-set size. decompose_mismatch
splits a train-vs-rollout mismatch into numerical error and the truncation term with them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qualify.matrix import Objective, Reference, Rollout
from qualify.models.hf import actor_logprobs, critic_values, load_model, reward_scores
from qualify.models.routing import NO_ROUTE, own_routes_BTLK, replayed_routes, routing
from qualify.ppo.logprob import processed_logprobs
from qualify.ppo.math import masked_gae, token_rewards, whiten_advantages

TARGETS_FILE = "targets.safetensors"
KEPT_SET_FLOOR = 1e-4
"""A processed-logprob delta beyond this (50 x the 2e-6 fp32 agreement of vLLM and the reference), and beyond
10 x the precision's own deviation from the fp32 reference, is a kept-set difference, not numerical error."""


@torch.no_grad()
def compute_targets(objective: Objective, reference: Reference, sampling: Rollout, models: dict[str, Path],
                    rollout: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """Reference logprobs, rewards, old values, advantages and returns (all fp32, (B, T) or (B,)), and the
    actor's sampler evidence (sampler_evidence). The forwards run where the reference's runs do (reference.device: a
    GPU when there is one), the GAE and rewards on the host."""
    ids_BT, mask_BT = rollout["input_ids_BT"], rollout["response_mask_BT"]
    old_logp_BT = rollout["sampler_logprobs_BT"]
    device = scoring_device(reference)
    ids, mask = ids_BT.to(device), mask_BT.to(device)
    ref_logp_BT = (actor_logprobs(_on(models["reference"], "reference", device), ids, sampling.temperature,
                                  reference.logprob_chunk_tokens, vocab_size) * mask).cpu()
    score_B = reward_scores(_on(models["reward"], "reward", device), ids, mask).cpu()
    if objective.algorithm == "grpo":  # no critic, no GAE: the objective makes group-relative advantages of score_B
        return {"old_logprobs_BT": old_logp_BT, "ref_logprobs_BT": ref_logp_BT, "score_B": score_B} \
            | sampler_evidence(reference, sampling, models["actor"], rollout, vocab_size)
    old_values_BT = (critic_values(_on(models["critic"], "critic", device), ids) * mask).cpu()
    p = objective.ppo
    rewards_BT = token_rewards(score_B, old_logp_BT, ref_logp_BT, mask_BT, p.kl_coef)
    advantages_BT, returns_BT = masked_gae(rewards_BT, old_values_BT, mask_BT, p.gamma, p.lam)
    if p.whiten_advantages:  # after the returns are made from the raw advantages, as verl does
        advantages_BT = whiten_advantages(advantages_BT, mask_BT)
    return {"old_logprobs_BT": old_logp_BT, "ref_logprobs_BT": ref_logp_BT, "score_B": score_B,
            "old_values_BT": old_values_BT, "rewards_BT": rewards_BT, "advantages_BT": advantages_BT,
            "returns_BT": returns_BT} | sampler_evidence(reference, sampling, models["actor"], rollout, vocab_size)


def scoring_device(reference: Reference) -> torch.device:
    """Where the targets' forwards run: the reference's device, as its runs' (qualify.case.ranks.device_of)."""
    from qualify.case.ranks import device_of

    return torch.device(device_of(reference))


def _on(model_dir: Path, role: str, device: torch.device) -> torch.nn.Module:
    """The role's fp32 model on device."""
    return load_model(model_dir, role).to(device)


def sampler_evidence(reference: Reference, sampling: Rollout, actor_dir: Path, rollout: dict[str, torch.Tensor],
                     vocab_size: int) -> dict[str, torch.Tensor]:
    """The fp32 actor's logprobs of the rollout tokens under the rollout's sampling settings, (B, T) each:

        processed_logprobs_BT  vLLM's processed formula (-inf: the token is outside the reference's kept set)
        full_logprobs_BT       the full-vocabulary formula (what a trainer computes)
        log_kept_mass_BT       log of the kept set's full-vocabulary probability (0: nothing cut)
        kept_size_BT           int64 size of the kept set
    Response positions only; every other position is 0. A MoE actor's forward replays the rollout's routes when
    rollout.routing is replay, and its own routes are kept (actor_routes_BTLK: the reference's routing at the
    rollout's weights, -1 where the rollout fed no token), for the routing agreement with the rollout.
    """
    r, device = sampling, scoring_device(reference)
    ids_BT, mask_BT = rollout["input_ids_BT"], rollout["response_mask_BT"]
    actor, own = _on(actor_dir, "actor", device), []
    with routing(actor, replayed_routes(sampling, "actor", rollout), own):
        logits_BTV = actor(input_ids=ids_BT.to(device), use_cache=False).logits
    routes = {}
    if "routes_BTLK" in rollout:
        fed = rollout["routes_BTLK"] != NO_ROUTE
        routes["actor_routes_BTLK"] = torch.where(fed, own_routes_BTLK(own, *ids_BT.shape), NO_ROUTE)
    evidence = processed_logprobs(logits_BTV[:, :-1], ids_BT[:, 1:].to(device), temperature=r.temperature,
                                  top_k=r.top_k, top_p=r.top_p, min_p=r.min_p,
                                  chunk_tokens=reference.logprob_chunk_tokens, vocab_size=vocab_size)
    # logp[:, t] scores token t from the logits at t - 1; position 0 has no context.
    return {f"{name}_BT": torch.where(mask_BT, torch.nn.functional.pad(x_BT.cpu(), (1, 0)), 0)
            for name, x_BT in zip(("processed_logprobs", "full_logprobs", "log_kept_mass", "kept_size"), evidence,
                                  strict=True)} | routes


def targets_meta(objective: Objective, sampling: Rollout, rollout_digest: str) -> dict[str, Any]:
    """What the targets were computed from."""
    p, r, g = objective.ppo, sampling, objective.grpo
    grpo = {} if g is None else {"algorithm": "grpo", "group_size": g.group_size,
                                 "rewards": "score_B: the reward model's score of each row (fp32)"}
    return grpo | {"rollout_digest": rollout_digest, "kl_coef": p.kl_coef, "gamma": p.gamma, "lam": p.lam,
            "behaviour_logprobs": "vLLM processed_logprobs", "precision": "fp32",
            "sampling": {"temperature": r.temperature, "top_k": r.top_k, "top_p": r.top_p, "min_p": r.min_p},
            "processed_formula": "qualify.ppo.logprob.processed_logprobs: vLLM's CPU sampler order (temperature, "
                                 "min-p, top-k, top-p), renormalized log_softmax over the kept set, fp32"}


def _stats(delta_N: torch.Tensor) -> dict[str, Any]:
    """max and mean of |delta| (None when there is no token to measure)."""
    if not delta_N.numel():
        return {"max_abs": None, "mean_abs": None}
    return {"max_abs": float(delta_N.abs().max()), "mean_abs": float(delta_N.abs().mean())}


def decompose_mismatch(sampler_N: torch.Tensor, processed_N: torch.Tensor, full_N: torch.Tensor,
                       where_N2: torch.Tensor, limit: float) -> dict[str, Any]:
    """Train-vs-rollout mismatch over N response tokens, split into numerical error and the truncation term.

        total       sampler - full        what a trainer computing the full formula sees
        numerical   sampler - processed   the same formula on both sides: numerical error only
        truncation  full - processed      the sampling definition (log kept mass; 0 when nothing is cut)
    A token is a kept-set difference when the reference's kept set lacks it (processed -inf) or its
    numerical delta exceeds limit; those are counted and listed (row, position, both logprobs) and
    left out of the numerical and truncation statistics, which they would swamp. where_N2 holds each
    token's (row, position). num_tokens, num_not_bitwise, max_abs, mean_abs are the numerical ones.
    """
    numerical_N = sampler_N - processed_N
    differs_N = torch.isinf(processed_N) | (numerical_N.abs() > limit)
    agree_N = ~differs_N
    listed = [{"row": int(b), "position": int(t), "sampler": float(s),
               "processed": float(p) if torch.isfinite(p) else None}
              for (b, t), s, p in zip(where_N2[differs_N].tolist(), sampler_N[differs_N], processed_N[differs_N],
                                      strict=True)]
    return {"num_tokens": int(sampler_N.numel()), "num_not_bitwise": int((sampler_N != processed_N).sum()),
            **_stats(numerical_N[agree_N]),
            "total": {"num_not_bitwise": int((sampler_N != full_N).sum()), **_stats(sampler_N - full_N)},
            "truncation": {"num_truncated": int((full_N[agree_N] != processed_N[agree_N]).sum()),
                           **_stats(full_N[agree_N] - processed_N[agree_N])},
            "kept_set_differs": {"count": len(listed), "limit": limit, "tokens": listed}}


def foreign_tokens(mismatch: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Rollout tokens whose recorded sampler logprob no scored precision of the reference gives: inside the
    reference's kept set, yet beyond the kept-set limit in every precision (decompose_mismatch). A token sampled by
    these weights is within the limit of at least the precision nearest the rollout's; a token changed after
    sampling (or sampled from other weights) is not. Tokens outside the kept set are left alone: under truncation a
    token at the kept set's edge may fall on either side."""
    if not mismatch:
        return []
    far = [{(t["row"], t["position"]) for t in mm["kept_set_differs"]["tokens"] if t["processed"] is not None}
           for mm in mismatch.values()]
    common = set.intersection(*far)
    first = next(iter(mismatch.values()))["kept_set_differs"]["tokens"]
    return [t for t in first if (t["row"], t["position"]) in common]
