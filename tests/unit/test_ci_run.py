""".ci/run stops when the local Slurm does not start, instead of running the tests without it.

The real .ci/run runs in a scratch copy whose scripts/slurm-local.sh and Makefile are stand-ins that
record what was called: the script under test is the committed one, byte for byte.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def sandbox(tmp_path: Path, start: str, sinfo_rc: int) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "repo"
    (root / ".ci").mkdir(parents=True)
    (root / "scripts").mkdir()
    shutil.copy(REPO / ".ci" / "run", root / ".ci" / "run")
    slurm = root / "scripts" / "slurm-local.sh"
    slurm.write_text("#!/usr/bin/env bash\n"
                     f'echo "slurm-local $*" >>"{tmp_path}/calls"\n'
                     f'if [ "$1" = start ]; then {start}; fi\n')
    slurm.chmod(0o755)
    chromium = root / "scripts" / "ensure-chromium.sh"
    chromium.write_text(f'#!/usr/bin/env bash\necho "ensure-chromium" >>"{tmp_path}/calls"\n')
    (root / "Makefile").write_text(f"test:\n\techo \"make test CI=$$CI\" >>{tmp_path}/calls\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sinfo = bin_dir / "sinfo"
    sinfo.write_text(f"#!/bin/sh\nexit {sinfo_rc}\n")
    sinfo.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "SLURM_CONF", "QUALIFY_SLURM_DIR")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return root, env


def run_ci(tmp_path: Path, start: str, sinfo_rc: int = 0) -> tuple[subprocess.CompletedProcess, list[str]]:
    root, env = sandbox(tmp_path, start, sinfo_rc)
    result = subprocess.run(["bash", str(root / ".ci" / "run")], env=env, capture_output=True, text=True,
                            timeout=60, check=False)
    calls = tmp_path / "calls"
    return result, calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_tests_run_with_ci_set_and_slurm_is_stopped_after_them(tmp_path):
    result, calls = run_ci(tmp_path, 'echo "export SLURM_CONF=/x/slurm.conf"; echo "export QUALIFY_SLURM_DIR=/x"')
    assert result.returncode == 0, result.stderr
    assert calls == ["slurm-local start", "ensure-chromium", "make test CI=true", "slurm-local stop /x"]


def test_a_failed_slurm_start_fails_ci_before_any_test(tmp_path):
    result, calls = run_ci(tmp_path, 'echo "slurm-local: error: slurmctld did not answer" >&2; exit 2')
    assert result.returncode == 1
    assert calls == ["slurm-local start"]
    assert "the local Slurm did not start" in result.stderr and "slurmctld did not answer" in result.stderr


def test_slurm_that_started_but_does_not_answer_fails_ci_and_is_stopped(tmp_path):
    result, calls = run_ci(tmp_path, 'echo "export QUALIFY_SLURM_DIR=/x"', sinfo_rc=1)
    assert result.returncode == 1 and "sinfo does not answer" in result.stderr
    assert calls == ["slurm-local start", "slurm-local stop /x"]
