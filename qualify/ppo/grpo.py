"""GRPO numerics on padded (B, T) tensors, DP-aware: group-relative advantages, KL estimators, the clipped
surrogate with a KL term, and the loss aggregations, each taking its global normalizers as arguments.

Conventions as in qualify.ppo.math: masks are bool (B, T), True on active (response) tokens; inactive
positions never influence a value or a gradient (inputs are zeroed with torch.where before arithmetic).
B = num_groups x group_size, a group being group_size contiguous rows (one prompt's responses).

Data parallelism: a DP rank holds a contiguous slice of whole rows (dp_slices). Everything that reduces
over the batch takes the *global* quantities explicitly (GroupStats from the global rewards, the global
numbers of active tokens and of sequences with an active token), so a rank's loss is exactly its rows'
share of the global loss: every per-sequence contribution and every gradient is bitwise the single-process
one, and the sum of the ranks' losses equals the single-process loss up to the rounding of that final sum.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from qualify.errors import QualifyError
from qualify.ppo.math import check_mode, clipped_surrogate, less_entropy
from qualify.ppo.share import Normalizers, count_normalizers  # noqa: F401  (re-exported: their home is ppo.share)
from qualify.ppo.vocab_parallel import tree_sum

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "k3_ratio")
CLIP_FRACS = ("loss_weighted", "token_mean")
STD_ESTIMATORS = ("population", "unbiased")


class DataParallelError(QualifyError):
    """A batch cannot be split over the requested data-parallel ranks."""


def dp_slices(num_rows: int, dp: int) -> list[slice]:
    """Contiguous row slices of DP ranks 0..dp-1: rank r holds rows [r * B/dp, (r + 1) * B/dp).

    Raises DataParallelError when dp does not divide num_rows: a trailing row is never dropped.
    """
    if dp < 1:
        raise DataParallelError(f"dp must be >= 1, got {dp}")
    if num_rows % dp:
        raise DataParallelError(
            f"{num_rows} sequences do not split evenly over dp={dp} ranks "
            f"({num_rows % dp} would be left over); use a batch size that dp divides"
        )
    rows = num_rows // dp
    return [slice(r * rows, (r + 1) * rows) for r in range(dp)]


# --- group-relative advantages ----------------------------------------------------------------------------


class GroupStats(NamedTuple):
    """Statistics of each group's rewards, computed once from the global (B,) rewards; every field is (G,)."""

    mean: torch.Tensor
    """mean_g = (1/n) sum_{i in g} r_i."""
    std: torch.Tensor
    """population sqrt((1/n) sum (r_i - mean_g)^2) or unbiased sqrt((1/(n-1)) sum (...)^2)."""
    identical: torch.Tensor
    """bool: every reward of the group is bitwise the same (its advantages are exactly 0)."""


