"""Which /dev/shm segments one child process tree used, so only its own leftovers are cleaned.

vLLM's CPU backend and its message queues create shared-memory segments whose names the harness
cannot choose. Diffing the whole of /dev/shm before and after a capture blames a healthy capture
for a neighbour's segments (another vLLM job on the same node). Instead, while the child runs, the
watcher reads the memory maps and open files of the child and all its descendants, and remembers
every /dev/shm path they hold; after the child exits, those that still exist are its leftovers.
"""

from __future__ import annotations

import os
from pathlib import Path

SHM = Path("/dev/shm")


def descendants(pid: int) -> list[int]:
    """pid and every live process below it (from /proc/<pid>/task/*/children). A process may exit while it is read:
    its /proc directory goes away under the listing (CI saw FileNotFoundError from the scan), and it has no children
    left to find."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            tasks = list(Path(f"/proc/{p}/task").glob("*"))
        except OSError:
            continue
        for task in tasks:
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
    return found


def shm_paths_of(pid: int) -> set[str]:
    """Names of the /dev/shm files a process maps or holds open (empty when it is gone)."""
    names = set()
    prefix = str(SHM) + "/"
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            path = line.split(maxsplit=5)[5] if len(line.split(maxsplit=5)) == 6 else ""
            if path.startswith(prefix):
                names.add(path[len(prefix):].removesuffix(" (deleted)"))
    except OSError:
        pass
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith(prefix):
                names.add(target[len(prefix):].removesuffix(" (deleted)"))
    except OSError:
        pass
    return names


class ShmWatch:
    """Accumulates the /dev/shm names used by one process tree; call poll() while it runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seen: set[str] = set()

    def poll(self) -> None:
        for p in descendants(self.pid):
            self.seen |= shm_paths_of(p)

    def leftovers(self) -> list[str]:
        """The segments the tree used that still exist (call after it has exited)."""
        return sorted(n for n in self.seen if "/" not in n and (SHM / n).exists())

    def remove_leftovers(self) -> list[str]:
        """Remove this tree's leftover segments; return their names."""
        left = self.leftovers()
        for name in left:
            (SHM / name).unlink(missing_ok=True)
        return left
