"""`qualify freeze`: freeze a reference into an acceptance manifest and per-tensor bounds."""

from __future__ import annotations

from typing import Annotated

import typer

from qualify.cli.options import Format, FormatOpt, RunDirArg

NAME = "freeze"
HELP = "Freeze a reference into an acceptance manifest and per-tensor bounds; never widens a bound."
EPILOG = "Examples:  qualify freeze runs/tiny-qwen3  |  qualify freeze runs/tiny-qwen3 --name tiny-qwen3-2026-11"


def main(
    run_dir: RunDirArg,
    name: Annotated[str | None, typer.Option("--name", help="Name recorded in the acceptance (default: the matrix name).")] = None,
    format: FormatOpt = Format.text,
) -> None:
    from qualify.cli.render import echo_json
    from qualify.freeze import freeze, run_dir_of
    from qualify.layout import RunLayout

    doc = freeze(run_dir, name)
    layout = RunLayout(run_dir_of(run_dir))
    if format is Format.json:
        echo_json({k: v for k, v in doc.items() if k != "files"} | {"num_files": len(doc["files"])})
        return
    typer.echo(f"frozen: {layout.acceptance} ({len(doc['files'])} artifacts, {doc['digest']})")
    typer.echo(f"rule: {doc['rule']['text']}; k = {doc['rule']['k']}")
    for bound_file, digest in doc["bounds"].items():
        typer.echo(f"  {layout.bounds / bound_file}  {digest[:19]}")
