"""Digests of tensors and of weight versions, computed the same way by the harness and by every vLLM rank.

A tensor digest is sha256 over a header (dtype and shape) and the tensor's row-major bytes, with
negative zeros made positive first: a rank that reads its weight back through its own GEMM (see
qualify.rounds.vllm_ext) gets +0.0 where the checkpoint holds -0.0, and the two are the same weight.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from qualify.hashing import digest_of_bytes, sha256_tag
from qualify.store import dumps_json


def tensor_digest(t: torch.Tensor) -> str:
    """'sha256:<hex>' of dtype, shape and bytes of t (-0.0 counted as +0.0)."""
    t = t.detach().cpu().contiguous()
    if t.is_floating_point():
        t = t + 0.0  # -0.0 + 0.0 == +0.0 under round-to-nearest; every other value is unchanged
    h = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}:{list(t.shape)}\n".encode("ascii"))
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return sha256_tag(h.hexdigest())


def digests_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """name -> tensor_digest, for every tensor."""
    return {name: tensor_digest(t) for name, t in sorted(tensors.items())}


def version_digest(per_tensor: Mapping[str, str]) -> str:
    """One digest naming a whole weight version: sha256 of the sorted name -> digest JSON."""
    return digest_of_bytes(dumps_json(dict(per_tensor)).encode("ascii"))
