"""Cluster profiles: where and how the stage jobs run (sbatch/clusters/*.yaml).

A profile names the partition, account and QOS, the shape of one node (GPUs, CPUs,
memory), a time limit per stage, how the environment is activated and which variables
must be exported before any process starts. Jobs get a share of a node in proportion
to what they use: GPUs on a GPU cluster, processes on a CPU cluster (gpus_per_node 0).
Every string of a profile lands in a rendered script, so each must be one line of
printable ASCII: a newline would inject a line (an #SBATCH directive, a command).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qualify.schema import load_yaml_file, show

STAGES = ("reference", "freeze", "candidate", "verdict")
_TIME = re.compile(r"(\d+-)?\d{1,2}:\d{2}:\d{2}|\d+")  # D-HH:MM:SS, HH:MM:SS or minutes (fullmatch)
_MEM = re.compile(r"(\d+)([MGT]?)")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SLURM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+@,-]*")  # partition, account, QOS, GPU type
_MEM_MB = {"": 1, "M": 1, "G": 1024, "T": 1024 * 1024}


def _one_line(value: str) -> bool:
    """Printable ASCII without line breaks or other control characters."""
    return value.isascii() and value.isprintable()


def _check_one_line(obj: Any) -> None:
    """Every string of obj's fields (alone, in a tuple, a dict key or value) is one line of printable ASCII."""
    for f in dataclasses.fields(obj):
        if f.name == "source":  # the loader's own record of the file path, never rendered into a script
            continue
        value = getattr(obj, f.name)
        items = (value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, tuple)
                 else [(None, value)])
        for key, v in items:
            for text in (key, v) if isinstance(key, str) else (v,):
                if isinstance(text, str) and not _one_line(text):
                    where = (f.name if key is None else f"{f.name}[{key}]" if isinstance(key, int)
                             else f"{f.name}.{key}" if _one_line(key) else f"{f.name} key")
                    quoted = show(text).encode("ascii", "backslashreplace").decode("ascii")
                    raise ValueError(f"{where}: {quoted} must be one line of printable ASCII (it is written "
                                     "into the sbatch scripts)")


@dataclass(kw_only=True, slots=True, frozen=True)
class StageTimes:
    """Wall-clock limit per stage job (sbatch --time: D-HH:MM:SS, HH:MM:SS or minutes)."""

    reference: str = "04:00:00"
    """vLLM capture plus every HF reference score and control."""
    freeze: str = "00:30:00"
    """Bounds and acceptance manifest."""
    candidate: str = "02:00:00"
    """One candidate case (one array task)."""
    verdict: str = "00:30:00"
    """Collecting the verdict and verifying the acceptance."""

    def __post_init__(self) -> None:
        for stage in STAGES:
            value = getattr(self, stage)
            if not (_one_line(value) and _TIME.fullmatch(value)):
                raise ValueError(f"time.{stage} {value!r} is not D-HH:MM:SS, HH:MM:SS or minutes")


@dataclass(kw_only=True, slots=True, frozen=True)
class Environment:
    """How a job activates its software before the first qualify process."""

    modules: tuple[str, ...] = ()
    """Environment modules, each loaded with `module load`."""
    venv: str | None = None
    """Virtual environment to activate (source VENV/bin/activate); relative to the job's working directory."""
    setup: tuple[str, ...] = ()
    """Further shell lines, verbatim, after modules and venv (container setup, a conda env, ...)."""

    def __post_init__(self) -> None:
        _check_one_line(self)


