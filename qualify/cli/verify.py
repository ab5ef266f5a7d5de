"""`qualify verify`: check an acceptance manifest (or any manifest) against its evidence."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qualify.cli.handler import EXIT_FAILED
from qualify.cli.options import Format, FormatOpt, JobsOpt
from qualify.cli.render import render_verify

NAME = "verify"
HELP = "Check a manifest against its evidence: every missing, extra or modified file; exit 1 if any."
EPILOG = ("Examples:  qualify verify runs/tiny-qwen3/acceptance/acceptance.json  |  "
          "qualify verify manifests/tiny-qwen3/acceptance/acceptance.json --partial  |  "
          "qualify verify runs/tiny-qwen3/reference.manifest.json --format json --jobs 4")


def main(
    manifest: Annotated[Path, typer.Argument(help="Manifest or acceptance.json file.", show_default=False)],
    evidence: Annotated[Path | None, typer.Option("--evidence", help="Evidence root (default: the one the manifest names).")] = None,
    format: FormatOpt = Format.text,
    jobs: JobsOpt = None,
    partial: Annotated[bool, typer.Option("--partial", help="The evidence is a subset by design (a committed "
                                          "acceptance's rollout, targets and r0 scores): files absent are allowed, "
                                          "every file present must match.")] = False,
    expect: Annotated[str | None, typer.Option("--expect", help="The manifest's own digest as pinned elsewhere "
                                               "(sha256:...): any other fails, whatever its files say.")] = None,
) -> None:
    from qualify.acceptance import verify_evidence

    report = verify_evidence(manifest, evidence, jobs=jobs, partial=partial, expect=expect)
    render_verify(report, format)
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)
