"""Derivation checks: a quantity a case reports that is a deterministic function of other quantities it reports, or
of the frozen inputs, recomputed in float64 from the case's own values and held to the rounding of its fp32
computation, not to the reference's control-calibrated bound.

    ratio_BT      exp(logprobs_BT - old logprobs), the old logprobs being the frozen rollout's
    kl_BT         the matrix's KL estimator of logprobs_BT and the frozen reference logprobs
    advantages_B  GRPO's group statistics of the frozen rewards (score_B)
    logprobs_BT   the sampler formula (fp32 log_softmax of logits / T over the full vocabulary) of the case's own
                  logits (the engine's logits() hook; computed on its rank, where the logits are, and recorded in the
                  case's meta.json); an engine without the hook fails that row, naming the hook, unless the matrix
                  waives the check for it by name (candidates.waive: {engine: [sampler_derivation]}; qualify.waivers):
                  a logprob computed otherwise (a bf16 log-sum-exp) can sit inside the reference's bounds
    entropy_BT    with an entropy bonus, the entropy of the same sampler distribution of the case's own logits,
                  recorded the same way
    clip_frac     the actor's clip decisions of its own ratio and advantages (fp32, as the objective takes them),
                  aggregated by the matrix's definition (PPO's normalizer; GRPO's aggregation or token mean); the
                  critic's value-clip decisions of its own values and the frozen old values and returns, each token
                  whose comparison is a rounding tie counted either way (the fraction must lie between the two
                  counts). A clip fraction is judged only here and by the clip decisions, token by token
                  (qualify.judge.decided), not against the reference's control-calibrated bound: it is a count,
                  which a rounding tie moves by one token and a few controls sample poorly
    grad_norm     the L2 norm of the case's own gradients
    moments       AdamW's moments of the case's own gradients, clipped by the coefficient of its reported norm, and
                  its own moments of the step before (the moments are not compared with the reference's: they are
                  this function of the gradients, which are)
    updates       AdamW's step of the case's own moments and start parameters (the declared lr, betas, eps, weight
                  decay: every parameter decayed, norms included) in the form nearest it (torch's, the decay
                  subtracted, FusedAdam's, the reordered one), held to the step term's own rounding, not the
                  parameter's: a missing or different decay is many ulps of the parameter
An engine that takes its old logprobs from another source, computes its KL or its group statistics otherwise, or
norms other gradients than it reports fails here from step 0, by far, even where the difference sits inside the
reference's bounds (which must absorb legitimate forward noise). Each check is one row per step, comparison
'derived'; its value is |case - derived| at the token the rule is closest to failing, its bound that token's
rounding allowance. The moments' and updates' rows are qualify.judge.derived_adamw's; derived_rows composes them all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from qualify.case.meta import CaseMeta
from qualify.compare import RunTensors
from qualify.judge.derived_adamw import DERIVED, U, moment_row, update_row  # U, DERIVED: shared with the AdamW rows
from qualify.matrix import Objective
from qualify.metrics import metrics_device
from qualify.ppo.math import policy_settings
from qualify.verdict import Row
from qualify.waivers import WAIVED, waived_note

EXP_ULPS = {"cpu": 1.0, "cuda": 2.0}
"""Largest error of fp32 exp in ulps: 1 on CPU (torch's vectorized exp), 2 on CUDA (expf's documented bound)."""


def ratio_rule(device: str) -> str:
    return (f"<= 2^-24 x ratio x (|log ratio| + {1 + 2 * EXP_ULPS.get(device, 2.0):g}) per token: fp32 subtraction "
            f"and exp ({EXP_ULPS.get(device, 2.0):g} ulp on {device})")
KL_RULE = "<= 2^-24 x (the estimator's fp32 rounding at that token: exp, subtractions, products)"
ADV_RULE = ("<= 2^-24 x ((G - 1) x mean |r| / (std + eps) + ((G + 1) / 2 + 3) x |A|) per row: fp32 group mean, std, "
            "subtraction and division")
NORM_RULE = "<= 2^-24 x (2 log2(elements) + 8) x norm: fp32 sums of squares in any order"
CLIP_RULE = ("<= 2^-24 x (active tokens + 4) x clip_frac: the fp32 sum of the clip indicators of the case's own ratio "
             "and advantages, aggregated by the matrix's clip_frac definition")
VALUE_CLIP_RULE = ("within [ties counted as unclipped, ties counted as clipped] + 2^-24 x (active tokens + 4) x "
                   "clip_frac: the value-clip indicators of the case's own values (v_clip = old + clamp(v - old, +-eps), "
                   "(v_clip - R)^2 > (v - R)^2), a token whose two squares are within their fp32 rounding (or inside "
                   "the range, where v_clip is v up to one rounding) counted either way, aggregated by the normalizer")

SAMPLER_RULE = ("<= 2^-24 x (2 log2(V) + 4 + 2 |x_token| + 2 |max x| + |logp|) per token, x = logits / T: fp32 "
                "scaling, the log-sum-exp over the vocabulary and the subtraction")
NOT_DERIVED = ("the engine exposes no logits() hook (or it gave none): its logprobs are not derived from its own "
               "logits, only judged against the reference's bounds")
NO_HOOK = ("give the engine a logits() hook (docs/plugins.md), or waive the check for it by name in the matrix: "
           "candidates.waive: {{{engine}: [sampler_derivation]}}")
HOOK_RULE = ("the engine's logits() hook gives the logits its logprobs are derived from (the matrix may waive "
             "sampler_derivation for an engine by name: candidates.waive)")
ENTROPY_RULE = ("<= 2^-24 x ((2 log2(V) + 8) x (|max z| + sum p |z|) + sum p |z| (|z - max z| + |max z - E z|) + "
                "|H|) per token, z = logits / T: fp32 scaling, the log-sum-exp, the softmax and its weighted sum over "
                "the vocabulary, and the subtraction")
ENTROPY_NOT_DERIVED = ("the engine exposes no logits() hook (or it gave none): its entropy is not derived from its own "
                       "logits, only judged against the reference's bounds")
Derivation = tuple[torch.Tensor, torch.Tensor]
"""(derived value, rounding allowance), float64, one per judged element."""


def ratio_derivation(logp: torch.Tensor, old: torch.Tensor, device: str = "cpu") -> Derivation:
    d = logp - old
    r = torch.exp(d)
    return r, U * r * (d.abs() + 1 + 2 * EXP_ULPS.get(device, 2.0))


def kl_derivation(logp: torch.Tensor, ref: torch.Tensor, estimator: str, ratio: torch.Tensor | None) -> Derivation:
    """The matrix's KL estimator (qualify.ppo.grpo.kl_estimate; PPO's is k1 = logp - ref) and its fp32 rounding."""
    d = ref - logp
    if estimator == "k1":
        return -d, U * 2 * d.abs()
    if estimator == "k2":
        return 0.5 * d * d, U * 4 * d * d
    e = torch.exp(d)
    # exp (1 ulp of e^d, up to 2 on CUDA, and the rounding of d it amplifies), the two subtractions: doubled, so that a
    # correct engine sits near a third of its allowance while another estimator (a difference of order d^2) fails
    k3, tol = e - d - 1, 2 * U * (e * (4 + d.abs()) + d.abs() + 1 + (e - d - 1).abs())
    if estimator == "k3":
        return k3, tol
    r, r_tol = ratio  # k3_ratio: k3 times the ratio, each with its own rounding, and the product's
    return k3 * r, tol * r + k3.abs() * r_tol + U * (k3 * r).abs()


def advantage_derivation(rewards: torch.Tensor, grpo: Any) -> Derivation:
    """GRPO's group-relative advantages of the step's rewards (groups of grpo.group_size contiguous rows), and their
    first-order fp32 rounding: the group mean's sum ((G - 1) roundings of the rewards' magnitudes, divided by the std)
    and the std's, the subtraction's and the division's roundings of the advantage itself."""
    size = grpo.group_size
    groups = rewards.reshape(-1, size)
    mean = groups.mean(dim=1, keepdim=True)
    centred = groups - mean
    mean_error = U * (size - 1) * groups.abs().mean(dim=1, keepdim=True)
    if not grpo.scale_std:
        return centred.reshape(-1), (mean_error + U * 2 * centred.abs()).expand_as(groups).reshape(-1)
    std = groups.std(dim=1, keepdim=True, unbiased=grpo.std_estimator == "unbiased")
    adv = centred / (std + grpo.eps)
    return adv.reshape(-1), (mean_error / (std + grpo.eps) + U * ((size + 1) / 2 + 3) * adv.abs()).reshape(-1)


