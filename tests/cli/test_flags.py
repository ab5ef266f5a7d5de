"""One meaning per flag: --run is the run directory, --out what a command writes, --only the case glob."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from qualify.cli.app import app

runner = CliRunner()


@pytest.mark.parametrize("verb", ["reference", "candidate", "rounds", "sbatch"])
def test_the_run_directory_is_run_everywhere(verb):
    help_text = runner.invoke(app, [verb, "--help"], terminal_width=200).stdout
    assert "--run" in help_text


@pytest.mark.parametrize("verb", ["candidate", "sbatch"])
def test_the_case_glob_is_only_everywhere(verb):
    help_text = runner.invoke(app, [verb, "--help"], terminal_width=200).stdout
    assert "--only" in help_text and "--cases" not in help_text


def test_reference_no_longer_shows_out_and_sbatch_out_is_the_scripts_directory():
    assert "--out" not in runner.invoke(app, ["reference", "--help"], terminal_width=200).stdout
    assert "Directory for the scripts" in runner.invoke(app, ["sbatch", "--help"], terminal_width=200).stdout


def test_old_case_glob_spelling_still_renders_the_same_chain(tmp_path):
    args = ["sbatch", "matrices/tiny-qwen3.yaml", "--cluster", "sbatch/clusters/local.yaml", "--run", str(tmp_path / "r")]
    new = runner.invoke(app, [*args, "--out", str(tmp_path / "a"), "--only", "torch-tp-*"])
    old = runner.invoke(app, [*args, "--out", str(tmp_path / "b"), "--cases", "torch-tp-*"])
    assert new.exit_code == old.exit_code == 0, (new.stdout, old.stdout)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(p.name for p in (tmp_path / "b").iterdir())
    assert any((tmp_path / "a").glob("3-candidate*"))
