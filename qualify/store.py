"""Evidence store: atomic writes of safetensors tensors and sorted, indented JSON.

Every write goes to a temporary file in the target directory, is fsynced, then
renamed over the target, so a reader never sees a half-written file. No pickles.
A temporary file is named for its writer ('.<name>.<host>.<pid>.<random>.tmp'): a writer killed
midway (SIGKILL, a scheduler's time limit) cannot remove its own, so the first write a process
makes into a directory removes every temporary file there whose writer, on this host, is dead.
Written files get the mode a plain open() would give (0666 less the umask), and a
write the system refuses (disk full, no permission) is an OutputError naming the file.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from qualify.errors import EvidenceError, OutputError


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# mkstemp creates 0600 files; evidence gets the mode a plain open() would give (read once: os.umask
# can only be read by setting it, which is not thread-safe later on).
_FILE_MODE = 0o666 & ~_read_umask()


HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"
"""This host's name as a temporary file carries it (no dots: the name is split on them)."""
TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>[0-9]+)\.[^.]+\.tmp$")
_swept: set[str] = set()
"""Directories this process has swept of dead writers' temporary files (once each)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_stale_temps(directory: Path) -> list[str]:
    """Remove the temporary files in directory whose writer was this host's and is no longer running (a write
    killed midway); returns their names. Another host's, or a running writer's, are kept."""
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        m = TEMP_NAME.match(entry.name)
        if m is None or m["host"] != HOST or int(m["pid"]) == os.getpid() or _alive(int(m["pid"])):
            continue
        try:
            os.unlink(entry.path)
            removed.append(entry.name)
        except FileNotFoundError:  # another process swept it first
            continue
    return removed


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call write(tmp_path), fsync tmp_path, then rename it onto path.

    The temporary file lies next to path (same filesystem, so the rename is atomic) and is
    removed if anything fails, an interrupt included; an OSError becomes an OutputError.
    """
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"cannot write {path}: it is a directory (give a file path)")
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if str(path.parent) not in _swept:
            sweep_stale_temps(path.parent)
            _swept.add(str(path.parent))
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.{HOST}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
        tmp = Path(tmp_name)
        os.close(fd)
        write(tmp)
        # after write(): a writer may replace the file (safetensors does) and the new one has mkstemp's 0600
        os.chmod(tmp, _FILE_MODE)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        tmp = None
        _fsync_dir(path.parent)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write bytes atomically."""
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def dumps_json(obj: Any) -> str:
    """Canonical JSON text: sorted keys, 2-space indent, ASCII, trailing newline."""
    return json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False) + "\n"


def json_safe(value: Any) -> Any:
    """value with every non-finite float as the string 'nan', 'inf' or '-inf' (JSON has no NaN; readers turn them
    back into floats with float()), so a NaN in evidence becomes a failing row naming it, not a crash writing it."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def write_json(path: Path, obj: Any) -> None:
    """Write obj as canonical JSON, atomically."""
    atomic_write_bytes(path, dumps_json(obj).encode("ascii"))


def read_json(path: Path) -> Any:
    """Read a JSON file; a missing, unreadable or malformed file is an EvidenceError."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise EvidenceError(f"missing file: {path}") from exc
    except json.JSONDecodeError as exc:
        raise EvidenceError(f"malformed JSON in {path}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise EvidenceError(f"malformed JSON in {path}: not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    except RecursionError as exc:
        raise EvidenceError(f"malformed JSON in {path}: nested too deeply") from exc
    except ValueError as exc:  # an integer of more than 4300 digits, say
        raise EvidenceError(f"malformed JSON in {path}: {str(exc).splitlines()[0][:200]}") from exc
    except OSError as exc:
        raise EvidenceError(f"cannot read {path}: {exc.strerror}") from exc


def read_json_object(path: Path, what: str, required: Iterable[str] = ()) -> dict[str, Any]:
    """Read a JSON file that must hold an object with the required keys (a reference summary, an acceptance).

    Anything else is an EvidenceError naming the file, what it should be and the first missing key, so a
    caller indexes the keys it named without a KeyError.
    """
    document = read_json(path)
    if not isinstance(document, dict):
        raise EvidenceError(f"{path}: not a {what} (a JSON {type(document).__name__}, not an object)")
    missing = [key for key in required if key not in document]
    if missing:
        raise EvidenceError(f"{path}: not a {what}: no '{missing[0]}' key"
                            + (f" (nor {', '.join(repr(k) for k in missing[1:])})" if missing[1:] else ""))
    return document


def write_tensors(path: Path, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> None:
    """Write a dict of torch tensors (name -> tensor) to safetensors, atomically.

    Tensors that share storage with an earlier one (tied embeddings) are cloned: safetensors
    refuses shared storage, and evidence wants every name as its own tensor.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    contiguous: dict[str, Any] = {}
    storages: set[int] = set()
    for name, tensor in tensors.items():
        t = tensor.detach().contiguous().cpu()
        ptr = t.untyped_storage().data_ptr()
        if ptr in storages and t.numel():
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        contiguous[name] = t

    def save(tmp: Path) -> None:
        try:
            # safetensors writes an unreadable header for no tensors with an empty metadata dict: pass none then
            # (and keep the empty dict otherwise, so evidence files stay byte-identical to earlier ones)
            md = dict(metadata or {})
            save_file(contiguous, str(tmp), metadata=md if (md or contiguous) else None)
        except SafetensorError as exc:  # its I/O errors (disk full) are not OSErrors
            raise OutputError(f"cannot write {path}: {exc}") from exc

    atomic_write(path, save)


