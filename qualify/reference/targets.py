"""PPO targets of the fixed rollout, computed once in fp32 and then frozen.

Behaviour logprobs are the sampler's own (vLLM's processed logprobs), so the ratio measures the
train-vs-rollout policy. Reference-policy logprobs, old values and rewards come from the frozen
HF models in fp32; advantages and returns come from masked GAE. Every candidate replays exactly
these targets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qualify.matrix import Matrix
from qualify.ppo.math import masked_gae, token_rewards
from qualify.reference.hf import actor_logprobs, critic_values, load_model, reward_scores

TARGETS_FILE = "targets.safetensors"


@torch.no_grad()
def compute_targets(matrix: Matrix, models: dict[str, Path], rollout: dict[str, torch.Tensor],
                    vocab_size: int) -> dict[str, torch.Tensor]:
    """Reference logprobs, rewards, old values, advantages and returns (all fp32, (B, T) or (B,))."""
    ids_BT, mask_BT = rollout["input_ids_BT"], rollout["response_mask_BT"]
    old_logp_BT = rollout["sampler_logprobs_BT"]
    ref = load_model(models["reference"], "reference")
    ref_logp_BT = actor_logprobs(ref, ids_BT, matrix.rollout.temperature, matrix.reference.logprob_chunk_tokens,
                                 vocab_size) * mask_BT
    score_B = reward_scores(load_model(models["reward"], "reward"), ids_BT, mask_BT)
    old_values_BT = critic_values(load_model(models["critic"], "critic"), ids_BT) * mask_BT
    rewards_BT = token_rewards(score_B, old_logp_BT, ref_logp_BT, mask_BT, matrix.ppo.kl_coef)
    advantages_BT, returns_BT = masked_gae(rewards_BT, old_values_BT, mask_BT, matrix.ppo.gamma, matrix.ppo.lam)
    return {"old_logprobs_BT": old_logp_BT, "ref_logprobs_BT": ref_logp_BT, "score_B": score_B,
            "old_values_BT": old_values_BT, "rewards_BT": rewards_BT, "advantages_BT": advantages_BT,
            "returns_BT": returns_BT}


def targets_meta(matrix: Matrix, rollout_digest: str) -> dict[str, Any]:
    """What the targets were computed from."""
    p = matrix.ppo
    return {"rollout_digest": rollout_digest, "kl_coef": p.kl_coef, "gamma": p.gamma, "lam": p.lam,
            "behaviour_logprobs": "vLLM processed_logprobs", "precision": "fp32"}
