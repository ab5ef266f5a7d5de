"""Real ranks for unit tests: spawned processes over gloo on loopback, each reporting through a queue."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(world: int, target: Callable[..., None], *args: Any, timeout: float = 60) -> list[Any]:
    """Start world processes target(rank, world, port, *args, queue) and return what each put on the queue, sorted
    by its first item (the rank); every process must exit 0, and one that hangs is killed."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(rank, world, port, *args, queue)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        results = sorted((queue.get(timeout=timeout) for _ in procs), key=lambda x: x[0])
    finally:
        for p in procs:
            p.join(timeout=120)  # a rank that imported TRL (and with it vLLM) takes seconds to tear down
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * world
    return results
