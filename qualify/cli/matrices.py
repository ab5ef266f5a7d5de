"""`qualify matrices list|show|validate`: inspect and validate matrix files.

yaml and the matrix loader are imported inside the commands: this module is imported
by every `qualify` invocation, including `qualify verify`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qualify.cli.handler import handle_errors
from qualify.cli.options import Format, FormatOpt
from qualify.cli.render import echo_json
from qualify.errors import MatrixError

HELP = "List, show and validate matrix files."
EPILOG = ("Examples:  qualify matrices list  |  qualify matrices show matrices/tiny-qwen3.yaml  |  "
          "qualify matrices validate matrices/tiny-qwen3*.yaml")
app = typer.Typer(no_args_is_help=True, help=HELP, epilog=EPILOG)
DirOpt = Annotated[Path, typer.Option("--dir", help="Directory of matrix files.")]
MatrixFileArg = Annotated[Path, typer.Argument(help="Matrix YAML file.", show_default=False)]


@app.command("list", epilog="Example:  qualify matrices list --dir matrices")
@handle_errors
def list_(directory: DirOpt = Path("matrices")) -> None:
    """One line per matrix: file, name, cases, description."""
    from qualify.matrix import load_matrix, matrix_files

    if not directory.is_dir():
        raise MatrixError(f"matrix directory not found: {directory}")
    paths = matrix_files(directory)
    if not paths:
        raise MatrixError(f"no *.yaml matrix files in {directory}")
    for path in paths:
        m = load_matrix(path)
        typer.echo(f"{path}\t{m.name}\t{len(m.cases())} cases\t{m.description}")


@app.command("show", epilog="Example:  qualify matrices show matrices/tiny-qwen3.yaml --format json")
@handle_errors
def show(matrix: MatrixFileArg, format: FormatOpt = Format.text) -> None:
    """Print a matrix with every default filled in, and its cases."""
    import yaml

    from qualify.matrix import load_matrix
    from qualify.schema import to_dict

    m = load_matrix(matrix)
    data = to_dict(m)
    data["cases"] = [c.name for c in m.cases()]
    if format is Format.json:
        echo_json(data)
    else:
        typer.echo(yaml.safe_dump(data, sort_keys=False).rstrip())


@app.command("validate", epilog="Example:  qualify matrices validate matrices/tiny-qwen3*.yaml")
@handle_errors
def validate(matrices: Annotated[list[Path], typer.Argument(help="Matrix YAML files.", show_default=False)]) -> None:
    """Validate matrix files and that each can run here; exit 2 naming the file and the first bad key, a required
    branch no run of it can take, what it names that this machine lacks (checkpoints, prompts file), or a tiny
    family too large for this machine's memory."""
    from qualify.matrix import load_matrix
    from qualify.memory import host_memory_bytes, tiny_family_problem

    for path in matrices:
        m = load_matrix(path)
        missing = m.missing_here()
        if missing:
            raise MatrixError(f"{path}: cannot run on this machine, it lacks {'; '.join(missing)}")
        too_large = tiny_family_problem(m.models.tiny, host_memory_bytes()) if m.models.tiny is not None else None
        if too_large:
            raise MatrixError(f"{path}: {too_large}")
        typer.echo(f"ok {path} ({m.name}, {len(m.cases())} cases)")
