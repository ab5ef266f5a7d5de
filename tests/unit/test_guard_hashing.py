"""qualify.hashing's worker protocol, run in this process (mutmut maps a function to the tests that call it here,
never to a subprocess): one 'size sha256' line per path, the first file problem as '! M'/'! E' and nothing after it,
an undecodable path escaped rather than crashing the worker (TESTING.md, mutation testing of hashing)."""

from __future__ import annotations

import hashlib
import io
import os
import sys
from types import SimpleNamespace

import pytest

from qualify import hashing


class _Std:
    def __init__(self, data: bytes = b"") -> None:
        self.buffer = io.BytesIO(data)


def run_worker(monkeypatch, base, raw_paths: list[bytes]) -> bytes:
    stdin, stdout = _Std(b"\0".join(raw_paths)), _Std()
    monkeypatch.setattr(sys, "stdin", stdin)
    monkeypatch.setattr(sys, "stdout", stdout)
    hashing.worker_main(str(base))
    return stdout.buffer.getvalue()


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 1000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.bin").write_bytes(b"")
    return tmp_path


def line(data: bytes) -> bytes:
    return b"%d %s\n" % (len(data), hashlib.sha256(data).hexdigest().encode("ascii"))


def test_the_worker_answers_one_line_per_path_in_order(tree, monkeypatch):
    assert run_worker(monkeypatch, tree, [b"sub/b.bin", b"a.bin"]) == line(b"") + line(b"x" * 1000)


def test_a_worker_without_paths_answers_nothing(tree, monkeypatch):
    assert run_worker(monkeypatch, tree, []) == b""


def test_the_first_file_problem_ends_the_worker(tree, monkeypatch):
    (tree / "link").symlink_to(tree / "a.bin")
    out = run_worker(monkeypatch, tree, [b"a.bin", b"link", b"sub/b.bin"])
    assert out == line(b"x" * 1000) + f"! M refusing symlink in evidence: {tree / 'link'}\n".encode()
    out = run_worker(monkeypatch, tree, [b"gone", b"a.bin"])
    assert out == f"! E cannot read {tree / 'gone'}: No such file or directory\n".encode()


def test_an_undecodable_path_is_escaped_in_the_workers_message(tree, monkeypatch):
    out = run_worker(monkeypatch, tree, [b"\xff"])
    assert out == f"! E cannot read {tree}/".encode() + b"\\udcff: No such file or directory\n"


def test_the_worker_code_runs_the_worker_of_the_package_it_is_given(tree):
    """_WORKER_CODE puts argv[1] first on the path and hands argv[2] to worker_main (as _Process calls it)."""
    import subprocess

    parent = os.path.dirname(os.path.dirname(os.path.abspath(hashing.__file__)))
    done = subprocess.run([sys.executable, "-I", "-S", "-c", hashing._WORKER_CODE, parent, str(tree)],
                          input=b"a.bin", capture_output=True, check=False)
    assert (done.returncode, done.stdout) == (0, line(b"x" * 1000)), done.stderr[-2000:]


# --- _Process: how the calling side starts, reads and stops a worker ----------------------------------------------

def test_a_worker_is_an_isolated_interpreter_without_site_whose_stderr_is_dropped(tree, monkeypatch):
    import subprocess

    calls = []
    real = subprocess.Popen

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", spy)
    worker = hashing._Process(str(tree), ["a.bin"], lambda n: None)
    try:
        assert worker._thread.name == "qualify-hash-worker" and worker._thread.daemon is True
        assert worker.result() == {"a.bin": (1000, hashlib.sha256(b"x" * 1000).hexdigest())}
    finally:
        worker.stop()
    parent = os.path.dirname(os.path.dirname(os.path.abspath(hashing.__file__)))
    assert calls == [(([sys.executable, "-I", "-S", "-c", hashing._WORKER_CODE, parent, str(tree)],),
                      {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.DEVNULL})]


def test_a_dying_workers_stderr_does_not_reach_the_caller(tree, monkeypatch, capfd):
    monkeypatch.setattr(hashing, "_WORKER_CODE", "import sys; sys.stderr.write('worker noise'); sys.exit(3)")
    worker = hashing._Process(str(tree), ["a.bin"], lambda n: None)
    try:
        assert worker.result() == {"a.bin": (1000, hashlib.sha256(b"x" * 1000).hexdigest())}
    finally:
        worker.stop()
    assert "worker noise" not in capfd.readouterr().err


