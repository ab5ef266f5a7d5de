"""The code a case's evidence was made with beyond qualify's own: every file a module the rank imported was loaded
from, outside the standard library and outside qualify/ (torch, transformers, the engine's framework, a plugin and
whatever the plugin imports, a peer library's loss), recorded when the case is sealed and hashed again before it is
reused.

qualify/ itself and a plugin's own module are in the resume key before launch (qualify.engines.registry
.engine_identity); what a rank imports is only known once it ran, so it is recorded beside the evidence (its list in
the case's .work/, its digest in the seal) and a resume whose files hash otherwise is a redo: a bug put into a module
a plugin imports, or into the installed peer library a plugin wraps, is never reused. Whatever the loader: a .py
source file, a sourceless .pyc, a compiled extension (.so), or a member of a zip archive on PYTHONPATH (zipimport:
recorded as '<archive>/<member>', its bytes read from the archive). A namespace package has no file of its own (its
modules are recorded one by one); a built-in or frozen module has none either.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from pathlib import Path

from qualify.hashing import sha256_tag

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


def loaded_from(file: str) -> str | None:
    """Where a module's code was read from, resolved: its file (source, .pyc or extension), or '<archive>/<member>'
    for a zip archive's member; None when that is no file (a frozen module's name for its source, say)."""
    path = Path(file)
    if path.is_file():
        return str(path.resolve())
    member = zip_member(str(path))
    return None if member is None else str(Path(member[0]).resolve() / member[1])


def zip_member(path: str) -> tuple[str, str] | None:
    """(archive, member) of a path inside a zip archive ('/x/lib.zip/pkg/mod.py' -> ('/x/lib.zip', 'pkg/mod.py')),
    else None."""
    import zipfile

    inner = Path(path)
    for archive in inner.parents:
        if archive.is_file():
            return (str(archive), inner.relative_to(archive).as_posix()) if zipfile.is_zipfile(archive) else None
    return None


def imported_files() -> list[str]:
    """Where every module this process imported was loaded from (loaded_from), those recorded (see recorded),
    sorted."""
    out = set()
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        where = loaded_from(file) if isinstance(file, str) else None
        if where is not None and recorded(Path(where)):
            out.add(where)
    return sorted(out)


def file_bytes(path: str) -> bytes:
    """The bytes of a recorded file: a file on disk, or a zip archive's member (OSError when neither is there)."""
    import zipfile

    if Path(path).is_file():
        return Path(path).read_bytes()
    member = zip_member(path)
    if member is None:
        raise FileNotFoundError(path)
    try:
        with zipfile.ZipFile(member[0]) as archive:
            return archive.read(member[1])
    except (KeyError, zipfile.BadZipFile) as exc:
        raise FileNotFoundError(path) from exc


def code_digest(paths: list[str]) -> str:
    """sha256 over each file's path and contents (a file gone since is its own mark)."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.encode() + b"\0")
        try:
            h.update(hashlib.sha256(file_bytes(p)).digest())
        except OSError:
            h.update(b"missing")
    return sha256_tag(h.hexdigest())


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
