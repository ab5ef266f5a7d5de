"""Where every artifact of a run lives. One place, so every stage agrees.

runs/<matrix name>/
  reference/                     the evidence root that acceptance.json covers
    models/<role>/               tiny family made from the seed (HF safetensors + config)
    rollout/tp<N>/rollout.safetensors, rollout.json
    targets/targets.safetensors, targets.json
    scores/<precision>-<control>/<role>/{outputs,grads,updates,moments}.safetensors, meta.json
    matrix/matrix.json           the matrix snapshot taken when the reference started (sealed)
    reference.json               summary: rollout digest, controls, versions, platform
  acceptance/acceptance.json, acceptance/bounds/<role>-<family>.json
  candidates/<case>/...          per-case evidence; candidates/verdict.json
  rounds/vllm-tp<N>/verdict.json  one sealed rounds run per vLLM TP degree
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROLES_TRAINED = ("actor", "critic")
ROLES_ALL = ("actor", "reference", "critic", "reward")


@dataclass(frozen=True, slots=True)
class RunLayout:
    """Paths of one run directory."""

    root: Path

    @property
    def models(self) -> Path:
        return self.reference / "models"

    def model(self, role: str) -> Path:
        return self.models / role

    @property
    def reference(self) -> Path:
        return self.root / "reference"

    def rollout(self, tp: int) -> Path:
        return self.reference / "rollout" / f"tp{tp}"

    @property
    def targets(self) -> Path:
        return self.reference / "targets"

    def scores(self, precision: str, control: str, role: str) -> Path:
        return self.reference / "scores" / f"{precision}-{control}" / role

    @property
    def reference_summary(self) -> Path:
        return self.reference / "reference.json"

    @property
    def matrix_snapshot(self) -> Path:
        """reference/matrix/: the matrix as the reference stage first saw it (sealed; freeze takes the rule from it)."""
        return self.reference / "matrix"

    @property
    def acceptance_dir(self) -> Path:
        return self.root / "acceptance"

    @property
    def acceptance(self) -> Path:
        return self.acceptance_dir / "acceptance.json"

    @property
    def bounds(self) -> Path:
        return self.acceptance_dir / "bounds"

    @property
    def candidates(self) -> Path:
        return self.root / "candidates"

    def case(self, name: str) -> Path:
        return self.candidates / name

    @property
    def verdict(self) -> Path:
        return self.candidates / "verdict.json"

    @property
    def rounds(self) -> Path:
        return self.root / "rounds"

    def rounds_dir(self, tp: int) -> Path:
        """One sealed rounds run per vLLM TP degree, with its verdict.json."""
        return self.rounds / f"vllm-tp{tp}"


def rounds_case(tp: int) -> str:
    """The case name of a rounds run in its verdict rows: its directory's name under rounds/."""
    return f"rounds-vllm-tp{tp}"


def default_run_dir(matrix_name: str) -> Path:
    """runs/<matrix name> under the current directory."""
    return Path("runs") / matrix_name
