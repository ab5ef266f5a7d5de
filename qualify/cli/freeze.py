"""`qualify freeze`: freeze a reference into an acceptance manifest and per-tensor bounds; never widens a bound."""

from __future__ import annotations

from qualify.cli.notbuilt import not_built
from qualify.cli.options import RunDirArg

NAME = "freeze"
HELP = "Freeze a reference into an acceptance manifest and per-tensor bounds; never widens a bound."
EPILOG = "Examples:  qualify freeze runs/tiny-qwen3"


def main(run_dir: RunDirArg) -> None:
    not_built(NAME)
