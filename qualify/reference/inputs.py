"""The targets and response mask of each optimizer step's rows of a run directory: what a step's decisions and loss
contributions are read back from (qualify.ppo.decisions), for freeze and for the judge."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qualify.layout import RunLayout
from qualify.matrix import PPO
from qualify.ppo.objective import rows_of, step_rows


@dataclass(frozen=True)
class StepInputs:
    """The targets and response mask of each step's rows (what decisions are recomputed from)."""

    targets: list[dict[str, torch.Tensor]]
    masks: list[torch.Tensor]

    @classmethod
    def load(cls, ppo: PPO, layout: RunLayout, primary_tp: int) -> StepInputs:
        """From the sealed targets and the primary rollout (vLLM at primary_tp), checked against the reference's
        summary's digests."""
        from qualify.store import read_json

        summary = read_json(layout.reference_summary)
        return cls.read(ppo, layout, primary_tp, summary["rollout_digest"], summary["targets_digest"])

    @classmethod
    def read(cls, ppo: PPO, layout: RunLayout, primary_tp: int, rollout_digest: str,
             targets_digest: str) -> StepInputs:
        """From the sealed targets and rollout, checked against the digests given (before the summary exists)."""
        from qualify.reference.evidence import load_targets
        from qualify.rollout.capture import load_rollout

        targets = load_targets(layout, targets_digest)
        mask = load_rollout(layout.rollout(primary_tp), rollout_digest)["response_mask_BT"]
        return cls.split(ppo, targets, mask)

    @classmethod
    def split(cls, ppo: PPO, targets: dict[str, torch.Tensor], mask_BT: torch.Tensor) -> StepInputs:
        """Whole-batch targets and response mask cut into each optimizer step's rows."""
        rows = step_rows(mask_BT.shape[0], ppo.epochs, ppo.minibatches)
        return cls([rows_of(targets, r) for r in rows], [mask_BT[r] for r in rows])
