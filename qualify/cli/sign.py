"""`qualify sign`: sign an acceptance's digest with an OpenSSH key (ssh-keygen -Y sign; qualify.signing)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

NAME = "sign"
HELP = ("Sign an acceptance's digest with an OpenSSH key (ssh-keygen -Y sign, namespace qualify-acceptance): an "
        "anchor outside the run that `qualify verify --allowed-signers FILE --signature FILE` checks.")
EPILOG = ("Examples:  qualify sign runs/tiny-qwen3/acceptance/acceptance.json --key keys/id_ed25519  |  "
          "qualify sign manifests/tiny-qwen3/acceptance/acceptance.json --key keys/id_ed25519 --out tiny-qwen3.sig "
          "--identity ci@example.org")


def main(
    acceptance: Annotated[Path, typer.Argument(help="acceptance.json to sign (its own digest is what is signed).",
                                               show_default=False)],
    key: Annotated[Path, typer.Option("--key", help="OpenSSH private key (or a public key whose private half "
                                                    "ssh-agent holds).", show_default=False)],
    out: Annotated[Path | None, typer.Option("--out", help="Signature file (default: ACCEPTANCE.sig).")] = None,
    identity: Annotated[str | None, typer.Option(
        "--identity", help="Also print the allowed_signers line that lets this identity's key sign acceptances.")]
    = None,
) -> None:
    from qualify.signing import allowed_signer_line, sign_acceptance

    line = allowed_signer_line(identity, key) if identity is not None else None
    digest, written = sign_acceptance(acceptance, key, out)
    typer.echo(f"signed {digest} (namespace qualify-acceptance) with {key}: {written}")
    if line is not None:
        typer.echo(f"allowed_signers line: {line}")
