"""A case's judged rows, kept beside its evidence so that judging resumes where it stopped.

Judging a 0.6B case takes minutes (every parameter's gradient, its AdamW replay and the derivations); a candidate
stage stopped after some cases were judged, or run case by case with --only, would otherwise judge them all again.
After a case is judged its rows are written to `<case>.work/judged.json` (outside the sealed evidence) under a key:
the acceptance's digest, the seal markers of every sealed directory the judge reads (the case, the reference
replays on its clip decisions, the TP1/DP1 case it is compared with), qualify's own source, the numerics packages'
versions and the device the metrics run on. A later stage reuses the rows only when the key is the same and every
one of those directories still verifies against its marker; anything else is judged again. The rows are never
trusted beyond that: `qualify report` and `qualify verify --run` judge every case again from its evidence.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

from qualify.errors import EvidenceError
from qualify.hashing import sha256_tag
from qualify.layout import work_dir
from qualify.stages import MARKER, check_sealed_all, fingerprint
from qualify.store import read_json, write_json
from qualify.verdict import Row

JUDGED_FILE = "judged.json"
JUDGED_SCHEMA = "qualify.judged/1"
NUMERICS = ("torch", "transformers", "safetensors", "numpy")


def judged_path(case_dir: Path) -> Path:
    """Where a case's judged rows are kept: its work directory, beside the sealed evidence."""
    return work_dir(case_dir) / JUDGED_FILE


@functools.cache
def code_fingerprint() -> str:
    """sha256 over qualify's own Python sources (path and bytes): rows judged by other code are judged again."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return sha256_tag(h.hexdigest())


def judged_key(root: Path, acceptance_digest: str, reads: list[Path]) -> str:
    """The key a case's judged rows are kept under (see the module): reads are the sealed directories judged."""
    from qualify.metrics import metrics_device
    from qualify.versions import dependency_versions

    versions = dependency_versions()
    markers = {}
    for path in sorted(set(map(Path, reads))):
        marker = path / MARKER
        where = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
        markers[where] = hashlib.sha256(marker.read_bytes()).hexdigest() if marker.is_file() else None
    return fingerprint({"schema": JUDGED_SCHEMA, "acceptance": acceptance_digest, "markers": markers,
                        "code": code_fingerprint(), "versions": {p: versions.get(p) for p in NUMERICS},
                        "metrics_device": str(metrics_device() or "cpu")})


def load_judged(case_dir: Path, key: str, reads: list[Path], verified: frozenset[Path] = frozenset()) -> list[Row] | None:
    """The rows judged before under key, or None (nothing kept, another key, or a directory read no longer verifies
    against its marker; verified: directories this process has already checked)."""
    path = judged_path(case_dir)
    if not path.is_file():
        return None
    try:
        doc = read_json(path)
    except EvidenceError:
        return None
    if not isinstance(doc, dict) or doc.get("schema") != JUDGED_SCHEMA or doc.get("key") != key:
        return None
    unchecked = [p for p in map(Path, reads) if p not in verified]
    if any(s is None for s in check_sealed_all(unchecked).values()):
        return None
    try:
        return [Row.from_json(r) for r in doc["rows"]]
    except (KeyError, TypeError, ValueError):
        return None


def save_judged(case_dir: Path, key: str, rows: list[Row]) -> None:
    """Keep a case's judged rows under key (replacing what was kept)."""
    doc: dict[str, Any] = {"schema": JUDGED_SCHEMA, "key": key, "rows": [r.to_json() for r in rows]}
    write_json(judged_path(case_dir), doc)
