"""The clipped objectives' discrete decisions, read back from a step's recorded outputs, and how close each came.

PPO's value loss and PPO's and GRPO's surrogates choose per token between a clipped and an unclipped term: a
discrete branch. Two correct implementations whose values (or ratios) differ by a rounding step decide a token
differently when it sits within that step of a clip edge, and from then on their gradients differ by that token's
whole contribution: a correct TP engine's step-1 gradients can then sit several bounds away from the reference's
(measured on two H200s). The candidate stage therefore judges decisions as decisions (one may differ from the
reference's only where the reference is within its tensor's bound of the edge) and the continuous quantities against
the reference replayed on the candidate's decisions (qualify.reference.forced).

Decisions are recomputed from the recorded fp32 outputs with the objectives' own arithmetic. A token is decided
'clipped' only where the clamp is active: inside the clip range the two terms are one function, and the value loss's
old + (v - old) may round either way of v without consequence (clip_frac counts such ties; decisions do not).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from qualify.ppo.grpo import token_advantages
from qualify.ppo.math import policy_settings


class Decisions(NamedTuple):
    clipped_BT: torch.Tensor
    """bool: the clipped term was the larger one (the token's gradient is the clipped term's)."""
    margin_BT: torch.Tensor
    """How far the deciding quantity sits from the nearest edge where the decision would change (inf where none)."""
    quantity: str
    """The recorded output the decision is made from: 'values_BT' (critic) or 'ratio_BT' (actor)."""
    name: str
    """'value_clip' or 'policy_clip'."""


def decisions(role: str, ppo: Any, grpo: Any, outputs: dict[str, torch.Tensor], targets: dict[str, torch.Tensor],
              mask_BT: torch.Tensor) -> Decisions | None:
    """The clip decisions of one step from its outputs (targets and mask of the step's rows); None when the outputs
    lack the quantity (a structure row fails such a candidate)."""
    mask_BT = mask_BT.bool()
    if not _readable(role, grpo, outputs, targets):
        return None
    if role == "critic":
        eps = ppo.value_clip_eps
        v = torch.where(mask_BT, outputs["values_BT"].float(), 0.0)
        old = torch.where(mask_BT, targets["old_values_BT"].float(), 0.0)
        ret = torch.where(mask_BT, targets["returns_BT"].float(), 0.0)
        v_clip = old + torch.clamp(v - old, -eps, eps)
        delta = v - old
        active = (delta > eps) | (delta < -eps)  # inside the range both terms are one (up to a rounding of old + d)
        clipped = active & ((v_clip - ret) ** 2 > (v - ret) ** 2) & mask_BT
        # the decision changes where v crosses old +- eps, or where |v - R| crosses |old +- eps - R|
        edges = torch.stack([old + eps, old - eps, 2 * ret - old - eps, 2 * ret - old + eps])
        margin = (v[None] - edges).abs().amin(0)
        return Decisions(clipped, torch.where(mask_BT, margin, math.inf), "values_BT", "value_clip")
    if grpo is not None:
        adv = token_advantages(outputs["advantages_B"].float(), mask_BT)
    else:
        adv = targets["advantages_BT"].float()
    low, high, c, _ = policy_settings(ppo)
    adv = torch.where(mask_BT, adv, 0.0)
    ratio = torch.where(mask_BT, outputs["ratio_BT"].float(), 1.0)
    active = (ratio > 1.0 + high) | (ratio < 1.0 - low)
    unclipped, edged = -adv * ratio, -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clipped = active & (edged > unclipped) & mask_BT
    # each edge is its own: A > 0 changes its decision at 1 + high, A < 0 at 1 - low (and at c with a dual clip)
    edge = torch.where(adv > 0, 1.0 + high, 1.0 - low)
    margin = (ratio - edge).abs()
    if c is not None:  # the objective's arithmetic: the clipped surrogate above -A c for A < 0 (ratio beyond c)
        dual = (adv < 0) & (ratio > c) & (torch.maximum(unclipped, edged) > -adv * c) & mask_BT
        clipped = clipped | dual
        margin = torch.where(adv < 0, torch.minimum(margin, (ratio - c).abs()), margin)
    margin = torch.where(mask_BT & (adv != 0), margin, math.inf)
    return Decisions(clipped, margin, "ratio_BT", "policy_clip")


def _readable(role: str, grpo: Any, outputs: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> bool:
    """Whether the outputs and targets hold what the role's objective reads."""
    if role == "critic":
        need_out, need_tgt = {"values_BT"}, {"old_values_BT", "returns_BT"}
    elif grpo is not None:
        need_out, need_tgt = {"ratio_BT", "advantages_B"}, set()
    else:
        need_out, need_tgt = {"ratio_BT"}, {"advantages_BT"}
    return need_out <= outputs.keys() and need_tgt <= targets.keys()


def differing(a: Decisions, b: Decisions) -> list[tuple[int, int]]:
    """(row, token) positions decided differently, in order."""
    return [tuple(p) for p in (a.clipped_BT != b.clipped_BT).nonzero().tolist()]


def loss_terms(role: str, ppo: Any, grpo: Any, outputs: dict[str, torch.Tensor], targets: dict[str, torch.Tensor],
               mask_BT: torch.Tensor) -> torch.Tensor | None:
    """Each token's weighted contribution to the step's loss (float64, (B, T), summing to the loss up to rounding),
    from the recorded outputs: the objective's per-token term times the aggregation's weight of that token. None
    when the outputs lack what the objective reads.

    A scalar loss of few control samples is a poor estimate of its own legitimate error: its per-token errors cancel
    by chance (the bf16 controls' loss errors were a few hundredths of the sum of their per-token errors, a correct
    TP2 engine's several times more: benchmarks/LOG.md). The sum of |per-token differences| does not cancel, so freeze takes it as the loss's control
    error (qualify.freeze), which bounds |loss difference| by the triangle inequality."""
    mask_BT = mask_BT.bool()
    f64 = torch.float64
    if not _readable(role, grpo, outputs, targets) or (grpo is not None and "kl_BT" not in outputs):
        return None
    if role == "critic":
        eps = ppo.value_clip_eps
        v, old, ret = (torch.where(mask_BT, x.to(f64), 0.0) for x in
                       (outputs["values_BT"], targets["old_values_BT"], targets["returns_BT"]))
        v_clip = old + torch.clamp(v - old, -eps, eps)
        term = 0.5 * torch.maximum((v - ret) ** 2, (v_clip - ret) ** 2)
    else:
        term = _policy_term(ppo, grpo, outputs, targets, mask_BT)
        if grpo is not None:
            term = term + grpo.kl_coef * torch.where(mask_BT, outputs["kl_BT"].to(f64), 0.0)
        coef = policy_settings(ppo).entropy_coef
        if coef != 0:  # the entropy bonus, of the entropy the case reports
            if "entropy_BT" not in outputs:
                return None
            term = term - coef * torch.where(mask_BT, outputs["entropy_BT"].to(f64), 0.0)
    weights = aggregation_weights(ppo, grpo, mask_BT)
    return torch.where(mask_BT, weights * term, 0.0)


def bias_terms(role: str, ppo: Any, grpo: Any, outputs: dict[str, torch.Tensor], targets: dict[str, torch.Tensor],
               mask_BT: torch.Tensor, decided_by: torch.Tensor | None = None) -> torch.Tensor | None:
    """Each token's contribution (float64, (B, T)) to the critic's value-head bias gradient: d loss / d value at that
    token, which the bias receives whole (value = w . h + b), so the gradient of score.bias is their sum. The clipped
    value loss's derivative: weight x (v - R), or 0 where the value is clipped (the clipped square the larger, v beyond
    the clip range; inside it the two are one). decided_by: the values whose clip decisions count (a run replayed on
    another run's decisions takes that run's values here), else the run's own. None for the actor or outputs that lack
    what the value loss reads.

    Like the loss, a gradient that is a sum over tokens of a few controls cancels by chance, and a shift of every
    value the same way (another final rounding of the parameters) adds up whole; freeze raises its control error to
    the sum of |per-token differences| (qualify.bounds.control_error)."""
    if role != "critic" or not _readable(role, grpo, outputs, targets):
        return None
    mask_BT = mask_BT.bool()
    f64 = torch.float64
    eps = ppo.value_clip_eps
    v, old, ret = (torch.where(mask_BT, x.to(f64), 0.0) for x in
                   (outputs["values_BT"], targets["old_values_BT"], targets["returns_BT"]))
    u = v if decided_by is None else torch.where(mask_BT, decided_by.to(f64), 0.0)
    clipped = (u - ret) ** 2 < (old + torch.clamp(u - old, -eps, eps) - ret) ** 2
    return torch.where(mask_BT & ~clipped, aggregation_weights(ppo, grpo, mask_BT) * (v - ret), 0.0)


def _policy_term(ppo: Any, grpo: Any, outputs: dict[str, torch.Tensor], targets: dict[str, torch.Tensor],
                 mask_BT: torch.Tensor) -> torch.Tensor:
    """Each token's clipped surrogate, float64, from the recorded ratio and the advantages (the matrix's edges and dual
    clip: qualify.ppo.math.clipped_surrogate)."""
    f64 = torch.float64
    if grpo is not None:
        adv = token_advantages(outputs["advantages_B"].to(f64), mask_BT)
    else:
        adv = targets["advantages_BT"].to(f64)
    adv = torch.where(mask_BT, adv, 0.0)
    ratio = torch.where(mask_BT, outputs["ratio_BT"].to(f64), 1.0)
    policy = policy_settings(ppo)
    term = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - policy.low, 1.0 + policy.high))
    if policy.dual_c is not None:
        term = torch.where(adv < 0, torch.minimum(term, -adv * policy.dual_c), term)
    return term


