"""The suite's disk use: a passing test's tmp_path is removed when it ends, a failing one's is kept.

Many integration tests copy a frozen run (about half a GB each); kept, they filled a CI machine's disk.
This runs pytest itself under the project's own configuration on two tiny tests.
"""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

INNER = '''
def test_passes(tmp_path):
    (tmp_path / "blob").write_bytes(b"x" * 1024)

def test_fails(tmp_path):
    (tmp_path / "blob").write_bytes(b"x" * 1024)
    assert False, "kept for debugging"
'''


def test_passing_tests_leave_no_tmp_dir_and_failing_ones_keep_theirs(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER)
    base = tmp_path / "base"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml"),
         "--rootdir", str(tmp_path), f"--basetemp={base}", str(tmp_path / "test_inner.py")],
        check=False, capture_output=True, text=True, cwd=tmp_path)
    assert "1 failed, 1 passed" in result.stdout, result.stdout + result.stderr
    left = sorted(p.name for p in base.iterdir() if p.is_dir() and not p.is_symlink())
    assert left == ["test_fails0"], left
    assert (base / "test_fails0" / "blob").stat().st_size == 1024
