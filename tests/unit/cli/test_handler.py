"""Through the CLI: bad input ends as exit 2 and exactly one line on stderr, before any expensive work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from qualify.cli.app import app
from qualify.cli.handler import MAX_MESSAGE, handle_errors, one_line
from qualify.errors import QualifyError

ROOT = Path(__file__).resolve().parents[3]


def usage_error(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert result.stderr.startswith("qualify: error: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def evidence(tmp_path: Path) -> Path:
    root = tmp_path / "evidence"
    root.mkdir()
    (root / "a.txt").write_text("a")
    return root


def test_manifest_create_onto_a_directory(tmp_path):
    out = tmp_path / "existing"
    out.mkdir()
    message = usage_error("manifest", "create", str(evidence(tmp_path)), "--out", str(out))
    assert f"--out {out} is a directory" in message
    assert list(out.iterdir()) == []


def test_manifest_create_into_a_missing_directory_creates_it(tmp_path):
    out = tmp_path / "new" / "m.json"
    result = CliRunner().invoke(app, ["manifest", "create", str(evidence(tmp_path)), "--out", str(out)])
    assert result.exit_code == 0 and json.loads(out.read_text())["files"][0]["path"] == "a.txt"


@pytest.mark.parametrize("text, expected", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"files": [], "schema": "qualify.manifest/1", "n": ' + "7" * 5000 + "}", "malformed JSON"),
    ('{"files": "x"}', "not a manifest"),
])
def test_verify_a_hostile_manifest(tmp_path, text, expected):
    manifest = tmp_path / "m.json"
    manifest.write_text(text)
    assert expected in usage_error("verify", str(manifest), "--evidence", str(evidence(tmp_path)))


def test_a_multiline_error_is_printed_as_one_line(capsys):
    @handle_errors
    def fails() -> None:
        raise QualifyError("vLLM failed:\nTraceback (most recent call last):\n\n  File x\nValueError: bad")

    with pytest.raises(typer.Exit) as info:
        fails()
    assert info.value.exit_code == 2
    err = capsys.readouterr().err
    assert err == "qualify: error: vLLM failed: | Traceback (most recent call last): | File x | ValueError: bad\n"


def test_a_huge_error_is_cut_in_the_middle():
    text = one_line("start " + "x" * 10_000 + " end")
    assert len(text) <= MAX_MESSAGE and text.startswith("start xx") and text.endswith("xx end") and " ... " in text