def _no_local_hashing(monkeypatch):
    def local(*args, **kwargs):
        raise AssertionError("hashed in the calling process")

    monkeypatch.setattr(hashing, "hash_path", local)


def test_a_worker_that_answers_every_path_is_taken_as_is(tree, monkeypatch):
    names = ["a.bin", "sub/b.bin"]
    _no_local_hashing(monkeypatch)  # the worker process imports its own, unpatched module
    worker = hashing._Process(str(tree), names, lambda n: None)
    try:
        assert worker.result() == {"a.bin": (1000, hashlib.sha256(b"x" * 1000).hexdigest()),
                                   "sub/b.bin": (0, hashlib.sha256(b"").hexdigest())}
    finally:
        worker.stop()


def test_a_worker_that_exits_cleanly_without_answering_is_replaced(tree, monkeypatch):
    monkeypatch.setattr(hashing, "_WORKER_CODE", "import sys; sys.stdin.buffer.read()")
    worker = hashing._Process(str(tree), ["a.bin"], lambda n: None)
    try:
        assert worker.result() == {"a.bin": (1000, hashlib.sha256(b"x" * 1000).hexdigest())}
    finally:
        worker.stop()


@pytest.mark.parametrize("name", ["odd ", "oddX"])
def test_a_file_problem_the_worker_reports_is_raised_as_is_not_rehashed(tree, monkeypatch, name):
    """The message ends with the path: neither its last character nor a trailing space may be lost."""
    (tree / name).symlink_to(tree / "a.bin")
    _no_local_hashing(monkeypatch)
    worker = hashing._Process(str(tree), ["a.bin", name], lambda n: None)
    try:
        with pytest.raises(hashing.ManifestError) as caught:
            worker.result()
    finally:
        worker.stop()
    assert str(caught.value) == f"refusing symlink in evidence: {tree / name}"


def test_stop_kills_a_worker_that_is_still_running(tree, monkeypatch):
    import time

    monkeypatch.setattr(hashing, "_WORKER_CODE", "import time; time.sleep(30)")
    worker = hashing._Process(str(tree), ["a.bin"], lambda n: None)
    started = time.monotonic()
    worker.stop()
    assert time.monotonic() - started < 10


class _Pipe:
    """A buffered stdout: what is written reaches the reader only when flushed."""

    def __init__(self) -> None:
        self.pending, self.delivered = b"", b""

    def write(self, data: bytes) -> None:
        self.pending += data

    def flush(self) -> None:
        self.delivered, self.pending = self.delivered + self.pending, b""


def test_the_worker_flushes_its_answer_also_after_a_file_problem(tree, monkeypatch):
    pipe = _Pipe()
    monkeypatch.setattr(sys, "stdin", _Std(b"a.bin\0gone\0sub/b.bin"))
    monkeypatch.setattr(sys, "stdout", SimpleNamespace(buffer=pipe))
    hashing.worker_main(str(tree))
    assert pipe.delivered == line(b"x" * 1000) + f"! E cannot read {tree / 'gone'}: No such file or directory\n".encode()


def test_split_by_cost_counts_a_files_bytes_plus_its_spawn_cost_from_zero():
    """Cost = size + SPAWN_COST_BYTES (C), cut where the cost before a path reaches a share. Two files of C bytes
    (2C each) fill the first half of 8C; an empty file that starts exactly at a share begins the next part, one
    that starts a byte before it does not."""
    c = hashing.SPAWN_COST_BYTES
    sizes = {"a": c, "b": c, "c": 0, "d": 0, "e": 0, "f": 0}
    assert hashing._split_by_cost(list("abcdef"), sizes, 2) == [["a", "b"], ["c", "d", "e", "f"]]
    assert hashing._split_by_cost(["a", "b"], {"a": 0, "b": 1}, 2) == [["a", "b"]]


# --- the helpers around the hashing ------------------------------------------------------------------------------

def test_default_jobs_are_the_cpus_this_process_may_run_on(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5}, raising=False)
    assert hashing.default_jobs() == 2  # the affinity, not the host's CPUs
    monkeypatch.delattr(os, "sched_getaffinity")
    assert hashing.default_jobs() == 64  # no affinity call on this platform: the host's CPUs
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert hashing.default_jobs() == 1


def test_list_files_leaves_out_what_it_is_told_to(tree):
    assert hashing.list_files(tree) == ["a.bin", "sub/b.bin"]
    assert hashing.list_files(tree, [tree / "a.bin"]) == ["sub/b.bin"]


