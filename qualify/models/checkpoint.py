"""Read the tensors of a local HF checkpoint directory (every *.safetensors file, HF names)."""

from __future__ import annotations

from pathlib import Path

import torch

from qualify.errors import EvidenceError
from qualify.store import read_tensors


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """name -> tensor over all safetensors shards; duplicate names are an error."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise EvidenceError(f"no *.safetensors in {model_dir}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        for name, tensor in read_tensors(f).items():
            if name in out:
                raise EvidenceError(f"{model_dir}: tensor {name} appears in more than one shard")
            out[name] = tensor
    return out


def quiet_transformers() -> None:
    """No per-load progress bars from transformers (stage progress is qualify's own)."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
