"""The Typer app through CliRunner: commands and help, matrices, manifest create/verify, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from qualify.cli.app import app
from qualify.cli.handler import EXIT_USAGE, handle_errors
from qualify.errors import EngineError, MatrixError

ROOT = Path(__file__).resolve().parents[2]
MATRICES = ROOT / "matrices"
VERBS = ["reference", "freeze", "candidate", "verify", "rounds", "sbatch", "report"]
GROUPS = {"manifest": ["create"], "matrices": ["list", "show", "validate"]}


def cli(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, list(args), env=env)


def flat(text: str) -> str:
    """Help text with rich's wrapping and box drawing folded away."""
    return " ".join(text.replace("│", " ").split())


def test_help_lists_every_command():
    result = cli("--help")
    assert result.exit_code == 0
    listed = {line.replace("│", " ").split()[0] for line in result.stdout.splitlines()
              if line.replace("│", " ").split()}
    assert set(VERBS) | set(GROUPS) <= listed


def test_no_arguments_shows_help_and_is_a_usage_error():
    result = cli()
    assert result.exit_code == EXIT_USAGE == 2
    text = flat(result.output)
    assert text.startswith("Usage: qualify [OPTIONS] COMMAND [ARGS]...") and all(v in text for v in VERBS)


@pytest.mark.parametrize("words", [[v] for v in VERBS] + [[g] for g in GROUPS]
                         + [[g, s] for g, subs in GROUPS.items() for s in subs], ids=" ".join)
def test_every_command_help_has_an_example(words):
    result = cli(*words, "--help")
    assert result.exit_code == 0, result.output
    text = flat(result.stdout)
    assert "Example" in text and f"qualify {words[0]}" in text.split("Example", 1)[1], text


def test_matrices_list():
    result = cli("matrices", "list", "--dir", str(MATRICES))
    assert result.exit_code == 0, result.output
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert [Path(r[0]).name for r in rows] == sorted(p.name for p in MATRICES.glob("*.yaml"))
    assert ["tiny-qwen3", "16 cases"] in [r[1:3] for r in rows]


def test_matrices_list_of_a_missing_directory(tmp_path):
    result = cli("matrices", "list", "--dir", str(tmp_path / "nope"))
    assert result.exit_code == 2 and "matrix directory not found" in result.stderr


def test_matrices_show_text_and_json():
    path = str(MATRICES / "tiny-qwen3.yaml")
    text = cli("matrices", "show", path)
    assert text.exit_code == 0 and "name: tiny-qwen3" in text.stdout and "- torch-tp-fp32-tp1-actor" in text.stdout
    doc = json.loads(cli("matrices", "show", path, "--format", "json").stdout)
    assert doc["name"] == "tiny-qwen3" and len(doc["cases"]) == 16
    assert doc["ppo"]["clip_eps"] == 0.2 and doc["reference"]["device"] == "auto"  # defaults filled in


EMBEDDED = sorted(p for p in MATRICES.rglob("*.yaml") if "checkpoints:" not in p.read_text())


@pytest.mark.parametrize("path", sorted(MATRICES.rglob("*.yaml")), ids=lambda p: str(p.relative_to(MATRICES)))
def test_every_shipped_matrix_validates_or_is_refused_with_the_reason(path):
    """Every matrix under matrices/ either runs here on the embedded models (validate says ok: it loads, every branch
    freeze.require names can be taken, what it names is here) or validate refuses it saying why: a matrix of real
    checkpoints on a machine that lacks them."""
    result = cli("matrices", "validate", str(path))
    if path in EMBEDDED:
        assert result.exit_code == 0 and result.stdout.startswith(f"ok {path} "), result.output
    else:
        assert result.exit_code == 2, result.output
        [line] = result.stderr.splitlines()
        assert line.startswith(f"qualify: error: {path}: cannot run on this machine, it lacks models.checkpoints.actor ")
        assert "(no config.json there)" in line


def test_matrices_validate(tmp_path):
    paths = [str(p) for p in EMBEDDED]
    good = cli("matrices", "validate", *paths)
    assert good.exit_code == 0 and good.stdout.count("ok ") == len(paths)
    bad = tmp_path / "bad.yaml"
    bad.write_text((MATRICES / "tiny-qwen3.yaml").read_text().replace("  repeats: 2", "  repeats: 2\n  repeat: 3"))
    result = cli("matrices", "validate", paths[0], str(bad))
    assert result.exit_code == 2
    assert result.stdout.startswith("ok ")
    [line] = result.stderr.splitlines()
    assert line.startswith("qualify: error: ") and str(bad) in line and "unknown key 'reference.repeat'" in line


def test_manifest_create_then_verify(tmp_path):
    evidence = tmp_path / "run" / "reference"
    (evidence / "actor").mkdir(parents=True)
    (evidence / "actor" / "grads.safetensors").write_bytes(b"\x01" * 4096)
    (evidence / "meta.json").write_text("{}\n")
    manifest = tmp_path / "run" / "reference.manifest.json"
    created = cli("manifest", "create", str(evidence), "--out", str(manifest))
    assert created.exit_code == 0, created.output
    assert created.stdout.startswith(f"{manifest}: 2 files, sha256:")

    assert cli("verify", str(manifest)).exit_code == 0
    (evidence / "actor" / "grads.safetensors").write_bytes(b"\x01" * 4095 + b"\x02")
    tampered = cli("verify", str(manifest))
    assert tampered.exit_code == 1 and "modified actor/grads.safetensors" in " ".join(tampered.stdout.split())


