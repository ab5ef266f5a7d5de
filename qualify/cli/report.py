"""`qualify report`: verify and summarize a run directory (terminal, Markdown, JSON, HTML or JUnit XML)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from qualify.cli.options import ExpectOpt, RunDirArg

if TYPE_CHECKING:
    from qualify.report import RunDocs

NAME = "report"
HELP = ("Verify and summarize a run directory: reference, acceptance, candidate verdicts, rounds. "
        "Exit 1 when the evidence does not verify, qualification failed or a stage did not finish (no verdict).")
EPILOG = ("Examples:  qualify report runs/tiny-qwen3  |  qualify report runs/tiny-qwen3 --format html --out report.html"
          "  |  qualify report runs/tiny-qwen3 --format junit --out junit.xml")


class ReportFormat(str, Enum):
    text = "text"
    markdown = "markdown"
    json = "json"
    html = "html"
    junit = "junit"


def main(
    run_dir: RunDirArg,
    format: Annotated[ReportFormat, typer.Option("--format", help="Output format.")] = ReportFormat.text,
    out: Annotated[Path | None, typer.Option("--out", help="Write the report to this file.")] = None,
    expect: ExpectOpt = None,
) -> None:
    from qualify.errors import QualifyError
    from qualify.report import exit_code, load_docs, summarize_docs
    from qualify.report_verify import verify_run

    if out is not None and not out.parent.is_dir():
        raise QualifyError(f"--out {out}: directory {out.parent} does not exist")
    docs = load_docs(run_dir)
    summary = summarize_docs(docs, verify_run(docs.layout, docs.reference, docs.acceptance, docs.verdict, docs.rounds,
                                              expect))
    data = render(format, docs, summary, None if out is None else out.resolve().parent)
    if out is not None:
        from qualify.store import atomic_write_bytes

        atomic_write_bytes(out, data)
        from qualify.waivers import waiver_text

        typer.echo(f"report written to {out} ({summary['status']}"
                   f"{waiver_text((summary['candidates'] or {}).get('waivers') or [])})")
    elif format is ReportFormat.text:
        from rich.console import Console
        from rich.markdown import Markdown

        Console(width=160).print(Markdown(data.decode()))
    else:
        typer.echo(data.decode(), nl=False)
    raise typer.Exit(exit_code(summary))


def render(format: ReportFormat, docs: RunDocs, summary: dict[str, Any], page_dir: Path | None = None) -> bytes:
    """The report in the chosen format, as bytes (page_dir: where an HTML page is written, for its relative link to
    the run's verdict JSON)."""
    if format is ReportFormat.json:
        from qualify.store import dumps_json

        return dumps_json(summary).encode()
    if format is ReportFormat.html:
        from qualify.report_html import to_html

        return to_html(docs, summary, page_dir).encode()
    if format is ReportFormat.junit:
        from qualify.junit import to_junit
        from qualify.report_verify import readable

        # the verdict's testcases only when it verified; otherwise the failing verification says why
        verdict = docs.verdict if summary["verification"]["ok"] and readable(docs.verdict) else None
        return to_junit(verdict, name=summary["matrix"], problems=summary["verification"]["problems"],
                        rounds=summary["rounds"], unfinished=summary["unfinished"])
    from qualify.childlog import printable
    from qualify.report import to_markdown

    return printable(to_markdown(summary), newlines=True).encode()  # a foreign string's control characters escaped
