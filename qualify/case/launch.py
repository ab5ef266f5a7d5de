"""Launching candidate cases: the spec in the case's work directory, the worker's TP ranks, the log and its tail.

Used by the candidate stage (a group of cases sharing engine and TP per launch) and by rounds (the
trainer's step is a candidate case), so both launch a case the same way.

The ranks are started directly (RANK, WORLD_SIZE, MASTER_ADDR/PORT in their environment, as torchrun would
set them): torchrun's agent is one more Python process that imports torch before any rank starts and tears
down after the last (benchmarks/LOG.md, "GPU scale"). On the CPU each rank is forked from a process that has imported
torch and transformers once (qualify.case.forkserver): a fresh rank spends longer importing them than a tiny case
spends in its steps. QUALIFY_LAUNCHER=direct starts
fresh interpreters on the CPU too, QUALIFY_LAUNCHER=torchrun uses torchrun itself. As with torchrun, the first rank
to fail stops the others.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from qualify.case.ranks import free_port, gpu_shortfall, rank_env
from qualify.case.spec import CaseSpec
from qualify.childlog import printable
from qualify.layout import SPEC_FILE, work_dir
from qualify.store import write_json

TAIL_LINES = 30


def write_spec_file(spec: CaseSpec) -> Path:
    """Write the case's spec.json into its work directory; return its path."""
    work = work_dir(spec.case_dir)
    work.mkdir(parents=True, exist_ok=True)
    write_json(work / SPEC_FILE, spec.to_json())
    return work / SPEC_FILE


def launch(worker: str, spec_paths: Path | list[Path], tp: int, device: str, log_path: Path,
           preload: tuple[str, ...] = ()) -> int:
    """The worker module's tp ranks (the caller names it: the case layer starts what a stage gives it) over one or more
    case specs; returns their exit code, output in log_path. preload: what the engine's ranks import besides torch
    and transformers (qualify.engines.registry.preload_modules)."""
    paths = [spec_paths] if isinstance(spec_paths, Path) else list(spec_paths)
    return start_module(worker, list(map(str, paths)), tp, device, launch_env(device, tp), log_path, preload)


def launch_env(device: str, tp: int) -> dict[str, str]:
    """The ranks' environment: this process's, and on the CPU the allocation's cores split among the tp ranks and
    DeepSpeed told it has no accelerator (each kept where already set)."""
    env = dict(os.environ)
    if device == "cpu":
        cpus = int(os.environ.get("SLURM_CPUS_PER_TASK") or len(os.sched_getaffinity(0)))  # the allocation, not the node
        env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // tp)))
        env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def launcher(device: str) -> str:
    """How ranks start: QUALIFY_LAUNCHER (direct, fork or torchrun) when set, else fork on the CPU and direct on a
    GPU (a process that initialised CUDA cannot fork, and the fork server never does)."""
    chosen = os.environ.get("QUALIFY_LAUNCHER") or ("fork" if device == "cpu" else "direct")
    if chosen not in ("direct", "fork", "torchrun"):
        raise ValueError(f"QUALIFY_LAUNCHER={chosen!r}: expected direct, fork or torchrun")
    if chosen == "fork" and device != "cpu":
        raise ValueError(f"QUALIFY_LAUNCHER=fork on {device}: ranks are forked on the CPU only")
    return chosen


def start_module(module: str, args: list[str], tp: int, device: str, env: dict[str, str], log_path: Path,
                 preload: tuple[str, ...] = ()) -> int:
    """Run `python -m module args` as tp ranks, the way launcher(device) says; output in log_path; returns 0 or the
    first failing rank's exit code. preload: modules a forked rank's server imports besides torch and transformers."""
    how = launcher(device)
    with open(log_path, "w") as log:
        short = gpu_shortfall(tp) if device == "cuda" else None
        if short:  # refused before any rank starts: set_device in a rank would fail with CUDA's own words
            log.write(f"not launched: {short}\n")
            return 2
        if how == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", "-m",
                   module, *args]
            return subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        if how == "fork":
            from qualify.case.forkserver import run_module_ranks

            return run_module_ranks(module, args, tp, env, log, preload)
        return run_ranks([sys.executable, "-m", module, *args], tp, env, log)


def run_ranks(cmd: list[str], tp: int, env: dict[str, str], log) -> int:
    """Start tp ranks of cmd with torchrun's rank variables; wait for all. The first rank to fail stops the others
    (a rank waiting in a collective for a dead peer would hang); returns 0 or that rank's exit code."""
    port = str(free_port())
    procs = [subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=rank_env(env, r, tp, port))
             for r in range(tp)]
    failed = 0
    while True:
        codes = [p.poll() for p in procs]  # every rank polled (any() would stop at the first running one)
        failed = next((c for c in codes if c), 0)
        if failed or all(c is not None for c in codes):
            break
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return failed or next((p.returncode for p in procs if p.returncode), 0)


FAILURE_GLOB = "failure-rank*.json"


def record_failure(work: Path, rank: int, exc: BaseException) -> None:
    """What stopped this rank, for the verdict (qualify.case.launch.failure_note): type, message, when."""
    import json

    work.mkdir(parents=True, exist_ok=True)
    (work / f"failure-rank{rank}.json").write_text(json.dumps({
        "rank": rank, "type": type(exc).__name__, "message": " ".join(str(exc).split()), "time": time.time()}))


def clear_failures(work: Path) -> None:
    for path in Path(work).glob(FAILURE_GLOB):
        path.unlink()


def failure_note(work: Path, log_path: Path, code: int) -> str:
    """One line: the exception that stopped the case's first failing rank and the launch log's path; without a
    recorded exception (a rank killed, out of memory), the exit code, the log's path and its last lines."""
    import json

    found = []
    for path in Path(work).glob(FAILURE_GLOB):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    first = min((f for f in found if isinstance(f, dict) and "time" in f), key=lambda f: f["time"], default=None)
    if first is None:
        return log_tail(log_path, code)
    return printable(f"{first.get('type')}: {first.get('message')} (rank {first.get('rank')}); log {log_path}")


def log_tail(log_path: Path, code: int) -> str:
    """'exit N; log PATH:' and the log's last TAIL_LINES lines (each with its control characters escaped)."""
    tail = "\n".join(map(printable, Path(log_path).read_text(errors="replace").splitlines()[-TAIL_LINES:]))
    return f"exit {code}; log {printable(str(log_path))}:\n{tail}"