def test_paths_with_markup_characters_print_as_themselves(tmp_path):
    evidence = tmp_path / "ev"
    evidence.mkdir()
    manifest = tmp_path / "m.json"
    assert cli("manifest", "create", str(evidence), "--out", str(manifest)).exit_code == 0
    (evidence / "[bold]x[red].bin").write_bytes(b"x")
    result = cli("verify", str(manifest))
    assert result.exit_code == 1 and "extra    [bold]x[red].bin" in result.stdout


def test_qualify_error_is_one_line_and_exit_2(tmp_path):
    result = cli("verify", str(tmp_path / "absent.json"))
    assert result.exit_code == EXIT_USAGE == 2
    assert result.stderr == f"qualify: error: missing file: {tmp_path / 'absent.json'}\n"
    assert "Traceback" not in result.output


def test_qualify_debug_shows_the_traceback(tmp_path):
    result = cli("verify", str(tmp_path / "absent.json"), env={"QUALIFY_DEBUG": "1"})
    assert result.exit_code == 2
    assert "Traceback (most recent call last)" in result.stderr and "EvidenceError" in result.stderr
    assert result.stderr.rstrip().splitlines()[-1].startswith("qualify: error: missing file")


def test_matrix_error_through_a_command(tmp_path):
    bad = tmp_path / "m.yaml"
    bad.write_text("name: x\n")
    result = cli("matrices", "show", str(bad))
    assert result.exit_code == 2 and result.stderr.startswith(f"qualify: error: {bad}: missing field")


def throwaway_app(error: Exception) -> typer.Typer:
    """A two-command app whose command raises error through the shared handler."""
    demo = typer.Typer()

    @demo.command("boom")
    @handle_errors
    def boom() -> None:
        raise error

    @demo.command("fine")
    @handle_errors
    def fine() -> None:
        typer.echo("fine")

    return demo


@pytest.mark.parametrize("error, message", [
    (EngineError("unknown engine 'boom' (known: deepspeed, megatron, torch-tp)"),
     "unknown engine 'boom' (known: deepspeed, megatron, torch-tp)"),
    (MatrixError("m.yaml: unknown key 'x'"), "m.yaml: unknown key 'x'"),
    (EngineError("engine plugin 'p:f': calling f() failed: RuntimeError: \x1b[2J\x1b]0;pwned\x07\u202e"),
     "engine plugin 'p:f': calling f() failed: RuntimeError: \\x1b[2J\\x1b]0;pwned\\x07\\u202e"),
], ids=["unknown-engine", "matrix-key", "engine-message-with-control-characters"])
def test_handler_maps_qualify_errors_to_exit_2(error, message):
    demo = throwaway_app(error)
    result = CliRunner().invoke(demo, ["boom"])
    assert result.exit_code == 2 and result.stderr == f"qualify: error: {message}\n"
    assert CliRunner().invoke(demo, ["fine"]).stdout == "fine\n"


def test_handler_leaves_programmer_errors_alone():
    result = CliRunner().invoke(throwaway_app(KeyError("bug")), ["boom"])
    assert result.exit_code == 1 and isinstance(result.exception, KeyError)


@pytest.mark.parametrize("value, problem", [("0", "Input should be greater than or equal to 1"),
                                            ("two", "Input should be a valid integer")])
def test_bad_option_value_is_a_usage_error_naming_the_option(tmp_path, value, problem):
    evidence = tmp_path / "ev"
    evidence.mkdir()
    (evidence / "a.bin").write_bytes(b"a")
    manifest = tmp_path / "m.json"
    assert cli("manifest", "create", str(evidence), "--out", str(manifest)).exit_code == 0
    assert cli("verify", str(manifest), "--jobs", "1").exit_code == 0  # the same call with a good value passes
    result = cli("verify", str(manifest), "--jobs", value)
    assert result.exit_code == EXIT_USAGE == 2 and result.stdout == ""
    assert f"Invalid value for '--jobs': {problem}" in flat(result.stderr), result.stderr


def test_cli_import_stays_light():
    """`qualify verify` must start fast: importing the app pulls in no engine or tensor library."""
    heavy = ("torch", "vllm", "deepspeed", "transformers", "megatron", "safetensors")
    code = ("import sys, qualify.cli.app\n"
            f"print(' '.join(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == ""


@pytest.mark.parametrize("args, expect", [
    (["reference"], "Missing argument 'matrix'. (see 'qualify reference --help')"),
    (["verify", "--nope", "x"], "No such option: --nope (see 'qualify verify --help')"),
    (["verify", "m.json", "--jobs", "0"], "Invalid value for '--jobs'"),
    (["reference", "matrices/tiny-qwen3.yaml", "--run", "README.md"],
     "Invalid value for '--run': README.md is a file, not a run directory"),
    (["report", "README.md"], "README.md is a file, not a run directory (see 'qualify report --help')"),
])
def test_a_usage_error_from_the_console_is_one_line_and_exit_2(args, expect):
    """The console entry point (not CliRunner): a usage error is one line on stderr, as every bad input is."""
    out = subprocess.run([sys.executable, "-c", "from qualify.cli.entry import main; main()", *args],
                         capture_output=True, text=True, cwd=ROOT, check=False)
    assert out.returncode == 2 and out.stdout == ""
    [line] = out.stderr.splitlines()
    assert line.startswith("qualify: error: ") and expect in line, line
