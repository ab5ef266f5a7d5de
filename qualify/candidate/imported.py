"""The code a case's evidence was made with beyond qualify's own: every Python source file the rank imported from
outside the standard library and outside qualify/ (torch, transformers, the engine's framework, a plugin and whatever
the plugin imports, a peer library's loss), recorded when the case is sealed and hashed again before it is reused.

qualify/ itself and a plugin's own module are in the resume key before launch (qualify.engines.registry
.engine_identity); what a rank imports is only known once it ran, so it is recorded beside the evidence (its list in
the case's .work/, its digest in the seal) and a resume whose files hash otherwise is a redo: a bug put into a module
a plugin imports, or into the installed peer library a plugin wraps, is never reused. Source files only (.py): compiled
extensions change with the package version, which the key holds too.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from pathlib import Path

IMPORTED_FILE = "imported.json"
KEY = "imported code"


QUALIFY = Path(__file__).resolve().parents[1]
"""qualify/ itself: in the resume key before launch."""


def recorded(path: Path) -> bool:
    """Whether an imported file is recorded: anything installed (site-packages, dist-packages) or outside the standard
    library, never qualify/ itself."""
    if path.is_relative_to(QUALIFY):
        return False
    if "site-packages" in path.parts or "dist-packages" in path.parts:
        return True
    stdlib = [Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib")]
    return not any(path.is_relative_to(root) for root in stdlib)


def imported_files() -> list[str]:
    """Every .py file of a module this process imported that is recorded (see recorded), sorted."""
    out = set()
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str) or not file.endswith(".py"):
            continue
        path = Path(file).resolve()
        if path.is_file() and recorded(path):
            out.add(str(path))
    return sorted(out)


def code_digest(paths: list[str]) -> str:
    """sha256 over each file's path and contents (a file gone since is its own mark)."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.encode() + b"\0")
        try:
            h.update(hashlib.sha256(Path(p).read_bytes()).digest())
        except OSError:
            h.update(b"missing")
    return "sha256:" + h.hexdigest()


def record(work: Path) -> str:
    """Write the list of imported files into the case's work directory; return their digest (for the seal)."""
    paths = imported_files()
    Path(work).mkdir(parents=True, exist_ok=True)
    (Path(work) / IMPORTED_FILE).write_text(json.dumps(paths, indent=0))
    return code_digest(paths)


def digest_now(work: Path) -> str | None:
    """The digest of the recorded files as they are now (None: nothing recorded, so the case cannot be reused)."""
    try:
        paths = json.loads((Path(work) / IMPORTED_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        return None
    return code_digest(paths)
