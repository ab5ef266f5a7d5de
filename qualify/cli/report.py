"""`qualify report`: summarize a run directory as tables, Markdown or JSON."""

from __future__ import annotations

from qualify.cli.notbuilt import not_built
from qualify.cli.options import RunDirArg

NAME = "report"
HELP = "Summarize a run directory as tables, Markdown or JSON."
EPILOG = "Examples:  qualify report runs/tiny-qwen3"


def main(run_dir: RunDirArg) -> None:
    not_built(NAME)
