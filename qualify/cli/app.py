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

COMMANDS = ("reference", "freeze", "candidate", "verify", "sign", "rounds", "sbatch", "report", "diagnose")
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
    """Console entry point: registers only the command named first on the command line, when it names one. A usage
    error (a missing argument, an unknown option, a bad value) is one line on stderr and exit 2, as every other
    error of bad input is; asking for help (or giving no command) prints the help."""
    from typer.main import get_command

    from qualify.cli.handler import one_line

    try:  # typer >= 0.25 carries its own copy of click
        from typer._click import exceptions as click
        from typer._click.utils import echo
    except ImportError:  # pragma: no cover (an older typer on the plain click)
        from click import echo  # type: ignore[no-redef]
        from click import exceptions as click

    first = sys.argv[1] if len(sys.argv) > 1 else None
    cli = get_command(build_app(first if first in COMMANDS + GROUPS else None))
    try:
        code = cli.main(prog_name="qualify", standalone_mode=False)
    except click.NoArgsIsHelpError:  # 'qualify' alone, or a group alone: typer printed its help
        sys.exit(2)
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx else "qualify"
        echo(f"qualify: error: {one_line(exc.format_message())} (see '{where} --help')", err=True)
        sys.exit(2)
    except typer.Abort:
        echo("qualify: aborted", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
