"""PPO numerics as small pure functions on tensors: the objective (math) and sampler logprobs (logprob)."""

from qualify.ppo.logprob import SamplerLogprob, naive_sampler_logprobs, sampler_logprobs
from qualify.ppo.math import (
    NORMALIZERS,
    clipped_policy_loss,
    clipped_value_loss,
    kl_terms,
    last_active_index,
    masked_gae,
    masked_mean,
    masked_sum,
    token_rewards,
)

__all__ = [
    "NORMALIZERS",
    "SamplerLogprob",
    "clipped_policy_loss",
    "clipped_value_loss",
    "kl_terms",
    "last_active_index",
    "masked_gae",
    "masked_mean",
    "masked_sum",
    "naive_sampler_logprobs",
    "sampler_logprobs",
    "token_rewards",
]
