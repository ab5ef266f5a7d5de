"""The targets and response mask of each optimizer step's rows of a run directory: what a step's decisions and loss
contributions are read back from (qualify.ppo.decisions), for freeze and for the judge."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qualify.layout import RunLayout
from qualify.matrix import Matrix
from qualify.ppo.objective import rows_of, step_rows


@dataclass(frozen=True)
class StepInputs:
    """The targets and response mask of each step's rows (what decisions are recomputed from)."""

    targets: list[dict[str, torch.Tensor]]
    masks: list[torch.Tensor]

    @classmethod
    def load(cls, matrix: Matrix, layout: RunLayout) -> StepInputs:
        from qualify.store import read_json

        summary = read_json(layout.reference_summary)
        return cls.read(matrix, layout, summary["rollout_digest"], summary["targets_digest"])

    @classmethod
    def read(cls, matrix: Matrix, layout: RunLayout, rollout_digest: str, targets_digest: str) -> StepInputs:
        """From the sealed targets and rollout, checked against the digests given (before the summary exists)."""
        from qualify.reference.evidence import load_targets
        from qualify.rollout.capture import load_rollout

        targets = load_targets(layout, targets_digest)
        mask = load_rollout(layout.rollout(matrix.rollout.vllm_tp[0]), rollout_digest)["response_mask_BT"]
        return cls.split(matrix, targets, mask)

    @classmethod
    def split(cls, matrix: Matrix, targets: dict[str, torch.Tensor], mask_BT: torch.Tensor) -> StepInputs:
        """Whole-batch targets and response mask cut into each optimizer step's rows."""
        rows = step_rows(mask_BT.shape[0], matrix.ppo.epochs, matrix.ppo.minibatches)
        return cls([rows_of(targets, r) for r in rows], [mask_BT[r] for r in rows])
