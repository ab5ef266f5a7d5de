"""Rank processes forked from a warm process that has already imported torch and transformers (CPU launches).

A rank started as a fresh interpreter spends most of a small case importing torch, torch._dynamo and transformers'
Qwen3 modules, several times what the steps of a tiny case take (benchmarks/LOG.md, "CPU ranks forked"). A
candidate stage launches one group of cases per engine and TP degree, and a test session hundreds, so the imports are
paid once per process instead: the first CPU launch starts a server (qualify/case/_forkserver_main.py, run as a
script, so that none of qualify's own modules is in it) that imports those third-party modules and waits; each rank
is then os.fork()ed from it and runs its module as `python -m MODULE ARGS` would, in its own working directory and
environment, with its output appended to the launch log.

What a forked rank shares with a fresh one: the same interpreter, the same installed modules (imported before the
rank's environment was set: a server is kept per value of the environment variables read at import time, see
import_env), torch's thread count (set from OMP_NUM_THREADS, as a fresh process reads it), sys.path with the
working directory first. What it does not: qualify's own modules and any plugin are imported by the rank itself, so
code changed between launches is the code that runs. CUDA is never used in the server (a process that has
initialised CUDA cannot fork), so GPU launches start fresh interpreters (qualify.case.launch).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from qualify.case.ranks import free_port, rank_env
from qualify.errors import QualifyError

SERVER_SCRIPT = Path(__file__).with_name("_forkserver_main.py")

PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.models.qwen3.modeling_qwen3",
           "transformers.models.qwen3_moe.modeling_qwen3_moe")
"""What the server imports before it forks (a module that is not installed is left out): what every rank of every
built-in engine imports, the slowest first. deepspeed and megatron are not among them: a rank of another engine
should not run with their import-time side effects."""

IMPORT_ENV_PREFIXES = ("PYTHON", "HF_", "TRANSFORMERS", "TORCH", "OMP_", "KMP_", "MKL", "GOMP", "LD_", "CUDA",
                       "NVIDIA", "DS_", "TOKENIZERS", "XDG_", "HOME", "PATH", "VIRTUAL_ENV")
"""Environment variables a preloaded module may read when it is imported: a server serves ranks whose values of
these are its own (import_env); another set of values gets its own server."""

PER_RANK = {"OMP_NUM_THREADS"}
"""Read after import by the rank itself (torch.set_num_threads in the child): not part of the server's key."""

READY_SECONDS = 600.0
MAX_SERVERS = 3


class ForkServerError(QualifyError):
    """The fork server could not be started or stopped answering (the message holds its log's tail)."""


def import_env(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of env a preloaded module can have read at import: the server's key."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(IMPORT_ENV_PREFIXES) and k not in PER_RANK))


class ForkServer:
    """One server process and its line protocol (JSON requests on its stdin, JSON replies on its stdout)."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = PRELOAD) -> None:
        self.env = {k: v for k, v in env.items() if k not in PER_RANK}  # torch's own default until a rank sets it
        self.lock = threading.Lock()
        self.log = Path(tempfile.mkstemp(prefix="qualify-forkserver-", suffix=".log")[1])
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, str(SERVER_SCRIPT), json.dumps(list(preload))],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=self.env,
                                         text=True, bufsize=1)
        ready = self._read(READY_SECONDS)
        if not ready.get("ready"):
            raise ForkServerError(f"the fork server did not start: {ready}; {self.tail()}")
        self.preloaded = ready.get("preloaded", [])

    def tail(self) -> str:
        try:
            return "log " + str(self.log) + ":\n" + "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return f"log {self.log} unreadable"

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        import select

        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ForkServerError(f"the fork server exited with {self.proc.returncode}; {self.tail()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    raise ForkServerError(f"the fork server closed its output; {self.tail()}")
                return json.loads(line)
        raise ForkServerError(f"the fork server did not answer in {timeout:.0f} s; {self.tail()}")

    def request(self, **req: Any) -> dict[str, Any]:
        with self.lock:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(json.dumps(req) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                raise ForkServerError(f"the fork server is gone ({exc}); {self.tail()}") from exc
            reply = self._read(60.0)
        if "error" in reply:
            raise ForkServerError(f"the fork server refused {req.get('op')}: {reply['error']}")
        return reply

    def spawn(self, module: str, args: list[str], env: dict[str, str], log_path: Path) -> int:
        """Fork a rank running `python -m module args` with env in the current working directory; returns its pid."""
        return int(self.request(op="spawn", module=module, args=list(args), env=env, cwd=os.getcwd(),
                                log=str(Path(log_path).resolve()))["pid"])

    def poll(self, pid: int) -> int | None:
        """The rank's exit code (negative: the signal that ended it), or None while it runs."""
        return self.request(op="poll", pid=pid)["code"]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # end of input: the server stops its live children and exits
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.unlink(missing_ok=True)


_servers: dict[tuple[Any, ...], ForkServer] = {}
_servers_lock = threading.Lock()


def server_for(env: dict[str, str], extra: tuple[str, ...] = ()) -> ForkServer:
    """The live server for env's import-time variables that has imported PRELOAD and extra, started when there is
    none (the oldest of MAX_SERVERS stopped first)."""
    key = (import_env(env), extra)
    with _servers_lock:
        server = _servers.get(key)
        if server is not None and server.alive():
            return server
        if server is not None:
            server.close()
            del _servers[key]
        while len(_servers) >= MAX_SERVERS:
            _servers.pop(next(iter(_servers))).close()
        server = _servers[key] = ForkServer(env, PRELOAD + tuple(m for m in extra if m not in PRELOAD))
        return server


@atexit.register
def close_all() -> None:
    with _servers_lock:
        while _servers:
            _servers.pop(next(iter(_servers))).close()


def run_module_ranks(module: str, args: list[str], tp: int, env: dict[str, str], log,
                     preload: tuple[str, ...] = ()) -> int:
    """qualify.case.launch.run_ranks for `python -m module args`, each rank forked from a warm server (one that has
    also imported preload): torchrun's variables in each rank's environment, output appended to log's file; the first
    rank to fail stops the others. Returns 0 or that rank's exit code."""
    log.flush()
    server = server_for(env, preload)
    port = str(free_port())
    pids = [server.spawn(module, args, rank_env(env, r, tp, port), Path(log.name)) for r in range(tp)]
    codes: dict[int, int | None] = {pid: None for pid in pids}
    failed = 0
    while True:
        for pid in pids:
            if codes[pid] is None:
                codes[pid] = server.poll(pid)
        failed = next((c for c in codes.values() if c), 0)
        if failed or all(c is not None for c in codes.values()):
            break
        time.sleep(0.05)
    stop(server, [pid for pid in pids if codes[pid] is None], codes)
    return failed or next((c for c in codes.values() if c), 0)


def stop(server: ForkServer, pids: list[int], codes: dict[int, int | None]) -> None:
    """Terminate the ranks still running; kill any that outlive 30 s; every one reaped."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30
    for pid in pids:
        while codes[pid] is None:
            codes[pid] = server.poll(pid)
            if codes[pid] is None and time.monotonic() > deadline:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
