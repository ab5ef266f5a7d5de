"""The one loader of matrix files: a YAML file read strictly into a validated Matrix (qualify.schema), checked against
a checkpoint family's config.json where there is one."""

from __future__ import annotations

from pathlib import Path

from qualify.matrix.top import Matrix
from qualify.schema import load_yaml_file


def load_matrix(path: Path | str) -> Matrix:
    """Read and validate a matrix YAML file (for checkpoint models, against the actor's config.json too)."""
    matrix = load_yaml_file(Matrix, path, "matrix file", {"source": str(path)})
    if matrix.models.checkpoints is not None:
        matrix.check_checkpoint_family()
    return matrix


def matrix_files(directory: Path) -> list[Path]:
    """Matrix files in a directory."""
    return sorted(p for p in Path(directory).glob("*.yaml"))
