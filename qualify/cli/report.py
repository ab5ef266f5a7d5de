"""`qualify report`: summarize a run directory at a glance (terminal, Markdown or JSON)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from qualify.cli.options import RunDirArg

NAME = "report"
HELP = "Summarize a run directory: reference, acceptance, candidate verdicts, rounds."
EPILOG = "Examples:  qualify report runs/tiny-qwen3  |  qualify report runs/tiny-qwen3 --format markdown --out report.md"


class ReportFormat(str, Enum):
    text = "text"
    markdown = "markdown"
    json = "json"


def main(
    run_dir: RunDirArg,
    format: Annotated[ReportFormat, typer.Option("--format", help="Output format.")] = ReportFormat.text,
    out: Annotated[Path | None, typer.Option("--out", help="Write the report to this file.")] = None,
) -> None:
    from rich.console import Console
    from rich.markdown import Markdown

    from qualify.report import summarize, to_markdown
    from qualify.store import dumps_json

    summary = summarize(run_dir)
    text = dumps_json(summary) if format is ReportFormat.json else to_markdown(summary)
    if out is not None:
        out.write_text(text)
        typer.echo(f"report written to {out}")
    elif format is ReportFormat.text:
        Console(width=160).print(Markdown(text))
    else:
        typer.echo(text, nl=False)
    candidates = summary["candidates"]
    if candidates is not None and not candidates["passed"]:
        raise typer.Exit(1)
