"""The engine-name policy: which names a matrix may give an engine (candidates.engines, rounds.engine). A built-in
name is one of qualify.engines.catalog's; any other must be a 'package.module:factory' plugin."""

from __future__ import annotations

import re

from qualify.engines.catalog import BUILTIN_ENGINES, DEEPSPEED_ENGINES, MEGATRON_ENGINES, UNPACKED_ENGINES

__all__ = ["BUILTIN_ENGINES", "DEEPSPEED_ENGINES", "MEGATRON_ENGINES", "UNPACKED_ENGINES", "engine_name_problem"]

# A plugin engine is 'package.module:factory'; case names and directories are made from it.
_PLUGIN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")


def engine_name_problem(name: str) -> str | None:
    """Why name is not an engine a matrix may name (None: a built-in name or a 'package.module:factory' plugin).
    The one check of engine names: the matrix's sections and the registry use it."""
    if name in BUILTIN_ENGINES or _PLUGIN.fullmatch(name):
        return None
    return (f"unknown engine {name!r} (known: {', '.join(sorted(BUILTIN_ENGINES))}; "
            "or 'package.module:factory' for a plugin)")
