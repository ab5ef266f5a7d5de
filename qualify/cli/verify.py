"""`qualify verify`: check an acceptance manifest (or any manifest) against its evidence."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qualify.cli.handler import EXIT_FAILED
from qualify.cli.options import Format, FormatOpt, JobsOpt
from qualify.cli.render import render_verify

NAME = "verify"
HELP = ("Check a manifest against its evidence: every missing, extra or modified file; with --signature, also a "
        "signature over an acceptance's digest (qualify sign); exit 1 if any fails.")
EPILOG = ("Examples:  qualify verify runs/tiny-qwen3/acceptance/acceptance.json  |  "
          "qualify verify manifests/tiny-qwen3/acceptance/acceptance.json --partial  |  "
          "qualify verify runs/tiny-qwen3/reference.manifest.json --format json --jobs 4  |  "
          "qualify verify manifests/tiny-qwen3/acceptance/acceptance.json --partial --allowed-signers "
          "keys/allowed_signers --signature tiny-qwen3.sig")


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
    allowed_signers: Annotated[Path | None, typer.Option(
        "--allowed-signers", help="OpenSSH allowed_signers file: who may sign acceptances (with --signature).")] = None,
    signature: Annotated[Path | None, typer.Option(
        "--signature", help="Signature over the acceptance's digest (qualify sign): it must be a good one by a key "
                            "--allowed-signers lists, or the verification fails.")] = None,
    identity: Annotated[str | None, typer.Option(
        "--identity", help="The identity of --allowed-signers that must have signed (default: any it lists for "
                           "the signing key).")] = None,
) -> None:
    from qualify.acceptance import verify_evidence

    if (allowed_signers is None) != (signature is None) or (identity is not None and signature is None):
        from qualify.errors import QualifyError

        raise QualifyError("--allowed-signers and --signature go together (and --identity with them): a signature is "
                           "checked against the signers a verifier allows")
    check = None
    if signature is not None:  # before the hashing: a signature file or an ssh-keygen that is missing stops it
        from qualify.signing import verify_signature

        check = verify_signature(manifest, allowed_signers, signature, identity)
    report = verify_evidence(manifest, evidence, jobs=jobs, partial=partial, expect=expect)
    if check is not None:
        from dataclasses import replace

        report = replace(report, signature=check.to_json(), problems=[*report.problems, *filter(None, [check.problem])])
    render_verify(report, format)
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)
