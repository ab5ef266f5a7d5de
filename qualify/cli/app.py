"""The qualify Typer application: registers every command and maps errors to exit codes.

Exit codes: 0 pass, 1 a qualification or verification failed, 2 bad usage or input.
This is the one place where a QualifyError becomes a one-line message and exit 2
(QUALIFY_DEBUG=1 prints the traceback too).
"""

from __future__ import annotations

from typing import Any

import typer

from qualify.cli.handler import handle_errors

app = typer.Typer(
    name="qualify",
    help="Numerics qualification and acceptance harness for RL post-training (PPO/GRPO) stacks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def command(group: typer.Typer, module: Any) -> None:
    """Register a command module exposing NAME, HELP, EPILOG and main()."""
    group.command(name=module.NAME, help=module.HELP, epilog=module.EPILOG)(handle_errors(module.main))


def _register() -> None:
    from qualify.cli import candidate, freeze, manifest, matrices, reference, report, rounds, sbatch, verify

    for module in (reference, freeze, candidate, verify, rounds, sbatch, report):
        command(app, module)
    app.add_typer(manifest.app, name="manifest", help=manifest.HELP)
    app.add_typer(matrices.app, name="matrices", help=matrices.HELP)


_register()


def main() -> None:
    """Console entry point."""
    app()
