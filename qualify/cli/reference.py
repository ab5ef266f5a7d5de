"""`qualify reference`: capture a fixed rollout with vLLM and score it with the independent HF reference, with controls."""

from __future__ import annotations

from qualify.cli.notbuilt import not_built
from qualify.cli.options import MatrixArg

NAME = "reference"
HELP = "Capture a fixed rollout with vLLM and score it with the independent HF reference, with controls."
EPILOG = "Examples:  qualify reference matrices/tiny-qwen3.yaml  |  qualify reference matrices/tiny-qwen3.yaml --out runs/t"


def main(matrix: MatrixArg) -> None:
    not_built(NAME)
