"""A case's ranks: where they run and how each joins the launch's process group."""

from __future__ import annotations

import os
import socket

from qualify.case.spec import CaseSpec
from qualify.errors import EngineError
from qualify.matrix import Reference


def device_of(reference: Reference) -> str:
    """Where a case's ranks run: the reference section's device, auto = CUDA when present."""
    if reference.device != "auto":
        return reference.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def gpu_shortfall(ranks: int, visible: int | None = None) -> str | None:
    """Why ranks CUDA ranks cannot run on this host (one GPU a rank), or None when they can. visible: the GPUs this
    process sees (torch.cuda.device_count(), which creates no CUDA context, when not given)."""
    if visible is None:
        import torch

        visible = torch.cuda.device_count()
    if ranks <= visible:
        return None
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (f"{ranks} ranks on cuda need {ranks} GPUs on this host, {visible} visible"
            f"{f' (CUDA_VISIBLE_DEVICES={shown!r})' if shown is not None else ''}: run the case where {ranks} GPUs "
            f"are (qualify sbatch), leave it out of the matrix, or set reference.device: cpu")


def init_distributed(spec: CaseSpec) -> int:
    """Join the launch's process group (gloo on CPU, NCCL on GPU); return this rank. Under srun without torchrun the
    rank comes from Slurm's variables."""
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:  # srun without torchrun
        os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                          LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != spec.world_size:
        raise EngineError(f"case {spec.name} needs {spec.world_size} ranks (tp {spec.tp} x dp {spec.dp}), "
                          f"launched with {world}")
    if not dist.is_initialized():
        backend = "nccl" if spec.device == "cuda" else "gloo"
        if spec.device == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            short = gpu_shortfall(local + 1)
            if short:
                raise EngineError(f"case {spec.name}: {short}")
            torch.cuda.set_device(local)
        dist.init_process_group(backend=backend)
    return dist.get_rank()


def free_port() -> int:
    """A TCP port free on the loopback now, for rank 0's rendezvous store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(env: dict[str, str], rank: int, tp: int, port: str) -> dict[str, str]:
    """env with torchrun's variables for rank of tp, rendezvous on the loopback at port."""
    return dict(env, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(tp),
                LOCAL_WORLD_SIZE=str(tp), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
