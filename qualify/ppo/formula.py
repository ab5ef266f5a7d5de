"""The logprob formula a candidate declares (candidates.logprob_formula) and the per-token logprobs it names.

'full' is log_softmax over the whole vocabulary (what trainers compute; qualify.ppo.logprob.sampler_logprobs).
'processed' is vLLM's: renormalized over the tokens the rollout's min-p/top-k/top-p keep
(qualify.ppo.logprob.processed_logprobs). With truncation off the two are bitwise the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qualify.ppo.logprob import processed_logprobs, sampler_logprobs, truncation_is_off

FORMULAS = ("full", "processed")
PROCESSED_KEY = "logprobs_processed_BT"
"""The reference's output holding the processed formula of the current policy (recorded when the sampling truncates;
otherwise it is bitwise outputs/logprobs_BT, which stands for it)."""


@dataclass(frozen=True, slots=True)
class Sampling:
    """The rollout's sampling settings the processed formula applies."""

    temperature: float
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0

    def truncates(self, vocab_size: int) -> bool:
        """Whether some token is ever cut, i.e. whether processed can differ from full."""
        return not truncation_is_off(vocab_size, self.top_k, self.top_p, self.min_p)


def rollout_sampling(rollout: Any) -> Sampling:
    """The Sampling of a matrix's rollout section (qualify.matrix.Rollout)."""
    return Sampling(temperature=rollout.temperature, top_k=rollout.top_k, top_p=rollout.top_p, min_p=rollout.min_p)


@torch.no_grad()
def formula_logprobs(logits_BTV: torch.Tensor, tokens_BT: torch.Tensor, formula: str, sampling: Sampling,
                     chunk_tokens: int, vocab_size: int) -> torch.Tensor:
    """(B, T) fp32 logprobs of tokens_BT under the named formula, no gradient.

        full       log_softmax(fp32(z[:V]) / T)[token]                     bitwise sampler_logprobs
        processed  log_softmax over the kept set [token]                   bitwise processed_logprobs
                   full - log_kept_mass for a token outside the kept set   (vLLM would give -inf)
    A policy that has moved off the rollout's (a later step, another precision) can drop a rollout token from its
    kept set; the finite value log(p(token) / P(kept set)) keeps such a token measurable instead of an -inf that no
    bound can judge.
    """
    assert formula in FORMULAS, formula
    if formula == "full":
        return sampler_logprobs(logits_BTV, tokens_BT, sampling.temperature, chunk_tokens, vocab_size)
    ev = processed_logprobs(logits_BTV, tokens_BT, temperature=sampling.temperature, top_k=sampling.top_k,
                            top_p=sampling.top_p, min_p=sampling.min_p, chunk_tokens=chunk_tokens,
                            vocab_size=vocab_size)
    return torch.where(torch.isinf(ev.processed), ev.full - ev.log_kept_mass, ev.processed)
