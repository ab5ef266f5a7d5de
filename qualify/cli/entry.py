"""The `qualify` console entry point: a fast path for a piped `qualify verify`, the Typer app for everything else.

A CI job that verifies ten thousand small files pays, before hashing anything, for Typer (which
imports pydantic) and rich: about a third of the whole run. When `qualify verify` is piped (no
terminal: rich would print plain text anyway) and its arguments are the Typer command's
(VALUE_OPTIONS, FLAG_OPTIONS), well formed, this path verifies with the same library call and prints the same
lines (qualify.cli.verify_text) without importing either. Anything else (a terminal, --help, an
option it does not know, a signature to check, a malformed value, an error while verifying) goes to
the Typer command, which says what is wrong exactly as it always does.
"""

from __future__ import annotations

import sys

VALUE_OPTIONS = ("--evidence", "--format", "--jobs", "--expect")
FLAG_OPTIONS = ("--partial",)


def parse_verify(args: list[str]) -> dict | None:
    """The verify command's arguments, or None when they are anything but plain and valid."""
    values: dict = {"manifest": None, "--evidence": None, "--format": "text", "--jobs": None, "--partial": False,
                    "--expect": None}
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, inline = arg.partition("=")
        if name in VALUE_OPTIONS:
            if eq:
                value = inline
            elif i + 1 < len(args):
                i += 1
                value = args[i]
            else:
                return None
            values[name] = value
        elif arg in FLAG_OPTIONS:
            values[arg] = True
        elif arg.startswith("-") or values["manifest"] is not None:
            return None
        else:
            values["manifest"] = arg
        i += 1
    if values["manifest"] is None or values["--format"] not in ("text", "json"):
        return None
    if values["--jobs"] is not None:
        if not values["--jobs"].isdigit() or int(values["--jobs"]) < 1:
            return None
        values["--jobs"] = int(values["--jobs"])
    return values


def fast_verify(args: list[str]) -> int | None:
    """Run a piped `qualify verify` without Typer or rich; None to hand it to the Typer command."""
    if sys.stdout.isatty():
        return None
    values = parse_verify(args)
    if values is None:
        return None
    from qualify.acceptance import verify_evidence

    try:
        report = verify_evidence(values["manifest"], values["--evidence"], jobs=values["--jobs"],
                                 partial=values["--partial"], expect=values["--expect"])
    except (ValueError, OSError):  # QualifyError is a ValueError: the Typer command repeats the call and says it
        return None
    if values["--format"] == "json":
        import json

        sys.stdout.write(json.dumps(report.to_json(), indent=2, sort_keys=True) + "\n")
    else:
        from qualify.cli.verify_text import verify_lines

        sys.stdout.write("".join(f"{tag} {text}\n" for _, tag, text in verify_lines(report)))
    return 0 if report.ok else 1


def main() -> None:
    """Console entry point."""
    if len(sys.argv) > 1 and sys.argv[1] == "verify":
        code = fast_verify(sys.argv[2:])
        if code is not None:
            sys.stdout.flush()
            sys.exit(code)
    from qualify.cli.app import main as typer_main

    typer_main()
