"""`qualify candidate`: replay the engine x precision x TP x role matrix and judge every tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qualify.cli.options import AcceptanceOpt, ExpectOpt, Format, FormatOpt, MatrixArg, OnlyOpt, RunOpt

NAME = "candidate"
HELP = "Replay the engine x precision x TP x role matrix and judge every tensor against frozen bounds."
EPILOG = ("Examples:  qualify candidate matrices/tiny-qwen3.yaml  |  "
          "qualify candidate matrices/tiny-qwen3.yaml --only 'torch-tp-*-tp2-*'  |  "
          "qualify candidate matrices/tiny-qwen3.yaml --run runs/tiny-qwen3 --format json  |  "
          "qualify candidate matrices/tiny-qwen3.yaml --junit junit.xml")


def main(
    matrix: MatrixArg,
    run: RunOpt = None,
    acceptance: AcceptanceOpt = None,
    only: OnlyOpt = None,
    format: FormatOpt = Format.text,
    junit: Annotated[Path | None, typer.Option("--junit", help="Also write the verdict as JUnit XML to this file.")]
    = None,
    expect: ExpectOpt = None,
    launches: Annotated[int, typer.Option(
        "--launches", min=1,
        help="How many launches (cases sharing engine, TP and DP) run at once. On one GPU they share it: at the "
             "Qwen3-0.6B shape two launches take one's time (their ranks spend it importing and loading).")] = 1,
) -> None:
    from qualify.candidate.stage import run_candidates
    from qualify.cli.verdict_view import show_verdict
    from qualify.layout import default_run_dir
    from qualify.matrix import load_matrix

    m = load_matrix(matrix)
    if junit is not None and not junit.parent.is_dir():
        from qualify.errors import QualifyError

        raise QualifyError(f"--junit {junit}: directory {junit.parent} does not exist")
    verdict = run_candidates(m, run or default_run_dir(m.name), acceptance=acceptance, only=only, expect=expect,
                             launches=launches)
    if junit is not None:
        from qualify.junit import to_junit
        from qualify.store import atomic_write_bytes

        atomic_write_bytes(junit, to_junit(verdict.to_json(), name=m.name))
    show_verdict(verdict.to_json(), format is Format.json)
