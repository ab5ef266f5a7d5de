"""Resumable, sealed stage directories: complete-and-verified outputs are skipped, partial ones redone.

A stage writes its files into its directory, then seals it (seal): a marker `_complete.json` listing
the sha256 of every file it wrote, and the info the stage records (its digest, its settings). A
consumer opens a sealed directory with open_sealed, which verifies every file once and checks the
digest it expects, and reads what it needs. On resume (after preemption or a requeue) a directory whose
marker verifies is kept as it is, never overwritten; a directory without a valid marker is partial: it is
removed and the stage runs again. A stage directory that is a symlink is refused (ManifestError), like a
symlinked file inside one.

Nothing here remembers a verification: a caller that has verified a directory keeps the Sealed it got
rather than checking again (a file rewritten within one tick of the filesystem clock keeps its size
and modification time, so a stat-based memory could miss it).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qualify.errors import EvidenceError, ManifestError
from qualify.hashing import digest_of_bytes, hash_files, scan_files, sha256_tag
from qualify.store import read_json, write_json

MARKER = "_complete.json"

@dataclass(frozen=True, slots=True)
class Sealed:
    """A verified sealed directory: every file's (size, sha256) as recorded, and the stage's info."""

    path: Path
    files: dict[str, list] = field(repr=False)
    info: dict[str, Any]

    def digest(self, name: str) -> str:
        """'sha256:<hex>' of one of the directory's files, as verified."""
        if name not in self.files:
            raise EvidenceError(f"{self.path} holds no {name}")
        return sha256_tag(self.files[name][1])


def refuse_linked(path: Path) -> None:
    """A stage directory that is a symlink (to another run's, say) is refused, as a symlinked file in it is
    (qualify.hashing): never read through, never believed complete, never removed through the link."""
    if Path(path).is_symlink():
        raise ManifestError(f"refusing symlinked directory in evidence: {path}")


def _digests(path: Path) -> dict[str, list]:
    sizes = {f: n for f, n in scan_files(path).items() if f != MARKER}
    files = sorted(sizes)
    return {f: list(v) for f, v in hash_files(path, files, progress=False, sizes=sizes).items()}