@dataclass(kw_only=True, slots=True, frozen=True)
class Profile:
    """One cluster: resources, limits, environment and the qualify command."""

    description: str = ""
    """One line for people."""
    partition: str | None = None
    """sbatch --partition (None: the cluster's default)."""
    account: str | None = None
    """sbatch --account."""
    qos: str | None = None
    """sbatch --qos."""
    gpus_per_node: int
    """GPUs on one node; 0 for a CPU cluster, where jobs get one CPU per process instead."""
    gpu_type: str | None = None
    """GPU type for --gres=gpu:TYPE:N (None: --gres=gpu:N)."""
    cpus_per_node: int
    """CPUs on one node; a GPU job gets cpus_per_node x gpus / gpus_per_node."""
    mem: str | None = None
    """Memory of one node (e.g. 1800G); jobs get the same share as of the CPUs or GPUs (None: no --mem)."""
    gpu_mem: str | None = None
    """Memory of one GPU (e.g. 81559M, as nvidia-smi gives it for an 80 GB card); qualify sbatch refuses a stage
    whose estimated need (qualify.memory) does not fit (None: not checked)."""
    time: StageTimes = field(default_factory=StageTimes)
    """Time limit per stage."""
    environment: Environment = field(default_factory=Environment)
    """Environment activation: modules, venv, container setup lines."""
    exports: dict[str, str] = field(default_factory=dict)
    """Variables exported before any process starts (CUBLAS_WORKSPACE_CONFIG, NCCL_*, VLLM_*)."""
    qualify: str = "qualify"
    """Command that runs qualify inside a job (e.g. 'apptainer exec --nv img.sif qualify')."""
    srun_args: tuple[str, ...] = ()
    """Extra srun options on every launch line (e.g. pyxis --container-image=...)."""
    sbatch_args: tuple[str, ...] = ()
    """Extra #SBATCH options on every job (e.g. --constraint=..., --exclusive)."""
    max_parallel_tasks: int | None = None
    """Most candidate array tasks running at once (--array=...%N; None: no limit)."""
    poll_seconds: float = 5.0
    """How often --wait asks squeue/scontrol for the state of the chain."""
    templates: str | None = None
    """Directory of sbatch templates, relative to this file (None: qualify's sbatch/templates)."""
    name: str = ""
    """Profile name (set by the loader: the file's stem)."""
    source: str = ""
    """Path of the YAML file (set by the loader)."""

    def __post_init__(self) -> None:
        _check_one_line(self)
        for key in ("partition", "account", "qos", "gpu_type"):
            value = getattr(self, key)
            if value is not None and not _SLURM_NAME.fullmatch(value):
                raise ValueError(f"{key} {value!r} is not a Slurm name (ASCII letters, digits and _ . + @ , -)")
        bad_args = [a for a in self.sbatch_args if not a.startswith("-")]
        if bad_args:
            raise ValueError(f"sbatch_args {bad_args} must be sbatch options (each starts with '-')")
        if self.gpus_per_node < 0 or self.cpus_per_node < 1:
            raise ValueError("gpus_per_node must be >= 0 and cpus_per_node >= 1")
        for key in ("mem", "gpu_mem"):
            value = getattr(self, key)
            if value is not None and not _MEM.fullmatch(value):
                raise ValueError(f"{key} {value!r} is not a size like 512000M, 1800G or 2T")
        if self.gpu_mem is not None and not self.gpus_per_node:
            raise ValueError("gpu_mem is set but gpus_per_node is 0")
        bad = sorted(k for k in self.exports if not _ENV_NAME.fullmatch(k))
        if bad:
            raise ValueError(f"exports: {bad} are not environment variable names")
        if self.gpus_per_node and "CUBLAS_WORKSPACE_CONFIG" not in self.exports:
            raise ValueError("a GPU profile must export CUBLAS_WORKSPACE_CONFIG (':4096:8'): cuBLAS reads it "
                             "once, at initialization, and without it its reductions are not reproducible")
        if self.max_parallel_tasks is not None and self.max_parallel_tasks < 1:
            raise ValueError("max_parallel_tasks must be >= 1")
        if not (math.isfinite(self.poll_seconds) and self.poll_seconds > 0):
            raise ValueError(f"poll_seconds must be a finite number > 0, got {self.poll_seconds}")

    @property
    def mem_mb(self) -> int | None:
        """Memory of one node in MiB (None: not set)."""
        if self.mem is None:
            return None
        number, unit = _MEM.fullmatch(self.mem).groups()
        return int(number) * _MEM_MB[unit]

    @property
    def gpu_mem_bytes(self) -> int | None:
        """Memory of one GPU in bytes (None: not set)."""
        if self.gpu_mem is None:
            return None
        number, unit = _MEM.fullmatch(self.gpu_mem).groups()
        return int(number) * _MEM_MB[unit] << 20

    def resolve(self, path: str) -> Path:
        """A path from the profile, relative to the profile file's directory."""
        p = Path(path).expanduser()
        return p if p.is_absolute() else Path(self.source).parent / p


def load_profile(path: Path | str) -> Profile:
    """Read and validate a cluster profile; unknown keys are errors naming the key and the file."""
    path = Path(path)
    return load_yaml_file(Profile, path, "cluster profile", {"name": path.stem, "source": str(path)})
