"""The qualify Typer application: registers the commands and maps errors to exit codes.

Exit codes: 0 pass, 1 a qualification or verification failed, 2 bad usage or input.
This is the one place where a QualifyError becomes a one-line message and exit 2
(QUALIFY_DEBUG=1 prints the traceback too).

Commands are registered lazily: `qualify verify ...` imports the verify command alone (a CI job
that verifies thousands of small files should not pay for every other command's imports), while
`qualify --help` and `from qualify.cli.app import app` get all of them.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import typer

from qualify.cli.handler import handle_errors

COMMANDS = ("reference", "freeze", "candidate", "verify", "rounds", "sbatch", "report", "diagnose")
"""Single commands: qualify/cli/<name>.py exposing NAME, HELP, EPILOG and main()."""
GROUPS = ("manifest", "matrices")
"""Command groups: qualify/cli/<name>.py exposing a Typer `app` and HELP."""
HELP = "Numerics qualification and acceptance harness for RL post-training (PPO/GRPO) stacks."


def command(group: typer.Typer, module: Any) -> None:
    """Register a command module exposing NAME, HELP, EPILOG and main()."""
    group.command(name=module.NAME, help=module.HELP, epilog=module.EPILOG)(handle_errors(module.main))


def build_app(only: str | None = None) -> typer.Typer:
    """The app with every command, or with the one named `only` (its usage and errors are the same)."""
    app = typer.Typer(name="qualify", help=HELP, no_args_is_help=True, add_completion=False,
                      pretty_exceptions_enable=False, rich_markup_mode="rich")

    @app.callback()
    def root() -> None:  # a callback keeps `qualify <command>` a group even when one command is registered
        pass

    for name in COMMANDS:
        if only in (None, name):
            command(app, importlib.import_module(f"qualify.cli.{name}"))
    for name in GROUPS:
        if only in (None, name):
            module = importlib.import_module(f"qualify.cli.{name}")
            app.add_typer(module.app, name=name, help=module.HELP)
    return app


def __getattr__(name: str) -> Any:
    """`app`: the full application, built on first use (tests, CliRunner)."""
    if name == "app":
        app = build_app()
        globals()["app"] = app
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    """Console entry point: registers only the command named first on the command line, when it names one."""
    first = sys.argv[1] if len(sys.argv) > 1 else None
    build_app(first if first in COMMANDS + GROUPS else None)()