@torch.no_grad()
def sampler_check(logits_BTV: torch.Tensor, ids_BT: torch.Tensor, scores_BT: torch.Tensor, mask_BT: torch.Tensor,
                  temperature: float, vocab_size: int, row_offset: int = 0) -> dict[str, Any]:
    """The token whose score is furthest (relative to its allowance) from the sampler formula of the engine's own
    logits, in float64 one row at a time (a row of a real vocabulary's logits is the largest thing held):
    {value, bound, row, position, case, derived}; value 0 and bound 0 when no response token."""
    worst = {"value": 0.0, "bound": 0.0, "ratio": -1.0, "row": None, "position": None, "case": None, "derived": None}
    for b in range(ids_BT.shape[0]):
        x = logits_BTV[b, :-1, :vocab_size].double() / temperature
        lse = torch.logsumexp(x, dim=-1)
        tok = ids_BT[b, 1:].to(x.device)
        x_tok = x.gather(-1, tok[:, None]).squeeze(-1)
        derived = (x_tok - lse).cpu()
        tol = (U * (2 * math.log2(vocab_size) + 4 + 2 * x_tok.abs() + 2 * x.max(dim=-1).values.abs())).cpu()
        tol = tol + U * derived.abs()
        got = scores_BT[b, 1:].double().cpu()
        m = mask_BT[b, 1:].cpu()
        if not bool(m.any()):
            continue
        diff = (got - derived).abs()
        ratio = torch.where(torch.isfinite(got), diff / tol, torch.full_like(diff, math.inf))
        ratio = torch.where(m, ratio, torch.full_like(ratio, -1.0))
        t = int(ratio.argmax())
        if float(ratio[t]) > worst["ratio"]:
            worst = {"value": float(diff[t]) if math.isfinite(float(got[t])) else math.inf, "bound": float(tol[t]),
                     "ratio": float(ratio[t]), "row": b + row_offset, "position": t + 1, "case": float(got[t]),
                     "derived": float(derived[t])}
    return worst


