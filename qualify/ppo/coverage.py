"""Which branches of the objective and the optimizer a reference step exercised (coverage is evidence).

A PASS means little for a branch no step took: a wrong clip range passes when no ratio leaves
[1 - eps, 1 + eps]. The reference records, per step, how often each branch was taken; freeze
refuses a matrix whose `freeze.require` names a branch that stayed inert, and says what wakes it.
"""

from __future__ import annotations

from typing import Any

import torch

from qualify.ppo.math import policy_settings

BRANCHES: dict[str, str] = {
    "policy_clip_high": "raise optimizer.lr or ppo.epochs, or lower ppo.clip_eps_high (or clip_eps) (no ratio went "
                        "above 1 + clip_eps_high)",
    "policy_clip_low": "raise optimizer.lr or ppo.epochs, or lower ppo.clip_eps_low (or clip_eps) (no ratio went "
                       "below 1 - clip_eps_low)",
    "policy_clip_dual": "set ppo.dual_clip_c, or lower it toward 1, or raise optimizer.lr or ppo.epochs (no ratio of a "
                        "negative-advantage token went above dual_clip_c)",
    "value_clip": "raise optimizer.lr or ppo.epochs, or lower ppo.value_clip_eps (no value left old +- value_clip_eps)",
    "grad_clip": "lower optimizer.max_grad_norm below the pre-clip gradient norms the reference measured",
    "kl": "take more than one step (ppo.epochs x ppo.minibatches), or use an actor that differs from the reference "
          "model (the actor's KL to it stayed 0)",
    "padded_rows": "let responses end at different lengths (an eos_token_id, a larger rollout.max_new_tokens): "
                   "no row of a minibatch was padded",
    "adam_past_first_step": "set ppo.epochs x ppo.minibatches >= 2 (Adam's bias correction and moment accumulation "
                            "past step 1)",
}
"""Every branch a matrix may require, with the setting that wakes it when it is inert."""


def step_coverage(role: str, ppo: Any, max_grad_norm: float, outputs: dict[str, torch.Tensor],
                  targets: dict[str, torch.Tensor], mask_BT: torch.Tensor, grad_norm: float,
                  adam_step: int) -> dict[str, Any]:
    """Counts of the branches one step of one role took (targets and outputs sliced to the step's rows)."""
    lengths_B = mask_BT.sum(1)
    cov: dict[str, Any] = {"grad_clip": bool(max_grad_norm > 0 and grad_norm > max_grad_norm),
                           "grad_norm": grad_norm, "padded_rows": int((lengths_B < lengths_B.max()).sum()),
                           "adam_step": adam_step}
    if role == "actor":
        ratio_BT, policy = outputs["ratio_BT"], policy_settings(ppo)
        cov["policy_clip_high"] = int(((ratio_BT > 1 + policy.high) & mask_BT).sum())
        cov["policy_clip_low"] = int(((ratio_BT < 1 - policy.low) & mask_BT).sum())
        if policy.dual_c is not None:  # recorded only where the matrix has a dual clip (else no step could take it)
            adv_BT = outputs["advantages_B"][:, None].expand(mask_BT.shape) if "advantages_B" in outputs \
                else targets["advantages_BT"]  # GRPO's per-row advantages, PPO's per-token ones
            cov["policy_clip_dual"] = int(((ratio_BT > policy.dual_c) & (adv_BT < 0) & mask_BT).sum())
        cov["kl"] = int(((outputs["kl_BT"] != 0) & mask_BT).sum())
    else:
        moved_BT = (outputs["values_BT"] - targets["old_values_BT"]).abs() > ppo.value_clip_eps
        cov["value_clip"] = int((moved_BT & mask_BT).sum())
    return cov


def exercised(steps: list[dict[str, Any]]) -> dict[str, bool]:
    """Per branch: did any step take it (adam_past_first_step: did any step run with Adam's step count >= 2)."""
    out = {}
    for branch in BRANCHES:
        if branch == "adam_past_first_step":
            out[branch] = any(s.get("adam_step", 0) >= 2 for s in steps)
        elif any(branch in s for s in steps):
            out[branch] = any(bool(s.get(branch)) for s in steps)
    return out


def inert(required: tuple[str, ...], coverage_by_role: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The required branches no step of any role took, each with what would wake it."""
    taken: dict[str, bool] = {}
    for steps in coverage_by_role.values():
        for branch, yes in exercised(steps).items():
            taken[branch] = taken.get(branch, False) or yes
    return [f"{b}: {BRANCHES[b]}" for b in required if not taken.get(b, False)]
