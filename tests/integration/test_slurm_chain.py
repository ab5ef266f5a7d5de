"""The sbatch chain against a real local Slurm, with a stand-in for the stage commands.

The stand-in takes the stage CLI's arguments and keeps its resume rule (a complete output is
skipped, a partial one redone) but writes small JSON files instead of tensors, so these tests
exercise what qualify owns (rendering, dependencies, the array, requeue, exit codes, --wait)
in seconds. Slurm itself is real: scripts/slurm-local.sh starts it; without it they skip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MATRIX = "matrices/tiny-qwen3.yaml"


pytestmark = [pytest.mark.slurm]  # tests/conftest.py skips them when sinfo does not answer

STUB = textwrap.dedent('''
    """Stand-in for `qualify reference|freeze|candidate|verify` with the same arguments and resume rule."""
    import json, os, sys, time
    from pathlib import Path

    ENV = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_NODELIST", "SLURM_RESTART_COUNT")

    def write(path, **data):
        path.parent.mkdir(parents=True, exist_ok=True)
        data.update({k: os.environ.get(k) for k in ENV})
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, sort_keys=True))
        os.replace(tmp, path)

    def option(name):
        return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None

    stage = sys.argv[1]
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    if stage == "reference":
        run = Path(option("--run"))
        if not (run / "reference.json").exists():
            write(run / "reference.json", stage=stage)
    elif stage == "freeze":
        run = Path(sys.argv[2])
        assert (run / "reference.json").exists(), "freeze ran before the reference"
        if not (run / "acceptance" / "acceptance.json").exists():
            write(run / "acceptance" / "acceptance.json", stage=stage)
    elif stage == "candidate" and option("--only") and "*" not in option("--only"):
        run, case = Path(option("--run")), option("--only")
        assert (run / "acceptance" / "acceptance.json").exists(), "candidate ran before freeze"
        out = run / "candidates" / case
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "starts.log", "a") as log:
            log.write(f"{restart}\\n")
        with open(out / "pids.log", "a") as log:
            log.write(f"{os.getpid()}\\n")
        if (out / "done.json").exists():
            print(f"stub: {case} complete, skipped")
            sys.exit(0)
        if (out / "partial.json").exists():
            print(f"stub: {case} partial, redone")
        write(out / "partial.json", case=case)
        if case == os.environ.get("STUB_FAIL_CASE"):
            sys.exit(2)
        # A held case blocks on its first run only: the test requeues it while it blocks.
        while (run / "hold" / case).exists() and restart == 0:
            time.sleep(0.2)
        write(out / "done.json", case=case)
        (out / "partial.json").unlink()
    elif stage == "candidate":
        run = Path(option("--run"))
        only = option("--only")
        write(run / "candidates" / "verdict.json", only=only,
              cases=sorted(p.parent.name for p in (run / "candidates").glob("*/done.json")))
        sys.exit(int(os.environ.get("STUB_VERDICT_EXIT", "0")))
    elif stage == "verify":
        assert Path(sys.argv[2]).exists(), f"no acceptance at {sys.argv[2]}"
    else:
        sys.exit(f"stub: unknown stage {sys.argv[1:]}")
''')


def make_profile(tmp_path: Path, **exports: str) -> Path:
    stub = tmp_path / "stub_stages.py"
    stub.write_text(STUB)
    profile = {"description": "local Slurm running the stand-in stages", "partition": "local",
               "gpus_per_node": 0, "cpus_per_node": 2, "qualify": f"{sys.executable} {stub}",
               "exports": dict(exports), "poll_seconds": 0.5}
    path = tmp_path / "stub.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def qualify_sbatch(*args: str, **popen) -> subprocess.Popen:
    cmd = [str(Path(sys.executable).parent / "qualify"), "sbatch", MATRIX, *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            **popen)


def run_chain(tmp_path: Path, profile: Path, *args: str) -> tuple[int, str, str]:
    proc = qualify_sbatch("--cluster", str(profile), "--run", str(tmp_path / "run"), "--wait", *args)
    out, err = proc.communicate()
    return proc.returncode, out, err


def job_ids(out: str) -> dict[str, str]:
    return dict(re.findall(r"^submitted (\S+) job (\d+)", out, re.MULTILINE))


def scontrol_job(job_id: str) -> dict[str, str]:
    text = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                          check=True).stdout
    return dict(tok.partition("=")[::2] for tok in text.split() if "=" in tok)


@pytest.mark.timeout(300)
def test_chain_completes_with_dependencies_array_and_provenance(tmp_path):
    code, out, err = run_chain(tmp_path, make_profile(tmp_path), "--only", "*-tp1-*")
    assert code == 0, out + err
    ids = job_ids(out)
    assert list(ids) == ["1-reference.sbatch", "2-freeze.sbatch", "3-candidate-1cpu.sbatch", "4-verdict.sbatch"]
    assert f"afterok:{ids['1-reference.sbatch']}" in out and f"afterok:{ids['3-candidate-1cpu.sbatch']}" in out
    run = tmp_path / "run"
    cases = sorted(p.name for p in (run / "candidates").iterdir() if p.is_dir())
    assert cases == sorted(c for c in _case_names() if "-tp1-" in c)
    array_id = ids["3-candidate-1cpu.sbatch"]
    for case in cases:
        done = json.loads((run / "candidates" / case / "done.json").read_text())
        # index -> case through the script's bash array, and the provenance the stages record
        assert done["SLURM_ARRAY_JOB_ID"] == array_id
        assert _case_names_tp1()[int(done["SLURM_ARRAY_TASK_ID"])] == case
        assert done["SLURM_JOB_NODELIST"]
        assert (run / "candidates" / case / "starts.log").read_text() == "0\n"
    verdict = json.loads((run / "candidates" / "verdict.json").read_text())
    assert verdict["only"] == "*-tp1-*" and verdict["cases"] == cases
    logs = sorted(p.name for p in (run / "slurm" / "logs").iterdir())
    assert f"tiny-qwen3-reference-{ids['1-reference.sbatch']}.out" in logs
    assert len([n for n in logs if n.startswith(f"tiny-qwen3-candidate-1cpu-{array_id}_")]) == len(cases)
    assert "chain completed: 4 jobs" in out


@pytest.mark.timeout(300)
def test_failed_verdict_exits_1_naming_the_verdict_job(tmp_path):
    code, out, err = run_chain(tmp_path, make_profile(tmp_path, STUB_VERDICT_EXIT="1"), "--only", "*-fp32-tp1-*")
    assert code == 1, out + err
    ids = job_ids(out)
    assert f"qualification failed: job {ids['4-verdict.sbatch']} 4-verdict.sbatch: FAILED exit 1" in err
    assert str(tmp_path / "run" / "slurm" / "logs" / f"tiny-qwen3-verdict-{ids['4-verdict.sbatch']}.out") in err


@pytest.mark.timeout(300)
def test_failed_array_task_exits_2_and_cancels_the_verdict(tmp_path):
    bad = "deepspeed-fp32-tp2-critic"
    code, out, err = run_chain(tmp_path, make_profile(tmp_path, STUB_FAIL_CASE=bad), "--only", "*-fp32-*")
    assert code == 2, out + err
    ids = job_ids(out)
    index = [c for c in _case_names() if "-fp32-" in c and "-tp2-" in c].index(bad)
    array_id = ids["4-candidate-2cpu.sbatch"]
    assert f"job {array_id}_{index} 4-candidate-2cpu.sbatch task {index} ({bad}): FAILED exit 2" in err
    assert f"tiny-qwen3-candidate-2cpu-{array_id}_{index}.out" in err
    assert "more jobs or tasks did not complete" in err  # the verdict, never started
    assert scontrol_job(ids["5-verdict.sbatch"])["JobState"] == "CANCELLED"
    assert not (tmp_path / "run" / "candidates" / "verdict.json").exists()


@pytest.mark.timeout(300)
def test_requeued_array_task_resumes_and_the_chain_completes(tmp_path):
    held = "torch-tp-bf16-tp1-actor"
    (tmp_path / "run" / "hold").mkdir(parents=True)
    (tmp_path / "run" / "hold" / held).touch()
    proc = qualify_sbatch("--cluster", str(make_profile(tmp_path)), "--run", str(tmp_path / "run"), "--wait",
                          "--only", "*-tp1-*")
    lines = []
    while len(job_ids("".join(lines))) < 4:
        lines.append(proc.stdout.readline())
        assert lines[-1], "".join(lines) + proc.stderr.read()  # qualify sbatch ended before submitting
    ids = job_ids("".join(lines))
    task = f"{ids['3-candidate-1cpu.sbatch']}_{_case_names_tp1().index(held)}"
    partial = tmp_path / "run" / "candidates" / held / "partial.json"
    while not partial.exists():  # the held case is running and has written a partial output
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    first = int((tmp_path / "run" / "candidates" / held / "pids.log").read_text().split()[0])
    subprocess.run(["scontrol", "requeue", task], check=True)
    _release(task, first)
    out, err = proc.communicate()
    out = "".join(lines) + out
    run = tmp_path / "run"
    assert proc.returncode == 0, out + err + _logs(run)
    assert (run / "candidates" / held / "starts.log").read_text() == "0\n1\n"  # redone after the requeue
    done = json.loads((run / "candidates" / held / "done.json").read_text())
    assert done["SLURM_RESTART_COUNT"] == "1"
    assert not partial.exists()
    for case in _case_names_tp1():
        if case != held:
            assert (run / "candidates" / case / "starts.log").read_text() == "0\n"
    log = run / "slurm" / "logs" / f"tiny-qwen3-candidate-1cpu-{task}.out"
    assert "restart 0" in log.read_text() and "restart 1" in log.read_text()  # --open-mode=append keeps both
    assert re.search(r"3-candidate-1cpu.sbatch job \d+: 8 COMPLETED, 1 restart$", err, re.MULTILINE)


def test_refused_submission_cancels_the_jobs_already_submitted(tmp_path):
    profile = make_profile(tmp_path)
    templates = tmp_path / "templates"
    shutil.copytree(ROOT / "sbatch" / "templates", templates)
    freeze = templates / "freeze.sh"
    freeze.write_text("#!/bin/bash\n#SBATCH --no-such-option\n" + freeze.read_text())
    data = yaml.safe_load(profile.read_text())
    profile.write_text(yaml.safe_dump({**data, "templates": "templates"}))
    code, out, err = run_chain(tmp_path, profile)
    assert code == 2, out + err
    assert "sbatch refused" in err and "2-freeze.sbatch" in err and "cancelled the 1 jobs already submitted" in err
    reference = re.search(r"^submitted 1-reference.sbatch job (\d+)", out, re.MULTILINE)
    assert reference is None  # ids are printed after the whole chain is in
    jobs = subprocess.run(["squeue", "-h", "-t", "all", "-n", "tiny-qwen3-reference", "-o", "%T %o"],
                          capture_output=True, text=True, check=True).stdout
    assert f"CANCELLED {tmp_path}/run/slurm/1-reference.sbatch" in jobs


def _logs(run: Path) -> str:
    """The array tasks' logs and the stand-in's start records, for a failure's message."""
    parts = [f"--- {p.relative_to(run)}\n{p.read_text()}" for p in sorted((run / "slurm" / "logs").glob("*"))]
    parts += [f"--- {p.relative_to(run)}\n{p.read_text()}" for p in sorted((run / "candidates").glob("*/*"))]
    return "\n".join(parts)


