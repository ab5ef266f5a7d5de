"""The embedded default through real sbatch jobs: reference -> freeze -> candidate arrays -> verdict.

A real local Slurm (scripts/slurm-local.sh) runs the real stages on the `local` profile. CI has
2 cores and a 30-minute budget, so (measured on 2 loaded cores: the full chain from scratch took
593 s, 300 s of it the vLLM TP1+TP2 capture) the chain starts from a copy of the session's frozen
run (tests/conftest.py): its reference and freeze jobs run for real and find their outputs complete,
and the candidate stage covers a slice of the matrix chosen with `qualify sbatch --only`: torch-tp
fp32 actor at TP1 and TP2, one case in each array shape (1 and 2 CPUs). A second chain on a copy of
that run has both arrays requeued while the TP2 case runs: it must end with the same verdict, the
interrupted case redone and the completed one skipped.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qualify.matrix import load_matrix

ROOT = Path(__file__).resolve().parents[2]
MATRIX = "matrices/tiny-qwen3.yaml"
CASES = "torch-tp-fp32-tp*-actor"
SELECTED = [c.name for c in load_matrix(ROOT / MATRIX).cases() if fnmatch.fnmatchcase(c.name, CASES)]
assert SELECTED == ["torch-tp-fp32-tp1-actor", "torch-tp-fp32-tp2-actor"]
QUALIFY = str(Path(sys.executable).parent / "qualify")


pytestmark = [pytest.mark.slurm, pytest.mark.slow]  # tests/conftest.py skips them when sinfo does not answer


def start_chain(run: Path) -> subprocess.Popen:
    cmd = [QUALIFY, "sbatch", MATRIX, "--cluster", "sbatch/clusters/local.yaml", "--run", str(run),
           "--only", CASES, "--wait"]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def read_ids(proc: subprocess.Popen, num_jobs: int) -> tuple[dict[str, str], str]:
    """Job ids from the lines `qualify sbatch --submit` prints, as soon as it prints them."""
    text = ""
    while len(re.findall(r"^submitted ", text, re.MULTILINE)) < num_jobs:
        line = proc.stdout.readline()
        assert line, f"qualify sbatch ended early:\n{text}{proc.stderr.read()}"
        text += line
    return dict(re.findall(r"^submitted \d+-(\S+)\.sbatch job (\d+)", text, re.MULTILINE)), text


def verdict_rows(run: Path) -> tuple[bool, list[dict]]:
    """The verdict the last job wrote over the selected cases (each array task writes its own case's too)."""
    found = [v for p in sorted((run / "candidates").glob("verdict*.json"))
             if sorted((v := json.loads(p.read_text()))["cases"]) == SELECTED]
    assert len(found) == 1, sorted(p.name for p in (run / "candidates").iterdir())
    return found[0]["passed"], found[0]["rows"]


@pytest.fixture(scope="module")
def first_chain(tmp_path_factory, frozen_run):
    run = tmp_path_factory.mktemp("slurm-tiny") / "run"
    shutil.copytree(frozen_run, run)
    proc = start_chain(run)
    ids, head = read_ids(proc, 5)
    out, err = proc.communicate()
    return run, ids, proc.returncode, head + out, err


@pytest.mark.timeout(2400)
def test_tiny_chain_passes_and_its_acceptance_verifies(first_chain):
    run, ids, code, out, err = first_chain
    assert code == 0, out + err
    assert list(ids) == ["reference", "freeze", "candidate-1cpu", "candidate-2cpu", "verdict"]
    passed, rows = verdict_rows(run)
    assert passed and rows
    verify = subprocess.run([QUALIFY, "verify", str(run / "acceptance" / "acceptance.json")], capture_output=True,
                            text=True, check=False)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    logs = run / "slurm" / "logs"
    assert "complete, skipped" in (logs / f"tiny-qwen3-reference-{ids['reference']}.out").read_text()
    assert "verdict exit 0, verify exit 0" in (logs / f"tiny-qwen3-verdict-{ids['verdict']}.out").read_text()
    for case in SELECTED:  # each case ran once, in the array of its shape, and recorded where
        key = "candidate-2cpu" if "-tp2-" in case else "candidate-1cpu"
        slurm = json.loads((run / "candidates" / case / "meta.json").read_text())["slurm"]
        assert slurm["SLURM_ARRAY_JOB_ID"] == ids[key] and slurm["SLURM_ARRAY_TASK_ID"] == "0"
        log = (logs / f"tiny-qwen3-{key}-{ids[key]}_0.out").read_text()
        assert f"case {case}\n" in log and "restart 0" in log and "restart 1" not in log


@pytest.mark.timeout(2400)
def test_requeued_candidate_arrays_complete_with_the_same_verdict(first_chain, tmp_path):
    first_run, _, first_code, first_out, first_err = first_chain
    assert first_code == 0, first_out + first_err
    run = tmp_path / "run"
    # The frozen reference and acceptance are reused: their jobs find the outputs complete and skip them.
    shutil.copytree(first_run, run, ignore=shutil.ignore_patterns("candidates", "slurm"))
    proc = start_chain(run)
    ids, head = read_ids(proc, 5)
    arrays = [ids["candidate-1cpu"], ids["candidate-2cpu"]]
    _wait_running(proc, ids["candidate-2cpu"], run / "candidates" / "torch-tp-fp32-tp2-actor.work")
    # Requeue both arrays: the running TP2 task dies mid-case, the completed TP1 task runs again.
    subprocess.run(["scontrol", "requeue", ",".join(arrays)], check=True)
    for array in arrays:
        _release_held(proc, array)
    out, err = proc.communicate()
    assert proc.returncode == 0, head + out + err
    assert verdict_rows(run) == verdict_rows(first_run)
    logs = run / "slurm" / "logs"
    tp1 = (logs / f"tiny-qwen3-candidate-1cpu-{arrays[0]}_0.out").read_text()
    tp2 = (logs / f"tiny-qwen3-candidate-2cpu-{arrays[1]}_0.out").read_text()
    assert "restart 1" in tp1 and "case torch-tp-fp32-tp1-actor: complete, skipped" in tp1
    assert "DUE TO JOB REQUEUE" in tp2 and "restart 1" in tp2
    assert "case torch-tp-fp32-tp2-actor: complete, skipped" not in tp2
    slurm = json.loads((run / "candidates" / "torch-tp-fp32-tp2-actor" / "meta.json").read_text())["slurm"]
    assert slurm["SLURM_RESTART_COUNT"] == "1"
    assert re.search(rf"4-candidate-2cpu.sbatch job {arrays[1]}: 1 COMPLETED, 1 restart$", err, re.MULTILINE)


def _task_states(array: str) -> dict[int, tuple[str, str]]:
    """Array index -> (state, reason) from squeue (-r: one line per task)."""
    text = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-j", array, "-o", "%K %T %r"], capture_output=True,
                          text=True, check=True).stdout
    return {int(i): (s, r) for i, s, r in (line.split(maxsplit=2) for line in text.splitlines())}


def _chain_alive(proc: subprocess.Popen) -> None:
    """Fail at once, with what qualify sbatch said, when the chain ended before the test acted on it."""
    if proc.poll() is not None:
        out, err = proc.communicate()
        pytest.fail(f"the chain ended early (exit {proc.returncode}):\n{out}{err}")


def _wait_running(proc: subprocess.Popen, array: str, work: Path) -> None:
    """Until the array's task runs and has started its case (the case's work directory exists)."""
    while not (_task_states(array).get(0, ("", ""))[0] == "RUNNING" and work.exists()):
        _chain_alive(proc)
        time.sleep(0.5)


def _release_held(proc: subprocess.Popen, array: str) -> None:
    """A requeued task is held cred_expire seconds (BeginTime): start each one now, until none waits."""
    while True:
        _chain_alive(proc)
        states = _task_states(array)
        held = [i for i, (state, reason) in states.items() if state == "PENDING" and reason == "BeginTime"]
        for index in held:
            subprocess.run(["scontrol", "update", f"JobId={array}_{index}", "StartTime=now"], check=False)
        if not held and all(state in ("RUNNING", "COMPLETED") for state, _ in states.values()):
            return
        time.sleep(0.5)
