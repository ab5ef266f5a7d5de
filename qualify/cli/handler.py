"""The one place where a QualifyError becomes a one-line message and exit 2.

One line means one line: a message that spans several (an error quoting a child's output, say)
is folded onto one, and a very long one is cut in the middle, keeping its start and its end; the control
characters of what it quotes (an engine's exception) are escaped (qualify.childlog.printable).
"""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Callable
from typing import Any

import typer

from qualify.childlog import printable
from qualify.errors import QualifyError

EXIT_FAILED = 1
EXIT_USAGE = 2
MAX_MESSAGE = 1000


def one_line(message: str) -> str:
    """message folded onto one line (' | ' between its non-blank lines), at most MAX_MESSAGE characters."""
    text = " | ".join(line.strip() for line in message.splitlines() if line.strip())
    if len(text) > MAX_MESSAGE:
        half = MAX_MESSAGE // 2 - 3
        text = f"{text[:half]} ... {text[-half:]}"
    return text


def handle_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn QualifyError raised by a command into one line on stderr and exit 2."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except QualifyError as exc:
            if os.environ.get("QUALIFY_DEBUG") == "1":
                traceback.print_exc()
            typer.echo(f"qualify: error: {printable(one_line(str(exc)))}", err=True)
            raise typer.Exit(EXIT_USAGE) from None

    return wrapper
