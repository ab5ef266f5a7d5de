"""Rendering of library results as rich text or JSON (no computation here).

rich is imported inside the functions: every command module imports this one, and
`qualify verify` should not pay for rich's import before it has hashed anything.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import typer

from qualify.cli.options import Format

if TYPE_CHECKING:
    from rich.console import Console

    from qualify.manifest import VerifyReport


def echo_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, sort_keys=True))


def stdout_console() -> Console:
    """A console for results: soft wrap, so a long path stays on one line for grep and logs."""
    from rich.console import Console

    return Console(soft_wrap=True, highlight=False)


def render_verify(report: VerifyReport, fmt: Format) -> None:
    if fmt is Format.json:
        echo_json(report.to_json())
        return
    from rich.markup import escape  # file names are data: '[red]' in a name must print as itself

    console = stdout_console()
    if report.ok:
        present = report.num_files - len(report.missing)
        absent = f"; {len(report.missing)} absent from this partial copy" if report.missing else ""
        console.print(f"[green]OK[/green] {present} of {report.num_files} files match {escape(report.manifest)} "
                      f"(evidence {escape(report.evidence)}{absent})")
        return
    for path in report.missing:
        console.print(f"[red]missing [/red] {escape(path)}")
    for path in report.extra:
        console.print(f"[red]extra   [/red] {escape(path)}")
    for m in report.modified:
        detail = (f"size {m.expected_bytes} -> {m.actual_bytes}" if m.expected_bytes != m.actual_bytes
                  else f"sha256 {m.expected_sha256[:12]} -> {m.actual_sha256[:12]}")
        console.print(f"[red]modified[/red] {escape(m.path)} ({detail})")
    for old, new in report.renamed:
        console.print(f"[yellow]renamed [/yellow] {escape(old)} -> {escape(new)} (same content)")
    console.print(f"[bold red]FAILED[/bold red] {len(report.missing)} missing, {len(report.extra)} extra, "
                  f"{len(report.modified)} modified, {len(report.renamed)} renamed of {report.num_files} files "
                  f"in {escape(report.manifest)}")
