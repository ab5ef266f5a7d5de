"""What scoring the reference model reads from the matrix, taken once: the objective, the reference and rollout
sections, the model directories and the scoring settings' fingerprint, with the run's layout and the digests of the
rollout and targets it scores. The reference's runs, its controls' replays, the candidate stage's replays on a case's
decisions and the platform replay are all made from one ScoringContext, never from the whole matrix."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qualify.layout import RunLayout
from qualify.matrix import Matrix, Objective, Reference, Rollout
from qualify.models.family import model_dirs
from qualify.reference.evidence import scoring_settings
from qualify.reference.inputs import StepInputs


@dataclass(frozen=True)
class ScoringContext:
    objective: Objective
    reference: Reference
    rollout: Rollout
    layout: RunLayout
    models: dict[str, Path]
    rollout_digest: str
    targets_digest: str
    settings: str
    """scoring_settings: the fingerprint of what targets and scores depend on (keys replays, marks sealed runs)."""

    @classmethod
    def of(cls, matrix: Matrix, layout: RunLayout, rollout_digest: str | None = None,
           targets_digest: str | None = None) -> ScoringContext:
        """The context of matrix's reference in layout, on the rollout and targets with these digests: by default
        those the reference's summary names (a reference that has run); targets_digest "" while the targets are being
        made."""
        if rollout_digest is None:
            from qualify.store import read_json

            summary = read_json(layout.reference_summary)
            rollout_digest, targets_digest = summary["rollout_digest"], summary["targets_digest"]
        return cls(objective=matrix.objective, reference=matrix.reference, rollout=matrix.rollout, layout=layout,
                   models=model_dirs(matrix.models, layout.models, matrix.resolve), rollout_digest=rollout_digest,
                   targets_digest=targets_digest or "", settings=scoring_settings(matrix, rollout_digest))

    @property
    def primary_tp(self) -> int:
        """The TP degree of the rollout that is scored (the matrix's first rollout.vllm_tp)."""
        return self.rollout.vllm_tp[0]

    def inputs(self) -> StepInputs:
        """Each optimizer step's targets and response mask, read from the sealed targets and rollout."""
        return StepInputs.read(self.objective.ppo, self.layout, self.primary_tp, self.rollout_digest,
                               self.targets_digest)
