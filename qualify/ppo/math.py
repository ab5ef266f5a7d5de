"""PPO math on padded (B, T) tensors: masked reductions, token rewards, masked GAE and the clipped losses.

Every function is a small pure function on tensors. B is the number of sequences, T the number of
positions; masks are bool (B, T) and True on active (response) tokens. Inactive positions never
influence a result, neither its value nor its gradient, whatever they hold (NaN and inf included):
inputs are zeroed with torch.where before any arithmetic, because a mask applied only at the end
still lets 0 * inf = NaN through the backward pass.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from qualify.ppo.share import Normalizers, count_normalizers

NORMALIZERS = ("global", "per_sequence", "constant")


def check_mode(kind: str, mode: str, known: tuple[str, ...], with_constant: str, constant: float | None, *,
               kind_in_full: str | None = None) -> None:
    """Refuses a normalization mode (a masked_mean normalizer, a GRPO loss aggregation) not among known, a constant
    given with another mode than with_constant or missing with it, and a constant not > 0. kind_in_full names the
    kind in the unknown-mode message where it differs from kind."""
    if mode not in known:
        raise ValueError(f"unknown {kind_in_full or kind} {mode!r}; known: {', '.join(known)}")
    if (mode == with_constant) != (constant is not None):
        raise ValueError(f"constant is required with {kind} {with_constant!r} and only then")
    if constant is not None and not constant > 0:
        raise ValueError(f"constant must be > 0, got {constant}")


class PolicySettings(NamedTuple):
    """The policy loss's settings of a ppo section beyond GAE: its clip edges, dual clip and entropy bonus."""

    low: float
    """The lower edge is 1 - low (ppo.clip_eps_low, else ppo.clip_eps)."""
    high: float
    """The upper edge is 1 + high (ppo.clip_eps_high, else ppo.clip_eps)."""
    dual_c: float | None
    """ppo.dual_clip_c: a negative-advantage token's loss is at most -A x dual_c; None: no dual clip."""
    entropy_coef: float
    """ppo.entropy_coef: the entropy bonus's coefficient (0: none)."""


def policy_settings(ppo: Any) -> PolicySettings:
    """The one reading of a ppo section's policy-loss settings (qualify.matrix.PPO, or any object with its clip_eps:
    a field it lacks reads as the matrix's default)."""
    low, high = getattr(ppo, "clip_eps_low", None), getattr(ppo, "clip_eps_high", None)
    return PolicySettings(low=ppo.clip_eps if low is None else low, high=ppo.clip_eps if high is None else high,
                          dual_c=getattr(ppo, "dual_clip_c", None), entropy_coef=getattr(ppo, "entropy_coef", 0.0))


