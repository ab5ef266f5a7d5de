"""`qualify rounds`: run two PPO rounds with live actor-weight installation into vLLM, and the rejection probes."""

from __future__ import annotations

from qualify.cli.notbuilt import not_built
from qualify.cli.options import MatrixArg

NAME = "rounds"
HELP = "Run two PPO rounds with live actor-weight installation into vLLM, and the rejection probes."
EPILOG = "Examples:  qualify rounds matrices/tiny-qwen3.yaml --engine torch-tp"


def main(matrix: MatrixArg) -> None:
    not_built(NAME)
