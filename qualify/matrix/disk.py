"""The checks of a matrix against this machine's disk: a checkpoint family's shapes read from the actor's config.json,
and what the matrix names that is not here (checkpoint directories, the prompts file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from qualify.errors import MatrixError
from qualify.matrix.models import Models
from qualify.matrix.rollout import Rollout
from qualify.roles import MODEL_ROLES

CHECKPOINT_ROLES = MODEL_ROLES
"""The directories of models.checkpoints, in the order a missing one is named."""
FAMILY_KEYS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
"""What check_checkpoint_family reads of the actor's config.json: the sizes every TP degree must divide, the vocab."""


class OnDisk(Protocol):
    """What the disk checks read of a matrix (qualify.matrix.top.Matrix is one)."""

    source: str
    models: Models
    rollout: Rollout

    def resolve(self, path: str) -> Path: ...

    def check_family(self, num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int,
                     where: str) -> None: ...


def check_checkpoint_family(matrix: OnDisk) -> None:
    """For checkpoint models, check the TP degrees and EOS against the actor's config.json when it is there.

    A missing directory is not an error here (the matrix may be written before the checkpoints are copied):
    the reference stage reports it when it needs the files.
    """
    config_path = matrix.resolve(matrix.models.checkpoints.actor) / "config.json"
    if not config_path.is_file():
        return
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise MatrixError(f"{matrix.source}: models.checkpoints.actor: cannot read {config_path}: "
                          f"{type(exc).__name__}") from exc
    values = [config.get(k) if isinstance(config, dict) else None for k in FAMILY_KEYS]
    if not all(type(v) is int and v > 0 for v in values):
        raise MatrixError(f"{matrix.source}: models.checkpoints.actor: {config_path} lacks positive integers "
                          f"{', '.join(FAMILY_KEYS)}")
    try:
        matrix.check_family(*values, "models.checkpoints.actor config.json")
    except ValueError as exc:
        raise MatrixError(f"{matrix.source}: {exc}") from exc


def missing_here(matrix: OnDisk) -> list[str]:
    """What the matrix names that is not on this machine (checkpoint directories without config.json, the prompts
    file): the reference stage would stop on each."""
    out = []
    if matrix.models.checkpoints is not None:
        for role in CHECKPOINT_ROLES:
            where = getattr(matrix.models.checkpoints, role)
            if not (matrix.resolve(where) / "config.json").is_file():
                out.append(f"models.checkpoints.{role} {where} (no config.json there)")
    if matrix.rollout.prompts_file is not None and not matrix.resolve(matrix.rollout.prompts_file).is_file():
        out.append(f"rollout.prompts_file {matrix.rollout.prompts_file} (not a file)")
    return out
