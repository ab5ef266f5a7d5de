"""The candidate stage's scheduling: its launch groups run on a thread pool while the stage judges what is sealed.

Scheduler runs the launch groups, `launches` of them at once (each admitted by the GPU plan, qualify.candidate.schedule,
when it fits), and meanwhile, when judging early, polls for a case whose evidence (and that of the TP1/DP1/padded
cases it is compared with) is sealed and judges it; a case judged out of GPU memory beside the launches is judged
after them. A failed group launch is retried case by case, each alone on the GPUs, so that each failure carries its
own log.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from qualify.candidate import WORKER
from qualify.candidate.resume import pending_cases
from qualify.candidate.schedule import LaunchPlan, judged_within_memory
from qualify.case.launch import clear_failures, failure_note, launch
from qualify.engines.registry import preload_modules
from qualify.judge.case import invariance_bases
from qualify.layout import RunLayout, launch_log, work_dir
from qualify.matrix import Case
from qualify.stagelog import StageLog
from qualify.stages import stage_is_complete
from qualify.verdict import Row

POLL_S = 2.0
"""Seconds between looks for a newly sealed case while launches run (a look reads each marker's name only)."""


def marked_complete(path: Path) -> bool:
    """Whether a stage directory holds its marker (cheap: nothing is hashed; stage_is_complete checks it)."""
    from qualify.stages import MARKER

    return (path / MARKER).is_file()


class Scheduler:
    """The stage's launches and its judging beside them. judge(case, verified) judges one case and returns its rows
    (verified: the cases whose seal this process has checked); rows holds every case judged so far, by name."""

    def __init__(self, layout: RunLayout, cases: list[Case], specs_by_case: dict[Case, Path], device: str,
                 log: StageLog, judge: Callable[[Case, frozenset[str]], list[Row]] | None = None,
                 resident: Any = None, plan: LaunchPlan | None = None,
                 needs: Callable[[list[Case]], dict[int, int]] | None = None) -> None:
        self.layout, self.cases, self.specs_by_case, self.device, self.log = layout, cases, specs_by_case, device, log
        self.judge, self.resident, self.plan, self.needs = judge, resident, plan or LaunchPlan(), needs
        self.rows: dict[str, list[Row]] = {}
        self.unsound: set[str] = set()  # marked, but its files do not match the marker: left to the end
        self.deferred: set[str] = set()  # out of GPU memory beside the launches: judged after them

    def run(self, groups: list[list[Case]], launches: int, early: bool) -> dict[str, str]:
        """Run the launch groups, launches of them at once, and meanwhile (early) judge what is sealed: judge_ready()
        is called again at once when it judged a case, else after POLL_S or when a launch ends. Returns errors by case
        name."""
        from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

        pending = [p for p in (pending_cases(self.layout, g, self.specs_by_case, self.log) for g in groups) if p]
        errors: dict[str, str] = {}
        if not pending:
            return errors
        ready = self.judge_ready if early else lambda: False
        with ThreadPoolExecutor(max(1, min(launches, len(pending)))) as pool:
            running = {pool.submit(self.launch_group, p, self.needs(p) if self.needs is not None else None)
                       for p in pending}
            while running:
                done, running = wait(running, timeout=0 if ready() else POLL_S, return_when=FIRST_COMPLETED)
                for future in done:
                    errors |= future.result()
        if self.plan.waited:
            self.log.note(f"{self.plan.waited} launch(es) waited for GPU memory (qualify.candidate.schedule)")
        return errors

    def launch_group(self, pending: list[Case], need: dict[int, int] | None = None) -> dict[str, str]:
        """Run cases sharing engine and TP in one launch (imports are paid once); a failed launch is retried case by
        case, each alone on the GPUs (the plan: qualify.candidate.schedule), so that each failure carries its own log
        and no other launch or judge copy took the memory it needed. need: what the launch plans for per GPU. Returns
        errors by case name."""
        if not pending:
            return {}
        layout, plan, log = self.layout, self.plan, self.log
        need = need or {}
        specs = [self.specs_by_case[c] for c in pending]
        for c in pending:
            clear_failures(work_dir(layout.case(c.name)))
        group_log = launch_log(layout.case(pending[0].name))
        with plan.admit(need), log.step(f"cases {', '.join(c.name for c in pending)}"):
            code = launch(WORKER, specs, pending[0].world_size, self.device, group_log,
                          preload_modules(pending[0].engine))
        errors = {}
        for case, spec in zip(pending, specs):
            if stage_is_complete(layout.case(case.name)):
                continue
            if len(pending) > 1:
                with plan.admit(need, alone=True), \
                        log.step(f"case {case.name} (alone, after a failed group launch)"):
                    code = launch(WORKER, spec, case.world_size, self.device, launch_log(layout.case(case.name)),
                                  preload_modules(case.engine))
            if not stage_is_complete(layout.case(case.name)):
                errors[case.name] = failure_note(work_dir(layout.case(case.name)),
                                                 launch_log(layout.case(case.name)) if len(pending) > 1 else group_log,
                                                 code)
        return errors

    def judge_ready(self) -> bool:
        """Judge the first case (in matrix order) whose evidence is sealed while launches still run, with the TP1/DP1
        cases it is compared with sealed too; True when one was (or was deferred)."""
        layout = self.layout
        for case in self.cases:
            group = [case, *(b for _, b in invariance_bases(case) if b in self.cases)]
            if case.name in self.rows or case.name in self.deferred or any(c.name in self.unsound for c in group) \
                    or not all(marked_complete(layout.case(c.name)) for c in group):
                continue
            bad = [c.name for c in group if not stage_is_complete(layout.case(c.name))]
            if bad:  # hashed once: a seal that does not hold is not hashed again at every look
                self.unsound.update(bad)
                continue
            if not judged_within_memory(partial(self.judge_one, case, frozenset(c.name for c in group)),
                                        self.resident, self.log, f"judge {case.name}", retry=False):
                self.deferred.add(case.name)
            return True
        return False

    def judge_rest(self, errors: dict[str, str]) -> None:
        """After the launches: judge every case that ran and was not judged beside them."""
        verified = frozenset(c.name for c in self.cases if c.name not in errors)  # launch_group checked each seal
        for case in self.cases:
            if case.name not in errors and case.name not in self.rows:
                judged_within_memory(partial(self.judge_one, case, verified), self.resident, self.log,
                                     f"judge {case.name}", retry=True)

    def judge_one(self, case: Case, verified: frozenset[str]) -> None:
        """judge(case, verified), its rows kept."""
        self.rows[case.name] = self.judge(case, verified)
