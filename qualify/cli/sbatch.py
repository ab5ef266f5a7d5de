"""`qualify sbatch`: render (and submit, and follow) the Slurm job chain for the stages of a matrix."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qualify.cli.handler import EXIT_FAILED
from qualify.cli.options import LegacyOnlyOpt, MatrixArg, OnlyOpt

NAME = "sbatch"
HELP = ("Render the stages of a matrix as chained sbatch scripts (reference, freeze, candidate array, verdict; "
        "on a GPU cluster a rounds job per topology); --submit submits them, --wait follows them and exits with the chain's result.")
EPILOG = ("Examples:  qualify sbatch matrices/qwen3-8b.yaml --cluster sbatch/clusters/h100x4.yaml  "
          "|  qualify sbatch matrices/tiny-qwen3.yaml --cluster sbatch/clusters/local.yaml --only 'torch-tp-*' "
          "--submit --wait")

ClusterOpt = Annotated[Path, typer.Option("--cluster", help="Cluster profile YAML (see sbatch/clusters/).",
                                          show_default=False)]
ScriptsOpt = Annotated[Path | None, typer.Option("--out", help="Directory for the scripts (default: RUN/slurm).")]
RunOpt = Annotated[Path | None, typer.Option("--run", help="Run directory the jobs write (default: runs/<matrix name>).")]
TopologyOpt = Annotated[str | None, typer.Option(
    "--topology", help="Render the rounds job for this GPU topology only: dedicated or shared (default: one per "
                       "topology of the matrix's candidates.topologies).")]
SubmitOpt = Annotated[bool, typer.Option("--submit", help="Submit the chain with sbatch and print the job ids.")]
WaitOpt = Annotated[bool, typer.Option(
    "--wait", help="Submit, follow the chain live and exit 0 if every job completed, 1 if the verdict failed, 2 else.")]


def main(matrix: MatrixArg, cluster: ClusterOpt, out: ScriptsOpt = None, run: RunOpt = None,
         topology: TopologyOpt = None, only: OnlyOpt = None, submit: SubmitOpt = False,
         wait: WaitOpt = False, cases: LegacyOnlyOpt = None) -> None:
    # imported here: `qualify --help` and the other verbs should not pay for Slurm and rich.live
    from qualify.cli.slurm_view import ChainDisplay
    from qualify.errors import SlurmError
    from qualify.layout import default_run_dir
    from qualify.matrix import load_matrix
    from qualify.slurm.render import render_chain, write_chain
    from qualify.slurm.submit import submit_chain
    from qualify.slurm.watch import ChainWatch, follow

    run = run or default_run_dir(load_matrix(matrix).name)
    chain = render_chain(matrix, cluster, run=run, out=out or run / "slurm", topology=topology, cases=only or cases)
    write_chain(chain)
    for job in chain.jobs:
        typer.echo(f"rendered {chain.out / job.file}  ({_describe(job)})")
    if not (submit or wait):
        return
    ids = submit_chain(chain)
    for job in chain.jobs:
        after = f" (afterok:{':'.join(ids[k] for k in job.after)})" if job.after else ""
        typer.echo(f"submitted {job.file} job {ids[job.key]}{after}")
    if not wait:
        return
    try:
        with ChainDisplay() as display:
            outcome = follow(ChainWatch(chain, ids), chain.profile.poll_seconds, display)
    except KeyboardInterrupt:
        typer.echo(f"qualify: stopped following; the jobs keep running (scancel {' '.join(ids.values())})", err=True)
        raise typer.Exit(130) from None
    if outcome.code == 0:
        typer.echo(outcome.message)
        return
    if outcome.code == 1:
        typer.echo(f"qualify: {outcome.message}", err=True)
        raise typer.Exit(EXIT_FAILED)
    raise SlurmError(outcome.message)


def _describe(job) -> str:
    need = job.need
    parts = [job.stage]
    if job.cases:
        parts.append(f"{len(job.cases)} tasks")
    if need.gpus:
        parts.append(_plural(need.gpus, "GPU"))
    parts.append(_plural(need.cpus, "CPU"))
    if job.after:
        parts.append("after " + ", ".join(job.after))
    return ", ".join(parts)


def _plural(n: int, unit: str) -> str:
    return f"{n} {unit}" if n == 1 else f"{n} {unit}s"
