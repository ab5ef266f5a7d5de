"""The checks of a matrix against this machine's disk: a checkpoint family's shapes read from the actor's config.json,
and what the matrix names that is not here (checkpoint directories, the prompts file). Paths in a matrix are relative
to the matrix file's directory (resolve)."""

from __future__ import annotations

import json
from pathlib import Path

from qualify.errors import MatrixError
from qualify.matrix.models import Checkpoints, Models
from qualify.matrix.rollout import Rollout
from qualify.roles import MODEL_ROLES

FAMILY_KEYS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
"""What read_checkpoint_family reads of the actor's config.json: the sizes every TP degree must divide, the vocab."""


def resolve(source: str, path: str) -> Path:
    """A path from the matrix, relative to the directory of the matrix file source."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else (Path(source).parent / p)


def read_checkpoint_family(source: str, checkpoints: Checkpoints) -> list[int] | None:
    """The actor's num_attention_heads, num_key_value_heads, intermediate_size and vocab_size from its config.json
    (FAMILY_KEYS), None when there is no config.json.

    A missing directory is not an error here (the matrix may be written before the checkpoints are copied):
    the reference stage reports it when it needs the files.
    """
    config_path = resolve(source, checkpoints.actor) / "config.json"
    if not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise MatrixError(f"{source}: models.checkpoints.actor: cannot read {config_path}: "
                          f"{type(exc).__name__}") from exc
    values = [config.get(k) if isinstance(config, dict) else None for k in FAMILY_KEYS]
    if not all(type(v) is int and v > 0 for v in values):
        raise MatrixError(f"{source}: models.checkpoints.actor: {config_path} lacks positive integers "
                          f"{', '.join(FAMILY_KEYS)}")
    return values


def missing_here(source: str, models: Models, rollout: Rollout) -> list[str]:
    """What the matrix names that is not on this machine (checkpoint directories without config.json, the prompts
    file): the reference stage would stop on each."""
    out = []
    if models.checkpoints is not None:
        for role in MODEL_ROLES:
            where = getattr(models.checkpoints, role)
            if not (resolve(source, where) / "config.json").is_file():
                out.append(f"models.checkpoints.{role} {where} (no config.json there)")
    if rollout.prompts_file is not None and not resolve(source, rollout.prompts_file).is_file():
        out.append(f"rollout.prompts_file {rollout.prompts_file} (not a file)")
    return out
