"""`qualify sbatch`: render (and submit) Slurm jobs for the stages of a matrix."""

from __future__ import annotations

from qualify.cli.notbuilt import not_built
from qualify.cli.options import MatrixArg

NAME = "sbatch"
HELP = "Render (and submit) Slurm jobs for the stages of a matrix."
EPILOG = "Examples:  qualify sbatch matrices/qwen3-8b.yaml --cluster sbatch/clusters/h100x4.yaml  |  ... --submit --wait"


def main(matrix: MatrixArg) -> None:
    not_built(NAME)
