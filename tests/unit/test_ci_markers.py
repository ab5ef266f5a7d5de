"""tests/conftest.py's marker logic, through a real pytest run: a skip outside CI, a failure in CI.

CI installs vLLM, deepspeed and megatron-core and starts Slurm (.ci/run); a test that needs one of them
must not turn green by skipping there. GPU tests still skip in CI: it has no GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SLURM_TEST = "tests/integration/test_slurm_chain.py::test_failed_verdict_exits_1_naming_the_verdict_job"
GPU_TEST = "tests/unit/ppo/test_logprob.py::test_cuda_divisor_must_live_on_the_device"


def run_pytest(tmp_path: Path, ci: bool, *tests: str) -> subprocess.CompletedProcess:
    """pytest on tests, with no Slurm controller reachable (SLURM_CONF names a missing file)."""
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"SLURM_CONF": str(tmp_path / "absent.conf")}
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           *tests], cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)


def test_outside_ci_a_slurm_test_skips_when_slurm_is_down(tmp_path):
    result = run_pytest(tmp_path, False, SLURM_TEST)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 skipped" in result.stdout and "no Slurm controller answers" in result.stdout


def test_in_ci_a_slurm_test_fails_when_slurm_is_down_and_a_gpu_test_still_skips(tmp_path):
    result = run_pytest(tmp_path, True, SLURM_TEST, GPU_TEST)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed, 1 skipped" in result.stdout, result.stdout
    assert "CI=true: no Slurm controller answers" in result.stdout and "CUDA GPU" in result.stdout
