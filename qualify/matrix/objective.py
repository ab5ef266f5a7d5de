"""What one training step computes: the ppo, grpo and optimizer sections, and the Objective that holds them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qualify.matrix.values import (
    Aggregation,
    Algorithm,
    ClipFrac,
    KLEstimator,
    StdEstimator,
    TokenNormalizer,
    at_least,
    finite,
    positive,
)
from qualify.roles import ACTOR_ONLY, ROLES, Role


@dataclass(kw_only=True, slots=True, frozen=True)
class PPO:
    """PPO objective settings shared by the reference and every candidate."""

    clip_eps: float = 0.2
    """Policy ratio clip range: the ratio is clipped to [1 - clip_eps_low, 1 + clip_eps_high], each clip_eps unless set
    (qualify.ppo.math.policy_settings reads them)."""
    clip_eps_low: float | None = None
    """The lower edge's own range (verl clip_ratio_low): 1 - clip_eps_low, in (0, 1); unset: clip_eps."""
    clip_eps_high: float | None = None
    """The upper edge's own range (verl clip_ratio_high, TRL epsilon_high, DAPO's clip-higher): 1 + clip_eps_high;
    unset: clip_eps."""
    dual_clip_c: float | None = None
    """Dual clip (verl clip_ratio_c): a negative-advantage token's loss is at most -A x dual_clip_c, > 1; unset: off."""
    entropy_coef: float = 0.0
    """Entropy bonus (verl entropy_coeff): the policy loss less entropy_coef x the entropy of the full-vocabulary
    sampler distribution (logits / temperature) at each response token, aggregated as the policy loss; 0: off."""
    value_clip_eps: float = 0.2
    """Value clip range around the old values."""
    gamma: float = 1.0
    """Discount."""
    lam: float = 0.95
    """GAE lambda."""
    kl_coef: float = 0.05
    """Per-token KL penalty folded into rewards."""
    token_normalizer: TokenNormalizer = "global"
    """How token losses are averaged: over all active tokens, per sequence then mean, or by a constant."""
    normalizer_constant: float | None = None
    """Divisor when token_normalizer is 'constant'."""
    epochs: int = 1
    """Passes over the fixed rollout; K = epochs x minibatches optimizer steps (old logprobs stay the rollout's)."""
    minibatches: int = 1
    """Contiguous, equal slices of the rollout's rows per epoch, one optimizer step each."""
    whiten_advantages: bool = False
    """Whiten the GAE advantages over the rollout's response tokens, after the returns are made from them (verl's
    default: (A - mean) / sqrt(var + 1e-8), var unbiased); false keeps them as GAE gives them."""

    def __post_init__(self) -> None:
        finite(self)
        at_least(self, 1, "epochs", "minibatches")
        positive(self, "clip_eps", "value_clip_eps")
        at_least(self, 0, "kl_coef", "entropy_coef")
        if self.clip_eps_low is not None and not 0 < self.clip_eps_low < 1:
            raise ValueError(f"clip_eps_low must be in (0, 1) (the lower edge 1 - clip_eps_low is a positive ratio), "
                             f"got {self.clip_eps_low}")
        if self.clip_eps_high is not None and not self.clip_eps_high > 0:
            raise ValueError(f"clip_eps_high must be > 0, got {self.clip_eps_high}")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1:
            raise ValueError(f"dual_clip_c must be > 1 (the dual clip bounds a ratio above 1; null turns it off), got "
                             f"{self.dual_clip_c}")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if (self.token_normalizer == "constant") != (self.normalizer_constant is not None):
            raise ValueError("normalizer_constant is required with token_normalizer 'constant' and only then")
        if self.normalizer_constant is not None and self.normalizer_constant <= 0:
            raise ValueError(f"normalizer_constant must be > 0, got {self.normalizer_constant}")


PPO_ADDED = {"clip_eps_low": None, "clip_eps_high": None, "dual_clip_c": None, "entropy_coef": 0.0}
"""PPO fields added after references and cases were sealed, with the values that leave the objective as it was."""


