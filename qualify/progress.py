"""Rich progress displays for long work (hashing, stages), written to stderr.

Displays appear only when stderr is a terminal, so logs and CI output stay clean.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

MIN_BYTES_FOR_BAR = 64 << 20  # below this, hashing is over before a bar is worth drawing


def console():
    from rich.console import Console

    return Console(stderr=True)


@contextmanager
def byte_progress(label: str, total: int, *, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """Yield an advance(nbytes) callback, thread-safe, drawing a bar on long runs."""
    if not enabled or total < MIN_BYTES_FOR_BAR or not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    lock = threading.Lock()
    with Progress("[bold]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=console(), transient=True) as bar:
        task = bar.add_task(label, total=total)
        pending = [0]

        def advance(n: int) -> None:
            with lock:
                pending[0] += n
                if pending[0] >= (8 << 20):  # batch refreshes: rich is slow per call
                    bar.update(task, advance=pending[0])
                    pending[0] = 0

        yield advance
        bar.update(task, completed=total)
