"""`qualify rounds`: run two PPO rounds with live actor-weight installation into vLLM, and the rejection probes."""

from __future__ import annotations

from typing import Annotated

import typer

from qualify.cli.options import Format, FormatOpt, MatrixArg, RunOpt

NAME = "rounds"
HELP = ("Run the matrix's rounds (its rounds: section) with live actor-weight installation into vLLM, and the "
        "rejection probes.")
EPILOG = ("Examples:  qualify rounds matrices/tiny-qwen3.yaml --engine torch-tp  |  "
          "qualify rounds matrices/tiny-qwen3.yaml --run runs/tiny-qwen3 --vllm-tp 2")


def main(
    matrix: MatrixArg,
    run: RunOpt = None,
    engine: Annotated[str | None, typer.Option("--engine", help="Override rounds.engine: the engine that trains "
                                               "the actor.")] = None,
    rounds: Annotated[int | None, typer.Option("--rounds", min=2, help="Override rounds.rounds.")] = None,
    vllm_tp: Annotated[int | None, typer.Option("--vllm-tp", min=1, help="Override rounds.vllm_tp (default: the "
                                                "matrix's first rollout.vllm_tp).")] = None,
    train_tp: Annotated[int | None, typer.Option("--train-tp", min=1, help="Override rounds.train_tp.")] = None,
    train_precision: Annotated[str | None, typer.Option("--train-precision", help="Override rounds.train_precision "
                                                        "(fp32 or bf16).")] = None,
    probe: Annotated[list[str] | None, typer.Option("--probe", help="Run only this probe (repeatable; overrides "
                                                    "rounds.probes): stale, wrong-shard, missing-ack, "
                                                    "duplicate-ack, warm-cache.")] = None,
    no_probes: Annotated[bool, typer.Option("--no-probes", help="Run no rejection probe.")] = False,
    format: FormatOpt = Format.text,
) -> None:
    """The settings come from the matrix's `rounds:` section; each flag overrides one of them."""
    from qualify.cli.verdict_view import show_verdict
    from qualify.layout import default_run_dir
    from qualify.matrix import load_matrix
    from qualify.rounds.stage import rounds_options, run_rounds

    m = load_matrix(matrix)
    probes = () if no_probes else tuple(probe) if probe else None
    opts = rounds_options(m, engine=engine, rounds=rounds, vllm_tp=vllm_tp, train_tp=train_tp, probes=probes,
                          train_precision=train_precision)
    verdict = run_rounds(m, run or default_run_dir(m.name), opts)
    show_verdict(verdict.to_json(), format is Format.json)
