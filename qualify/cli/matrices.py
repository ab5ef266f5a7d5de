"""`qualify matrices list|show|validate`: inspect and validate matrix files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
import yaml

from qualify.cli.handler import handle_errors
from qualify.cli.options import Format, FormatOpt
from qualify.cli.render import echo_json
from qualify.matrix import load_matrix, matrix_files
from qualify.schema import to_dict

HELP = "List, show and validate matrix files."
app = typer.Typer(no_args_is_help=True, help=HELP)
DirOpt = Annotated[Path, typer.Option("--dir", help="Directory of matrix files.")]


@app.command("list", epilog="Example:  qualify matrices list --dir matrices")
@handle_errors
def list_(directory: DirOpt = Path("matrices")) -> None:
    """One line per matrix: file, name, cases, description."""
    for path in matrix_files(directory):
        m = load_matrix(path)
        typer.echo(f"{path}\t{m.name}\t{len(m.cases())} cases\t{m.description}")


@app.command("show", epilog="Example:  qualify matrices show matrices/tiny-qwen3.yaml --format json")
@handle_errors
def show(matrix: Annotated[Path, typer.Argument(show_default=False)], format: FormatOpt = Format.text) -> None:
    """Print a matrix with every default filled in, and its cases."""
    m = load_matrix(matrix)
    data = to_dict(m)
    data["cases"] = [c.name for c in m.cases()]
    if format is Format.json:
        echo_json(data)
    else:
        typer.echo(yaml.safe_dump(data, sort_keys=False).rstrip())


@app.command("validate", epilog="Example:  qualify matrices validate matrices/*.yaml")
@handle_errors
def validate(matrices: Annotated[list[Path], typer.Argument(show_default=False)]) -> None:
    """Validate matrix files; exit 2 naming the first bad key."""
    for path in matrices:
        m = load_matrix(path)
        typer.echo(f"ok {path} ({m.name}, {len(m.cases())} cases)")