def group_stats(rewards_B: torch.Tensor, group_size: int, std_estimator: str = "unbiased") -> GroupStats:
    """Per-group mean, std and 'identical' flag of the global rewards (B,), groups = contiguous rows.

    Two-pass: the mean first, then the sum of squared deviations from it, divided by n (population) or
    n - 1 (unbiased, Bessel; TRL's and verl's choice). A constant group's mean need not round back to its
    value, so its std may be a tiny non-zero: the 'identical' flag, not the std, marks it. 'unbiased' with
    group_size 1 has no defined std: it gives std = 0 (the group is identical anyway).
    """
    if std_estimator not in STD_ESTIMATORS:
        raise ValueError(f"unknown std_estimator {std_estimator!r}; known: {', '.join(STD_ESTIMATORS)}")
    num_rows = rewards_B.shape[0]
    if group_size < 1 or num_rows % group_size:
        raise ValueError(f"{num_rows} rewards do not form whole groups of {group_size}")
    r_GN = rewards_B.reshape(num_rows // group_size, group_size)
    mean_G = r_GN.mean(-1)
    sq_dev_G = ((r_GN - mean_G[:, None]) ** 2).sum(-1)
    dof = group_size - 1 if std_estimator == "unbiased" else group_size
    std_G = (sq_dev_G / max(dof, 1)).sqrt()
    identical_G = (r_GN == r_GN[:, :1]).all(-1)
    return GroupStats(mean=mean_G, std=std_G, identical=identical_G)


def all_gather_rewards(rewards_b: torch.Tensor, group=None) -> torch.Tensor:
    """The global rewards (B,) from every DP rank's contiguous slice (b,), in rank order (one all_gather).

    Rewards are B numbers: gathering them and computing group_stats on every rank is exact and cheap, where
    all-reducing sums of rewards and of their squares would round differently from the single process.
    """
    import torch.distributed as dist

    parts = [torch.empty_like(rewards_b) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, rewards_b.contiguous(), group=group)
    return torch.cat(parts)


def group_advantages(
    rewards_b: torch.Tensor,
    stats: GroupStats,
    group_size: int,
    *,
    row_start: int = 0,
    scale_std: bool,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages (b,) of the rows [row_start, row_start + b) of the global batch.

        A_i = r_i - mean_g(i)                        scale_std False (Dr. GRPO)
        A_i = (r_i - mean_g(i)) / (std_g(i) + eps)   scale_std True  (GRPO)
        A_i = 0 exactly when every reward of g(i) is the same (never NaN, never a rounding residue)

    with g(i) = (row_start + i) // group_size. eps (default 1e-6; TRL uses 1e-4) keeps a near-constant group
    finite. stats come from group_stats over the *global* rewards (all_gather_rewards on DP ranks): a
    group may straddle DP ranks, and normalizing it with a rank's own rows would be a different objective.
    Single process: row_start 0 and the whole batch.
    """
    group_b = (torch.arange(rewards_b.shape[0], device=rewards_b.device) + row_start) // group_size
    centred_b = rewards_b - stats.mean[group_b]
    if scale_std:
        centred_b = centred_b / (stats.std[group_b] + eps)
    # The mean of n equal floats need not round back to them (0.1 * 3 / 3), so a constant group is
    # zeroed explicitly rather than left with a 1e-17 / eps residue.
    return torch.where(stats.identical[group_b], 0.0, centred_b)


def token_advantages(advantages_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Broadcast sequence advantages (B,) to tokens (B, T): A[b, t] = A[b] on active tokens, 0 elsewhere."""
    return torch.where(mask_BT, advantages_B[:, None], 0.0)


# --- KL to the reference policy ------------------------------------------------------------------------------


def kl_estimate(
    logp_BT: torch.Tensor, logp_ref_BT: torch.Tensor, mask_BT: torch.Tensor, estimator: str,
    ratio_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimator (B, T) of KL(policy || ref) for tokens sampled from the policy; 0 off the mask.

    With d = logp_ref - logp:
        k1 = -d                    (unbiased, can be negative)        d k1 / d logp = 1
        k2 = 0.5 d^2               (biased, >= 0)                      d k2 / d logp = -d
        k3 = exp(d) - d - 1        (unbiased, >= 0; Schulman's k3)     d k3 / d logp = 1 - exp(d)
        k3_ratio = k3 x ratio      (TRL's use_bias_correction_kl: k3 importance-weighted by ratio_BT =
                                    exp(logp - logp_old), which stays differentiable: the tokens were sampled
                                    from the old policy)
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}")
    if estimator == "k3_ratio":
        if ratio_BT is None:
            raise ValueError("the k3_ratio KL estimator needs the ratio exp(logp - logp_old)")
        return kl_estimate(logp_BT, logp_ref_BT, mask_BT, "k3") * torch.where(mask_BT, ratio_BT, 0.0)
    # d is zeroed off the mask first so that exp() of garbage there cannot reach the backward as 0 * inf.
    d_BT = torch.where(mask_BT, logp_ref_BT - logp_BT, 0.0)
    if estimator == "k1":
        return -d_BT
    if estimator == "k2":
        return 0.5 * d_BT * d_BT
    return torch.exp(d_BT) - d_BT - 1.0


# --- loss aggregation with global normalizers ---------------------------------------------------------------


def per_sequence_loss(
    x_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    aggregation: str,
    normalizers: Normalizers,
    constant: float | None = None,
) -> torch.Tensor:
    """Each row's contribution c (B,) to the aggregated loss: loss = sum_b c[b] (the global loss, or on a DP rank its
    share of it). With s_b = sum_t m*x,
    n_b = sum_t m, N_tok and N_seq the *global* normalizers (each clamped to >= 1):

        'token_mean':              c_b = s_b / N_tok
        'seq_mean_token_mean':     c_b = (s_b / n_b) / N_seq        (0 for a row with n_b = 0)
        'seq_mean_token_sum_norm': c_b = s_b / (constant * N_seq)   (Dr. GRPO; constant e.g. the max length)

    A row's c_b depends only on its own tokens and the normalizers (s_b is a fixed pairwise sum over t), so
    it is bitwise the same on any DP split. No active token at all gives c = 0 and a zero gradient, never
    NaN (the clamps divide 0 by 1).
    """
    check_mode("aggregation", aggregation, AGGREGATIONS, "seq_mean_token_sum_norm", constant,
               kind_in_full="loss aggregation")
    dtype = x_BT.dtype
    # A fixed pairwise tree of elementwise adds, not torch.sum: torch may split one long row over threads
    # when a rank holds few rows, which would make s_b depend on how many rows the rank holds.
    s_B = tree_sum(torch.where(mask_BT, x_BT, 0.0))
    if aggregation == "token_mean":
        return s_B / normalizers.num_active_tokens.clamp_min(1).to(dtype)
    num_seq = normalizers.num_active_sequences.clamp_min(1).to(dtype)
    if aggregation == "seq_mean_token_sum_norm":
        return s_B / (constant * num_seq)
    n_B = mask_BT.sum(-1)
    return torch.where(n_B > 0, s_B / n_B.clamp_min(1).to(dtype), 0.0) / num_seq


# --- the GRPO objective --------------------------------------------------------------------------------------


class GRPOLoss(NamedTuple):
    """The GRPO objective of a batch (or of a DP rank's share of it). Scalars unless marked."""

    loss: torch.Tensor
    """aggregate of the per-token policy loss + kl_coef * kl: what backward() is called on."""
    policy_loss: torch.Tensor
    """aggregate of the per-token clipped surrogate alone."""
    kl: torch.Tensor
    """aggregate of the per-token KL estimate (0 when kl_coef is 0 and no reference is given)."""
    clip_frac: torch.Tensor
    """1[the clipped term was taken] aggregated as the loss ('loss_weighted') or as a token mean, no gradient."""
    per_sequence_B: torch.Tensor
    """(B,) each row's contribution to loss (loss = per_sequence_B.sum())."""
    ratio_BT: torch.Tensor
    """(B, T) exp(logp - logp_old) on active tokens, 1 elsewhere."""


def grpo_loss(
    logp_BT: torch.Tensor,
    logp_old_BT: torch.Tensor,
    logp_ref_BT: torch.Tensor | None,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_eps: float,
    clip_eps_high: float | None = None,
    kl_coef: float,
    kl_estimator: str = "k3",
    aggregation: str,
    normalizers: Normalizers,
    constant: float | None = None,
    decided_BT: torch.Tensor | None = None,
    clip_frac: str = "loss_weighted",
    dual_clip_c: float | None = None,
    entropy_BT: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> GRPOLoss:
    """GRPO's clipped surrogate with the KL penalty inside the loss, aggregated with global normalizers.

        ratio_t = exp(logp_t - logp_old_t)
        pg_t    = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - clip_eps, 1 + clip_eps_high))
                  (then min(pg_t, -A_t * dual_clip_c) where A_t < 0, with a dual clip: qualify.ppo.math.clipped_surrogate)
        loss_t  = pg_t + kl_coef * kl_estimate(logp_t, logp_ref_t) - entropy_coef * H_t
        loss    = sum_b per_sequence_loss(loss_t, mask, aggregation, normalizers, constant)[b]

    clip_frac: 'loss_weighted' aggregates 1[clipped] as the loss is aggregated; 'token_mean' is its mean over the
    step's active tokens (verl, TRL), whatever the aggregation.
    clip_eps_high defaults to clip_eps (DAPO's clip-higher when larger). logp_ref_BT may be None only with kl_coef
    0, entropy_BT (the policy's entropy per token, qualify.ppo.entropy) only with entropy_coef 0. The clip comparison
    is strict, as in qualify.ppo.math.clipped_policy_loss; decided_BT imposes the decision as there.
    """
    if logp_ref_BT is None and kl_coef != 0:
        raise ValueError("a reference logprob is required when kl_coef is not 0")
    high = clip_eps if clip_eps_high is None else clip_eps_high
    s = clipped_surrogate(logp_BT, logp_old_BT, advantages_BT, mask_BT, clip_eps, high, decided_BT, dual_clip_c)
    pg_BT = s.term_BT
    if logp_ref_BT is None:
        kl_BT = torch.zeros_like(pg_BT)
    else:
        kl_BT = kl_estimate(logp_BT, logp_ref_BT, mask_BT, kl_estimator, s.ratio_BT)
    loss_BT = less_entropy(pg_BT + kl_coef * kl_BT, entropy_BT, mask_BT, entropy_coef)

    def agg(x_BT: torch.Tensor) -> torch.Tensor:
        return per_sequence_loss(x_BT, mask_BT, aggregation, normalizers, constant)

    per_sequence_B = agg(loss_BT)
    return GRPOLoss(
        loss=per_sequence_B.sum(),
        policy_loss=agg(pg_BT).sum(),
        kl=agg(kl_BT).sum(),
        clip_frac=(agg(s.is_clipped_BT) if clip_frac == "loss_weighted"
                   else per_sequence_loss(s.is_clipped_BT, mask_BT, "token_mean", normalizers)).sum(),
        per_sequence_B=per_sequence_B,
        ratio_BT=s.ratio_BT,
    )
