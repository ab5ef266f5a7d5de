"""The one place where a QualifyError becomes a one-line message and exit 2."""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Callable
from typing import Any

import typer

from qualify.errors import QualifyError

EXIT_FAILED = 1
EXIT_USAGE = 2


def handle_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn QualifyError raised by a command into one line on stderr and exit 2."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except QualifyError as exc:
            if os.environ.get("QUALIFY_DEBUG") == "1":
                traceback.print_exc()
            typer.echo(f"qualify: error: {exc}", err=True)
            raise typer.Exit(EXIT_USAGE) from None

    return wrapper
