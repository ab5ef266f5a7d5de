"""Rendering of library results as rich text or JSON (no computation here)."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from qualify.cli.options import Format
from qualify.manifest import VerifyReport


def echo_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, sort_keys=True))


def render_verify(report: VerifyReport, fmt: Format) -> None:
    if fmt is Format.json:
        echo_json(report.to_json())
        return
    console = Console()
    if report.ok:
        console.print(f"[green]OK[/green] {report.num_files} files match {report.manifest} (evidence {report.evidence})")
        return
    for path in report.missing:
        console.print(f"[red]missing [/red] {path}")
    for path in report.extra:
        console.print(f"[red]extra   [/red] {path}")
    for m in report.modified:
        detail = (f"size {m.expected_bytes} -> {m.actual_bytes}" if m.expected_bytes != m.actual_bytes
                  else f"sha256 {m.expected_sha256[:12]} -> {m.actual_sha256[:12]}")
        console.print(f"[red]modified[/red] {m.path} ({detail})")
    for old, new in report.renamed:
        console.print(f"[yellow]renamed?[/yellow] {old} -> {new} (same content)")
    console.print(f"[bold red]FAILED[/bold red] {len(report.missing)} missing, {len(report.extra)} extra, "
                  f"{len(report.modified)} modified of {report.num_files} files")


def table(title: str, columns: list[str], rows: list[list[Any]]) -> Table:
    t = Table(title=title, show_lines=False)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*[str(v) for v in r])
    return t
