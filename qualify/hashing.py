"""The one home of file digests: listing an evidence tree, and streaming sha256 of many files in parallel with
bounded memory (file_digest is the "sha256:<hex>" string every stage records).

Every file is read in CHUNK_BYTES pieces into one reusable buffer per thread (os.readv: no
allocation per read). Large files are hashed by threads: hashlib releases the GIL while it
hashes a chunk, so threads scale. Small files do not scale on threads (opening, reading and
hashing 16 KiB releases and retakes the GIL half a dozen times, and the hand-offs between
threads cost more than they overlap), so many
small files are split among worker processes: fresh `python -I -S` interpreters that import
nothing but this module, read their paths on stdin and answer one line per file (no fork: safe in a
process that runs other threads). Hashing starts in the background (start_hashing) so that
the caller can do other work, such as checking a manifest's digest, meanwhile. Symlinks and
special files are refused.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import os
import stat
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from qualify.errors import EvidenceError, ManifestError, QualifyError

CHUNK_BYTES = 1 << 20  # 1 MiB reads: large enough for hashlib to drop the GIL, small enough to bound memory
# A batch (one task) closes at BATCH_BYTES or BATCH_FILES; a file larger than BATCH_BYTES is a task alone.
BATCH_BYTES = 8 << 20
BATCH_FILES = 512
# Files below SMALL_BYTES go to worker processes when there are at least MIN_SPAWN_FILES of them
# (a worker interpreter's start is worth it only for many small files), else to one thread. Files from SMALL_BYTES
# up go to `jobs` threads.
SMALL_BYTES = 256 << 10
MIN_SPAWN_FILES = 2000
SPAWN_COST_BYTES = 32 << 10  # per-file cost (open, stat, close) in bytes-hashed equivalents, to balance workers
_WORKER_CODE = ("import sys; sys.path.insert(0, sys.argv[1]); from qualify.hashing import worker_main; "
                "worker_main(sys.argv[2])")
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
               | getattr(os, "O_NONBLOCK", 0))  # O_NONBLOCK: a FIFO must not hang the open; no effect on files
_local = threading.local()

Hashes = dict[str, tuple[int, str]]  # relative path -> (size, hex sha256)


def default_jobs() -> int:
    """CPUs this process may run on (a Slurm or taskset allocation, not the whole host)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _buffer() -> tuple[bytearray, memoryview]:
    """This thread's read buffer: allocated once, so hashing many small files allocates nothing."""
    if not hasattr(_local, "buf"):
        _local.buf = bytearray(CHUNK_BYTES)
        _local.view = memoryview(_local.buf)
    return _local.buf, _local.view


