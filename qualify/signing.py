"""Signatures over an acceptance's digest with OpenSSH (`ssh-keygen -Y sign` and `-Y verify`): an anchor outside the run.

What is signed is the acceptance's own digest string (its `digest` field, which qualify.manifest.load_manifest checks
against the document before anything else reads it), not the file's bytes. That digest covers the rule, the bound
files' digests and every reference artifact's, so a writer who edits a bound and re-seals every digest after it makes
an acceptance that verifies by itself and has another digest, which no signature covers; reformatting the file
changes nothing signed. Signatures are made in the namespace NAMESPACE, so that one made here is never valid as a
git commit's or a login's, nor one of theirs as an acceptance's. Who may sign is the verifier's allowed_signers file
(ssh-keygen(1), ALLOWED SIGNERS): `<identity> namespaces="qualify-acceptance" <public key>` per line.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from qualify.acceptance import is_acceptance
from qualify.errors import ManifestError, QualifyError
from qualify.manifest import load_manifest
from qualify.store import atomic_write_bytes

NAMESPACE = "qualify-acceptance"
"""The ssh-keygen -Y namespace of an acceptance's signature."""
SIG_SUFFIX = ".sig"
"""A signature's default path: the acceptance's with this appended (as ssh-keygen -Y sign names its own)."""


@dataclass(frozen=True, slots=True)
class SignatureCheck:
    """Outcome of verifying a signature over an acceptance's digest."""

    digest: str
    signature: str
    signer: str | None
    """The allowed_signers identity whose key made a good signature; None when it does not verify."""
    problem: str | None = None
    """Why it does not verify (ssh-keygen's own words); None when it does."""

    @property
    def ok(self) -> bool:
        return self.problem is None

    def to_json(self) -> dict[str, str | bool | None]:
        return {"ok": self.ok, "digest": self.digest, "signature": self.signature, "namespace": NAMESPACE,
                "signer": self.signer, "problem": self.problem}


def acceptance_digest(acceptance: Path) -> str:
    """The acceptance's own digest, after the document is checked against it (qualify.manifest.load_manifest)."""
    document = load_manifest(Path(acceptance))
    if not is_acceptance(document):
        raise ManifestError(f"{acceptance}: not an acceptance (schema_version {document.get('schema_version')!r}): "
                            "only an acceptance's digest is signed")
    return document["digest"]


def ssh_keygen() -> str:
    """The ssh-keygen on PATH (OpenSSH 8.2 or later has -Y sign and -Y verify)."""
    found = shutil.which("ssh-keygen")
    if found is None:
        raise QualifyError("ssh-keygen not found on PATH: signing and verifying an acceptance's signature need "
                           "OpenSSH's ssh-keygen (8.2 or later, for -Y sign and -Y verify)")
    return found


def keygen(args: list[str], message: str | None = None) -> subprocess.CompletedProcess:
    """ssh-keygen with args, the message (if any) on its standard input; its output as text."""
    return subprocess.run([ssh_keygen(), *args], input=message, capture_output=True, text=True, check=False)


def said(done: subprocess.CompletedProcess) -> str:
    """ssh-keygen's last line of complaint, for a one-line message."""
    lines = [x.strip() for x in (done.stderr or done.stdout or "").splitlines() if x.strip()]
    return lines[-1] if lines else f"exit status {done.returncode}"


def require_file(path: Path, what: str) -> Path:
    if not Path(path).is_file():
        raise QualifyError(f"{what} {path} does not exist (or is not a file)")
    return Path(path)


def sign_acceptance(acceptance: Path, key: Path, out: Path | None = None) -> tuple[str, Path]:
    """Sign the acceptance's digest with the private key (or a public key whose private half ssh-agent holds); the
    signature is written to out (default: the acceptance's path + SIG_SUFFIX). Returns (digest, signature path)."""
    digest = acceptance_digest(acceptance)
    require_file(key, "key")
    out = Path(out) if out is not None else Path(f"{acceptance}{SIG_SUFFIX}")
    if not out.parent.is_dir():
        raise QualifyError(f"--out {out}: directory {out.parent} does not exist")
    done = keygen(["-Y", "sign", "-f", str(key), "-n", NAMESPACE], digest)
    if done.returncode != 0 or "BEGIN SSH SIGNATURE" not in done.stdout:
        raise QualifyError(f"ssh-keygen could not sign with {key}: {said(done)}")
    atomic_write_bytes(out, done.stdout.encode())
    return digest, out


def allowed_signer_line(identity: str, key: Path) -> str:
    """The allowed_signers line that lets identity's key sign acceptances: the key's public half (key.pub beside a
    private key, the key itself when it is public) restricted to NAMESPACE."""
    if not identity or any(c.isspace() for c in identity):
        raise QualifyError(f"--identity {identity!r}: an identity is one word without spaces (an email address)")
    pub = Path(f"{key}.pub") if not str(key).endswith(".pub") else Path(key)
    if pub.is_file():
        public = pub.read_text().strip()
    else:
        done = keygen(["-y", "-f", str(key)])
        if done.returncode != 0:
            raise QualifyError(f"ssh-keygen could not read the public key of {key}: {said(done)}")
        public = done.stdout.strip()
    return f'{identity} namespaces="{NAMESPACE}" {public}'


def principals(allowed_signers: Path, signature: Path) -> list[str]:
    """The identities of allowed_signers whose key made the signature (ssh-keygen -Y find-principals)."""
    done = keygen(["-Y", "find-principals", "-s", str(signature), "-f", str(allowed_signers)])
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def verify_signature(acceptance: Path, allowed_signers: Path, signature: Path,
                     identity: str | None = None) -> SignatureCheck:
    """Whether the signature is a good one over the acceptance's digest, in NAMESPACE, by a key allowed_signers lists
    (as identity when given; otherwise as any identity it lists for the signing key)."""
    digest = acceptance_digest(acceptance)
    require_file(allowed_signers, "--allowed-signers")
    require_file(signature, "--signature")
    ssh_keygen()
    who = [identity] if identity is not None else principals(allowed_signers, signature)
    if not who:
        return SignatureCheck(digest, str(signature), None, f"signature {signature}: no identity in {allowed_signers} "
                                                            "holds the key that made it")
    problem = ""
    for principal in who:
        done = keygen(["-Y", "verify", "-f", str(allowed_signers), "-I", principal, "-n", NAMESPACE,
                       "-s", str(signature)], digest)
        if done.returncode == 0:
            return SignatureCheck(digest, str(signature), principal)
        problem = said(done)
    return SignatureCheck(digest, str(signature), None,
                          f"signature {signature} is not a good signature of {digest} by "
                          f"{' or '.join(who)} in {allowed_signers} (namespace {NAMESPACE}): {problem}")
