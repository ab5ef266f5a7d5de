"""TRL's GRPO loss qualified as an engine's own objective: the torch-tp engine for the model, TRL's
`GRPOTrainer._compute_loss` (TRL 1.16, installed from PyPI; a test dependency of qualify) for the loss.

Name it in a GRPO matrix as `qualify.examples.trl_grpo:engine` (any TP, any DP). TRL's settings are mapped from the
matrix:

    TRL (GRPOConfig)              matrix
    loss_type 'dapo' (default)    grpo.aggregation token_mean: divides by num_items_in_batch, the active tokens of the
                                  whole batch gathered over the processes (DP-correct). 'bnpo' divides by this
                                  process's tokens: the same at DP1, a mean of per-process token means above
    loss_type 'grpo'              grpo.aggregation seq_mean_token_mean (every sequence holding a response token)
    loss_type 'dr_grpo'           grpo.aggregation seq_mean_token_sum_norm, grpo.constant = max_completion_length
    beta                          grpo.kl_coef (TRL's KL is k3: grpo.kl_estimator k3)
    use_bias_correction_kl        grpo.kl_estimator k3_ratio
    epsilon, epsilon_high         ppo.clip_eps_low, ppo.clip_eps_high (each ppo.clip_eps unless set)
    (no dual clip, no entropy bonus: a matrix with ppo.dual_clip_c or ppo.entropy_coef is refused)
    clip_ratio/region_mean        grpo.clip_frac token_mean (TRL logs the token mean)

Data parallelism as accelerate runs TRL: the processes are the case's DP ranks (the engine's DP group), TRL's
accelerator.gather and reduce are real collectives over them, and DDP averages the processes' gradients. The
harness's engines sum each rank's share instead, so the rank's loss is TRL's divided by the number of processes:
with 'grpo' and 'dr_grpo' (each process's mean over its equal number of sequences) and 'dapo' (the global token
count over the processes) that is the rank's exact share of the step's loss.

TRL computes group-relative advantages while it generates; here they are the step's share of the matrix's
(`share.advantages_B`), as a trainer's would be after its own generation step. The loss, and through it every
gradient, is TRL's code; the judged outputs are the tensors TRL's loss reads and the metrics TRL logs (kl, clip
ratio). `mismatched(...)` makes the same engine with one TRL setting changed away from the matrix: qualification
must then fail naming the tensors that setting moves.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import torch

from qualify.engines.torch_tp import TorchTPEngine
from qualify.ppo.math import policy_settings

LOSS_TYPES = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum_norm": "dr_grpo"}


def trl_compute_loss() -> Any:
    """TRL's GRPOTrainer._compute_loss (imported here only: TRL is heavy and optional)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL warns about the installed vLLM's version on import
        from trl.trainer.grpo_trainer import GRPOTrainer
    return GRPOTrainer._compute_loss


class _Accelerator:
    """What _compute_loss asks of accelerate, over the case's DP ranks: group is the DP process group the engine sums
    gradients over (None at DP1: one process, every collective the identity)."""

    def __init__(self, group: Any = None, num_processes: int = 1) -> None:
        self.group, self.num_processes = group, num_processes

    def reduce(self, x: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        if self.group is None:
            return x
        import torch.distributed as dist

        total = x.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        return total / self.num_processes if reduction == "mean" else total

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every process's x, concatenated in rank order (a 0-d x gives one element per process), as accelerate's."""
        if self.group is None:
            return x
        import torch.distributed as dist

        x = x.detach().reshape(-1).contiguous()
        parts = [torch.empty_like(x) for _ in range(self.num_processes)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts)

    def gather_for_metrics(self, x: torch.Tensor) -> torch.Tensor:
        return self.gather(x)


def trl_settings(ppo: Any, grpo: Any, changed: dict[str, Any]) -> dict[str, Any]:
    """TRL's settings for the matrix (then the changed ones)."""
    if grpo.kl_estimator not in ("k3", "k3_ratio"):
        raise ValueError(f"TRL's KL is k3 (or k3 with use_bias_correction_kl); the matrix says {grpo.kl_estimator}")
    policy = policy_settings(ppo)
    if policy.dual_c is not None or policy.entropy_coef != 0:
        raise ValueError("the TRL GRPO adapter maps no dual clip (ppo.dual_clip_c) and no entropy bonus "
                         "(ppo.entropy_coef): unset them")
    settings = {"loss_type": LOSS_TYPES[grpo.aggregation], "beta": grpo.kl_coef, "epsilon": policy.low,
                "epsilon_high": policy.high, "use_bias_correction_kl": grpo.kl_estimator == "k3_ratio",
                "max_completion_length": grpo.constant}
    return settings | changed


def trainer_view(settings: dict[str, Any], logp_BT: torch.Tensor, accelerator: _Accelerator) -> Any:
    """The trainer state _compute_loss reads, for these settings; its log-probabilities are the engine's own."""
    return SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp_BT, torch.zeros_like(logp_BT), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=settings["beta"], loss_type=settings["loss_type"], epsilon_low=settings["epsilon"],
        epsilon_high=settings["epsilon_high"], use_vllm=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=settings["max_completion_length"],
        _entropy_bonus_enabled=False, aux_loss_enabled=False, accelerator=accelerator,
        _metrics={"train": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=settings["use_bias_correction_kl"], delta=None,
                             steps_per_generation=1))


