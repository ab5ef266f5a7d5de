"""Follow a submitted chain by polling `scontrol show job` and decide its result.

Slurm forgets finished jobs after MinJobAge, so the last state seen of every job and
array task is kept here. Exit codes of a chain: 0 every job COMPLETED; 1 the verdict job
failed with exit 1 (qualification or verification failed); 2 anything else.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from qualify.errors import SlurmError
from qualify.slurm.render import Chain, Job
from qualify.slurm.submit import slurm

# VANISHED is ours: Slurm forgot the job (MinJobAge) before its end was seen.
FINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY",
                   "VANISHED"})
# With --requeue, Slurm puts a preempted job or one whose node failed back in the queue.
FINAL_UNLESS_REQUEUED = frozenset({"PREEMPTED", "NODE_FAIL"})
# A pending job with one of these reasons never starts without a person stepping in.
STUCK_REASONS = frozenset({"DependencyNeverSatisfied", "launch_failed_requeued_held"})


@dataclass(frozen=True, slots=True)
class Task:
    """The last seen state of one job or one array task."""

    job_id: str
    """Slurm's id for it: 12 or 12_3."""
    state: str
    reason: str
    exit_code: int
    """The script's exit status (ExitCode=status:signal)."""
    signal: int
    restarts: int
    requeue: bool
    """Whether Slurm requeues it when its node fails or it is preempted."""
    log: str
    """Resolved --output path."""

    @property
    def final(self) -> bool:
        return self.state in FINAL or (self.state in FINAL_UNLESS_REQUEUED and not self.requeue)

    @property
    def stuck(self) -> bool:
        return self.state == "PENDING" and self.reason in STUCK_REASONS


@dataclass(slots=True)
class JobView:
    """One job of the chain with the last state of each of its tasks (index None: not an array)."""

    job: Job
    job_id: str
    tasks: dict[int | None, Task] = field(default_factory=dict)

    @property
    def indices(self) -> list[int | None]:
        return list(range(len(self.job.cases))) if self.job.cases else [None]

    def summary(self) -> str:
        """'COMPLETED' for a job, or counts per state for an array ('3 COMPLETED, 1 RUNNING')."""
        states = [self.tasks[i].state if i in self.tasks else "UNKNOWN" for i in self.indices]
        if not self.job.cases:
            task = self.tasks.get(None)
            extra = f" ({task.reason})" if task and task.state == "PENDING" and task.reason != "None" else ""
            return states[0] + extra
        counts = {s: states.count(s) for s in sorted(set(states))}
        return ", ".join(f"{n} {s}" for s, n in counts.items())

    @property
    def restarts(self) -> int:
        return sum(t.restarts for t in self.tasks.values())

    def settled(self) -> bool:
        return all(i in self.tasks and (self.tasks[i].final or self.tasks[i].stuck) for i in self.indices)

    def failures(self) -> list[tuple[int | None, Task]]:
        return [(i, self.tasks[i]) for i in self.indices
                if i in self.tasks and self.tasks[i].state != "COMPLETED" and (self.tasks[i].final or
                                                                               self.tasks[i].stuck)]


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a chain ended: exit code and one line naming the failed job and its log."""

    code: int
    message: str


class ChainWatch:
    """Poll the jobs of a submitted chain and keep their last seen states."""

    def __init__(self, chain: Chain, ids: dict[str, str]) -> None:
        self.views = [JobView(job=j, job_id=ids[j.key]) for j in chain.jobs]

    def poll(self) -> None:
        for view in self.views:
            records = query(view.job_id)
            for index, task in records:
                view.tasks[index] = task
            if not records:
                for index in view.indices:
                    if index not in view.tasks or not view.tasks[index].final:
                        view.tasks[index] = Task(job_id=view.job_id, state="VANISHED", reason="None", exit_code=0,
                                                 signal=0, restarts=0, requeue=False, log="")

    def settled(self) -> bool:
        return all(v.settled() for v in self.views)

    def outcome(self) -> Outcome:
        """The chain's result once settled."""
        failed = [(v, i, t) for v in self.views for i, t in v.failures()]
        if not failed:
            return Outcome(0, f"chain completed: {len(self.views)} jobs")
        first = next(((v, i, t) for v, i, t in failed if t.state != "CANCELLED" and not t.stuck), failed[0])
        view, index, task = first
        what = view.job.file if index is None else f"{view.job.file} task {index} ({view.job.cases[index]})"
        detail = (f"{task.state} ({task.reason})" if task.stuck else
                  f"{task.state} exit {task.exit_code}" + (f" signal {task.signal}" if task.signal else ""))
        others = len(failed) - 1
        tail = f"; {others} more jobs or tasks did not complete" if others else ""
        message = f"job {task.job_id} {what}: {detail}, log {task.log}{tail}"
        verdict_only = len(failed) == 1 and view.job.stage == "verdict" and task.state == "FAILED"
        if verdict_only and task.exit_code == 1 and not task.signal:
            return Outcome(1, f"qualification failed: {message}")
        return Outcome(2, message)


def follow(watch: ChainWatch, interval: float, on_poll: Callable[[ChainWatch], None]) -> Outcome:
    """Poll until every job has settled, calling on_poll after each poll; return the outcome."""
    while True:
        watch.poll()
        on_poll(watch)
        if watch.settled():
            return watch.outcome()
        time.sleep(interval)


def query(job_id: str) -> list[tuple[int | None, Task]]:
    """(array index or None, Task) for every record Slurm still holds of a job; [] once it is forgotten."""
    proc = slurm("scontrol", "-o", "show", "job", job_id)
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            return []
        raise SlurmError(f"scontrol show job {job_id} failed: {proc.stderr.strip()}")
    found = []
    for line in proc.stdout.splitlines():
        if line.strip():
            found.extend(_tasks(_fields(line)))
    return found


def _fields(line: str) -> dict[str, str]:
    """key=value pairs of one `scontrol -o` record (values with spaces are cut; none that we read has any)."""
    pairs = (token.partition("=") for token in line.split())
    return {key: value for key, sep, value in pairs if sep}


def _tasks(rec: dict[str, str]) -> list[tuple[int | None, Task]]:
    status, _, signal = rec.get("ExitCode", "0:0").partition(":")
    base = {"state": rec["JobState"], "reason": rec.get("Reason", "None"), "exit_code": int(status),
            "signal": int(signal or 0), "restarts": int(rec.get("Restarts", "0")),
            "requeue": rec.get("Requeue") == "1", "log": rec.get("StdOut", "")}
    if "ArrayTaskId" not in rec:
        return [(None, Task(job_id=rec["JobId"], **base))]
    array_id = rec["ArrayJobId"]
    return [(i, Task(job_id=f"{array_id}_{i}", **{**base, "log": base["log"].replace("%a", str(i))}))
            for i in _indices(rec["ArrayTaskId"])]


def _indices(spec: str) -> list[int]:
    """Expand an ArrayTaskId such as '3', '2-7', '1,4-6' or '0-15%4' (pending tasks not yet split off)."""
    out: list[int] = []
    for part in spec.split("%")[0].split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out
