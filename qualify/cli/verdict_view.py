"""Rich rendering of a verdict: per case, its worst row per comparison and every failing row."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.table import Table

MAX_FAILING_ROWS = 40


def _fmt(v: Any) -> str:
    return v if isinstance(v, str) else f"{v:.3g}"


def pick_rows(verdict: dict[str, Any]) -> list[dict[str, Any]]:
    """Worst row of each (case, comparison) plus failing rows (capped), in case order."""
    worst: dict[tuple[str, str], dict[str, Any]] = {}
    failing = []
    for row in verdict["rows"]:
        ratio = float(row["ratio"])
        key = (row["case"], row["comparison"])
        if key not in worst or ratio > float(worst[key]["ratio"]):
            worst[key] = row
        if not row["passed"]:
            failing.append(row)
    chosen = {id(r): r for r in list(worst.values()) + failing[:MAX_FAILING_ROWS]}
    order = list(verdict["cases"])
    return sorted(chosen.values(), key=lambda r: (order.index(r["case"]), r["comparison"], r["passed"]))


def render_verdict(verdict: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    table = Table(title=f"qualify verdict: {verdict['matrix']}", show_lines=False)
    for column in ("case", "role", "comparison", "tensor", "metric", "value", "bound", "value/bound", ""):
        table.add_column(column, overflow="fold")
    for r in pick_rows(verdict):
        mark = "[green]ok[/green]" if r["passed"] else "[bold red]FAIL[/bold red]"
        table.add_row(r["case"], r["role"], r["comparison"], r["tensor"], r["metric"], _fmt(r["value"]),
                      _fmt(r["bound"]), _fmt(r["ratio"]), mark)
    console.print(table)
    for name, c in verdict["cases"].items():
        status = "[green]PASS[/green]" if c["passed"] else "[bold red]FAIL[/bold red]"
        console.print(f"{status} {name}: {c['num_checks']} checks, {c['num_failed']} failed")
    total = len(verdict["cases"])
    failed = sum(not c["passed"] for c in verdict["cases"].values())
    console.print(f"[bold]{'PASSED' if verdict['passed'] else 'FAILED'}[/bold]: {total - failed}/{total} cases pass")