class TRLGRPOEngine(TorchTPEngine):
    """torch-tp whose objective is TRL's GRPO loss (see the module docstring)."""

    name = "trl-grpo"

    def __init__(self, changed: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.changed = dict(changed or {})

    def objective(self, role: str, ppo: Any, scores_BT: torch.Tensor, mask_BT: torch.Tensor,
                  targets: dict[str, torch.Tensor], *, grpo: Any = None,
                  share: Any = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if grpo is None or role != "actor":
            raise ValueError("the TRL GRPO adapter qualifies GRPO's actor only")
        settings = trl_settings(ppo, grpo, self.changed)
        logp_BT = torch.where(mask_BT, scores_BT, 0.0)
        accelerator = _Accelerator(self.dp_group, self.ctx.dp)
        trainer = trainer_view(settings, logp_BT, accelerator)
        B, T = mask_BT.shape
        inputs = {"prompt_ids": torch.zeros(B, 0, dtype=torch.long), "prompt_mask": torch.zeros(B, 0, dtype=torch.long),
                  "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask_BT.to(logp_BT.dtype),
                  "advantages": share.advantages_B.to(logp_BT.dtype),
                  "old_per_token_logps": targets["old_logprobs_BT"].to(logp_BT.dtype),
                  "ref_per_token_logps": targets["ref_logprobs_BT"].to(logp_BT.dtype),
                  # as TRL's _generate_and_score_completions counts it: the active tokens of every process
                  "num_items_in_batch": accelerator.gather(mask_BT.sum()).sum()}
        # DDP averages the processes' gradients, the engine sums the ranks': the rank's share is TRL's loss / dp
        loss = trl_compute_loss()(trainer, None, inputs) / self.ctx.dp
        view = {"dp": self.ctx.dp, "first": self.ctx.dp_rank == 0, "num_items": inputs["num_items_in_batch"]}
        return loss, self.outputs(settings, trainer._metrics["train"], logp_BT, mask_BT, targets, share, view)

    @staticmethod
    def outputs(settings: dict[str, Any], logged: dict[str, list[float]], logp_BT: torch.Tensor,
                mask_BT: torch.Tensor, targets: dict[str, torch.Tensor], share: Any,
                view: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The tensors TRL's loss reads and what it logs, as the judged outputs: this rank's rows, and scalars as its
        share of the step's (TRL logs the step's global kl and clip ratio on every process: rank 0 reports them)."""
        with torch.no_grad():
            d = logp_BT.detach()
            ratio_BT = torch.where(mask_BT, torch.exp(d - targets["old_logprobs_BT"]), 0.0)
            ref_d_BT = torch.where(mask_BT, targets["ref_logprobs_BT"] - d, 0.0)
            kl_BT = torch.where(mask_BT, torch.exp(ref_d_BT) - ref_d_BT - 1, 0.0)
            if settings["use_bias_correction_kl"]:
                kl_BT = kl_BT * ratio_BT
            kl_mean = torch.tensor(logged["kl"][-1] if logged.get("kl") and view["first"] else 0.0)
            clip_frac = torch.tensor(logged["clip_ratio/region_mean"][-1] if view["first"] else 0.0)
            adv_BT = share.advantages_B[:, None].to(d.dtype)
            pg_BT = -torch.minimum(ratio_BT * adv_BT, ratio_BT.clamp(1 - settings["epsilon"],
                                                                     1 + settings["epsilon_high"]) * adv_BT)
            per_token_BT = torch.where(mask_BT, pg_BT + settings["beta"] * kl_BT, 0.0)
            seq_loss_B = trl_aggregate(per_token_BT, mask_BT, settings, view)
            policy_loss = (seq_loss_B - settings["beta"] * trl_aggregate(kl_BT, mask_BT, settings, view)).sum()
        return {"logprobs_BT": d, "ratio_BT": ratio_BT, "kl_BT": kl_BT, "kl_mean": kl_mean.to(d.dtype),
                "policy_loss": policy_loss.to(d.dtype), "clip_frac": clip_frac.to(d.dtype),
                "advantages_B": share.advantages_B.detach(), "seq_loss_B": seq_loss_B}


def trl_aggregate(x_BT: torch.Tensor, mask_BT: torch.Tensor, settings: dict[str, Any],
                  view: dict[str, Any]) -> torch.Tensor:
    """Each row's contribution (B,) to the rank's share of TRL's aggregate of x for its loss type (TRL's loss / dp)."""
    rows = mask_BT.shape[0] * view["dp"]  # the step's sequences: every process holds as many
    sums_B = torch.where(mask_BT, x_BT, 0.0).sum(dim=1)
    if settings["loss_type"] == "dapo":
        return sums_B / view["num_items"].clamp(min=1)
    if settings["loss_type"] == "bnpo":  # this process's tokens, averaged over the processes by DDP
        return sums_B / mask_BT.sum().clamp(min=1) / view["dp"]
    if settings["loss_type"] == "grpo":
        return sums_B / mask_BT.sum(dim=1).clamp(min=1).to(x_BT.dtype) / rows
    return sums_B / (rows * settings["max_completion_length"])


def engine() -> TRLGRPOEngine:
    """TRL's GRPO loss with its settings mapped from the matrix."""
    return TRLGRPOEngine()


def mismatched() -> TRLGRPOEngine:
    """TRL's 'grpo' loss type (a mean over sequences of each sequence's token mean) where the matrix says
    token_mean: must fail, naming the loss and the gradients."""
    return TRLGRPOEngine({"loss_type": "grpo"})
