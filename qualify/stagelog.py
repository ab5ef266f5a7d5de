"""Progress of long stages on stderr: a live spinner on a terminal, one line per step otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Step:
    """Handle of a running step: the body calls skip() when it finds its output already complete."""

    __slots__ = ("skipped",)

    def __init__(self) -> None:
        self.skipped = False

    def skip(self) -> None:
        """Mark the step as skipped: its output was complete and verified, nothing was redone."""
        self.skipped = True


class StageLog:
    """Reports each step of a stage (what runs now, how long it took, what was skipped)."""

    def __init__(self, stage: str, *, quiet: bool = False) -> None:
        from rich.console import Console
        from rich.markup import escape

        self.stage = stage
        self.prefix = escape(f"[{stage}]")
        self.console = Console(stderr=True, highlight=False, soft_wrap=True)  # a log line is never folded
        self.quiet = quiet
        self.started = time.monotonic()

    @contextmanager
    def step(self, description: str) -> Iterator[Step]:
        """Show description while the body runs, then its duration, or that it was skipped (Step.skip)."""
        t0 = time.monotonic()
        handle = Step()
        if self.quiet:
            yield handle
            return
        if sys.stderr.isatty():
            with self.console.status(f"[bold]{self.stage}[/bold] {escape_text(description)}"):
                yield handle
        else:
            self.console.print(f"{self.prefix} {escape_text(description)} ...")
            yield handle
        seconds = time.monotonic() - t0
        if handle.skipped:
            self.console.print(f"{self.prefix} {escape_text(description)}: complete, skipped (verified in "
                               f"{seconds:.1f} s)")
        else:
            self.console.print(f"{self.prefix} {escape_text(description)}: done in {seconds:.1f} s")

    def skip(self, description: str) -> None:
        """Note a step whose output is already complete and verified."""
        if not self.quiet:
            self.console.print(f"{self.prefix} {escape_text(description)}: complete, skipped")

    def note(self, text: str) -> None:
        """One line of information (why a complete output is redone, say)."""
        if not self.quiet:
            self.console.print(f"{self.prefix} {escape_text(text)}")


def escape_text(text: str) -> str:
    """Text shown verbatim (a case name or a path may hold '[')."""
    from rich.markup import escape

    return escape(text)