def masked_sum(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Sum of x over active tokens: sum_{b,t: mask[b,t]} x[b,t]. Returns a scalar."""
    return torch.where(mask_BT, x_BT, 0.0).sum()


def masked_mean(
    x_BT: torch.Tensor, mask_BT: torch.Tensor, normalizer: str, constant: float | None = None,
    normalizers: Normalizers | None = None,
) -> torch.Tensor:
    """Mean of x over active tokens, as the PPO token normalizer says. Returns a scalar.

    - 'global':       sum_{b,t} m*x / N_tok                     (every active token weighs the same)
    - 'per_sequence': sum over rows with >= 1 active token of (sum_t m*x / sum_t m), / N_seq
                      (every sequence weighs the same)
    - 'constant':     sum_{b,t} m*x / constant                   (independent of the batch's lengths)

    N_tok and N_seq are the step's normalizers (qualify.ppo.share): given, x is a slice of the step (a micro-batch,
    a DP rank's rows) and the result is its exact share of the step's mean (the shares sum to it); None, they are
    this batch's own counts (the batch is the whole step).
    No active token at all gives 0, not NaN, and keeps the graph: the gradient is then 0.
    `constant` is required with 'constant' and only then (the matrix's rule).
    """
    check_mode("normalizer", normalizer, NORMALIZERS, "constant", constant)
    if normalizers is None:
        normalizers = count_normalizers(mask_BT)
    xm_BT = torch.where(mask_BT, x_BT, 0.0)
    if normalizer == "global":
        # clamp_min(1): with no active token the sum is 0, so 0 / 1 = 0 instead of 0 / 0 = NaN.
        return xm_BT.sum() / normalizers.num_active_tokens.clamp_min(1).to(x_BT.dtype)
    if normalizer == "constant":
        return xm_BT.sum() / constant
    num_active_B = mask_BT.sum(-1)
    row_mean_B = xm_BT.sum(-1) / num_active_B.clamp_min(1).to(x_BT.dtype)
    # Rows with no active token are left out of the mean over rows, not counted as a 0.
    return torch.where(num_active_B > 0, row_mean_B, 0.0).sum() / \
        normalizers.num_active_sequences.clamp_min(1).to(x_BT.dtype)


def last_active_index(mask_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Position of each row's last active token.

    Returns (index_B int64, has_any_B bool). index_B is 0 where has_any_B is False: that 0 is a
    placeholder, not a position, and callers must select with has_any_B before using it.
    """
    positions_T = torch.arange(mask_BT.shape[-1], device=mask_BT.device)
    last_B = torch.where(mask_BT, positions_T, -1).amax(-1)
    has_any_B = last_B >= 0
    return last_B.clamp_min(0), has_any_B


def token_rewards(
    score_B: torch.Tensor,
    logp_old_BT: torch.Tensor,
    logp_ref_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    kl_coef: float,
) -> torch.Tensor:
    """Per-token rewards (B, T): a KL penalty on every active token, the sequence score on the last one.

    r[b,t] = -kl_coef * (logp_old[b,t] - logp_ref[b,t])   on active tokens (k1 KL, see kl_terms)
           + score[b]                                      at t = the last active token of row b
    and 0 on inactive tokens. A row with no active token gets all zeros: its score is dropped,
    never placed at position 0.
    """
    kl_BT = torch.where(mask_BT, kl_terms(logp_old_BT, logp_ref_BT), 0.0)
    rewards_BT = -kl_coef * kl_BT
    last_B, has_any_B = last_active_index(mask_BT)
    positions_T = torch.arange(mask_BT.shape[-1], device=mask_BT.device)
    at_last_BT = (positions_T == last_B[:, None]) & has_any_B[:, None]
    return rewards_BT + torch.where(at_last_BT, score_B[:, None], 0.0)


@torch.no_grad()
def masked_gae(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over each row's active positions, in order. No gradient.

    For active positions t of a row, with n(t) the next active position after t (none: terminal):
        delta_t = r_t + gamma * V_{n(t)} - V_t              (V_{n(t)} = 0 when t is the last active one)
        A_t     = delta_t + gamma * lam * A_{n(t)}          (A_{n(t)} = 0 likewise)
        R_t     = A_t + V_t
    Inactive positions are skipped (their rewards and values are never read) and get A = R = 0.
    For the usual contiguous response mask, n(t) = t + 1. A row with no active position gives
    zeros: nothing bootstraps from position 0.

    Returns (advantages_BT, returns_BT), both in the dtype of rewards_BT.
    """
    num_rows, num_positions = rewards_BT.shape
    next_value_B = rewards_BT.new_zeros(num_rows)
    next_adv_B = rewards_BT.new_zeros(num_rows)
    advantages_BT = torch.zeros_like(rewards_BT)
    # Backwards over T, vectorized over B; inactive positions carry the running state unchanged,
    # which is what makes n(t) the next *active* position for arbitrary masks.
    for t in range(num_positions - 1, -1, -1):
        active_B = mask_BT[:, t]
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        adv_B = delta_B + gamma * lam * next_adv_B
        advantages_BT[:, t] = torch.where(active_B, adv_B, 0.0)
        next_value_B = torch.where(active_B, values_BT[:, t], next_value_B)
        next_adv_B = torch.where(active_B, adv_B, next_adv_B)
    returns_BT = torch.where(mask_BT, advantages_BT + values_BT, 0.0)
    return advantages_BT, returns_BT


def kl_terms(logp_BT: torch.Tensor, logp_ref_BT: torch.Tensor) -> torch.Tensor:
    """Per-token k1 KL estimator (B, T): kl[b,t] = logp[b,t] - logp_ref[b,t].

    For tokens sampled from the policy, E[logp - logp_ref] = KL(policy || ref): k1 is unbiased but
    a single term can be negative. It is not masked: callers reduce it with a mask.
    """
    return logp_BT - logp_ref_BT


def impose(unclipped_BT: torch.Tensor, natural_BT: torch.Tensor, natural_clipped_BT: torch.Tensor,
           decided: Decided | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A clipped objective's per-token (term, clipped indicator): its own rule's (natural_BT, natural_clipped_BT), or
    the imposed decision's.

    A decision is what the token's gradient is: True, the clipped term at the clip edge (a constant: no gradient),
    even where this run's own value sits just inside the range (a candidate whose value crossed the edge decided so);
    False, the unclipped term. Inside the range, where nothing is imposed on the equal terms (they may differ by
    a rounding of old + (v - old)), the rule stays, so imposing a run's own decisions reproduces it bitwise."""
    if decided is None:
        return natural_BT, natural_clipped_BT
    term_BT = torch.where(decided.clipped_BT, decided.edge_term_BT,
                          torch.where(decided.active_BT, unclipped_BT, natural_BT))
    return term_BT, decided.clipped_BT | (~decided.active_BT & natural_clipped_BT)


def choose(unclipped_BT: torch.Tensor, clipped_BT: torch.Tensor, decided: Decided | None) -> torch.Tensor:
    """The larger of the two terms (PPO's rule), or the imposed decision (impose)."""
    return impose(unclipped_BT, torch.maximum(unclipped_BT, clipped_BT), clipped_BT > unclipped_BT, decided)[0]


def clipped_fraction_mask(unclipped_BT: torch.Tensor, clipped_BT: torch.Tensor, decided: Decided | None) -> torch.Tensor:
    """clip_frac's per-token indicator: the clipped term is the larger (or is imposed)."""
    return impose(unclipped_BT, torch.maximum(unclipped_BT, clipped_BT), clipped_BT > unclipped_BT, decided)[1]


class Decided(NamedTuple):
    """An imposed decision with what it needs: the clamp's activity and the clipped term at the edge."""

    clipped_BT: torch.Tensor
    active_BT: torch.Tensor
    edge_term_BT: torch.Tensor


def policy_decided(decided_BT: torch.Tensor | None, ratio_BT: torch.Tensor, adv_BT: torch.Tensor, low: float,
                   high: float, dual_c: float | None = None) -> Decided | None:
    """The surrogate's imposed decision: the clipped term -A x (1 + high) for A > 0, -A x (1 - low) for A < 0, or with
    a dual clip -A x c for A < 0 where this run's ratio is nearer c than 1 - low (the edge the deciding run crossed:
    a ratio imposed a decision it did not take itself sits within a rounding of that edge)."""
    if decided_BT is None:
        return None
    r = ratio_BT.detach()
    edge_BT = torch.where(adv_BT > 0, torch.full_like(r, 1.0 + high), torch.full_like(r, 1.0 - low))
    active_BT = (r > 1.0 + high) | (r < 1.0 - low)
    if dual_c is not None:
        dual_side_BT = (adv_BT < 0) & ((r - dual_c).abs() < (r - (1.0 - low)).abs())
        edge_BT = torch.where(dual_side_BT, torch.full_like(r, dual_c), edge_BT)
        active_BT = active_BT | ((adv_BT < 0) & (r > dual_c))
    return Decided(decided_BT, active_BT, -adv_BT * edge_BT)


class Surrogate(NamedTuple):
    """PPO's clipped surrogate per token, before any reduction."""

    ratio_BT: torch.Tensor
    """(B, T) exp(logp - logp_old) on active tokens, 1 elsewhere."""
    term_BT: torch.Tensor
    """(B, T) the clipped surrogate (clipped_surrogate's formula), or the imposed decision's term (impose)."""
    is_clipped_BT: torch.Tensor
    """(B, T) 1.0 where a clipped term is taken (either edge, or the dual clip), in logp's dtype, no gradient."""


def clipped_surrogate(logp_BT: torch.Tensor, logp_old_BT: torch.Tensor, advantages_BT: torch.Tensor,
                      mask_BT: torch.Tensor, low: float, high: float, decided_BT: torch.Tensor | None,
                      dual_c: float | None = None) -> Surrogate:
    """The per-token clipped surrogate of clipped_policy_loss and GRPO's, with asymmetric edges and verl's dual clip:

        ratio_t = exp(logp_t - logp_old_t)                                    (1 on inactive tokens)
        pg_t    = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - low, 1 + high))
        term_t  = min(pg_t, -A_t * dual_c) where A_t < 0 (dual_c set), else pg_t

    A token is clipped where the clipped term is the larger, or (dual clip) where A_t < 0 and pg_t > -A_t * dual_c:
    verl's pg_clipfrac and pg_clipfrac_lower, counted together. The comparisons are strict; decided_BT (bool,
    optional) imposes the decision instead (impose).
    """
    # Zero the log-ratio and advantage off the mask first, so exp() of garbage there cannot turn
    # the backward into 0 * inf = NaN.
    log_ratio_BT = torch.where(mask_BT, logp_BT - logp_old_BT, 0.0)
    adv_BT = torch.where(mask_BT, advantages_BT, 0.0)
    ratio_BT = torch.exp(log_ratio_BT)
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * torch.clamp(ratio_BT, 1.0 - low, 1.0 + high)
    natural_BT = torch.maximum(unclipped_BT, clipped_BT)
    natural_clipped_BT = clipped_BT > unclipped_BT
    if dual_c is not None:  # verl's order: the clipped surrogate first, then its minimum with -A c for A < 0
        dual_BT = -adv_BT * dual_c
        negative_BT = adv_BT < 0
        natural_clipped_BT = natural_clipped_BT | (negative_BT & (natural_BT > dual_BT))
        natural_BT = torch.where(negative_BT, torch.minimum(natural_BT, dual_BT), natural_BT)
    decided = policy_decided(decided_BT, ratio_BT, adv_BT, low, high, dual_c)
    term_BT, is_clipped_BT = impose(unclipped_BT, natural_BT, natural_clipped_BT, decided)
    return Surrogate(ratio_BT, term_BT, is_clipped_BT.detach().to(logp_BT.dtype))


def clipped_policy_loss(
    logp_BT: torch.Tensor,
    logp_old_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_eps: float,
    normalizer: str,
    constant: float | None = None,
    decided_BT: torch.Tensor | None = None,
    normalizers: Normalizers | None = None,
    *,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    entropy_BT: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate. Returns (loss scalar, ratio_BT, clip_frac scalar).

        ratio_t = exp(logp_t - logp_old_t)                                    (1 on inactive tokens)
        loss_t  = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - clip_eps, 1 + clip_eps_high))
                  (then min(loss_t, -A_t * dual_clip_c) where A_t < 0, with a dual clip: clipped_surrogate)
                  - entropy_coef * H_t                                       (an entropy bonus)
        loss    = masked_mean(loss_t, mask, normalizer, constant, normalizers)
        clip_frac = masked_mean(1[a clipped term is taken], same normalizer)

    clip_eps is the lower edge's range, clip_eps_high the upper's (default clip_eps). entropy_BT (B, T): the entropy
    of the policy at each token (qualify.ppo.entropy), differentiable, required when entropy_coef is not 0.
    The comparison is strict: a ratio exactly at an edge is not clipped. clip_frac is a float tensor without
    gradient. decided_BT (bool, optional) imposes the decision instead of the max: the clipped term where True, the
    unclipped one elsewhere (a reference replayed on a candidate's decisions, qualify.ppo.decisions).
    normalizers: the step's (qualify.ppo.share) when these rows are a slice of it: loss and clip_frac are its shares.
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
    s = clipped_surrogate(logp_BT, logp_old_BT, advantages_BT, mask_BT, clip_eps, high, decided_BT, dual_clip_c)
    loss = masked_mean(less_entropy(s.term_BT, entropy_BT, mask_BT, entropy_coef), mask_BT, normalizer, constant,
                       normalizers)
    clip_frac = masked_mean(s.is_clipped_BT, mask_BT, normalizer, constant, normalizers)
    return loss, s.ratio_BT, clip_frac


def less_entropy(loss_BT: torch.Tensor, entropy_BT: torch.Tensor | None, mask_BT: torch.Tensor,
                 entropy_coef: float) -> torch.Tensor:
    """Per-token loss less the entropy bonus: loss_t - entropy_coef * H_t (H zeroed off the mask first); loss_BT
    itself when the coefficient is 0 (the entropy, if given, is then not read)."""
    if entropy_coef == 0:
        return loss_BT
    if entropy_BT is None:
        raise ValueError(f"an entropy coefficient of {entropy_coef} needs the policy's entropy at every token")
    return loss_BT - entropy_coef * torch.where(mask_BT, entropy_BT, 0.0)


def clipped_value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_eps: float,
    normalizer: str,
    constant: float | None = None,
    decided_BT: torch.Tensor | None = None,
    normalizers: Normalizers | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped value loss. Returns (loss scalar, clip_frac scalar).

        v_clip_t = old_t + clamp(v_t - old_t, -clip_eps, clip_eps)
        loss_t   = 0.5 * max((v_t - R_t)^2, (v_clip_t - R_t)^2)
        loss     = masked_mean(loss_t, mask, normalizer, constant)
        clip_frac = masked_mean(1[(v_clip_t - R_t)^2 > (v_t - R_t)^2], same normalizer)

    clip_frac is a float tensor without gradient. decided_BT and normalizers (the step's, for a slice of it): as in
    clipped_policy_loss.
    """
    # Same guard as in clipped_policy_loss: nothing off the mask reaches the arithmetic.
    v_BT = torch.where(mask_BT, values_BT, 0.0)
    old_BT = torch.where(mask_BT, old_values_BT, 0.0)
    ret_BT = torch.where(mask_BT, returns_BT, 0.0)
    v_clip_BT = old_BT + torch.clamp(v_BT - old_BT, -clip_eps, clip_eps)
    unclipped_BT = (v_BT - ret_BT) ** 2
    clipped_BT = (v_clip_BT - ret_BT) ** 2
    decided = None
    if decided_BT is not None:
        delta_BT = (v_BT - old_BT).detach()
        eps_BT = torch.full_like(old_BT, clip_eps)  # in the values' dtype, as clamp converts clip_eps
        edge_BT = old_BT + torch.where(delta_BT >= 0, eps_BT, -eps_BT)  # the side this run's value is on
        decided = Decided(decided_BT, (delta_BT > clip_eps) | (delta_BT < -clip_eps), (edge_BT - ret_BT) ** 2)
    loss = masked_mean(0.5 * choose(unclipped_BT, clipped_BT, decided), mask_BT, normalizer, constant, normalizers)
    is_clipped_BT = clipped_fraction_mask(unclipped_BT, clipped_BT, decided).detach().to(values_BT.dtype)
    clip_frac = masked_mean(is_clipped_BT, mask_BT, normalizer, constant, normalizers)
    return loss, clip_frac


WHITEN_EPS = 1e-8
"""Added to the variance before its inverse square root when whitening advantages (verl's masked_whiten)."""


@torch.no_grad()
def whiten_advantages(advantages_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Advantages whitened over every active position of the batch: (A - mean) / sqrt(var + WHITEN_EPS), with the
    mean over active positions and the unbiased variance (divided by n - 1), as verl's masked_whiten; 0 off the mask.
    Fewer than two active positions have no variance: refused."""
    count = int(mask_BT.sum())
    if count < 2:
        raise ValueError(f"whitening advantages needs at least 2 active positions, the batch has {count}")
    active = advantages_BT[mask_BT]
    mean = active.sum() / count
    var = (active - mean).square().sum() / (count - 1)
    return torch.where(mask_BT, (advantages_BT - mean) * torch.rsqrt(var + WHITEN_EPS), 0.0)
