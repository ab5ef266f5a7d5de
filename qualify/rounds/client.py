"""The harness's side of the rollout engine: start qualify.rounds.server in a child process, talk JSON lines.

The child's stderr (vLLM's logs) goes to a log file in the run directory; a child that dies or
stops answering is an EngineCrash with the log's tail, never a hang. Like the one-shot capture,
the engine must leave no /dev/shm segment behind.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Self

from qualify.errors import Refused, RoundsError
from qualify.rollout.capture import vllm_env
from qualify.rollout.shm import ShmWatch

TAIL_LINES = 25


class EngineCrash(RoundsError):
    """The engine process died or did not answer in time."""


class RolloutEngine:
    """One vLLM engine process for a whole rounds run."""

    def __init__(self, start: dict[str, Any], log_path: Path, timeout_s: float = 1800.0) -> None:
        self.log_path, self.timeout_s = Path(log_path), timeout_s
        self.log = open(self.log_path, "ab")  # noqa: SIM115 (open as long as the engine runs)
        self.proc = subprocess.Popen([sys.executable, "-m", "qualify.rounds.server"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=vllm_env(start["tp"], bool(start.get("batch_invariant"))))
        self.shm = ShmWatch(self.proc.pid)  # only this engine's own segments are ever its leftovers
        self.shm_removed: list[str] = []
        self.buffer = b""
        try:
            self.started = self.call({"cmd": "start", **start})
        except BaseException:
            self.close()
            raise

    def request(self, req: dict[str, Any]) -> dict[str, Any]:
        """Send one request; return the reply whatever it says."""
        if self.proc.poll() is not None:
            raise EngineCrash(f"the engine process has exited (code {self.proc.returncode}):\n{self.tail()}")
        self.shm.poll()
        self.proc.stdin.write((json.dumps(req, allow_nan=False) + "\n").encode("ascii"))
        self.proc.stdin.flush()
        reply = json.loads(self._read_line(time.monotonic() + self.timeout_s))
        self.shm.poll()
        return reply

    def call(self, req: dict[str, Any]) -> dict[str, Any]:
        """Send one request; raise Refused unless the engine accepted it."""
        reply = self.request(req)
        if not reply.get("ok"):
            raise Refused(reply.get("kind", "unknown"), reply.get("error", "refused"), reply)
        return reply

    def _read_line(self, deadline: float) -> bytes:
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self.buffer:
                if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    raise EngineCrash(f"the engine did not answer within {self.timeout_s:.0f} s:\n{self.tail()}")
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    self.proc.wait()
                    raise EngineCrash(f"the engine process exited (code {self.proc.returncode}):\n{self.tail()}")
                self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    def tail(self) -> str:
        self.log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-TAIL_LINES:])

    def close(self) -> list[str]:
        """Shut the engine down and remove the /dev/shm segments its processes left (kept in shm_removed);
        return those still there afterwards (none unless they could not be removed)."""
        if self.proc.poll() is None:
            try:
                self.request({"cmd": "shutdown"})
                self.proc.wait(timeout=120)
            except (EngineCrash, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        self.shm_removed = self.shm.remove_leftovers()
        return self.shm.leftovers()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