@torch.no_grad()
def entropy_check(logits_BTV: torch.Tensor, entropy_BT: torch.Tensor, mask_BT: torch.Tensor, temperature: float,
                  vocab_size: int, row_offset: int = 0) -> dict[str, Any]:
    """The token whose reported entropy is furthest (relative to its allowance) from the entropy of the sampler
    distribution of the engine's own logits (the distribution at t - 1 scores token t), in float64 one row at a time;
    the same record as sampler_check."""
    worst = {"value": 0.0, "bound": 0.0, "ratio": -1.0, "row": None, "position": None, "case": None, "derived": None}
    for b in range(entropy_BT.shape[0]):
        m = mask_BT[b, 1:].cpu()
        if not bool(m.any()):
            continue
        z = logits_BTV[b, :-1, :vocab_size].double() / temperature
        top = z.max(dim=-1, keepdim=True).values
        p = torch.softmax(z, dim=-1)
        weighted, mean = (p * z.abs()).sum(-1), (p * z).sum(-1, keepdim=True)
        derived = (torch.logsumexp(z, dim=-1) - mean.squeeze(-1)).cpu()
        # the sums' and the log-sum-exp's roundings, and each p's (its exp amplifies the rounding of z - max z) and
        # each z's (dH/dz = -p (z - E z)) carried through the weighted sum
        spread = (p * z.abs() * ((z - top).abs() + (top - mean).abs())).sum(-1)
        tol = U * ((2 * math.log2(vocab_size) + 8) * (top.squeeze(-1).abs() + weighted) + spread).cpu()
        tol = tol + U * derived.abs()
        got = entropy_BT[b, 1:].double().cpu()
        diff = (got - derived).abs()
        ratio = torch.where(torch.isfinite(got), diff / tol, torch.full_like(diff, math.inf))
        ratio = torch.where(m, ratio, torch.full_like(ratio, -1.0))
        t = int(ratio.argmax())
        if float(ratio[t]) > worst["ratio"]:
            worst = {"value": float(diff[t]) if math.isfinite(float(got[t])) else math.inf, "bound": float(tol[t]),
                     "ratio": float(ratio[t]), "row": b + row_offset, "position": t + 1, "case": float(got[t]),
                     "derived": float(derived[t])}
    return worst


