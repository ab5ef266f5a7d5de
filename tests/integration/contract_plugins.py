"""Plugins that break the engine contract the way their authors do, named in matrices as
'tests.integration.contract_plugins:<factory>'. Each must stop its case before anything is sealed, with a one-line
note naming the plugin, the hook, what was expected and what came back, and the launch log's path."""

from __future__ import annotations

from typing import Any

import torch

from qualify.engines.torch_tp import TorchTPEngine
from qualify.examples.own_objective import OwnObjectiveEngine


def needs_config(config: dict) -> TorchTPEngine:
    """A factory that expects a config argument: the registry calls factories with none."""
    return TorchTPEngine()


class NoGradDtypes(TorchTPEngine):
    """Forgets grad_dtypes() (the method list in an old README lacked it)."""

    grad_dtypes = None


def no_grad_dtypes() -> TorchTPEngine:
    return NoGradDtypes()


class PerRowLoss(OwnObjectiveEngine):
    """Returns one loss per row instead of the batch's one number."""

    def objective(self, role: str, ppo: Any, scores_BT: torch.Tensor, mask_BT: torch.Tensor,
                  targets: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        _, outputs = super().objective(role, ppo, scores_BT, mask_BT, targets)
        per_row_B = (torch.where(mask_BT, scores_BT, torch.zeros_like(scores_BT))).sum(dim=1)
        return per_row_B, outputs


def per_row_loss() -> OwnObjectiveEngine:
    return PerRowLoss()


class ShortRatio(OwnObjectiveEngine):
    """Returns ratio_BT over the shifted positions (one column short): a shape the judge cannot compare."""

    def objective(self, role: str, ppo: Any, scores_BT: torch.Tensor, mask_BT: torch.Tensor,
                  targets: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, outputs = super().objective(role, ppo, scores_BT, mask_BT, targets)
        if "ratio_BT" in outputs:
            outputs["ratio_BT"] = outputs["ratio_BT"][:, 1:]
        return loss, outputs


def short_ratio() -> OwnObjectiveEngine:
    return ShortRatio()


class FiveParameterObjective(OwnObjectiveEngine):
    """The README's PPO objective(role, ppo, scores_BT, response_mask_BT, targets), without share=: used under GRPO,
    which also passes grpo= and share=, or under PPO at DP > 1, which passes share=."""

    def objective(self, role: str, ppo: Any, scores_BT: torch.Tensor, mask_BT: torch.Tensor,
                  targets: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return super().objective(role, ppo, scores_BT, mask_BT, targets)


def five_parameter_objective() -> OwnObjectiveEngine:
    return FiveParameterObjective()
