"""One reference control: forward, PPO loss, backward, clip, one AdamW step, for actor or critic.

BF16 runs the forward and backward in a bf16 copy of the model; its gradients are cast to FP32
into the FP32 master parameters, which are clipped and stepped by torch.optim.AdamW (the FP32
master-weight scheme that Megatron and DeepSpeed use). FP32 runs everything on the master.
A micro-batch control splits the rows in two and accumulates gradients, scaling each micro-batch
loss so that the sum equals the full-batch loss for every token normalizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qualify.matrix import Matrix
from qualify.ppo.math import clipped_policy_loss, clipped_value_loss, kl_terms, masked_mean
from qualify.reference.hf import actor_logprobs, compute_copy, critic_values, enable_checkpointing

CONTROL_ATTN = {"attn_impl": "eager"}
BASE_ATTN = "sdpa"


@dataclass(frozen=True, slots=True)
class Control:
    """One independent reference run: a repeat or a numerically legitimate perturbation."""

    name: str
    """r0, r1, ... for repeats; the perturbation's name otherwise."""
    microbatches: int = 1
    reverse_rows: bool = False
    attn_impl: str = BASE_ATTN


def controls_of(matrix: Matrix) -> list[Control]:
    """The repeats and perturbations the matrix declares, in order (r0 first: the reference itself)."""
    ref = matrix.reference
    out = [Control(name=f"r{i}") for i in range(ref.repeats)]
    for p in ref.perturbations:
        out.append({"microbatch_split": Control(name=p, microbatches=2),
                    "batch_order": Control(name=p, reverse_rows=True),
                    "attn_impl": Control(name=p, attn_impl=CONTROL_ATTN["attn_impl"])}[p])
    return out


def _loss_scale(mask_BT: torch.Tensor, rows: slice, normalizer: str,
                constant: float | None) -> tuple[str, float | None, float]:
    """(normalizer, constant, weight) for a micro-batch so that weighted micro-batch losses sum to the full loss."""
    if normalizer == "global":
        return "constant", float(mask_BT.sum()), 1.0
    if normalizer == "per_sequence":
        rows_total = int(mask_BT.any(1).sum())
        rows_here = int(mask_BT[rows].any(1).sum())
        return "per_sequence", None, (rows_here / rows_total) if rows_total else 0.0
    return "constant", constant, 1.0


def _row_slices(B: int, n: int) -> list[slice]:
    step = -(-B // n)
    return [slice(i, min(i + step, B)) for i in range(0, B, step)]


def run_role(matrix: Matrix, role: str, precision: str, control: Control, master: torch.nn.Module,
             batch: dict[str, torch.Tensor], targets: dict[str, torch.Tensor], vocab_size: int,
             model_dir: Path) -> dict[str, Any]:
    """Forward + loss + backward + clip + AdamW on master; returns tensors and metadata to store."""
    model = compute_copy(master, precision, model_dir, role, control.attn_impl)
    if matrix.reference.gradient_checkpointing:
        enable_checkpointing(model)
    order = torch.arange(batch["input_ids_BT"].shape[0])
    if control.reverse_rows:
        order = order.flip(0)
    ids_BT = batch["input_ids_BT"][order]
    mask_BT = batch["response_mask_BT"][order]
    tgt = {k: v[order] for k, v in targets.items()}
    p = matrix.ppo
    parts: dict[str, list[torch.Tensor]] = {}
    totals = {"loss": torch.zeros((), dtype=torch.float32), "clip_frac": torch.zeros((), dtype=torch.float32)}
    for rows in _row_slices(ids_BT.shape[0], control.microbatches):
        normalizer, constant, weight = (p.token_normalizer, p.normalizer_constant, 1.0)
        if control.microbatches > 1:
            normalizer, constant, weight = _loss_scale(mask_BT, rows, p.token_normalizer, p.normalizer_constant)
        m_BT = mask_BT[rows]
        if role == "actor":
            logp_BT = actor_logprobs(model, ids_BT[rows], matrix.rollout.temperature,
                                     matrix.reference.logprob_chunk_tokens, vocab_size) * m_BT
            loss, ratio_BT, clip_frac = clipped_policy_loss(logp_BT, tgt["old_logprobs_BT"][rows],
                                                            tgt["advantages_BT"][rows], m_BT, p.clip_eps,
                                                            normalizer, constant)
            parts.setdefault("logprobs_BT", []).append(logp_BT.detach())
            parts.setdefault("ratio_BT", []).append((ratio_BT * m_BT).detach())
        else:
            values_BT = critic_values(model, ids_BT[rows]) * m_BT
            loss, clip_frac = clipped_value_loss(values_BT, tgt["old_values_BT"][rows], tgt["returns_BT"][rows], m_BT,
                                                 p.value_clip_eps, normalizer, constant)
            parts.setdefault("values_BT", []).append(values_BT.detach())
        (loss * weight).backward()
        totals["loss"] += (loss * weight).detach()
        totals["clip_frac"] += (clip_frac * weight).detach()
    undo = torch.argsort(order)
    outputs = {k: torch.cat(v)[undo] for k, v in parts.items()}
    outputs.update(totals)
    if role == "actor":
        kl_BT = kl_terms(outputs["logprobs_BT"], targets["ref_logprobs_BT"]) * batch["response_mask_BT"]
        outputs["kl_BT"] = kl_BT
        outputs["kl_mean"] = masked_mean(kl_BT, batch["response_mask_BT"], "global")
    return outputs | _optimizer_step(matrix, master, model)


def _optimizer_step(matrix: Matrix, master: torch.nn.Module, model: torch.nn.Module) -> dict[str, Any]:
    """Move gradients to FP32 master grads, clip, step AdamW; return grads, updates, moments, dtypes."""
    o = matrix.optimizer
    names = [n for n, _ in master.named_parameters()]
    grad_dtypes = {}
    for (name, mp), (_, cp) in zip(master.named_parameters(), model.named_parameters()):
        grad_dtypes[name] = str(cp.grad.dtype).removeprefix("torch.") if cp.grad is not None else "none"
        if cp is not mp:
            mp.grad = None if cp.grad is None else cp.grad.detach().to(torch.float32)
    params = [p for p in master.parameters()]
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for n, p in zip(names, params)}
    before = {n: p.detach().clone() for n, p in zip(names, params)}
    max_norm = o.max_grad_norm if o.max_grad_norm > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
    opt = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, foreach=False)
    opt.step()
    state = {n: opt.state[p] for n, p in zip(names, params)}
    return {
        "grad_norm": grad_norm.detach().to(torch.float32),
        "grads": grads,
        "updates": {n: p.detach() - before[n] for n, p in zip(names, params)},
        "moments": {f"{k}/{n}": s[k] for n, s in state.items() for k in ("exp_avg", "exp_avg_sq")},
        "meta": {"compute_grad_dtypes": grad_dtypes,
                 "grad_dtypes": {n: str(p.grad.dtype).removeprefix("torch.") for n, p in zip(names, params)
                                 if p.grad is not None},
                 "state_dtypes": {n: str(s["exp_avg"].dtype).removeprefix("torch.") for n, s in state.items()},
                 "master_dtype": "float32"},
    }
