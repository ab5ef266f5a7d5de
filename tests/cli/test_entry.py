"""The fast path of a piped `qualify verify`: the same words and exit codes as the Typer command, no Typer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qualify.cli.app import app
from qualify.cli.entry import parse_verify
from qualify.manifest import create_manifest

ROOT = Path(__file__).resolve().parents[2]
PROBE = ("import atexit, sys\n"
         "atexit.register(lambda: sys.stderr.write('IMPORTED ' + ' '.join(m for m in ('typer', 'rich', 'pydantic') "
         "if m in sys.modules) + '\\n'))\n"
         "sys.argv = ['qualify', *sys.argv[1:]]\n"
         "from qualify.cli.entry import main\n"
         "main()\n")


def piped(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=ROOT, check=False)


@pytest.fixture
def evidence(tmp_path):
    data = tmp_path / "data"
    (data / "d").mkdir(parents=True)
    for i in range(5):
        (data / "d" / f"f{i}.bin").write_bytes(bytes([i]) * 100)
    manifest = tmp_path / "m.json"
    create_manifest(data, manifest, progress=False)
    return manifest, data


@pytest.mark.parametrize("args", [["--format", "json"], [], ["--expect", "sha256:00", "--jobs", "1"],
                                  ["--jobs=2", "--format=text"]])
def test_fast_path_says_what_the_typer_command_says(evidence, args):
    manifest, data = evidence
    (data / "d" / "f1.bin").write_bytes(b"changed")  # one modified file: exit 1, every line printed
    (data / "d" / "f2.bin").unlink()
    fast = piped("verify", str(manifest), "--evidence", str(data), *args)
    slow = CliRunner().invoke(app, ["verify", str(manifest), "--evidence", str(data), *args], terminal_width=500)
    assert fast.returncode == slow.exit_code == 1
    assert fast.stdout == slow.stdout
    assert fast.stderr.strip() == "IMPORTED"  # neither Typer, rich nor pydantic was imported


def test_fast_path_passes_and_json_parses(evidence):
    manifest, data = evidence
    fast = piped("verify", str(manifest), "--evidence", str(data), "--format", "json")
    assert fast.returncode == 0 and json.loads(fast.stdout)["ok"] is True


@pytest.mark.parametrize("args", [["--help"], ["--jobs", "0"], ["--jobs", "x"], ["--format", "xml"], ["--nope"],
                                  [], ["a.json", "b.json"], ["--evidence"],
                                  ["a.json", "--allowed-signers", "f", "--signature", "s"]])
def test_anything_unusual_goes_to_the_typer_command(args):
    assert parse_verify(args) is None


def test_errors_are_reported_by_the_typer_command(tmp_path):
    result = piped("verify", str(tmp_path / "missing.json"))
    assert result.returncode == 2
    assert "IMPORTED typer" in result.stderr and "Traceback" not in result.stderr


def test_parse_verify_reads_every_declared_option():
    assert parse_verify(["m.json", "--evidence=e", "--format", "json", "--jobs", "3", "--partial",
                         "--expect", "sha256:ab"]) == {
        "manifest": "m.json", "--evidence": "e", "--format": "json", "--jobs": 3, "--partial": True,
        "--expect": "sha256:ab"}
