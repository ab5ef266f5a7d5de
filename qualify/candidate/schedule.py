"""How the candidate stage shares its GPUs between the launches it runs at once and its own judging.

A launch is admitted only when its estimated peak on each GPU its ranks use (qualify.memory.candidate_need, the
largest of its cases, plus the CUDA context) fits beside the launches already running there and what the judge's
process holds on that GPU, within what the GPU had free when the stage started (less HEADROOM). A launch that fits
nowhere beside others waits for one to end; alone it always starts (then it has the GPU to itself, as it would with
`--launches 1`). A launch retried after a failed group launch runs alone: whatever the estimate missed, it is not
fighting another launch or the judge's copies for the memory. The judge's copies (qualify.resident) are sized
against what the running launches may still take (reserved()), so no combination of launches and copies is planned
beyond the GPU.

QUALIFY_GPU_MEMORY (bytes, or with a GiB suffix: '80GiB') caps what the stage plans for on each GPU, for a GPU
shared with other work, or to plan a smaller card's run on a larger one.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from qualify.resident import HEADROOM

GiB = 1 << 30
ESTIMATE_MARGIN = 1.25
"""A launch's planned bytes are its estimate times this: qualify.memory models state, activations and logits, not the
allocator's cache, which a case's process adds on top (benchmarks/LOG.md, "The candidate stage's GPU plan")."""
CAP_ENV = "QUALIFY_GPU_MEMORY"


def parse_bytes(text: str) -> int:
    """'85899345920', '80GiB', '80 GiB', '512MiB' as bytes; anything else is a ValueError naming the variable."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(GiB|MiB|)\s*", text)
    if not match:
        raise ValueError(f"{CAP_ENV}={text!r}: expected bytes or a size such as '80GiB' or '512MiB'")
    scale = {"GiB": GiB, "MiB": 1 << 20, "": 1}[match.group(2)]
    return int(float(match.group(1)) * scale)


def gpu_budgets(num_gpus: int) -> dict[int, int]:
    """Per GPU index, the bytes the stage may plan for: what the driver reports free now (other processes' memory is
    not the stage's), capped by QUALIFY_GPU_MEMORY, less HEADROOM."""
    import torch

    cap = os.environ.get(CAP_ENV)
    out = {}
    for index in range(num_gpus):
        free, _ = torch.cuda.mem_get_info(index)
        free += torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
        if cap:
            free = min(free, parse_bytes(cap))
        out[index] = max(0, free - HEADROOM)
    return out


class LaunchPlan:
    """Which launches run now and what each may take on each GPU; thread-safe (launches are admitted from the stage's
    launch threads, reserved() is read by the judge in the stage's own thread).

    budgets: bytes the stage may plan for per GPU index (gpu_budgets); judge_held: bytes the judge's process holds
    on a GPU now (torch.cuda.memory_reserved: its copies, its decoded tensors and its allocator's cache). With no
    budgets (a CPU stage) every launch is admitted at once and nothing is reserved.
    """

    def __init__(self, budgets: dict[int, int] | None = None, judge_held: Callable[[int], int] | None = None) -> None:
        self.budgets = budgets or {}
        self.judge_held = judge_held or (lambda index: 0)
        self.running: dict[int, dict[int, int]] = {}  # launch id -> bytes planned per GPU index
        self.alone = 0  # launches running alone (nothing else may start beside them)
        self.waited = 0  # admissions that had to wait (information for the stage log)
        self._ids = 0
        self._cond = threading.Condition()

    def planned(self, index: int) -> int:
        """Bytes the running launches may take on GPU index."""
        return sum(per.get(index, 0) for per in self.running.values())

    def reserved(self, index: int = 0) -> int:
        """What the judge must leave on GPU index for the launches running now (their planned bytes)."""
        with self._cond:
            return self.planned(index)

    def fits(self, need: dict[int, int], alone: bool) -> bool:
        """Whether a launch needing need (bytes per GPU index) may start now."""
        if not self.running:
            return True
        if alone or self.alone:
            return False
        return all(self.planned(i) + n + self.judge_held(i) <= self.budgets.get(i, 0) for i, n in need.items())

    @contextlib.contextmanager
    def admit(self, need: dict[int, int], alone: bool = False) -> Iterator[None]:
        """Within the block a launch runs with need (bytes per GPU index) planned for it; waits until it fits (see
        the module). alone: nothing else runs beside it."""
        if not self.budgets:
            yield
            return
        with self._cond:
            if not self.fits(need, alone):
                self.waited += 1
            while not self.fits(need, alone):
                self._cond.wait(timeout=1.0)  # the judge's holdings change without notice: look again now and then
            self._ids += 1
            me = self._ids
            self.running[me] = dict(need)
            self.alone += alone
        try:
            yield
        finally:
            with self._cond:
                del self.running[me]
                self.alone -= alone
                self._cond.notify_all()


def launch_need(case_needs: list[int], ranks: int) -> dict[int, int]:
    """Bytes a launch plans for on each GPU its ranks use (rank r on GPU r): the largest of its cases' estimates
    (qualify.memory.candidate_need's GPU bytes, each with the CUDA context) times ESTIMATE_MARGIN."""
    need = int(max(case_needs) * ESTIMATE_MARGIN)
    return {index: need for index in range(ranks)}


def case_needs(models: dict[str, Path], rollout: Any, ppo: Any, reference: Any) -> Callable[[list[Any]], dict[int, int]]:
    """needs(group) for LaunchPlan: what a launch of the group's cases plans for per GPU, from each role's model
    (models: role -> checkpoint directory with its config.json) and the matrix's rollout, ppo and reference sections
    (the step's tokens)."""
    import json

    from qualify.memory import CONTEXT_BYTES, Workload, candidate_need, shape_from_config

    work = Workload.of(rollout, ppo, reference)
    shapes: dict[str, Any] = {}

    def needs(group: list[Any]) -> dict[int, int]:
        for case in group:
            if case.role not in shapes:
                config = json.loads((Path(models[case.role]) / "config.json").read_text())
                shapes[case.role] = shape_from_config(config, case.role)
        return launch_need([candidate_need(work, shapes, c).gpu_bytes + CONTEXT_BYTES for c in group],
                           group[0].world_size)

    return needs


def torch_gpus() -> int:
    """The CUDA devices this process sees."""
    import torch

    return torch.cuda.device_count()


def gpu_held(index: int) -> int:
    """Bytes this process's allocator holds on GPU index (0 before it has used CUDA)."""
    import torch

    return torch.cuda.memory_reserved(index) if torch.cuda.is_initialized() else 0


def judged_within_memory(judge: Callable[[], None], resident: Any, log: Any, what: str, retry: bool) -> bool:
    """judge(), and True; on a CUDA out-of-memory the judge's copies are given back (resident.drop(): from then on
    the stage judges tensor by tensor) and, with retry, judge() runs once more; without, False: the caller judges it
    later, once the launches that hold the memory have ended."""
    import torch

    try:
        judge()
        return True
    except torch.OutOfMemoryError as exc:
        resident.drop()
        said = (str(exc).splitlines() or ["CUDA out of memory"])[0][:200]
        if not retry:
            log.note(f"{what}: out of GPU memory beside the running launches ({said}); judged after them")
            return False
        log.note(f"{what}: out of GPU memory ({said}); judged again with nothing held, tensor by tensor")
    judge()
    return True
