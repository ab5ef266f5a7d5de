"""sha256 manifests of evidence directories: create them and verify evidence against them.

A manifest lists every file under an evidence root (relative POSIX path, size,
sha256), sorted by path, and carries its own digest. Verification streams every
file in fixed-size chunks (bounded memory), hashes in parallel (qualify.hashing)
while it checks the manifest, and reports every missing, extra and modified file.
Symlinks, special files and manifest paths that escape the root are refused,
never followed.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qualify.errors import ManifestError
from qualify.hashing import (
    CHUNK_BYTES,
    default_jobs,
    digest_of_bytes,
    hash_files,
    list_files,
    scan_files,
    sha256_file,
    start_hashing,
)
from qualify.schema import show
from qualify.store import read_json, write_json

__all__ = ["CHUNK_BYTES", "MANIFEST_SCHEMA", "FileEntry", "Modified", "VerifyReport", "build_manifest",
           "check_relative", "create_manifest", "default_evidence", "default_jobs", "digest_of", "hash_files",
           "list_files", "load_manifest", "scan_files", "sha256_file", "verify_manifest"]

MANIFEST_SCHEMA = "qualify.manifest/1"
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_ENTRY_KEYS = frozenset({"path", "bytes", "sha256"})
# What check_relative accepts, as one regex for the fast path: components that are neither empty,
# '.' nor '..', no leading '/', no backslash or NUL anywhere.
_COMPONENT = r"(?!\.\.?(?:/|\Z))[^/\\\x00]+"
_GOOD_PATH = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a manifest."""

    path: str
    """Path relative to the evidence root, POSIX separators."""
    bytes: int
    """Size in bytes."""
    sha256: str
    """Hex sha256 of the content."""

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "bytes": self.bytes, "sha256": self.sha256}


@dataclass(frozen=True, slots=True)
class Modified:
    """A file whose size or content differs from the manifest."""

    path: str
    expected_bytes: int
    actual_bytes: int
    expected_sha256: str
    actual_sha256: str


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """Outcome of verifying evidence against a manifest."""

    manifest: str
    evidence: str
    num_files: int
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    modified: list[Modified] = field(default_factory=list)
    renamed: list[tuple[str, str]] = field(default_factory=list)
    """(old, new) pairs among missing x extra with the same content; they stay in missing and extra too."""
    partial: bool = False
    """The evidence is a partial copy by design (e.g. a committed subset): missing files are allowed."""
    problems: list[str] = field(default_factory=list)
    """What else failed (qualify.acceptance.verify_evidence: the part a partial copy must hold, the acceptance's
    chain of digests, an expected digest); each fails the report."""
    signature: dict[str, Any] | None = None
    """The signature over the manifest's digest that was checked (qualify.signing.SignatureCheck.to_json), None when
    none was asked for; one that does not verify is among the problems too."""

    @property
    def ok(self) -> bool:
        return not (self.extra or self.modified or (self.missing and not self.partial) or self.problems)

    def to_json(self) -> dict[str, Any]:
        return {
            "manifest": self.manifest,
            "evidence": self.evidence,
            "num_files": self.num_files,
            "ok": self.ok,
            "partial": self.partial,
            "missing": self.missing,
            "extra": self.extra,
            "modified": [_modified_json(m) for m in self.modified],
            "renamed": [{"from": a, "to": b} for a, b in self.renamed],
            "problems": self.problems,
            **({"signature": self.signature} if self.signature is not None else {}),
        }


def _modified_json(m: Modified) -> dict[str, Any]:
    return {
        "path": m.path,
        "expected_bytes": m.expected_bytes,
        "actual_bytes": m.actual_bytes,
        "expected_sha256": m.expected_sha256,
        "actual_sha256": m.actual_sha256,
    }


def check_relative(path: str) -> str:
    """Validate a manifest path: a relative, normalized POSIX path inside the root."""
    if not isinstance(path, str) or not path:
        raise ManifestError(f"manifest path must be a non-empty string, got {path!r}")
    if path.startswith("/"):
        raise ManifestError(f"manifest path is absolute, refusing: {path!r}")
    parts = path.split("/")
    if ".." in parts:
        raise ManifestError(f"manifest path escapes the evidence root, refusing: {path!r}")
    if "" in parts or "." in parts or "\\" in path or "\x00" in path:
        raise ManifestError(f"manifest path is not a normalized POSIX path, refusing: {path!r}")
    return path


