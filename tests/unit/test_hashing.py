"""Parallel hashing: threads and worker processes agree with hashlib; failures surface; nothing is left running."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from qualify import hashing
from qualify.errors import EvidenceError, ManifestError
from qualify.hashing import SMALL_BYTES, make_batches, start_hashing


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    """Many small files and two above SMALL_BYTES, with their sizes."""
    root = tmp_path / "root"
    sizes = {}
    for i in range(60):
        rel = f"d{i % 4}/f{i:02d}.bin"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(os.urandom(i * 331))
        sizes[rel] = i * 331
    for i in range(2):
        rel = f"big{i}.bin"
        (root / rel).write_bytes(os.urandom(SMALL_BYTES + 1000 * i))
        sizes[rel] = SMALL_BYTES + 1000 * i
    return root, sizes


def expected(root: Path, paths) -> dict[str, tuple[int, str]]:
    out = {}
    for p in paths:
        data = (root / p).read_bytes()
        out[p] = (len(data), hashlib.sha256(data).hexdigest())
    return out


def hash_all(root: Path, sizes: dict[str, int], jobs: int) -> dict[str, tuple[int, str]]:
    with start_hashing(root, sorted(sizes), sizes, jobs=jobs, progress=False) as result:
        return result()


def no_hash_threads_left() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith("qualify-hash")]


@pytest.mark.parametrize("jobs", [1, 2, 3])
def test_worker_processes_and_threads_agree_with_hashlib(files, monkeypatch, jobs):
    root, sizes = files
    monkeypatch.setattr(hashing, "MIN_SPAWN_FILES", 10)  # use worker processes on this small tree
    assert hash_all(root, sizes, jobs) == expected(root, sizes)
    assert no_hash_threads_left()


def test_a_worker_process_hashes_its_share(files):
    root, sizes = files
    names = sorted(p for p in sizes if sizes[p] < SMALL_BYTES)
    counted: list[int] = []
    worker = hashing._Process(str(root), names, counted.append)
    try:
        assert worker.result() == expected(root, names)
    finally:
        worker.stop()
    assert sum(counted) == sum(sizes[p] for p in names)  # the progress callback sees every byte


def test_a_worker_that_dies_is_replaced_by_local_hashing(files, monkeypatch):
    root, sizes = files
    monkeypatch.setattr(hashing, "_WORKER_CODE", "import sys; sys.exit(3)")
    names = sorted(sizes)[:20]
    worker = hashing._Process(str(root), names, lambda n: None)
    try:
        assert worker.result() == expected(root, names)
    finally:
        worker.stop()


@pytest.mark.parametrize("make, error, words", [
    (lambda p: os.mkfifo(p), ManifestError, "refusing special file in evidence"),
    (lambda p: None, EvidenceError, "cannot read"),
    (lambda p: p.symlink_to("/etc/passwd"), ManifestError, "refusing symlink in evidence"),
], ids=["fifo", "vanished", "symlink"])
def test_a_file_problem_found_by_a_worker_is_raised(files, make, error, words):
    root, _ = files
    make(root / "odd")
    names = ["d0/f00.bin", "odd", "d1/f01.bin"]
    worker = hashing._Process(str(root), names, lambda n: None)
    try:
        with pytest.raises(error, match=words) as info:
            worker.result()
        assert str(root / "odd") in str(info.value)
    finally:
        worker.stop()


def test_leaving_early_stops_everything(files, monkeypatch):
    root, sizes = files
    monkeypatch.setattr(hashing, "MIN_SPAWN_FILES", 10)
    with pytest.raises(RuntimeError, match="bad manifest"), start_hashing(root, sorted(sizes), sizes, jobs=2,
                                                                           progress=False):
        raise RuntimeError("bad manifest")
    assert no_hash_threads_left()


def test_batches_cover_every_path_once_largest_first(files):
    _, sizes = files
    paths = sorted(sizes)
    for jobs in (1, 2, 8):
        batches = make_batches(paths, sizes, jobs)
        flat = [p for b in batches for p in b]
        assert sorted(flat) == paths
        assert [sizes[p] for p in flat] == sorted((sizes[p] for p in paths), reverse=True)
        assert len(batches) >= min(len(paths), 4 * jobs) // 2  # enough tasks to keep every thread busy


def test_split_by_cost_keeps_order_and_balances():
    sizes = {f"f{i:03d}": (1000 if i % 2 else 10) for i in range(100)}
    parts = hashing._split_by_cost(sorted(sizes), sizes, 3)
    assert [p for part in parts for p in part] == sorted(sizes) and len(parts) == 3
    costs = [sum(sizes[p] + hashing.SPAWN_COST_BYTES for p in part) for part in parts]
    assert max(costs) - min(costs) <= 2 * (1000 + hashing.SPAWN_COST_BYTES)


def test_a_digest_is_sha256_tagged_hex_of_the_bytes_or_file(tmp_path):
    """sha256_tag, digest_of_bytes and file_digest write the one 'sha256:<hex>' form every stage records."""
    data = b"qualify\x00\xff" * 1000
    hexdigest = hashlib.sha256(data).hexdigest()
    assert hashing.sha256_tag(hexdigest) == "sha256:" + hexdigest
    assert hashing.digest_of_bytes(data) == "sha256:" + hexdigest
    (tmp_path / "f").write_bytes(data)
    assert hashing.file_digest(tmp_path / "f") == hashing.digest_of_bytes(data)
    assert hashing.digest_of_bytes(b"") == "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
