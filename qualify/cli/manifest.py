"""`qualify manifest create`: write the sha256 manifest of an evidence directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qualify.cli.handler import handle_errors
from qualify.cli.options import JobsOpt
from qualify.errors import OutputError
from qualify.manifest import create_manifest

HELP = "Create sha256 manifests of evidence directories."
EPILOG = ("Examples:  qualify manifest create runs/tiny-qwen3/reference --out runs/tiny-qwen3/reference.manifest.json"
          "  |  qualify verify runs/tiny-qwen3/reference.manifest.json")
app = typer.Typer(no_args_is_help=True, help=HELP, epilog=EPILOG)


@app.command("create", epilog="Example:  qualify manifest create runs/tiny-qwen3/reference "
                               "--out runs/tiny-qwen3/reference.manifest.json")
@handle_errors
def create(
    directory: Annotated[Path, typer.Argument(help="Evidence directory.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="Manifest file to write.", show_default=False)],
    jobs: JobsOpt = None,
) -> None:
    """Write a sorted manifest (path, bytes, sha256 per file) with its own digest."""
    if out.is_dir():  # before hashing the whole evidence, not after
        raise OutputError(f"--out {out} is a directory; give the manifest's file path (e.g. {out}/manifest.json)")
    document = create_manifest(directory, out, jobs=jobs)
    typer.echo(f"{out}: {len(document['files'])} files, {document['digest']}")
