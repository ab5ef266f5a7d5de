"""Live status of a submitted Slurm chain: a table on a terminal, one line per state change elsewhere."""

from __future__ import annotations

import sys
from typing import Self

from rich.console import Console
from rich.live import Live
from rich.table import Table

from qualify.slurm.watch import ChainWatch


def plural(n: int, unit: str) -> str:
    return f"{n} {unit}" if n == 1 else f"{n} {unit}s"


class ChainDisplay:
    """Live table on a terminal; elsewhere (CI logs) one line per change of a job's state."""

    def __init__(self) -> None:
        self.console = Console(stderr=True)
        self.live = Live(console=self.console, auto_refresh=False) if sys.stderr.isatty() else None
        self.last: dict[str, str] = {}

    def __enter__(self) -> Self:
        if self.live is not None:
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.stop()

    def __call__(self, watch: ChainWatch) -> None:
        if self.live is not None:
            self.live.update(self._table(watch), refresh=True)
            return
        for view in watch.views:
            line = view.summary() + (f", {plural(view.restarts, 'restart')}" if view.restarts else "")
            if self.last.get(view.job.key) != line:
                self.last[view.job.key] = line
                self.console.print(f"qualify-slurm: {view.job.file} job {view.job_id}: {line}", highlight=False)

    @staticmethod
    def _table(watch: ChainWatch) -> Table:
        table = Table(title="qualify sbatch: chain status")
        for column in ("job", "id", "state", "restarts"):
            table.add_column(column)
        for view in watch.views:
            table.add_row(view.job.file, view.job_id, view.summary(), str(view.restarts))
        return table
