"""Submit a rendered chain with sbatch --parsable, each job after its predecessors (afterok)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from pathlib import Path

from qualify.errors import SlurmError
from qualify.slurm.render import Chain


def slurm(*args: str) -> subprocess.CompletedProcess[str]:
    """Run a Slurm client command; a missing client is a SlurmError."""
    try:
        return subprocess.run(list(args), capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise SlurmError(f"{args[0]} not found: run on a Slurm login node (or start scripts/slurm-local.sh)") from exc


def submit_chain(chain: Chain) -> dict[str, str]:
    """Submit every job in chain order; return job key -> Slurm job id.

    If sbatch refuses a job, the jobs already submitted are cancelled (no half chain is left
    waiting on a dependency that never comes) and the refusal is raised as a SlurmError.
    """
    logs = Path(chain.run) / "slurm" / "logs"
    logs.mkdir(parents=True, exist_ok=True)  # Slurm does not create the --output directory
    ids: dict[str, str] = {}
    for job in chain.jobs:
        args = ["sbatch", "--parsable"]
        if job.after:
            args.append("--dependency=afterok:" + ":".join(ids[key] for key in job.after))
        proc = slurm(*args, str(chain.out / job.file))
        if proc.returncode != 0:
            cancel(ids.values())
            undone = f"; cancelled the {len(ids)} jobs already submitted" if ids else ""
            raise SlurmError(f"sbatch refused {chain.out / job.file}: {proc.stderr.strip() or proc.stdout.strip()}"
                             f"{undone}")
        ids[job.key] = proc.stdout.strip().split(";")[0]  # --parsable prints "id" or "id;cluster"
    return ids


def cancel(job_ids: Iterable[str]) -> None:
    """scancel the given jobs (best effort: a job that already ended is fine)."""
    ids = list(job_ids)
    if ids:
        slurm("scancel", *ids)
