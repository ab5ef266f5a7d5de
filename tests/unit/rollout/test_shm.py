"""Only the /dev/shm segments a child process tree used are its leftovers; a neighbour's are not."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qualify.rollout.shm import SHM, ShmWatch

pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")

CHILD = """
import mmap, os, sys, time
path = sys.argv[1]
fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)
time.sleep(1.0)
if sys.argv[2] == "unlink":
    os.unlink(path)
"""


def _run_watched(name: str, mode: str) -> ShmWatch:
    """A real child (and a grandchild, as vLLM's TP workers are) that maps a segment, then exits."""
    launcher = f"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', {CHILD!r}, " \
               f"{str(SHM / name)!r}, {mode!r}]))"
    proc = subprocess.Popen([sys.executable, "-c", launcher])
    watch = ShmWatch(proc.pid)
    while proc.poll() is None:
        watch.poll()
        time.sleep(0.05)
    assert proc.returncode == 0
    return watch


def test_child_leftover_is_found_and_removed_neighbour_is_kept():
    mine, neighbour = f"qualify-test-{os.getpid()}-child", f"qualify-test-{os.getpid()}-neighbour"
    (SHM / neighbour).write_bytes(b"x" * 16)  # another job's segment, present all along
    try:
        watch = _run_watched(mine, "keep")
        assert watch.leftovers() == [mine]
        assert watch.remove_leftovers() == [mine]
        assert not (SHM / mine).exists()
        assert (SHM / neighbour).exists()
    finally:
        (SHM / mine).unlink(missing_ok=True)
        (SHM / neighbour).unlink(missing_ok=True)


def test_child_that_cleans_up_leaves_nothing():
    mine = f"qualify-test-{os.getpid()}-clean"
    try:
        watch = _run_watched(mine, "unlink")
        assert mine in watch.seen  # it was used ...
        assert watch.leftovers() == []  # ... and removed by the child itself
    finally:
        (SHM / mine).unlink(missing_ok=True)


def test_watch_of_a_finished_process_sees_nothing(tmp_path: Path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    watch = ShmWatch(proc.pid)
    watch.poll()
    assert watch.seen == set()


def test_a_process_that_exits_while_its_tasks_are_listed_is_not_an_error(monkeypatch):
    """CI saw the race: the child's /proc/<pid>/task went away between the listing's start and its scan, and the
    FileNotFoundError ended a capture that was about to report vLLM's own failure."""
    from pathlib import Path

    from qualify.rollout import shm

    def vanished(self, pattern):
        raise FileNotFoundError(2, "No such file or directory", str(self))

    monkeypatch.setattr(Path, "glob", vanished)
    assert shm.descendants(12345) == [12345]
