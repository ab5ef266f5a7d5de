"""Commands whose stage is not built yet say so plainly and exit 2."""

from qualify.errors import NotBuiltError


def not_built(verb: str) -> None:
    raise NotBuiltError(f"'qualify {verb}' is not built yet in this version")
