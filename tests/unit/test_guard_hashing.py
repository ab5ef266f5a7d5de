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