def test_hash_files_without_sizes_names_a_missing_file(tree):
    with pytest.raises(hashing.EvidenceError) as caught:
        hashing.hash_files(tree, ["a.bin", "gone"], jobs=1, progress=False)
    assert str(caught.value) == f"cannot read {os.path.join(tree, 'gone')}: No such file or directory"


def test_hash_files_passes_sizes_jobs_and_the_bar_to_the_hashing(tree, monkeypatch):
    calls = []
    real = hashing.start_hashing

    def spy(root, paths, sizes, **kwargs):
        calls.append((paths, dict(sizes), kwargs))
        return real(root, paths, sizes, **kwargs)

    monkeypatch.setattr(hashing, "start_hashing", spy)
    found = hashing.hash_files(tree, ["sub/b.bin", "a.bin"])
    assert list(found) == ["sub/b.bin", "a.bin"] and found["a.bin"][0] == 1000
    hashing.hash_files(tree, ["a.bin"], 3, False, sizes={"a.bin": 1000})
    assert calls == [(["sub/b.bin", "a.bin"], {"sub/b.bin": 0, "a.bin": 1000}, {"jobs": None, "progress": True}),
                     (["a.bin"], {"a.bin": 1000}, {"jobs": 3, "progress": False})]


def test_a_directory_that_cannot_be_listed_is_named(tmp_path):
    """A directory whose path is longer than the system allows (made level by level through directory fds) cannot
    be listed: scan_files names it (a permission error would not do: the tests may run as root)."""
    root = tmp_path / "root"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY)
    try:
        for _ in range(24):
            os.mkdir("d" * 200, dir_fd=fd)
            inner = os.open("d" * 200, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
    finally:
        os.close(fd)
    with pytest.raises(hashing.EvidenceError) as caught:
        hashing.scan_files(root)
    message = str(caught.value)
    assert message.startswith(f"cannot list {root}/{'d' * 200}/") and message.endswith(": File name too long")


# --- make_batches and the hashing threads --------------------------------------------------------------------------

def test_make_batches_limit_is_a_quarter_share_per_job_at_least_one_byte():
    # total 2 bytes, 1 job: limit max(1, 2 // 4) = 1, so every non-empty file closes its batch
    assert hashing.make_batches(["a", "b"], {"a": 1, "b": 1}, 1) == [["a"], ["b"]]
    # total 10 bytes: limit 10 // 4 = 2 (an integer), so a 2-byte file closes its batch by itself
    assert hashing.make_batches(["a", "b", "c"], {"a": 2, "b": 1, "c": 7}, 1) == [["c"], ["a"], ["b"]]
    # total 12 bytes: limit 12 // 4 = 3; a batch closes when its bytes reach the limit, counted from 0
    assert hashing.make_batches(["a", "b", "c"], {"a": 2, "b": 1, "c": 9}, 1) == [["c"], ["a", "b"]]
    assert hashing.make_batches(list("abcdefgh"), dict.fromkeys("abcdefgh", 1), 1) == [
        ["a", "b"], ["c", "d"], ["e", "f"], ["g", "h"]]
    # empty files never reach a byte limit: BATCH_FILES of them close a batch
    names = [f"f{i:03d}" for i in range(hashing.BATCH_FILES + 88)]
    assert [len(b) for b in hashing.make_batches(names, dict.fromkeys(names, 0), 1)] == [hashing.BATCH_FILES, 88]


def test_hashing_threads_are_named_daemons_one_per_job_at_most_one_per_batch(tree):
    counted: list[int] = []
    workers = hashing._Workers(str(tree), [["a.bin"], ["sub/b.bin"]], 3, counted.append)
    try:
        assert [(t.name, t.daemon) for t in workers._threads] == [("qualify-hash-0", True), ("qualify-hash-1", True)]
        assert workers.result() == {"a.bin": (1000, hashlib.sha256(b"x" * 1000).hexdigest()),
                                    "sub/b.bin": (0, hashlib.sha256(b"").hexdigest())}
    finally:
        workers.stop()
    assert sum(counted) == 1000  # the progress callback sees every byte the threads hash
    single = hashing._Workers(str(tree), [["a.bin"]], 1, lambda n: None)
    single.stop()
    assert len(single._threads) == 1


def test_a_file_problem_in_a_hashing_thread_is_raised(tree):
    workers = hashing._Workers(str(tree), [["gone"], ["a.bin"]], 1, lambda n: None)
    try:
        with pytest.raises(hashing.EvidenceError) as caught:
            workers.result()
    finally:
        workers.stop()
    assert str(caught.value) == f"cannot read {tree / 'gone'}: No such file or directory"
