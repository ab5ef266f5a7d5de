"""`make lint` stays green: ruff (the version pinned in requirements/cpu.lock, settings in pyproject) finds nothing in
qualify, tests or benchmarks. When it was not run, 19 findings piled up (subprocesses with an implicit check, files
opened and never closed, implicit string concatenations in lists, where a missing comma hides)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUFF = Path(sys.executable).parent / "ruff"


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(RUFF), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), *args],
                          cwd=ROOT, check=False, capture_output=True, text=True)


def test_ruff_finds_nothing():
    result = ruff("qualify", "tests", "benchmarks")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_with_the_project_settings_finds_an_unchecked_subprocess(tmp_path):
    """Negative control: the project's rules are the ones applied (a file with one finding fails)."""
    bad = tmp_path / "probe.py"
    bad.write_text('import subprocess\n\nsubprocess.run(["true"])\n')
    result = ruff(str(bad))
    assert result.returncode == 1 and "PLW1510" in result.stdout, result.stdout + result.stderr
