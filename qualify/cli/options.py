"""Option and argument types shared by every command."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer


class Format(str, Enum):
    """Output format of a report."""

    text = "text"
    json = "json"


MatrixArg = Annotated[Path, typer.Argument(help="Matrix YAML file (see matrices/README.md).", show_default=False)]
def run_directory(value: Path | None) -> Path | None:
    """A run directory argument: absent (made by the stage) or a directory, never a file."""
    if value is not None and value.exists() and not value.is_dir():
        raise typer.BadParameter(f"{value} is a file, not a run directory")
    return value


RunDirArg = Annotated[Path, typer.Argument(help="Run directory written by an earlier stage.", show_default=False,
                                           callback=run_directory)]
RunOpt = Annotated[Path | None, typer.Option("--run", help="Run directory (default: runs/<matrix name>).",
                                             callback=run_directory)]
OnlyOpt = Annotated[str | None, typer.Option(
    "--only", help="Only the cases whose name matches this glob (fnmatch), e.g. 'deepspeed-bf16-*'.")]
# Old spellings, accepted (hidden) for one release: --out was the run directory of `reference`, --cases the
# case glob of `sbatch`; everywhere else --out is the file or directory a command writes.
LegacyRunOpt = Annotated[Path | None, typer.Option("--out", hidden=True)]
LegacyOnlyOpt = Annotated[str | None, typer.Option("--cases", hidden=True)]
FormatOpt = Annotated[Format, typer.Option("--format", help="Output format.")]
JobsOpt = Annotated[int | None, typer.Option("--jobs", min=1, help="Parallel hashing threads (default: CPU count).")]
ExpectOpt = Annotated[str | None, typer.Option("--expect", help="The acceptance's digest as pinned elsewhere "
                                              "(sha256:...): any other acceptance is refused.")]
AcceptanceOpt = Annotated[Path | None, typer.Option("--acceptance", help="Frozen acceptance.json (default: the run's).")]
