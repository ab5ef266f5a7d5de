"""`qualify reference`: capture the fixed rollout with vLLM and score it with the HF reference and controls."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from qualify.cli.options import Format, FormatOpt, LegacyRunOpt, MatrixArg, RunOpt
from qualify.cli.render import echo_json

NAME = "reference"
HELP = "Capture a fixed rollout with vLLM and score it with the independent HF reference, with controls."
EPILOG = ("Examples:  qualify reference matrices/tiny-qwen3.yaml  |  "
          "qualify reference matrices/qwen3-8b.yaml --run /scratch/q8b --stage capture  |  "
          "qualify reference matrices/tiny-qwen3.yaml --rollout manifests/tiny-qwen3/reference/rollout")


class Stage(str, Enum):
    all = "all"
    capture = "capture"
    score = "score"


def main(
    matrix: MatrixArg,
    run: RunOpt = None,
    stage: Annotated[Stage, typer.Option("--stage", help="Run only the vLLM capture or only the HF scoring.")] = Stage.all,
    rollout: Annotated[Path | None, typer.Option(
        "--rollout", help="Reuse the sealed rollouts in DIR/tp<N>/ (e.g. a committed acceptance's reference/rollout) "
                          "instead of sampling; refused unless they were made for this matrix and its weights.",
        exists=True, file_okay=False, dir_okay=True)] = None,
    format: FormatOpt = Format.text,
    out: LegacyRunOpt = None,
) -> None:
    from qualify.layout import default_run_dir
    from qualify.matrix import load_matrix
    from qualify.reference.stage import run_reference

    m = load_matrix(matrix)
    run_dir = run or out or default_run_dir(m.name)
    summary = run_reference(m, run_dir, stage.value, rollout)
    if format is Format.json:
        echo_json(summary)
        return
    if stage is Stage.capture:
        typer.echo(f"rollout captured under {run_dir}/reference/rollout")
        return
    from qualify.hardware import describe
    from qualify.reference.mismatch_text import evidence_line, mismatch_lines, routing_lines

    typer.echo(f"reference complete: {run_dir}/reference  rollout {summary['rollout_digest'][:19]}  "
               f"controls {', '.join(summary['controls'])}")
    typer.echo(f"  platform: {describe(summary.get('platform'))}")
    if summary.get("evidence"):
        typer.echo(evidence_line(summary["evidence"]))
    for tp, agreement in summary["tp_agreement"].items():
        typer.echo(f"  {tp}: tokens equal {agreement['tokens_equal']}, logprob max |delta| {agreement['logprob_max_abs']}")
    for precision, mm in summary["rollout_mismatch"].items():
        for line in mismatch_lines(precision, mm):
            typer.echo(line)
    for line in routing_lines(summary.get("routing_agreement")):
        typer.echo(line)
