"""Where a stage's time goes: one `qualify` command run in this process under cProfile, the functions that took the
most time (cumulative and own) written to OUT.txt and the raw profile to OUT.prof. On a GPU the time of queued
kernels is charged to the call that waited for them (a copy to the host, .item()).

Usage: python benchmarks/profile_stage.py OUT -- reference MATRIX --run RUN [--rollout DIR]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    out, command = argv[0], argv[2:]
    from qualify.cli.app import main as qualify_main

    sys.argv = ["qualify", *command]
    profile = cProfile.Profile()
    started = time.monotonic()
    code = 0
    profile.enable()
    try:
        qualify_main()
    except SystemExit as exc:  # typer exits when the command ends
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        profile.disable()
    wall = time.monotonic() - started
    profile.dump_stats(f"{out}.prof")
    text = io.StringIO()
    text.write(f"qualify {' '.join(command)}: exit {code}, {wall:.1f} s\n")
    for key in ("cumulative", "tottime"):
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats(key).print_stats(45)
    with open(f"{out}.txt", "w") as f:
        f.write(text.getvalue())
    print(f"{out}.txt: exit {code}, {wall:.1f} s")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
