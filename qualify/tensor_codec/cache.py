"""What the reader keeps between reads in this process: the decoded moments and new parameters a later step's decode
reads again (the most recently used, by device), and one checkpoint directory's index of tensor names to shards."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from qualify.errors import EvidenceError

DECODED_BYTES = 256 << 20
"""How many bytes of decoded moments and new parameters a process holds in host memory (the most recently used)."""
DECODED_GPU_SHARE = 0.1
"""The share of a GPU's memory the decoded tensors held there may take: a step's moments and new parameters, which the
next step's decode reads (12 bytes a parameter: about 7 GB at the Qwen3-0.6B shape)."""
_DECODED: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_HELD: dict[str, int] = {}


def cached(path: Path, kind: str, name: str, device: torch.device,
           compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """compute(), or a copy of it from the decoded tensors held on that device (a later step's prediction reads
    the step before's moment and new parameter: without them every step would decode all the steps before it
    again)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, kind, name, str(device))
    held = _DECODED.get(key)
    if held is not None:
        _DECODED.move_to_end(key)
        return held.clone()
    value = compute()
    nbytes = value.numel() * value.element_size()
    if nbytes <= held_bytes(device) // 4:
        _DECODED[key] = value.clone()
        _HELD[key[-1]] = _HELD.get(key[-1], 0) + nbytes
        while _HELD[key[-1]] > held_bytes(device):
            oldest = next(k for k in _DECODED if k[-1] == key[-1])
            gone = _DECODED.pop(oldest)
            _HELD[key[-1]] -= gone.numel() * gone.element_size()
    return value


def held_bytes(device: torch.device) -> int:
    """How many bytes of decoded tensors may be held on device."""
    if device.type == "cuda":
        return int(DECODED_GPU_SHARE * torch.cuda.get_device_properties(device).total_memory)
    return DECODED_BYTES


def release(device: torch.device | str | None = None) -> None:
    """Drop the decoded tensors held (on device, or everywhere)."""
    where = None if device is None else str(torch.device(device))
    for key in [k for k in _DECODED if where is None or k[-1] == where]:
        gone = _DECODED.pop(key)
        _HELD[key[-1]] -= gone.numel() * gone.element_size()


_INDEX: dict[str, dict[str, Path]] = {}


def checkpoint_tensor(model_dir: Path, name: str) -> torch.Tensor | None:
    """One tensor of a checkpoint directory's safetensors shards, as stored (None when no shard holds that name): the
    start of a first step's coded update, read alone (a real model's parameters are never held whole for it)."""
    from safetensors import SafetensorError, safe_open

    key = str(Path(model_dir).resolve())
    if key not in _INDEX:
        index: dict[str, Path] = {}
        try:
            for shard in sorted(Path(key).glob("*.safetensors")):
                with safe_open(str(shard), framework="pt") as f:
                    index.update(dict.fromkeys(f.keys(), shard))
        except SafetensorError as exc:
            raise EvidenceError(f"{key}: a shard is not readable safetensors: {exc}") from exc
        _INDEX.clear()  # the model directory being read: one at a time
        _INDEX[key] = index
    shard = _INDEX[key].get(name)
    if shard is None:
        return None
    with safe_open(str(shard), framework="pt") as f:
        return f.get_tensor(name)

