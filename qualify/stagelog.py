"""Progress of long stages on stderr: a live spinner on a terminal, one line per step otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


class StageLog:
    """Reports each step of a stage (what runs now, how long it took, what was skipped)."""

    def __init__(self, stage: str, *, quiet: bool = False) -> None:
        from rich.console import Console
        from rich.markup import escape

        self.stage = stage
        self.prefix = escape(f"[{stage}]")
        self.console = Console(stderr=True, highlight=False)
        self.quiet = quiet
        self.started = time.monotonic()

    @contextmanager
    def step(self, description: str) -> Iterator[None]:
        """Show description while the body runs, then its duration."""
        t0 = time.monotonic()
        if self.quiet:
            yield
            return
        if sys.stderr.isatty():
            with self.console.status(f"[bold]{self.stage}[/bold] {escape_text(description)}"):
                yield
        else:
            self.console.print(f"{self.prefix} {escape_text(description)} ...")
            yield
        self.console.print(f"{self.prefix} {escape_text(description)}: done in {time.monotonic() - t0:.1f} s")

    def skip(self, description: str) -> None:
        """Note a step whose output is already complete and verified."""
        if not self.quiet:
            self.console.print(f"{self.prefix} {escape_text(description)}: complete, skipped")


def escape_text(text: str) -> str:
    """Text shown verbatim (a case name or a path may hold '[')."""
    from rich.markup import escape

    return escape(text)
