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

    typer.echo(f"reference complete: {run_dir}/reference  rollout {summary['rollout_digest'][:19]}  "
               f"controls {', '.join(summary['controls'])}")
    typer.echo(f"  platform: {describe(summary.get('platform'))}")
    for tp, agreement in summary["tp_agreement"].items():
        typer.echo(f"  {tp}: tokens equal {agreement['tokens_equal']}, logprob max |delta| {agreement['logprob_max_abs']}")
    for precision, mm in summary["rollout_mismatch"].items():
        for line in mismatch_lines(precision, mm):
            typer.echo(line)


def _g(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def mismatch_lines(precision: str, mm: dict) -> list[str]:
    """Train-vs-rollout of one precision: numerical error, truncation term, total, kept-set differences (all listed)."""
    n, total, trunc, differs = mm["num_tokens"], mm["total"], mm["truncation"], mm["kept_set_differs"]
    lines = [(f"  train-vs-rollout {precision}: {n - mm['num_not_bitwise']}/{n} tokens bitwise equal to the processed "
             f"formula; numerical |delta| max {_g(mm['max_abs'])}, mean {_g(mm['mean_abs'])}"),
             (f"    truncation (full - processed): {trunc['num_truncated']} tokens truncated, |term| max "
             f"{_g(trunc['max_abs'])}, mean {_g(trunc['mean_abs'])}; vs the full formula: "
             f"{total['num_not_bitwise']}/{n} not bitwise, max {_g(total['max_abs'])}, mean {_g(total['mean_abs'])}"),
             (f"    kept set differs (beyond {differs['limit']:.3g} or outside the reference's kept set): "
             f"{differs['count']} tokens")]
    lines += [f"      row {t['row']} position {t['position']}: sampler {t['sampler']:.7g}, reference processed "
              f"{'-inf (outside its kept set)' if t['processed'] is None else format(t['processed'], '.7g')}"
              for t in differs["tokens"]]
    return lines
