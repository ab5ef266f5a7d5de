"""RoleMeta: a reference role directory's meta.json, typed (written by qualify.reference.evidence.write_role and, for a
control kept as a summary, qualify.reference.summary; read by freeze, the bounds and the loaders of qualify.compare).

Written: the run's precision, control and role, its settings (attention, micro-batches, TP split, row order), the
dtypes of its masters, gradients and optimizer state, the rollout's and targets' digests, the number of steps, each
step's coverage (the branches it took), its time; `evidence` only where the run is kept lean ('lean': outputs and
gradients) or as a summary ('summary'). The stages after the reference read three of these: num_steps, coverage and
evidence (typed here); the whole document is kept as written, so that to_json gives it back key for key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qualify.errors import EvidenceError

NAME = "meta.json"
"""The file's name in a role directory."""
EVIDENCE_KINDS = ("lean", "summary")
"""What `evidence` says where it is written: a run kept in full writes none."""


@dataclass(frozen=True)
class RoleMeta:
    """One reference role directory's meta.json (see the module's docstring)."""

    num_steps: int = 1
    """How many optimizer steps the directory holds (1 where not written)."""
    coverage: list[dict[str, Any]] = field(default_factory=list)
    """Per step, the branches the step took (clip sides, KL, padding), as the reference recorded them."""
    evidence: str | None = None
    """'lean', 'summary', or None for a run kept in full."""
    document: dict[str, Any] = field(default_factory=dict)
    """The document as written (to_json gives it back)."""

    @property
    def lean(self) -> bool:
        """A run kept lean: a reference r0 under reference.evidence lean (outputs and gradients only)."""
        return self.evidence == "lean"

    @classmethod
    def from_json(cls, doc: Any, where: str = NAME) -> RoleMeta:
        """The typed document; one that is not an object, or whose read fields have the wrong type, is refused."""
        if not isinstance(doc, dict):
            raise EvidenceError(f"{where}: not a JSON object")
        steps, coverage, evidence = doc.get("num_steps", 1), doc.get("coverage", []), doc.get("evidence")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise EvidenceError(f"{where}: num_steps {steps!r} is not a count of steps")
        if not isinstance(coverage, list):
            raise EvidenceError(f"{where}: coverage is not a list")
        if evidence is not None and evidence not in EVIDENCE_KINDS:
            raise EvidenceError(f"{where}: evidence {evidence!r} is not one of {', '.join(EVIDENCE_KINDS)}")
        return cls(num_steps=steps, coverage=coverage, evidence=evidence, document=dict(doc))

    def to_json(self) -> dict[str, Any]:
        """The document as written."""
        return dict(self.document)