def read_tensors(path: Path) -> dict[str, Any]:
    """Read every tensor of a safetensors file into a dict (name -> tensor)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise EvidenceError(f"missing tensor file: {path}")
    try:
        tensors = load_file(str(path))
    except SafetensorError as exc:
        raise EvidenceError(f"{path}: not a readable safetensors file: {exc}") from exc
    if _is_coded(path):  # a coded file (qualify.tensor_codec): its logical tensors
        coded = TensorFile(path)
        return {name: coded[name] for name in coded}
    return tensors


def _is_coded(path: Path) -> bool:
    from safetensors import safe_open

    from qualify.tensor_codec import CODEC_KEY

    with safe_open(str(path), framework="pt") as f:
        return CODEC_KEY in (f.metadata() or {})


def _safetensors_dtypes() -> dict[str, Any]:
    import torch

    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
            "BOOL": torch.bool}


SAFETENSORS_DTYPES: dict[str, Any] = {}


def tensor_spec(tensors: Mapping[str, Any], name: str) -> tuple[tuple[int, ...], Any]:
    """(shape, dtype) of tensors[name]: from the header of a TensorFile (nothing read), else from the tensor."""
    if isinstance(tensors, TensorFile):
        return tensors.spec(name)
    t = tensors[name]
    return tuple(t.shape), t.dtype


class TensorFile(Mapping):
    """A safetensors file read one tensor at a time, on access, never whole: a run's gradients, updates and moments
    at a real shape are many GB, and every check walks them tensor by tensor. Reading the header checks the file."""

    def __init__(self, path: Path) -> None:
        from safetensors import SafetensorError, safe_open

        from qualify.tensor_codec import CodedFile, parse

        self.path = Path(path)
        if not self.path.is_file():
            raise EvidenceError(f"missing tensor file: {path}")
        try:
            with safe_open(str(self.path), framework="pt") as f:
                # in the file's order, as read_tensors (load_file) returns them: sums over a group add in one order
                self._keys = list(f.offset_keys() if hasattr(f, "offset_keys") else f.keys())
                self._specs = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in self._keys}
                doc = parse(f.metadata())
        except SafetensorError as exc:
            raise EvidenceError(f"{path}: not a readable safetensors file: {exc}") from exc
        self._stored = frozenset(self._keys)
        # a coded file (qualify.tensor_codec): its logical tensors, in a plain file's order, each fp32
        self.coded = None if doc is None else CodedFile(self.path, doc, self._stored_tensor, TensorFile)
        if self.coded is not None:
            self._keys = self.coded.names
            self._specs = {n: (self.coded.shapes[n], "F32") for n in self._keys}
        self._index = frozenset(self._keys)
        self.device: Any = None
        """Where tensor() reads to when no device is named (None: the CPU; on(device) gives such a view)."""

    def on(self, device: Any) -> TensorFile:
        """This file read onto device by default: a view, each tensor read (a coded one decoded) there when asked,
        never held."""
        import copy

        import torch

        view = copy.copy(self)
        view.device = torch.device(device)
        return view

    def _stored_tensor(self, name: str) -> Any:
        """A tensor as stored (a coded file's part), None when the file has none of that name."""
        from safetensors import SafetensorError, safe_open

        if name not in self._stored:
            return None
        try:
            with safe_open(str(self.path), framework="pt") as f:
                return f.get_tensor(name)
        except SafetensorError as exc:
            raise EvidenceError(f"{self.path}: tensor {name} is not readable: {exc}") from exc

    def __getitem__(self, name: str) -> Any:
        return self.tensor(name)

    def tensor(self, name: str, device: Any = None) -> Any:
        """The tensor of that name on device (default the CPU); a coded one is decoded there (a GPU decodes a
        case's moments and new parameters where a CPU would take seconds a tensor, to the same bits)."""
        if name not in self._index:
            raise KeyError(name)
        device = self.device if device is None else device
        if self.coded is not None and self.coded.is_coded(name):
            return self.coded.decode(name, device)
        t = self._stored_tensor(name)
        return t if device is None else t.to(device)

    def spec(self, name: str) -> tuple[tuple[int, ...], Any]:
        """(shape, torch dtype) of a tensor, from the file's header (nothing read)."""
        import torch

        if not SAFETENSORS_DTYPES:
            SAFETENSORS_DTYPES.update(_safetensors_dtypes())
        shape, dtype = self._specs[name]
        return shape, SAFETENSORS_DTYPES.get(dtype) or getattr(torch, dtype.lower(), dtype)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def tree_bytes(path: Path) -> int:
    """Bytes of every file under path (0 when it does not exist)."""
    path = Path(path)
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0
