"""Launching candidate cases: the spec in the case's work directory, torchrun over the worker, the log and its tail.

Used by the candidate stage (a group of cases sharing engine and TP per launch) and by rounds (the
trainer's step is a candidate case), so both launch a case the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from qualify.candidate.spec import CaseSpec
from qualify.store import write_json

TAIL_LINES = 30


def work_dir(case_dir: Path | str) -> Path:
    """<case>.work/: spec, launch log and engine scratch, beside the sealed evidence directory, outside it."""
    return Path(str(case_dir) + ".work")


def write_spec_file(spec: CaseSpec) -> Path:
    """Write the case's spec.json into its work directory; return its path."""
    work = work_dir(spec.case_dir)
    work.mkdir(parents=True, exist_ok=True)
    write_json(work / "spec.json", spec.to_json())
    return work / "spec.json"


def launch(spec_paths: Path | list[Path], tp: int, device: str, log_path: Path) -> int:
    """torchrun the worker with tp ranks over one or more case specs; returns its exit code, output in log_path."""
    paths = [spec_paths] if isinstance(spec_paths, Path) else list(spec_paths)
    env = dict(os.environ)
    if device == "cpu":
        cpus = int(os.environ.get("SLURM_CPUS_PER_TASK") or len(os.sched_getaffinity(0)))  # the allocation, not the node
        env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // tp)))
        env.setdefault("DS_ACCELERATOR", "cpu")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}",
           "-m", "qualify.candidate.worker", *map(str, paths)]
    with open(log_path, "w") as log:
        return subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode


def log_tail(log_path: Path, code: int) -> str:
    """'exit N; log PATH:' and the log's last TAIL_LINES lines."""
    tail = "\n".join(Path(log_path).read_text(errors="replace").splitlines()[-TAIL_LINES:])
    return f"exit {code}; log {log_path}:\n{tail}"
