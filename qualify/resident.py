"""Tensors a stage measures many times, held on the metrics GPU while they fit: the reference's control records and
the candidate stage's (and `qualify report`'s) judging.

A control's record compares the control's gradients, updates and moments with its families' r0 (or r0 replayed on
its decisions) and replays its AdamW step from its fp64 start (qualify.reference.summary.control_record); a case's
judging compares its gradients with two r0 runs, replays its AdamW step once per family, derives its grad norm,
moments and updates and counts its bf16-exact elements (qualify.judge.case.judge_case). Left on the host, each of
those comparisons copied both sides to the GPU again, tensor by tensor: several copies of every gradient, update and
moment a control record or a case, which at the Qwen3-0.6B shape took most of a record's time (benchmarks/LOG.md,
"the reference's records on the GPU").
Resident copies are made once: the run measured (a control, a case) and a replay for that record or case, and per
stage the r0 runs and the fp64 starts every control or case of a role is measured against. What does not fit (at
most CACHE_SHARE of the GPU for what is kept, and everything within what the device has free) stays where it was:
the metrics move it per tensor, as before. The values are the same wherever a tensor lies (qualify.metrics computes
on the metrics device either way).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
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


def meminfo(field: str) -> int:
    """Bytes of a /proc/meminfo field ('MemAvailable', 'MemTotal'; 0 when it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))
    except (OSError, StopIteration, ValueError):
        return 0


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
    if isinstance(group, TensorFile):  # read (a coded tensor decoded) straight onto the device
        return {n: group.tensor(n, device) for n in group}
    return {n: t.to(device) for n, t in group.items()}


def on_device(steps: Sequence[RunTensors], device: torch.device) -> list[RunTensors]:
    """The steps with their gradients, updates and moments on device (outputs stay on the host, where decisions, loss
    terms and the derivations of outputs are computed)."""
    return [dataclasses.replace(s, grads=_moved(s.grads, device), updates=_moved(s.updates, device),
                                moments=_moved(s.moments, device)) for s in steps]


def on_demand(steps: Sequence[RunTensors], device: torch.device) -> list[RunTensors]:
    """The steps with their gradient, update and moment files read onto device tensor by tensor, when asked (a coded
    tensor decoded there): what does not fit is not moved by the host's decoder."""
    def view(group: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        return group.on(device) if isinstance(group, TensorFile) else group

    return [dataclasses.replace(s, grads=view(s.grads), updates=view(s.updates), moments=view(s.moments))
            for s in steps]


class Resident:
    """Per stage: which copies are on the metrics GPU, and the stage-long ones (r0 runs by directory, fp64 starts by
    role). device: where copies are held (default the metrics device when it is a GPU; none on the CPU, where every
    method returns what it was given; the CPU itself holds whole runs in host memory, which tests compare with
    per-tensor reads)."""

    def __init__(self, device: torch.device | None | str = "metrics") -> None:
        if device == "metrics":
            found = metrics_device()
            device = found if found is not None and found.type == "cuda" else None
        self.device: torch.device | None = None if device is None else torch.device(device)
        self.kept: dict[Any, Any] = {}
        self.kept_bytes = 0
        self.reserved: Callable[[], int] = lambda: 0  # bytes left to others now (reserving)
        self.frugal = False  # after an out-of-memory (drop): nothing whole is copied any more, tensor by tensor

    @contextlib.contextmanager
    def reserving(self, reserved: Callable[[], int]) -> Iterator[None]:
        """Within the block, leave reserved() bytes of the device to other processes (the launches running beside the
        judge, qualify.candidate.schedule.LaunchPlan.reserved, asked at every room()): room() counts as taken what of
        it they do not hold yet."""
        if self.device is None:
            yield
            return
        self.reserved = reserved
        try:
            yield
        finally:
            self.reserved = lambda: 0

    def drop(self) -> None:
        """Give back every copy held on the device (the stage-long ones too), the decoded tensors the open DecodeCache
        holds there (qualify.tensor_codec.decoding) and the allocator's cache: after an out-of-memory, what is judged
        next is read tensor by tensor (transient() finds no room, base() keeps none until there is)."""
        from qualify.tensor_codec import open_cache

        self.kept.clear()
        self.kept_bytes = 0
        self.frugal = True
        decoded = open_cache()
        if self.device is not None:
            if decoded is not None:
                decoded.release(self.device)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def room(self) -> int:
        """Bytes that may still be placed where the copies are held (less what is reserved for others and not yet
        taken by them)."""
        assert self.device is not None
        reserved = self.reserved()
        if self.device.type != "cuda":
            return meminfo("MemAvailable") - HEADROOM - reserved
        room = gpu_room(self.device)
        if reserved:
            free, total = torch.cuda.mem_get_info(self.device)
            others = total - free - torch.cuda.memory_reserved(self.device)  # other processes' memory on it now
            room -= max(0, reserved - others)
        return room

    def total(self) -> int:
        """Bytes of memory where the copies are held (CACHE_SHARE of it for what is kept)."""
        assert self.device is not None
        if self.device.type == "cuda":
            return torch.cuda.get_device_properties(self.device).total_memory
        return meminfo("MemTotal")

    def transient(self, steps: Sequence[RunTensors]) -> Sequence[RunTensors]:
        """steps on the device for one record or case when they fit in its free memory, else read onto it tensor by
        tensor as the metrics ask (on_demand: a real model's coded case is decoded there, not on the host)."""
        if self.device is None:
            return steps
        if self.frugal or steps_bytes(steps) > self.room():
            return on_demand(steps, self.device)
        return on_device(steps, self.device)

    def base(self, directory: Path, steps: Sequence[RunTensors]) -> Sequence[RunTensors]:
        """A sealed r0's steps (read from directory), kept on the device for the rest of the stage when they fit
        within the cache's share, else as they are."""
        key = ("base", Path(directory))
        if key in self.kept:
            return self.kept[key]
        return self._keep(key, steps, steps_bytes(steps), lambda: on_device(steps, self.device))

    def start(self, role: str, initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The role's initial parameters in fp64 (every step's start begins there), kept on the device when they
        fit."""
        key = ("start", role)
        if key in self.kept:
            return self.kept[key]
        nbytes = sum(t.numel() * 8 for t in initial.values())
        return self._keep(key, initial, nbytes, lambda: {n: t.to(self.device).double() for n, t in initial.items()})

    def _keep(self, key: Any, given: Any, nbytes: int, make: Any) -> Any:
        if self.device is None or self.frugal:
            return given
        if self.kept_bytes + nbytes > CACHE_SHARE * self.total() or nbytes > self.room():
            return given
        self.kept[key] = made = make()
        self.kept_bytes += nbytes
        return made

