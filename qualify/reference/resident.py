"""Tensors a reference stage measures many times, held on the metrics GPU while they fit.

A control's record compares the control's gradients, updates and moments with its families' r0 (or r0 replayed on
its decisions) and replays its AdamW step from its fp64 start (qualify.reference.summary.control_record). Left on the
host, each of those comparisons copied both sides to the GPU again, tensor by tensor: at the Qwen3-0.6B shape about
22 GB of host-to-device copies a control, for 13.5 s (fp32) to 22 s (bf16) of its record (benchmarks/LOG.md, session
17). Resident copies are made once: the control's run and its replay for the record, and per stage the r0 runs and
the fp64 starts every control of a role is measured against. What does not fit (at most CACHE_SHARE of the GPU for
what is kept, and everything within what the device has free) stays where it was: the metrics move it per tensor, as
before. The values are the same wherever a tensor lies (qualify.metrics computes on the metrics device either way).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from qualify.compare import RunTensors
from qualify.metrics import metrics_device
from qualify.store import TensorFile

HEADROOM = 4 << 30
"""Bytes of the GPU left free whatever is made resident."""

CACHE_SHARE = 0.3
"""The share of the GPU's memory the stage-long cache (r0 runs, fp64 starts) may hold."""


def gpu_room(device: torch.device) -> int:
    """Bytes this process can still place on device: what the driver has free and what torch's allocator holds
    unused, less HEADROOM."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) - HEADROOM


def steps_bytes(steps: Sequence[RunTensors]) -> int:
    """Bytes of the steps' gradients, updates and moments (read from their files' headers where they are files)."""
    total = 0
    for s in steps:
        for group in (s.grads, s.updates, s.moments):
            for name in group:
                if isinstance(group, TensorFile):
                    shape, dtype = group.spec(name)
                    total += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                else:
                    total += group[name].numel() * group[name].element_size()
    return total


def _moved(group: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {n: t.to(device) for n, t in group.items()}


def on_device(steps: Sequence[RunTensors], device: torch.device) -> list[RunTensors]:
    """The steps with their gradients, updates and moments on device (outputs stay on the host, where the records'
    decisions and loss terms are computed)."""
    return [dataclasses.replace(s, grads=_moved(s.grads, device), updates=_moved(s.updates, device),
                                moments=_moved(s.moments, device)) for s in steps]


class Resident:
    """Per reference stage: which copies are on the metrics GPU, and the stage-long ones (r0 runs by directory, fp64
    starts by role). On the CPU (no metrics device) every method returns what it was given."""

    def __init__(self) -> None:
        device = metrics_device()
        self.device = device if device is not None and device.type == "cuda" else None
        self.kept: dict[Any, Any] = {}
        self.kept_bytes = 0

    def transient(self, steps: Sequence[RunTensors]) -> Sequence[RunTensors]:
        """steps on the GPU for one record when they fit in its free memory, else as they are."""
        if self.device is None or steps_bytes(steps) > gpu_room(self.device):
            return steps
        return on_device(steps, self.device)

    def base(self, directory: Path, steps: Sequence[RunTensors]) -> Sequence[RunTensors]:
        """A sealed r0's steps (read from directory), kept on the GPU for the rest of the stage when they fit within
        the cache's share, else as they are."""
        key = ("base", Path(directory))
        if key in self.kept:
            return self.kept[key]
        return self._keep(key, steps, steps_bytes(steps), lambda: on_device(steps, self.device))

    def start(self, role: str, initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The role's initial parameters in fp64 (every step's start begins there), kept on the GPU when they fit."""
        key = ("start", role)
        if key in self.kept:
            return self.kept[key]
        nbytes = sum(t.numel() * 8 for t in initial.values())
        return self._keep(key, initial, nbytes, lambda: {n: t.to(self.device).double() for n, t in initial.items()})

    def _keep(self, key: Any, given: Any, nbytes: int, make: Any) -> Any:
        if self.device is None:
            return given
        total = torch.cuda.get_device_properties(self.device).total_memory
        if self.kept_bytes + nbytes > CACHE_SHARE * total or nbytes > gpu_room(self.device):
            return given
        self.kept[key] = made = make()
        self.kept_bytes += nbytes
        return made
