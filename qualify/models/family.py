"""Where each role's checkpoint lives: made from the seed under the run (tiny) or named by the matrix."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from qualify.roles import MODEL_ROLES

if TYPE_CHECKING:
    from qualify.matrix import Models

ROLES = MODEL_ROLES
"""Every role of the family: the trained actor and critic, the frozen reference policy and reward model."""


def model_dirs(models: Models, models_dir: Path, resolve: Callable[[str], Path]) -> dict[str, Path]:
    """Every role's checkpoint directory: under models_dir for a tiny family (made from its seed), else the matrix's
    checkpoint paths resolved by resolve (Matrix.resolve: relative to the matrix file). Not made or checked here
    (qualify.reference.stage.prepare_models makes them)."""
    if models.tiny is not None:
        return {role: Path(models_dir) / role for role in ROLES}
    return {role: resolve(getattr(models.checkpoints, role)) for role in ROLES}