def ppo_as_before(ppo: dict[str, Any]) -> dict[str, Any]:
    """A ppo section's plain data (schema.to_dict) without the PPO_ADDED fields that hold their defaults: what the
    scoring fingerprint and a case's spec take, so that an unchanged matrix's fingerprint and resume keys read as
    before those fields existed (a sealed snapshot reads them as their defaults: acceptance.read_snapshot)."""
    return {k: v for k, v in ppo.items() if not (k in PPO_ADDED and v == PPO_ADDED[k])}


@dataclass(kw_only=True, slots=True, frozen=True)
class GRPO:
    """GRPO settings (algorithm: grpo): group-relative advantages, KL to the reference policy in the loss, and the
    loss aggregation. The ppo section's policy clip (clip_eps, clip_eps_low, clip_eps_high, dual_clip_c), entropy_coef,
    epochs and minibatches apply to GRPO too; nothing else of it does."""

    group_size: int
    """Responses per prompt: vLLM samples each prompt group_size times (each response with its own seed); a group
    is group_size contiguous rows, and the batch holds rollout.num_prompts x group_size rows."""
    scale_std: bool = True
    """true: advantages (r - group mean) / (group std + eps) (GRPO); false: r - group mean (Dr. GRPO)."""
    std_estimator: StdEstimator = "unbiased"
    """Group std: 'unbiased' (divides by n - 1, as TRL and verl) or 'population' (by n)."""
    eps: float = 1.0e-6
    """Added to the group std before dividing."""
    kl_estimator: KLEstimator = "k3"
    """Per-token KL(policy || reference) estimator in the loss: k1 (log ratio), k2 (half its square), k3 (Schulman's),
    k3_ratio (k3 times the differentiable ratio to the old policy: TRL's use_bias_correction_kl)."""
    kl_coef: float = 0.04
    """Coefficient of the KL term in the loss (0: no KL term)."""
    clip_frac: ClipFrac = "loss_weighted"
    """The reported clip fraction: 1[clipped] aggregated as the loss is ('loss_weighted'), or its mean over the step's
    active tokens ('token_mean', as verl and TRL report it under every aggregation)."""
    aggregation: Aggregation = "token_mean"
    """How per-token losses become the loss: 'token_mean' (over the global active tokens), 'seq_mean_token_mean'
    (mean over sequences of each sequence's token mean), 'seq_mean_token_sum_norm' (Dr. GRPO: each sequence's token
    sum over a fixed constant, then the mean over sequences)."""
    constant: float | None = None
    """The Dr. GRPO constant (for example the longest response): required with seq_mean_token_sum_norm, only then."""

    def __post_init__(self) -> None:
        finite(self)
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (a group of one has no relative advantage), got "
                             f"{self.group_size}")
        positive(self, "eps")
        at_least(self, 0, "kl_coef")
        if (self.aggregation == "seq_mean_token_sum_norm") != (self.constant is not None):
            raise ValueError("constant is required with aggregation 'seq_mean_token_sum_norm' and only then "
                             f"(aggregation is {self.aggregation!r}, constant {self.constant})")
        if self.constant is not None and not self.constant > 0:
            raise ValueError(f"constant must be > 0, got {self.constant}")


@dataclass(kw_only=True, slots=True, frozen=True)
class Optimizer:
    """AdamW settings of the single optimizer step."""

    lr: float = 1e-3
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip (0: no clipping)."""

    def __post_init__(self) -> None:
        finite(self)
        positive(self, "lr", "eps")
        at_least(self, 0, "weight_decay", "max_grad_norm")
        for i, beta in enumerate(self.betas):
            if not 0 <= beta < 1:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {beta}")


@dataclass(kw_only=True, slots=True, frozen=True)
class Objective:
    """What one training step computes: the algorithm with its PPO and GRPO settings, and AdamW. The reference's step,
    the decisions, the loss terms and the judge's derivations read this section of the matrix, never the whole of it
    (Matrix.objective makes it)."""

    algorithm: Algorithm
    ppo: PPO
    grpo: GRPO | None
    optimizer: Optimizer

    @property
    def roles(self) -> tuple[Role, ...]:
        """The trained roles: actor and critic under ppo, the actor alone under grpo."""
        return ACTOR_ONLY if self.algorithm == "grpo" else ROLES