def _num(v: Any) -> float:
    """A number recorded in meta.json (non-finite ones are written as 'nan' or 'inf' strings)."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def sampler_rows(case: str, role: str, cand: list[RunTensors], key: str = "sampler_derivation",
                 output: str = "logprobs_BT") -> list[Row]:
    """The logprobs (or, key 'entropy_derivation', the entropy_BT) derived from the case's own logits, one row per step
    (recorded by the worker in meta.json)."""
    if role != "actor" or not cand:
        return []
    entropy = output == "entropy_BT"
    meta = CaseMeta.of(cand[0].meta)
    found = getattr(meta, key)
    if not isinstance(found, list) or not found:
        if entropy:
            return [Row(case, role, DERIVED, f"outputs/{output}", "not_derived", 0.0, math.inf, True,
                        ENTROPY_NOT_DERIVED)]
        return [not_derived_row(case, role, meta.spec)]
    rows = []
    for k, w in enumerate(found):
        value, bound = _num(w["value"]), _num(w["bound"])
        passed = w["row"] is None or (math.isfinite(value) and value <= bound)
        note = "" if passed else (f"row {w['row']} position {w['position']}: the case has {_num(w['case']):.9g}, "
                                  f"the {'entropy' if entropy else 'sampler formula'} of its own logits "
                                  f"{_num(w['derived']):.9g}")
        rows.append(Row(case, role, DERIVED, f"step{k}/outputs/{output}", "derived_abs", value, bound, passed,
                        note, step=k, rule=ENTROPY_RULE if entropy else SAMPLER_RULE))
    return rows


def not_derived_row(case: str, role: str, spec: dict[str, Any]) -> Row:
    """The row of an actor whose logprobs could not be derived (no logits): failing, naming the hook, unless its
    sealed spec (spec: meta.json's 'case') carries the engine's waiver of sampler_derivation; then passing, waived."""
    engine = str(spec.get("engine", "?"))
    if "sampler_derivation" in (spec.get("waive") or ()):
        return Row(case, role, DERIVED, "outputs/logprobs_BT", WAIVED, 0.0, math.inf, True,
                   waived_note("sampler_derivation", engine, NOT_DERIVED), rule=HOOK_RULE)
    return Row(case, role, DERIVED, "outputs/logprobs_BT", "not_derived", 1.0, 0.0, False,
               f"{NOT_DERIVED}; {NO_HOOK.format(engine=engine)}", rule=HOOK_RULE)


def worst_row(case: str, role: str, k: int, tensor: str, got: torch.Tensor, derivation: Derivation, rule: str,
              where: Callable[[int], str]) -> Row:
    """One row: |case - derived| and the allowance at the element nearest (or furthest past) its allowance."""
    want, tol = derivation
    diff = (got.double() - want).abs()
    bad = ~torch.isfinite(got.double())
    ratio = torch.where(bad, torch.full_like(diff, math.inf), diff / tol.clamp(min=torch.finfo(torch.float64).tiny))
    if not ratio.numel():
        return Row(case, role, DERIVED, tensor, "derived_abs", 0.0, 0.0, True, "no element to derive", step=k,
                   rule=rule)
    i = int(ratio.argmax())
    value, bound = (math.inf if bad[i] else float(diff[i])), float(tol[i])
    passed = bool(ratio[i] <= 1)
    note = "" if passed else (f"{where(i)}: the case has {float(got.reshape(-1)[i]):.9g}, derived from its own "
                              f"inputs {float(want[i]):.9g}")
    return Row(case, role, DERIVED, tensor, "derived_abs", value, bound, passed, note, step=k, rule=rule)


def token_place(mask: torch.Tensor) -> Callable[[int], str]:
    where = torch.nonzero(mask)
    return lambda i: f"row {int(where[i][0])} position {int(where[i][1])}"


def clip_frac_derivation(ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                         objective: Objective) -> Derivation:
    """The clip fraction of the case's own ratio and advantages (B, T, fp32 as reported): the strict comparison of the
    clipped and unclipped terms in fp32 at the matrix's edges, and of the dual clip (as the objective decides),
    aggregated in float64 by the matrix's definition."""
    from qualify.ppo.grpo import count_normalizers, per_sequence_loss
    from qualify.ppo.math import masked_mean

    policy = policy_settings(objective.ppo)
    a = torch.where(mask, adv.float(), 0.0)
    r = torch.where(mask, ratio.float(), 1.0)
    edged, unclipped = -a * r.clamp(1.0 - policy.low, 1.0 + policy.high), -a * r
    clipped = edged > unclipped
    if policy.dual_c is not None:  # the dual clip's tokens count with the others (qualify.ppo.math.clipped_surrogate)
        clipped = clipped | ((a < 0) & (torch.maximum(edged, unclipped) > -a * policy.dual_c))
    clipped = clipped.double()
    if objective.grpo is None:
        value = masked_mean(clipped, mask, objective.ppo.token_normalizer, objective.ppo.normalizer_constant)
    else:
        g = objective.grpo
        how, constant = ("token_mean", None) if g.clip_frac == "token_mean" else (g.aggregation, g.constant)
        value = per_sequence_loss(clipped, mask, how, count_normalizers(mask), constant).sum()
    value = value.reshape(1).double()
    return value, U * (int(mask.sum()) + 4) * value.abs()


def value_clip_frac_derivation(clip_frac: torch.Tensor, values: torch.Tensor, old: torch.Tensor, ret: torch.Tensor,
                               mask: torch.Tensor, objective: Objective) -> Derivation:
    """The critic's clip fraction of its own values (B, T) against the frozen old values and returns: the nearest
    value to the reported one in [the fraction with every rounding tie unclipped, the fraction with every tie
    clipped], and the fp32 sum's rounding. The objective decides (v_clip - R)^2 > (v - R)^2 in fp32 with v_clip =
    old + clamp(v - old, -eps, eps); inside the range v_clip is v up to that sum's rounding, and at the range's edge
    the two squares can be equal up to rounding, so such tokens go either way in a correct engine (one that tests
    |v - old| > eps first counts them unclipped)."""
    from qualify.ppo.math import masked_mean

    eps = objective.ppo.value_clip_eps
    v32, o32, r32 = (torch.where(mask, t.float(), 0.0) for t in (values, old, ret))
    # the objective's own fp32 comparison (qualify.ppo.math.clipped_value_loss): inside the range it can hold by
    # the rounding of old + (v - old) alone
    natural = ((o32 + (v32 - o32).clamp(-eps, eps) - r32).square() > (v32 - r32).square()) & mask
    v, o, r = v32.double(), o32.double(), r32.double()
    v_clip = o + (v - o).clamp(-eps, eps)
    a, b = (v_clip - r).square(), (v - r).square()
    # first-order fp32 rounding of the two squares: v_clip's sum (|o| + |v - o|), each difference, each square
    tol = 4 * U * ((o.abs() + (v - o).abs() + r.abs() + v.abs()) * ((v_clip - r).abs() + (v - r).abs()) + a + b)
    active = ((v - o).abs() > eps) & mask
    sure = active & (a - b > tol)
    maybe = sure | (active & ((a - b).abs() <= tol)) | natural

    def frac(clipped: torch.Tensor) -> torch.Tensor:
        return masked_mean(clipped.double(), mask, objective.ppo.token_normalizer,
                           objective.ppo.normalizer_constant).reshape(1).double()

    lo, hi = frac(sure), frac(maybe)
    got = clip_frac.double().reshape(1)
    want = torch.minimum(torch.maximum(got, lo), hi) if bool(torch.isfinite(got).all()) else lo
    return want, U * (int(mask.sum()) + 4) * hi.abs() + torch.finfo(torch.float64).tiny


def step_rows(case: str, role: str, objective: Objective, k: int, outputs: dict[str, torch.Tensor],
              targets: dict[str, torch.Tensor], mask: torch.Tensor, device: str = "cpu",
              scored: bool = True) -> list[Row]:
    """The derivation rows of one step's outputs (each only where the case reports the quantity). scored: the
    reported logprobs are the ones the loss was made of (not another declared formula's)."""
    rows = []
    place = token_place(mask)
    logp = outputs.get("logprobs_BT") if scored else None
    f64 = {name: t.double()[mask] for name, t in targets.items() if name in ("old_logprobs_BT", "ref_logprobs_BT")}
    if role == "actor" and logp is not None and logp.shape == mask.shape:
        own = logp.double()[mask]
        ratio = ratio_derivation(own, f64["old_logprobs_BT"], device)
        if "ratio_BT" in outputs and outputs["ratio_BT"].shape == mask.shape:
            rows.append(worst_row(case, role, k, f"step{k}/outputs/ratio_BT", outputs["ratio_BT"][mask], ratio,
                                  ratio_rule(device) + "; old logprobs: the frozen rollout's", place))
        if "kl_BT" in outputs and outputs["kl_BT"].shape == mask.shape and "ref_logprobs_BT" in f64:
            estimator = "k1" if objective.grpo is None else objective.grpo.kl_estimator
            rows.append(worst_row(case, role, k, f"step{k}/outputs/kl_BT", outputs["kl_BT"][mask],
                                  kl_derivation(own, f64["ref_logprobs_BT"], estimator, ratio),
                                  f"{KL_RULE}; estimator {estimator}", place))
    adv = None
    if role == "actor" and objective.grpo is None:
        adv = targets.get("advantages_BT")
    elif role == "actor" and "advantages_B" in outputs:
        adv = outputs["advantages_B"][:, None].expand(mask.shape)
    ratio_out = outputs.get("ratio_BT")
    if adv is not None and ratio_out is not None and "clip_frac" in outputs and ratio_out.shape == mask.shape \
            and adv.shape == mask.shape:
        rows.append(worst_row(case, role, k, f"step{k}/outputs/clip_frac", outputs["clip_frac"].reshape(1),
                              clip_frac_derivation(ratio_out, adv, mask, objective), CLIP_RULE,
                              lambda i: f"{int(mask.sum())} tokens"))
    values = outputs.get("values_BT")
    if role == "critic" and "clip_frac" in outputs and values is not None and values.shape == mask.shape \
            and all(name in targets and targets[name].shape == mask.shape for name in ("old_values_BT", "returns_BT")):
        rows.append(worst_row(case, role, k, f"step{k}/outputs/clip_frac", outputs["clip_frac"].reshape(1),
                              value_clip_frac_derivation(outputs["clip_frac"], values, targets["old_values_BT"],
                                                         targets["returns_BT"], mask, objective), VALUE_CLIP_RULE,
                              lambda i: f"{int(mask.sum())} tokens"))
    if objective.grpo is not None and "advantages_B" in outputs and "score_B" in targets:
        rewards = targets["score_B"].double()
        if outputs["advantages_B"].shape == rewards.shape and rewards.numel() % objective.grpo.group_size == 0:
            rows.append(worst_row(case, role, k, f"step{k}/outputs/advantages_B", outputs["advantages_B"],
                                  advantage_derivation(rewards, objective.grpo), ADV_RULE, lambda i: f"row {i}"))
    return rows


def norm_row(case: str, role: str, k: int, step: RunTensors) -> Row | None:
    """The reported pre-clip gradient norm against the norm of the reported gradients."""
    if "grad_norm" not in step.outputs or not step.grads:
        return None
    device = metrics_device()  # the GPU when there is one: a real model's gradients are hundreds of millions
    total = sum(float((g if device is None else g.to(device)).double().square().sum()) for g in step.grads.values())
    elements = sum(g.numel() for g in step.grads.values())
    norm = math.sqrt(total)
    tol = U * (2 * math.log2(max(elements, 2)) + 8) * norm
    derivation = (torch.tensor([norm], dtype=torch.float64), torch.tensor([tol], dtype=torch.float64))
    return worst_row(case, role, k, f"step{k}/outputs/grad_norm", step.outputs["grad_norm"].reshape(1), derivation,
                     NORM_RULE, lambda i: f"{len(step.grads)} gradients, {elements} elements")


def derived_rows(case: str, role: str, objective: Objective, cand: list[RunTensors], inputs: Any,
                 scored: bool = True, starts: list[dict[str, torch.Tensor]] | None = None) -> list[Row]:
    """Every derivation row of a case, step by step (scored: see step_rows)."""
    meta = CaseMeta.of(cand[0].meta) if cand else CaseMeta()
    device, state_dtypes = meta.spec.get("device", "cpu"), meta.state_dtypes or {}
    rebuilt: dict[str, torch.Tensor] = {}  # update_row: the ulps of the updates the starts are rebuilt from
    rows = sampler_rows(case, role, cand)
    if role == "actor" and policy_settings(objective.ppo).entropy_coef > 0:
        rows += sampler_rows(case, role, cand, "entropy_derivation", "entropy_BT")
    for k, step in enumerate(cand):
        if k < len(inputs.masks):
            rows += step_rows(case, role, objective, k, step.outputs, inputs.targets[k], inputs.masks[k], device, scored)
        norm = norm_row(case, role, k, step)
        if norm is not None:
            rows.append(norm)
        moments = moment_row(case, role, k, step, cand[k - 1] if k else None, objective.optimizer, state_dtypes)
        if moments is not None:
            rows.append(moments)
        if starts is not None and k < len(starts):
            update = update_row(case, role, k, step, starts[k], objective.optimizer, state_dtypes, rebuilt)
            if update is not None:
                rows.append(update)
    return rows