def check_sealed(path: Path) -> Sealed | None:
    """The verified seal of path, or None when path is missing, partial or modified since it was sealed."""
    path = Path(path)
    refuse_linked(path)
    marker = path / MARKER
    if not marker.is_file():
        return None
    try:
        doc = read_json(marker)
        recorded, info = doc["files"], doc.get("info", {})
    except (EvidenceError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(recorded, dict) or recorded != _digests(path):
        return None
    return Sealed(path, recorded, info)


def check_sealed_all(paths: Iterable[Path]) -> dict[Path, Sealed | None]:
    """check_sealed of every path, with the files of all of them hashed in one parallel pass (qualify.hashing spreads
    large files over threads): a run's sealed directories are verified at once, not one directory after another."""
    import os

    found: dict[Path, Sealed | None] = {}
    recorded: dict[Path, tuple[dict, dict, dict[str, int]]] = {}
    for path in map(Path, paths):
        refuse_linked(path)
        found[path] = None
        marker = path / MARKER
        if not marker.is_file():
            continue
        try:
            doc = read_json(marker)
            files, info = doc["files"], doc.get("info", {})
        except (EvidenceError, KeyError, TypeError, AttributeError):
            continue
        if isinstance(files, dict):
            recorded[path] = (files, info, {f: n for f, n in scan_files(path).items() if f != MARKER})
    if not recorded:
        return found
    root = Path(os.path.commonpath([os.fspath(p) for p in recorded]))
    sizes = {(p.relative_to(root) / f).as_posix(): n for p, (_, _, own) in recorded.items() for f, n in own.items()}
    hashes = hash_files(root, sorted(sizes), progress=False, sizes=sizes)
    for path, (files, info, own) in recorded.items():
        prefix = path.relative_to(root)
        if files == {f: list(hashes[(prefix / f).as_posix()]) for f in sorted(own)}:
            found[path] = Sealed(path, files, info)
    return found


def stage_is_complete(path: Path) -> bool:
    """True when path holds a marker whose file digests all match what is on disk."""
    return check_sealed(path) is not None


def open_sealed(path: Path, what: str, expected_digest: str | None = None, main: str | None = None) -> Sealed:
    """Verify a sealed directory (every file against its marker) and, given expected_digest, that its main file
    (or, without main, the digest the stage recorded in its info) is the expected one."""
    sealed = check_sealed(path)
    if sealed is None:
        raise EvidenceError(f"{what} at {path} is missing, partial or modified; rerun the stage that makes it")
    if expected_digest is not None:
        actual = sealed.digest(main) if main is not None else sealed.info.get("digest")
        if actual != expected_digest:
            raise EvidenceError(f"{what} at {path} has digest {actual}, expected {expected_digest}: refusing to run "
                                f"on a different {what}")
    return sealed


def seal(path: Path, info: dict[str, Any] | None = None, main: str | None = None) -> str | None:
    """Seal path: record the digest of every file in it and info (with, given main, that file's digest as
    info['digest']). Returns the main file's digest ('sha256:<hex>'), else None."""
    path = Path(path)
    files = _digests(path)
    info = dict(info or {})
    digest = None
    if main is not None:
        if main not in files:
            raise EvidenceError(f"cannot seal {path}: it holds no {main}")
        digest = sha256_tag(files[main][1])
        info["digest"] = digest
    write_json(path / MARKER, {"files": files, "info": info})
    return digest


def prepare_stage(path: Path) -> None:
    """Make path an empty directory, removing a partial earlier attempt. Refuses a complete one."""
    path = Path(path)
    refuse_linked(path)
    if stage_is_complete(path):
        raise EvidenceError(f"refusing to overwrite a complete stage output: {path}")
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def write_tensor_stage(path: Path, file: str, tensors: dict[str, Any], meta_file: str, meta: dict[str, Any],
                       info: dict[str, Any] | None = None, extra: dict[str, dict[str, Any]] | None = None) -> str:
    """The sequence of every tensor stage: empty path, write the tensors, record their digest in the meta file
    (meta | {'digest': ...}) and in the seal's info, seal. Returns the tensors' digest. extra: further tensor files
    (file name -> tensors) written beside file before the seal, so that it covers them; their digests go in the
    meta file's 'extra_digests'."""
    from qualify.hashing import file_digest
    from qualify.store import write_tensors

    prepare_stage(path)
    write_tensors(Path(path) / file, tensors)
    digest = file_digest(Path(path) / file)
    for name, more in (extra or {}).items():
        write_tensors(Path(path) / name, more)
    extras = {"extra_digests": {name: file_digest(Path(path) / name) for name in extra}} if extra else {}
    write_json(Path(path) / meta_file, meta | extras | {"digest": digest})
    seal(path, info, main=file)
    return digest


def complete_stage(path: Path, info: dict[str, Any] | None = None) -> None:
    """Seal path without a main file (see seal)."""
    seal(path, info)


def require_complete(path: Path, what: str) -> Sealed:
    """The verified seal of path; EvidenceError unless path is a complete, verified stage output."""
    return open_sealed(path, what)


def require_all_complete(stages: list[tuple[Path, str]]) -> dict[Path, Sealed]:
    """require_complete of every (path, what), verified together (check_sealed_all); the first one that is not
    complete raises, as require_complete would."""
    sealed = check_sealed_all(path for path, _ in stages)
    for path, what in stages:
        if sealed[Path(path)] is None:
            raise EvidenceError(f"{what} at {path} is missing, partial or modified; rerun the stage that makes it")
    return {path: s for path, s in sealed.items() if s is not None}


def stage_info(path: Path) -> dict[str, Any]:
    """The info recorded when the stage at path was completed."""
    return read_json(Path(path) / MARKER).get("info", {})


def fingerprint(settings: Any) -> str:
    """sha256 of the canonical JSON of the settings a stage output depends on."""

    from qualify.store import dumps_json

    return digest_of_bytes(dumps_json(settings).encode("ascii"))


def reuse_complete(path: Path, settings_fingerprint: str, what: str) -> bool:
    """True when path is complete and was made with the same settings; a complete output made with
    other settings is refused (it is never overwritten: choose another run directory)."""
    if not stage_is_complete(path):
        return False
    recorded = stage_info(path).get("settings")
    if recorded != settings_fingerprint:
        from qualify.errors import FrozenError

        raise FrozenError(f"{what} at {path} was made with other settings than the matrix now asks for; "
                          "it is never overwritten: use another --out directory")
    return True