def aggregation_weights(ppo: Any, grpo: Any, mask_BT: torch.Tensor, normalizer: str | None = None) -> torch.Tensor:
    """Each token's weight in the step's aggregation (float64, (B, T)): GRPO's grpo.aggregation, PPO's masked mean
    with `normalizer` (ppo.token_normalizer when None). The aggregation is linear in the per-token terms: its
    gradient is each token's weight."""
    from qualify.ppo.grpo import per_sequence_loss
    from qualify.ppo.math import masked_mean
    from qualify.ppo.share import count_normalizers

    mask_BT = mask_BT.bool()
    x = torch.zeros(mask_BT.shape, dtype=torch.float64, requires_grad=True)
    with torch.enable_grad():
        if grpo is not None:
            total = per_sequence_loss(x, mask_BT, grpo.aggregation, count_normalizers(mask_BT), grpo.constant).sum()
        else:
            total = masked_mean(x, mask_BT, normalizer or ppo.token_normalizer, ppo.normalizer_constant)
        (weights,) = torch.autograd.grad(total, x)
    return weights


def mean_terms(role: str, ppo: Any, grpo: Any, outputs: dict[str, torch.Tensor], targets: dict[str, torch.Tensor],
               mask_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each token's weighted contribution (float64, (B, T)) to the step's scalar means other than the loss:
    kl_mean (the actor's; PPO's is the masked global mean of kl_BT, GRPO's the aggregation of kl_BT) and GRPO's
    policy_loss (the aggregation of the clipped surrogate). A mean is left out where the outputs lack what it reads
    or its contributions do not sum to the recorded value (then it is not that aggregation of those terms).

    Like the loss, such a mean of few control samples cancels by chance; freeze raises its control error to the
    random-sign scale of these contributions' differences (qualify.bounds.control_error.means_scale_error)."""
    if role != "actor" or "kl_BT" not in outputs:
        return {}
    mask_BT = mask_BT.bool()
    f64 = torch.float64
    kl_BT = torch.where(mask_BT, outputs["kl_BT"].to(f64), 0.0)
    weights = aggregation_weights(ppo, grpo, mask_BT, None if grpo is not None else "global")
    out = {"kl_mean": weights * kl_BT}
    if grpo is not None and _readable(role, grpo, outputs, targets):  # GRPO aggregates both the same way
        out["policy_loss"] = torch.where(mask_BT, weights * _policy_term(ppo, grpo, outputs, targets, mask_BT), 0.0)
    return {name: c for name, c in out.items() if name in outputs and
            abs(float(c.sum()) - float(outputs[name])) <= 1e-4 * float(c.abs().sum()) + 1e-6}
