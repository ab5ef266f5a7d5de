"""The one rendering of a verdict (candidate or rounds): a table of rows, then each case and the result.

A candidate verdict shows, per case, its worst row per comparison and its failing rows from the first failing step
and family (capped per case), and what stopped a case that did not run; a rounds
verdict, which holds a few dozen facts, shows every row, then its actor versions and its logprob bound.
"""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from qualify.childlog import printable
from qualify.verdict import ROUNDS_SCHEMA
from qualify.waivers import waiver_text, waivers_of

MAX_FAILING_PER_CASE = 8
GROUP_ORDER = ("outputs", "grads", "updates", "moments")
"""Within a case's failing rows: its outputs first (the loss and logprobs explain most failures), then gradients."""


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if v is None:
        return ""
    text = printable(str(v))
    return text if len(text) <= 60 else text[:57] + "..."


def _text(v: Any) -> str:
    """A string of the verdict as a cell: what an engine named (a tensor, a case) may hold control characters."""
    return escape(printable(str(v)))


def _failing_order(row: dict[str, Any], comparisons: list[str]) -> tuple:
    """A failing row's place in its case: first step, the case's first comparison (its own family), outputs before
    gradients, the furthest past its bound first."""
    step = row.get("step")
    group = str(row["tensor"]).split("/")[1] if str(row["tensor"]).count("/") >= 2 else ""
    ratio = float(row["ratio"]) if isinstance(row.get("ratio"), (int, float, str)) else 0.0
    return (step if isinstance(step, int) else -1, comparisons.index(row["comparison"]),
            GROUP_ORDER.index(group) if group in GROUP_ORDER else len(GROUP_ORDER), -ratio)


def pick_rows(verdict: dict[str, Any]) -> list[dict[str, Any]]:
    """Worst row of each (case, comparison) plus each case's failing rows from its first failing step and family,
    capped per case (one case's many failing gradients never hide another case's rows), in case order."""
    if verdict.get("schema") == ROUNDS_SCHEMA:
        return list(verdict["rows"])
    worst: dict[tuple[str, str], dict[str, Any]] = {}
    failing: dict[str, list[dict[str, Any]]] = {}
    comparisons: dict[str, list[str]] = {}
    for row in verdict["rows"]:
        ratio = float(row["ratio"])
        key = (row["case"], row["comparison"])
        comparisons.setdefault(row["case"], [])
        if row["comparison"] not in comparisons[row["case"]]:
            comparisons[row["case"]].append(row["comparison"])
        if key not in worst or ratio > float(worst[key]["ratio"]):
            worst[key] = row
        if not row["passed"]:
            failing.setdefault(row["case"], []).append(row)
    shown = [r for case, rows in failing.items()
             for r in sorted(rows, key=lambda r: _failing_order(r, comparisons[case]))[:MAX_FAILING_PER_CASE]]
    chosen = {id(r): r for r in list(worst.values()) + shown}
    order = list(verdict["cases"])
    return sorted(chosen.values(), key=lambda r: (order.index(r["case"]), r["passed"],
                                                  _failing_order(r, comparisons[r["case"]])))


def _title(verdict: dict[str, Any]) -> str:
    if verdict.get("schema") == ROUNDS_SCHEMA:
        return (f"qualify rounds: {verdict['matrix']} (vLLM TP{verdict['vllm_tp']}, trainer {verdict['engine']} "
                f"{verdict.get('train_precision', 'fp32')} TP{verdict['train_tp']})")
    return f"qualify verdict: {verdict['matrix']}"


def _rounds_footer(verdict: dict[str, Any], console: Console) -> None:
    for v in verdict["actor_versions"]:
        console.print(f"v{v['version']}: {v['digest']}")
    b = verdict["bound"]
    console.print(f"logprob bound {_fmt(b['logprob_max_abs'])} = {b['k']} x {_fmt(b['control'])} + {b['floor']} "
                  f"({b['source']})")
    if verdict.get("failure"):
        console.print(f"[bold red]{_text(verdict['failure'])}[/bold red]")
    status = "PASSED" if verdict["passed"] else "FAILED"
    console.print(f"[bold]{status}[/bold]: {verdict['num_checks'] - verdict['num_failed']}/{verdict['num_checks']} "
                  f"checks pass, {verdict['seconds']} s; evidence in the run's rounds/")


def _cases_footer(verdict: dict[str, Any], console: Console) -> None:
    for name, c in verdict["cases"].items():
        status = "[green]PASS[/green]" if c["passed"] else "[bold red]FAIL[/bold red]"
        invariance = "".join(f"; {axis}: " + ", ".join(f"{t['counts'].get(tier, 0)} {tier.replace('_', ' ')}"
                                                       for tier in ("bitwise", "within_bound", "failing"))
                             for axis, t in c.get("invariance", {}).items())  # TP > 1 or DP > 1 cases' tiers
        waived = "".join(f"; waived: {w}" for w in waivers_of(r for r in verdict.get("rows", []) if r["case"] == name))
        console.print(f"{status} {_text(name)}: {c['num_checks']} checks, {c['num_failed']} failed{invariance}"
                      f"{_text(waived)}")
        for row in verdict.get("rows", []):  # a case that did not run: what stopped it, whole
            if row["case"] == name and row["comparison"] == "run" and row.get("note"):
                console.print(f"  [red]did not run:[/red] {escape(printable(str(row['note']), newlines=True))}",
                              highlight=False)
    total = len(verdict["cases"])
    failed = sum(not c["passed"] for c in verdict["cases"].values())
    console.print(f"[bold]{'PASSED' if verdict['passed'] else 'FAILED'}[/bold]: {total - failed}/{total} cases pass"
                  f"{escape(waiver_text(waivers_of(verdict.get('rows', []))))}")


def render_verdict(verdict: dict[str, Any], console: Console | None = None) -> None:
    """Print a verdict document (its JSON form, as written to disk)."""
    console = console or Console(width=None if sys.stdout.isatty() else 200, highlight=False)
    table = Table(title=_title(verdict), show_lines=False)
    for column in ("case", "step", "comparison", "tensor / check", "metric", "value", "bound", "rule",
                   "value/bound", ""):
        table.add_column(column, overflow="fold")
    for r in pick_rows(verdict):
        mark = "[green]ok[/green]" if r["passed"] else "[bold red]FAIL[/bold red]"
        table.add_row(_text(r["case"]), _fmt(r.get("step")), _text(r["comparison"]), _text(r["tensor"]),
                      _text(r["metric"]), escape(_fmt(r["value"])), escape(_fmt(r["bound"])), _text(r.get("rule", "")),
                      _fmt(r.get("ratio")) if r.get("bound") is not None else "", mark)
    console.print(table)
    if verdict.get("schema") == ROUNDS_SCHEMA:
        _rounds_footer(verdict, console)
    else:
        _cases_footer(verdict, console)


def show_verdict(verdict: dict[str, Any], json_out: bool) -> None:
    """Print a stage's verdict (JSON, or the table) and exit 1 when it failed: how candidate and rounds end."""
    import typer

    from qualify.cli.handler import EXIT_FAILED
    from qualify.cli.render import echo_json

    if json_out:
        echo_json(verdict)
    else:
        render_verdict(verdict)
    if not verdict["passed"]:
        raise typer.Exit(EXIT_FAILED)
