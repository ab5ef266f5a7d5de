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

    from qualify.cli.verify_text import verify_lines

    console = stdout_console()
    for style, tag, text in verify_lines(report):
        console.print(f"[{style}]{tag}[/{style}] {escape(text)}")
