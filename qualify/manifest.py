"""sha256 manifests of evidence directories: create them and verify evidence against them.

A manifest lists every file under an evidence root (relative POSIX path, size,
sha256), sorted by path, and carries its own digest. Verification streams every
file in fixed-size chunks (bounded memory), hashes in parallel threads (hashlib
releases the GIL on large updates) and reports every missing, extra and modified
file. Symlinks and paths that escape the root are refused, never followed.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from qualify.errors import ManifestError
from qualify.store import dumps_json, read_json, write_json

MANIFEST_SCHEMA = "qualify.manifest/1"
CHUNK_BYTES = 1 << 20  # 1 MiB reads: large enough for hashlib to drop the GIL, small enough to bound memory


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

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.modified)

    def to_json(self) -> dict[str, Any]:
        return {
            "manifest": self.manifest,
            "evidence": self.evidence,
            "num_files": self.num_files,
            "ok": self.ok,
            "missing": self.missing,
            "extra": self.extra,
            "modified": [_modified_json(m) for m in self.modified],
            "renamed": [{"from": a, "to": b} for a, b in self.renamed],
        }


def _modified_json(m: Modified) -> dict[str, Any]:
    return {
        "path": m.path,
        "expected_bytes": m.expected_bytes,
        "actual_bytes": m.actual_bytes,
        "expected_sha256": m.expected_sha256,
        "actual_sha256": m.actual_sha256,
    }


def sha256_file(path: Path, on_bytes: Callable[[int], None] | None = None) -> tuple[int, str]:
    """Stream a file through sha256; return (size, hexdigest). Refuses symlinks."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if os.path.islink(path):
            raise ManifestError(f"refusing symlink in evidence: {path}") from exc
        raise
    digest = hashlib.sha256()
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    size = 0
    with os.fdopen(fd, "rb", buffering=0) as handle:
        while n := handle.readinto(buf):
            digest.update(view[:n])
            size += n
            if on_bytes is not None:
                on_bytes(n)
    return size, digest.hexdigest()


def list_files(root: Path, exclude: Iterable[Path] = ()) -> list[str]:
    """Every regular file under root as a sorted relative POSIX path; symlinks are refused."""
    root = Path(root)
    if not root.is_dir():
        raise ManifestError(f"evidence root is not a directory: {root}")
    excluded = {Path(p).resolve() for p in exclude}
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            mode = os.lstat(full).st_mode
            if stat.S_ISLNK(mode):
                raise ManifestError(f"refusing symlink in evidence: {full}")
            if stat.S_ISREG(mode) and full.resolve() not in excluded:
                found.append(full.relative_to(root).as_posix())
            elif not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
                raise ManifestError(f"refusing special file in evidence: {full}")
    return sorted(found)


def check_relative(path: str) -> str:
    """Validate a manifest path: relative, normalized, inside the root."""
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or ".." in pure.parts or "\\" in path or str(pure) != path:
        raise ManifestError(f"manifest path escapes or is not normalized under the evidence root: {path!r}")
    return path


def digest_of(document: dict[str, Any]) -> str:
    """sha256 over the canonical JSON of a manifest document without its digest field."""
    body = {k: v for k, v in document.items() if k != "digest"}
    return "sha256:" + hashlib.sha256(dumps_json(body).encode("ascii")).hexdigest()


def hash_files(root: Path, paths: list[str], jobs: int | None = None, progress: bool = True) -> dict[str, tuple[int, str]]:
    """Hash many files under root in parallel; returns path -> (size, sha256)."""
    from qualify.progress import byte_progress

    jobs = jobs or os.cpu_count() or 1
    total = sum(os.lstat(root / p).st_size for p in paths)
    with byte_progress("hashing", total, enabled=progress) as advance:
        def one(rel: str) -> tuple[str, tuple[int, str]]:
            return rel, sha256_file(root / rel, advance)

        if jobs == 1 or len(paths) <= 1:
            return dict(map(one, paths))
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            return dict(pool.map(one, paths, chunksize=max(1, len(paths) // (jobs * 8))))


def build_manifest(root: Path, *, exclude: Iterable[Path] = (), jobs: int | None = None,
                   progress: bool = True, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Manifest document for every file under root (extra keys are merged in before digesting)."""
    root = Path(root)
    paths = list_files(root, exclude)
    hashed = hash_files(root, paths, jobs, progress)
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


def load_manifest(path: Path) -> dict[str, Any]:
    """Read a manifest, checking schema, entries and its own digest."""
    path = Path(path)
    if path.is_symlink():
        raise ManifestError(f"refusing symlinked manifest: {path}")
    try:
        document = read_json(path)
    except ValueError as exc:
        raise ManifestError(str(exc)) from exc
    if not isinstance(document, dict) or not isinstance(document.get("files"), list):
        raise ManifestError(f"{path}: not a manifest (no 'files' list)")
    for entry in document["files"]:
        if not isinstance(entry, dict) or set(entry) != {"path", "bytes", "sha256"}:
            raise ManifestError(f"{path}: malformed file entry {entry!r}")
        check_relative(entry["path"])
    if document.get("digest") != digest_of(document):
        raise ManifestError(f"{path}: manifest digest does not match its content (edited by hand?)")
    return document


def default_evidence(manifest_path: Path, document: dict[str, Any]) -> Path:
    """The evidence root a manifest names (relative to its own directory), else its directory."""
    hint = document.get("evidence", ".")
    if not isinstance(hint, str):
        raise ManifestError(f"{manifest_path}: 'evidence' must be a path string, got {hint!r}")
    return (Path(manifest_path).parent / hint).resolve()


def verify_manifest(manifest_path: Path, evidence: Path | None = None, *, jobs: int | None = None,
                    progress: bool = True) -> VerifyReport:
    """Compare evidence with a manifest; lists every missing, extra and modified file."""
    manifest_path = Path(manifest_path)
    document = load_manifest(manifest_path)
    root = Path(evidence) if evidence is not None else default_evidence(manifest_path, document)
    expected = {e["path"]: e for e in document["files"]}
    present = set(list_files(root, exclude=[manifest_path]))
    missing = sorted(set(expected) - present)
    extra = sorted(present - set(expected))
    common = sorted(set(expected) & present)
    hashed = hash_files(root, common + extra, jobs, progress)
    modified = [
        Modified(p, expected[p]["bytes"], hashed[p][0], expected[p]["sha256"], hashed[p][1])
        for p in common
        if hashed[p] != (expected[p]["bytes"], expected[p]["sha256"])
    ]
    by_sha = {expected[p]["sha256"]: p for p in missing}
    renamed = [(by_sha[hashed[p][1]], p) for p in extra if hashed[p][1] in by_sha]
    return VerifyReport(str(manifest_path), str(root), len(expected), missing, extra, modified, renamed)
