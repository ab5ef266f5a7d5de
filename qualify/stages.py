"""Resumable stage directories: complete-and-verified outputs are skipped, partial ones redone.

A stage writes its files into its directory, then a marker `_complete.json` listing the sha256
of every file it wrote. On resume (after preemption or a requeue) a directory whose marker
verifies is kept as it is, never overwritten; a directory without a valid marker is partial:
it is removed and the stage runs again.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from qualify.errors import EvidenceError
from qualify.manifest import hash_files, list_files
from qualify.store import read_json, write_json

MARKER = "_complete.json"


def _digests(path: Path) -> dict[str, list]:
    files = [f for f in list_files(path) if f != MARKER]
    return {f: list(v) for f, v in hash_files(path, files, progress=False).items()}


def stage_is_complete(path: Path) -> bool:
    """True when path holds a marker whose file digests all match what is on disk."""
    path = Path(path)
    marker = path / MARKER
    if not marker.is_file():
        return False
    try:
        recorded = read_json(marker)["files"]
    except (EvidenceError, KeyError, TypeError):
        return False
    return recorded == _digests(path)


def prepare_stage(path: Path) -> None:
    """Make path an empty directory, removing a partial earlier attempt. Refuses a complete one."""
    path = Path(path)
    if stage_is_complete(path):
        raise EvidenceError(f"refusing to overwrite a complete stage output: {path}")
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def complete_stage(path: Path, info: dict[str, Any] | None = None) -> None:
    """Seal path: record the digest of every file in it."""
    write_json(Path(path) / MARKER, {"files": _digests(Path(path)), "info": info or {}})


def require_complete(path: Path, what: str) -> None:
    """Raise EvidenceError unless path is a complete, verified stage output."""
    if not stage_is_complete(path):
        raise EvidenceError(f"{what} at {path} is missing, partial or modified; rerun the stage that makes it")


def stage_info(path: Path) -> dict[str, Any]:
    """The info recorded when the stage at path was completed."""
    return read_json(Path(path) / MARKER).get("info", {})


def fingerprint(settings: Any) -> str:
    """sha256 of the canonical JSON of the settings a stage output depends on."""
    import hashlib

    from qualify.store import dumps_json

    return "sha256:" + hashlib.sha256(dumps_json(settings).encode("ascii")).hexdigest()


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
