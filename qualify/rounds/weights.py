"""Actor weight versions of a rounds run: v0 is the actor checkpoint, v(n+1) = v(n) + the trainer's update.

A version is an HF checkpoint directory (model.safetensors in fp32, HF names, and the actor's
config), sealed as a stage, with version.json: the digest of every tensor, the version digest
(one name for the whole version) and the digests it was made from. The update is the candidate
worker's exported updates.safetensors (new - old fp32 parameters), so v(n+1) is the trainer's
new weights up to the rounding of (new - old) + old; HF, vLLM and the digests all use v(n+1).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qualify.errors import EvidenceError
from qualify.models.checkpoint import checkpoint_layout, checkpoint_tensors
from qualify.rounds.digests import digests_of, version_digest
from qualify.stages import complete_stage, prepare_stage, require_complete
from qualify.store import read_json, write_json, write_tensors

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILES = ("config.json", "generation_config.json")


@dataclass(frozen=True, slots=True)
class Version:
    """One actor version: its number, checkpoint directory, tensors and digests."""

    number: int
    path: Path
    tensors: dict[str, torch.Tensor]
    digests: dict[str, str]

    @property
    def digest(self) -> str:
        return version_digest(self.digests)

    @property
    def config(self) -> dict[str, Any]:
        return read_json(self.path / "config.json")

    @property
    def weights_file(self) -> Path:
        return self.path / WEIGHTS_FILE


def load_version(number: int, path: Path) -> Version:
    """A version from an HF checkpoint directory (all its safetensors shards, as fp32)."""
    tensors = {n: t.float() for n, t in checkpoint_tensors(path).items()}
    return Version(number, Path(path), tensors, digests_of(tensors))


def apply_update(prev: Version, updates: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """prev + updates in fp32, name for name; an update that misses or adds a tensor is refused."""
    missing, extra = sorted(set(prev.tensors) - set(updates)), sorted(set(updates) - set(prev.tensors))
    if missing or extra:
        raise EvidenceError(f"the trainer's update does not cover version {prev.number} name for name: "
                            f"missing {missing[:5]}, extra {extra[:5]}")
    bad = [n for n, u in updates.items() if u.shape != prev.tensors[n].shape]
    if bad:
        raise EvidenceError(f"update shapes differ from version {prev.number}: {bad[:5]}")
    return {n: prev.tensors[n] + updates[n].float() for n in sorted(prev.tensors)}


def write_version(prev: Version, updates: dict[str, torch.Tensor], out: Path, info: dict[str, Any]) -> Version:
    """Make and seal version prev.number + 1 in out (an HF checkpoint directory). updates are named as the model's
    parameters (a MoE layer's fused experts): they are applied to the checkpoint's tensors of the same elements."""
    tensors = apply_update(prev, checkpoint_layout(updates))
    prepare_stage(out)
    write_tensors(out / WEIGHTS_FILE, tensors)
    for name in CONFIG_FILES:
        if (prev.path / name).is_file():
            shutil.copyfile(prev.path / name, out / name)
    new = Version(prev.number + 1, Path(out), tensors, digests_of(tensors))
    write_json(out / "version.json", {"version": new.number, "digest": new.digest, "tensors": new.digests,
                                      "parent": {"version": prev.number, "digest": prev.digest},
                                      "update_digest": version_digest(digests_of(updates)), **info})
    complete_stage(out, {"version": new.number, "digest": new.digest})
    return new


def reload_version(number: int, path: Path) -> Version:
    """A sealed version written by write_version, checked against its recorded digest."""
    require_complete(path, f"actor version {number}")
    version = load_version(number, path)
    recorded = read_json(Path(path) / "version.json")["digest"]
    if version.digest != recorded:
        raise EvidenceError(f"actor version {number} at {path} has digest {version.digest}, recorded {recorded}")
    return version