def _release(task: str, first: int) -> None:
    """A requeued job is held cred_expire seconds; start it now once it is pending again and its first run is gone.

    Slurm's hold is what keeps a restart from meeting what is left of the killed run on the node (its stand-in
    process, its step daemons); starting it early, the test waits for those to be gone itself.
    """
    while True:
        job = scontrol_job(task)
        if job["JobState"] == "PENDING" and not _alive(first) and not _step_daemons(job["JobId"]):
            subprocess.run(["scontrol", "update", f"JobId={task}", "StartTime=now"], check=True)
            return
        if job["JobState"] == "RUNNING" and job["Restarts"] != "0":
            return
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    """Whether a process runs (a zombie nobody reaps does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _step_daemons(job_id: str) -> list[str]:
    """The live slurmstepd processes of a job on this (the only) node; zombies excluded."""
    pattern = rf"^slurmstepd: \[{job_id}\."
    found = subprocess.run(["pgrep", "-f", pattern], check=False, capture_output=True, text=True)  # 1: none
    return found.stdout.split()


def _case_names() -> list[str]:
    from qualify.matrix import load_matrix

    return [c.name for c in load_matrix(ROOT / MATRIX).cases()]


def _case_names_tp1() -> list[str]:
    return [c for c in _case_names() if "-tp1-" in c]
