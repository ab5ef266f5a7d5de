"""Where each role's checkpoint lives: made from the seed under the run (tiny) or named by the matrix."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qualify.matrix import Matrix

ROLES = ("actor", "reference", "critic", "reward")
"""Every role of the family: the trained actor and critic, the frozen reference policy and reward model."""


def model_dirs(matrix: Matrix, models_dir: Path) -> dict[str, Path]:
    """Every role's checkpoint directory (not made or checked here: qualify.reference.stage.prepare_models makes them)."""
    if matrix.models.tiny is not None:
        return {role: Path(models_dir) / role for role in ROLES}
    c = matrix.models.checkpoints
    return {role: matrix.resolve(getattr(c, role)) for role in ROLES}


def model_dir(matrix: Matrix, models_dir: Path, role: str) -> Path:
    """One role's checkpoint directory."""
    return model_dirs(matrix, models_dir)[role]