def _open_regular(path: str) -> int:
    """Open a regular file for reading without following a symlink; anything else is refused."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise ManifestError(f"refusing symlink in evidence: {path}") from exc
        raise EvidenceError(f"cannot read {path}: {exc.strerror}") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ManifestError(f"refusing special file in evidence: {path}")
    return fd


def hash_path(path: str, on_bytes: Callable[[int], None] | None = None) -> tuple[int, str]:
    """(size, hex sha256) of one file, read in CHUNK_BYTES pieces into this thread's buffer."""
    buf, view = _buffer()
    fd = _open_regular(path)
    digest = hashlib.sha256()
    size = 0
    try:
        while n := os.readv(fd, (buf,)):
            digest.update(view[:n])
            size += n
            if on_bytes is not None:
                on_bytes(n)
    except OSError as exc:
        raise EvidenceError(f"cannot read {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)
    return size, digest.hexdigest()


DIGEST_PREFIX = "sha256:"
"""What every recorded digest starts with: 'sha256:<hex>'."""


def sha256_tag(hexdigest: str) -> str:
    """'sha256:<hex>' of a hex sha256 digest (hashlib's hexdigest()): how every stage writes a digest."""
    return DIGEST_PREFIX + hexdigest


def digest_of_bytes(data: bytes) -> str:
    """'sha256:<hex>' of bytes (a canonical JSON text's, a bounds file's)."""
    return sha256_tag(hashlib.sha256(data).hexdigest())


def file_digest(path: Path | str) -> str:
    """'sha256:<hex>' of one file: how every stage names a sealed file's content (rollout, targets, bounds)."""
    return sha256_tag(hash_path(str(path))[1])


def make_batches(paths: list[str], sizes: Mapping[str, int], jobs: int) -> list[list[str]]:
    """Group paths into tasks, largest files first so no thread is left alone with a big one at the end."""
    total = sum(sizes[p] for p in paths)
    limit = max(1, min(BATCH_BYTES, total // (4 * jobs)))  # at least about 4 tasks per thread
    batches: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for path in sorted(paths, key=sizes.__getitem__, reverse=True):
        current.append(path)
        current_bytes += sizes[path]
        if current_bytes >= limit or len(current) >= BATCH_FILES:
            batches.append(current)
            current, current_bytes = [], 0
    if current:
        batches.append(current)
    return batches


class _Workers:
    """Threads that take batches in order until none is left, the first error, or stop()."""

    def __init__(self, base: str, batches: list[list[str]], jobs: int, advance: Callable[[int], None]) -> None:
        self._base, self._batches, self._advance = base, batches, advance
        self._next = itertools.count()  # next() on a count is atomic under the GIL: a lock-free work queue
        self._done: list[list[tuple[str, tuple[int, str]]]] = []
        self._error: BaseException | None = None
        self._stopped = False
        num_threads = max(1, min(jobs, len(batches)))
        self._threads = [threading.Thread(target=self._work, name=f"qualify-hash-{i}", daemon=True)
                         for i in range(num_threads)]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        join, advance = os.path.join, self._advance
        while not self._stopped:
            index = next(self._next)
            if index >= len(self._batches):
                return
            try:
                self._done.append([(p, hash_path(join(self._base, p), advance)) for p in self._batches[index]])
            except BaseException as exc:  # noqa: BLE001 - not swallowed: result() re-raises it in the caller
                self._error = self._error or exc
                self._stopped = True
                return

    def stop(self) -> None:
        self._stopped = True
        for thread in self._threads:
            thread.join()

    def result(self) -> Hashes:
        for thread in self._threads:
            thread.join()
        if self._error is not None:
            raise self._error
        return {path: value for batch in self._done for path, value in batch}


def worker_main(base: str) -> None:
    """A worker process: NUL-separated paths under base on stdin; per path one line 'size sha256' on stdout.

    A failure ends the worker with one line '! M message' (ManifestError) or '! E message' (EvidenceError).
    """
    data = sys.stdin.buffer.read()
    out = sys.stdout.buffer
    for raw in data.split(b"\0") if data else ():
        try:
            size, digest = hash_path(os.path.join(base, os.fsdecode(raw)))
        except QualifyError as exc:
            kind = b"M" if isinstance(exc, ManifestError) else b"E"
            out.write(b"! " + kind + b" " + str(exc).encode("utf-8", "backslashreplace") + b"\n")
            break
        out.write(b"%d %s\n" % (size, digest.encode("ascii")))
    out.flush()


class _Process:
    """One worker process hashing a fixed list of paths; a thread feeds it and collects its lines.

    The worker only accelerates: should it fail to start or die (not a file problem it reports),
    result() hashes its paths in the calling thread instead.
    """

    def __init__(self, base: str, paths: list[str], advance: Callable[[int], None]) -> None:
        import subprocess

        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self._base, self._paths, self._advance = base, paths, advance
        self._hashes: list[tuple[int, str]] = []
        self._error: QualifyError | None = None
        self._crashed = False
        self._proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WORKER_CODE, package_parent, base],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._thread = threading.Thread(target=self._talk, name="qualify-hash-worker", daemon=True)
        self._thread.start()

    def _talk(self) -> None:
        proc = self._proc
        try:
            # The worker reads all of stdin before it writes: feeding it first cannot deadlock.
            with proc.stdin:
                proc.stdin.write(os.fsencode("\0".join(self._paths)))
            for line in proc.stdout:
                if line.startswith(b"! "):
                    kind = ManifestError if line[2:3] == b"M" else EvidenceError
                    self._error = kind(line[4:].decode("utf-8", "replace").rstrip("\n"))
                    return
                size, digest = line.split()
                self._hashes.append((int(size), digest.decode("ascii")))
                self._advance(int(size))
        except (OSError, ValueError):  # broken pipe, a garbled line: the worker died
            pass
        self._crashed = proc.wait() != 0 or len(self._hashes) != len(self._paths)

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._thread.join()
        self._proc.wait()
        self._proc.stdout.close()

    def result(self) -> Hashes:
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._crashed:
            return {p: hash_path(os.path.join(self._base, p)) for p in self._paths}
        return dict(zip(self._paths, self._hashes))


def _split_by_cost(paths: list[str], sizes: Mapping[str, int], parts: int) -> list[list[str]]:
    """paths (kept in order, for locality) cut into parts of about equal cost (bytes + a per-file cost)."""
    costs = [sizes[p] + SPAWN_COST_BYTES for p in paths]
    share = sum(costs) / parts
    chunks: list[list[str]] = [[] for _ in range(parts)]
    acc = 0.0
    for path, cost in zip(paths, costs):
        chunks[min(parts - 1, int(acc / share))].append(path)
        acc += cost
    return [c for c in chunks if c]


def _use_processes(small: list[str], jobs: int) -> bool:
    return (jobs > 1 and len(small) >= MIN_SPAWN_FILES and os.name == "posix" and bool(sys.executable)
            and not getattr(sys, "frozen", False))


@contextmanager
def start_hashing(root: Path, paths: list[str], sizes: Mapping[str, int], *, jobs: int | None = None,
                  progress: bool = True) -> Iterator[Callable[[], Hashes]]:
    """Start hashing paths (relative to root) in the background; yield result(), which waits for them.

    Leaving the block early (an error in the caller) kills the worker processes and stops the
    threads after their current batch.
    """
    from qualify.progress import byte_progress

    jobs = jobs or default_jobs()
    small = [p for p in paths if sizes[p] < SMALL_BYTES]
    large = [p for p in paths if sizes[p] >= SMALL_BYTES]
    base = os.fspath(root)
    with byte_progress("hashing", sum(sizes[p] for p in paths), enabled=progress) as advance:
        parts: list[_Workers | _Process] = []

        def result() -> Hashes:
            found: Hashes = {}
            for part in parts:
                found.update(part.result())
            return found

        try:
            if _use_processes(small, jobs):
                parts.extend(_Process(base, chunk, advance) for chunk in _split_by_cost(small, sizes, jobs))
            elif small:  # one thread: more would only trade the GIL back and forth (see the module docstring)
                parts.append(_Workers(base, make_batches(small, sizes, 1), 1, advance))
            if large:
                parts.append(_Workers(base, make_batches(large, sizes, jobs), jobs, advance))
            yield result
        finally:
            for part in parts:
                part.stop()


def sha256_file(path: Path, on_bytes: Callable[[int], None] | None = None) -> tuple[int, str]:
    """Stream a file through sha256; return (size, hexdigest). Refuses symlinks and special files."""
    return hash_path(os.fspath(path), on_bytes)


def _relative_excludes(root: Path, exclude: Iterable[Path]) -> set[str]:
    """The excluded paths that lie under root, as relative POSIX paths.

    Symlinks under root are refused, so a file's real path is realpath(root)/relative: comparing
    relative strings is exact and costs no per-file resolve().
    """
    real_root = os.path.realpath(root)
    inside = set()
    for path in exclude:
        rel = os.path.relpath(os.path.realpath(path), real_root)
        if rel != ".." and not rel.startswith("../"):
            inside.add(rel)
    return inside


def scan_files(root: Path, exclude: Iterable[Path] = ()) -> dict[str, int]:
    """Every regular file under root: relative POSIX path -> size. Symlinks and special files are refused."""
    root = Path(root)
    if not root.is_dir():
        raise ManifestError(f"evidence root is not a directory: {root}")
    skip = _relative_excludes(root, exclude)
    sizes: dict[str, int] = {}
    pending = [("", os.fspath(root))]
    while pending:
        prefix, directory = pending.pop()
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except OSError as exc:
            raise EvidenceError(f"cannot list {directory}: {exc.strerror}") from exc
        for entry in entries:  # is_* come from the directory listing; one lstat per file, for its size
            rel = prefix + entry.name
            if entry.is_symlink():
                raise ManifestError(f"refusing symlink in evidence: {entry.path}")
            if entry.is_dir(follow_symlinks=False):
                pending.append((rel + "/", entry.path))
            elif not entry.is_file(follow_symlinks=False):
                raise ManifestError(f"refusing special file in evidence: {entry.path}")
            elif rel not in skip:
                sizes[rel] = entry.stat(follow_symlinks=False).st_size
    return sizes


def list_files(root: Path, exclude: Iterable[Path] = ()) -> list[str]:
    """Every regular file under root as a sorted relative POSIX path; symlinks are refused."""
    return sorted(scan_files(root, exclude))


def hash_files(root: Path, paths: list[str], jobs: int | None = None, progress: bool = True, *,
               sizes: Mapping[str, int] | None = None) -> Hashes:
    """Hash many files under root in parallel; returns path -> (size, sha256), in the order of paths.

    sizes (path -> bytes, as scan_files returns) schedules the work and sizes the progress bar;
    without it every file is stat'ed first.
    """
    if sizes is None:
        sizes = {p: _size_of(os.path.join(root, p)) for p in paths}
    with start_hashing(root, paths, sizes, jobs=jobs, progress=progress) as result:
        found = result()
    return {p: found[p] for p in paths}


def _size_of(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except OSError as exc:
        raise EvidenceError(f"cannot read {path}: {exc.strerror}") from exc
