"""`qualify candidate`: replay the engine x precision x TP x role matrix and judge every tensor against frozen bounds."""

from __future__ import annotations

from qualify.cli.notbuilt import not_built
from qualify.cli.options import MatrixArg

NAME = "candidate"
HELP = "Replay the engine x precision x TP x role matrix and judge every tensor against frozen bounds."
EPILOG = "Examples:  qualify candidate matrices/tiny-qwen3.yaml  |  qualify candidate matrices/tiny-qwen3.yaml --only 'torch-tp-*-tp2-*'"


def main(matrix: MatrixArg) -> None:
    not_built(NAME)