def digest_of(document: dict[str, Any]) -> str:
    """sha256 over the canonical JSON of a manifest document without its digest field.

    Canonical here is sorted keys, compact separators, ASCII: json's C encoder writes it (an
    indented dump runs the pure-Python encoder, several times slower on 10,000 entries).
    """
    body = {k: v for k, v in document.items() if k != "digest"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return digest_of_bytes(text.encode("ascii"))


def build_manifest(root: Path, *, exclude: Iterable[Path] = (), jobs: int | None = None,
                   progress: bool = True, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Manifest document for every file under root (extra keys are merged in before digesting)."""
    root = Path(root)
    sizes = scan_files(root, exclude)
    paths = sorted(sizes)
    hashed = hash_files(root, paths, jobs, progress, sizes=sizes)
    document: dict[str, Any] = {"schema": MANIFEST_SCHEMA, **(extra or {})}
    document["files"] = [FileEntry(p, *hashed[p]).to_json() for p in paths]
    document["digest"] = digest_of(document)
    return document


def create_manifest(root: Path, out: Path, *, jobs: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Write the manifest of root to out; the manifest records where its evidence lies."""
    root, out = Path(root), Path(out)
    evidence = os.path.relpath(root.resolve(), out.resolve().parent)
    document = build_manifest(root, exclude=[out], jobs=jobs, progress=progress,
                              extra={"evidence": Path(evidence).as_posix()})
    write_json(out, document)
    return document


def _check_entry(path: Path, index: int, entry: Any) -> None:
    """One file entry: exactly path, bytes, sha256, each well-formed."""
    if not isinstance(entry, dict) or entry.keys() != _ENTRY_KEYS:
        raise ManifestError(f"{path}: files[{index}]: malformed entry {show(entry)} (keys: bytes, path, sha256)")
    try:
        check_relative(entry["path"])
    except ManifestError as exc:
        raise ManifestError(f"{path}: files[{index}].path: {exc}") from exc
    size, sha = entry["bytes"], entry["sha256"]
    if type(size) is not int or size < 0:
        raise ManifestError(f"{path}: files[{index}] ({entry['path']}): bytes must be an integer >= 0, "
                            f"got {show(size)}")
    if not isinstance(sha, str) or not _SHA256_HEX.fullmatch(sha):
        raise ManifestError(f"{path}: files[{index}] ({entry['path']}): sha256 must be 64 lowercase hex digits, "
                            f"got {show(sha)}")


def _read_manifest(path: Path) -> dict[str, Any]:
    """Parse a manifest file and check its shape; entries and digest are _check_manifest's."""
    path = Path(path)
    if path.is_symlink():
        raise ManifestError(f"refusing symlinked manifest: {path}")
    try:
        document = read_json(path)
    except ValueError as exc:
        raise ManifestError(str(exc)) from exc
    if not isinstance(document, dict) or not isinstance(document.get("files"), list):
        raise ManifestError(f"{path}: not a manifest (no 'files' list)")
    if not isinstance(document.get("schema"), str):
        raise ManifestError(f"{path}: not a manifest (no 'schema' string)")
    return document


def _entry_ok(entry: Any) -> bool:
    """The common case, checked fast (two regex matches per entry); _check_entry explains a failure."""
    return (type(entry) is dict and entry.keys() == _ENTRY_KEYS
            and type(entry["path"]) is str and _GOOD_PATH.fullmatch(entry["path"]) is not None
            and type(entry["bytes"]) is int and entry["bytes"] >= 0
            and type(entry["sha256"]) is str and _SHA256_HEX.fullmatch(entry["sha256"]) is not None)


def _check_manifest(path: Path, document: dict[str, Any]) -> None:
    """Every entry well-formed and unique, and the document's digest its own."""
    files = document["files"]
    for index, entry in enumerate(files):
        if not _entry_ok(entry):
            _check_entry(path, index, entry)
            raise AssertionError(f"_entry_ok and _check_entry disagree on {entry!r}")
    if len({entry["path"] for entry in files}) != len(files):
        seen: set[str] = set()
        for index, entry in enumerate(files):
            if entry["path"] in seen:
                raise ManifestError(f"{path}: files[{index}]: duplicate path {entry['path']!r}")
            seen.add(entry["path"])
    try:
        digest = digest_of(document)
    except ValueError as exc:  # NaN or Infinity: valid for json.loads, not canonical JSON
        raise ManifestError(f"{path}: not canonical JSON: {exc}") from exc
    if document.get("digest") != digest:
        raise ManifestError(f"{path}: manifest digest does not match its content (edited by hand?)")


def load_manifest(path: Path) -> dict[str, Any]:
    """Read a manifest, checking schema, entries and its own digest."""
    document = _read_manifest(path)
    _check_manifest(Path(path), document)
    return document


def default_evidence(manifest_path: Path, document: dict[str, Any]) -> Path:
    """The evidence root a manifest names (relative to its own directory), else its directory; a root that is a
    symlink (another run's reference, say) is refused, as a symlink inside it is."""
    hint = document.get("evidence", ".")
    if not isinstance(hint, str):
        raise ManifestError(f"{manifest_path}: 'evidence' must be a path string, got {hint!r}")
    named = Path(manifest_path).parent / hint
    last = Path(os.path.realpath(named.parent)) / named.name  # the root itself, its parents resolved
    if named.name not in ("", ".", "..") and last.is_symlink():
        raise ManifestError(f"{manifest_path}: refusing symlinked evidence directory {named}")
    return named.resolve()


def verify_manifest(manifest_path: Path, evidence: Path | None = None, *, jobs: int | None = None,
                    progress: bool = True, partial: bool = False) -> VerifyReport:
    """Compare evidence with a manifest; lists every missing, extra and modified file.

    partial: the evidence is a subset by design; every file present must still match and none may be extra.

    Every file present is hashed (an extra one too: a rename is recognized by its content) while
    this thread checks the manifest's entries and digest; a manifest that fails the check stops
    the hashing and raises.
    """
    manifest_path = Path(manifest_path)
    document = _read_manifest(manifest_path)
    root = Path(evidence) if evidence is not None else default_evidence(manifest_path, document)
    sizes = scan_files(root, exclude=[manifest_path])
    present = sorted(sizes)
    with start_hashing(root, present, sizes, jobs=jobs, progress=progress) as result:
        _check_manifest(manifest_path, document)
        hashed = result()
    expected = {e["path"]: e for e in document["files"]}
    missing = sorted(expected.keys() - sizes.keys())
    extra = sorted(sizes.keys() - expected.keys())
    modified = [
        Modified(p, expected[p]["bytes"], hashed[p][0], expected[p]["sha256"], hashed[p][1])
        for p in present
        if p in expected and hashed[p] != (expected[p]["bytes"], expected[p]["sha256"])
    ]
    by_content = {(expected[p]["bytes"], expected[p]["sha256"]): p for p in missing}
    renamed = [(by_content[hashed[p]], p) for p in extra if hashed[p] in by_content]
    return VerifyReport(str(manifest_path), str(root), len(expected), missing, extra, modified, renamed, partial)
