"""How `qualify sbatch --wait` reads `scontrol -o show job` records and decides a chain's exit code.

The records are in the exact format Slurm 22.05 prints (captured from the local cluster); the
tests against the running Slurm itself are in tests/integration/test_slurm_chain.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from qualify.slurm.render import render_chain
from qualify.slurm.watch import ChainWatch, _fields, _indices, _tasks

ROOT = Path(__file__).resolve().parents[3]


def record(job_id: str, state: str, *, array: str | None = None, task: str | None = None, exit_code: str = "0:0",
           reason: str = "None", restarts: int = 0, requeue: int = 1) -> str:
    array_part = f"ArrayJobId={array} ArrayTaskId={task} " if array else ""
    out = f"/runs/t/slurm/logs/t-{array}_{task}.out" if array else f"/runs/t/slurm/logs/t-{job_id}.out"
    return (f"JobId={job_id} {array_part}JobName=t UserId=root(0) GroupId=root(0) MCS_label=N/A "
            f"Priority=4294901759 Nice=0 Account=(null) QOS=(null) JobState={state} Reason={reason} "
            f"Dependency=(null) Requeue={requeue} Restarts={restarts} BatchFlag=1 Reboot=0 ExitCode={exit_code} "
            f"RunTime=00:00:03 TimeLimit=UNLIMITED Partition=local NodeList=vm NumCPUs=1 "
            f"TRES=cpu=1,node=1,billing=1 Command=/tmp/sj/a.sh WorkDir=/tmp/sj StdErr={out} StdIn=/dev/null "
            f"StdOut={out} Power= ")


def parse(line: str):
    return _tasks(_fields(line))


@pytest.fixture()
def watch(monkeypatch) -> ChainWatch:
    monkeypatch.chdir(ROOT)
    chain = render_chain(Path("matrices/tiny-qwen3.yaml"), Path("sbatch/clusters/local.yaml"),
                         run=Path("runs/t"), out=Path("unused"), cases="torch-tp-fp32-*")
    ids = {"reference": "10", "freeze": "11", "candidate-1cpu": "12", "candidate-2cpu": "13", "verdict": "14"}
    return ChainWatch(chain, ids)


def load(watch: ChainWatch, **states) -> None:
    """states: job key -> list of record lines."""
    for view in watch.views:
        for line in states.get(view.job.key, []):
            for index, task in parse(line):
                view.tasks[index] = task


def completed(watch: ChainWatch, **overrides) -> dict[str, list[str]]:
    states = {"reference": [record("10", "COMPLETED")], "freeze": [record("11", "COMPLETED")],
              "candidate-1cpu": [record(f"2{i}", "COMPLETED", array="12", task=str(i)) for i in range(2)],
              "candidate-2cpu": [record(f"3{i}", "COMPLETED", array="13", task=str(i)) for i in range(2)],
              "verdict": [record("14", "COMPLETED")]}
    return {**states, **overrides}


def test_array_task_ranges_expand():
    assert _indices("3") == [3]
    assert _indices("2-5") == [2, 3, 4, 5]
    assert _indices("0,4-6%2") == [0, 4, 5, 6]


def test_a_pending_array_record_stands_for_each_of_its_tasks():
    tasks = parse(record("12", "PENDING", array="12", task="1-3%8", reason="Dependency"))
    assert [(i, t.job_id, t.state) for i, t in tasks] == [(1, "12_1", "PENDING"), (2, "12_2", "PENDING"),
                                                          (3, "12_3", "PENDING")]
    (index, task), = parse(record("21", "FAILED", array="12", task="0", exit_code="2:0"))
    assert (index, task.exit_code, task.signal, task.log) == (0, 2, 0, "/runs/t/slurm/logs/t-12_0.out")


def test_every_job_completed_is_exit_0(watch):
    load(watch, **completed(watch))
    assert watch.settled() and watch.outcome().code == 0


def test_a_running_or_requeued_chain_is_not_settled(watch):
    load(watch, **completed(watch, verdict=[record("14", "PENDING", reason="Dependency")]))
    assert not watch.settled()
    load(watch, verdict=[record("14", "NODE_FAIL", requeue=1)])  # Slurm puts it back in the queue
    assert not watch.settled()
    load(watch, verdict=[record("14", "NODE_FAIL", requeue=0)])
    assert watch.settled() and watch.outcome().code == 2


def test_verdict_exit_1_is_a_failed_qualification(watch):
    load(watch, **completed(watch, verdict=[record("14", "FAILED", exit_code="1:0", reason="NonZeroExitCode")]))
    outcome = watch.outcome()
    assert outcome.code == 1
    assert outcome.message.startswith("qualification failed: job 14 5-verdict.sbatch: FAILED exit 1")
    assert "log /runs/t/slurm/logs/t-14.out" in outcome.message


@pytest.mark.parametrize("exit_code", ["2:0", "0:9"])
def test_verdict_input_error_or_signal_is_exit_2(watch, exit_code):
    load(watch, **completed(watch, verdict=[record("14", "FAILED", exit_code=exit_code)]))
    assert watch.outcome().code == 2


def test_a_failed_array_task_is_named_with_its_case_and_log(watch):
    load(watch, **completed(watch, **{
        "candidate-2cpu": [record("30", "COMPLETED", array="13", task="0"),
                           record("31", "FAILED", array="13", task="1", exit_code="1:0")],
        "verdict": [record("14", "CANCELLED", reason="DependencyNeverSatisfied")]}))
    outcome = watch.outcome()
    assert outcome.code == 2
    assert outcome.message == ("job 13_1 4-candidate-2cpu.sbatch task 1 (torch-tp-fp32-tp2-critic): FAILED exit 1, "
                               "log /runs/t/slurm/logs/t-13_1.out; 1 more jobs or tasks did not complete")


def test_a_dependency_that_can_never_be_satisfied_settles_the_chain(watch):
    load(watch, **completed(watch, **{
        "reference": [record("10", "TIMEOUT", exit_code="0:15")],
        "freeze": [record("11", "PENDING", reason="DependencyNeverSatisfied")],
        "candidate-1cpu": [record("12", "PENDING", array="12", task="0-1", reason="Dependency")]}))
    assert not watch.settled()  # the arrays wait on freeze, which waits forever
    load(watch, **{"candidate-1cpu": [record("12", "PENDING", array="12", task="0-1",
                                             reason="DependencyNeverSatisfied")],
                   "candidate-2cpu": [record("13", "PENDING", array="13", task="0-1",
                                             reason="DependencyNeverSatisfied")],
                   "verdict": [record("14", "PENDING", reason="DependencyNeverSatisfied")]})
    assert watch.settled()
    outcome = watch.outcome()
    assert outcome.code == 2 and outcome.message.startswith("job 10 1-reference.sbatch: TIMEOUT exit 0 signal 15")
