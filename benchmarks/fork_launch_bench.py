"""CPU candidate launches: ranks forked from a warm process against fresh interpreters, side by side in one run.

Usage: python benchmarks/fork_launch_bench.py MATRIX RUN_DIR [--only GLOB] [--repeats N]
  RUN_DIR must hold a frozen reference (qualify reference + qualify freeze). For each repeat, `qualify candidate
  MATRIX --run RUN_DIR [--only GLOB]` runs once with QUALIFY_LAUNCHER=direct and once with QUALIFY_LAUNCHER=fork (the
  CPU default), the candidates directory removed before each; printed per run: the whole command's wall time and the
  launches' time (the stage log's 'cases ... done in' lines), then the ratios, and whether every sealed tensor file of
  the two launchers' cases is byte for byte the same.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

DONE = re.compile(r"\[candidate\] cases .*: done in ([0-9.]+) s")


def digests(candidates: Path) -> dict[str, str]:
    return {str(p.relative_to(candidates)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(candidates.rglob("*.safetensors"))}


def run_once(matrix: str, run: Path, only: str | None, launcher: str) -> tuple[float, float, dict[str, str]]:
    shutil.rmtree(run / "candidates", ignore_errors=True)
    cmd = [sys.executable, "-c", "import sys; from qualify.cli.app import main; sys.argv[0] = 'qualify'; main()",
           "candidate", matrix, "--run", str(run)] + (["--only", only] if only else [])
    env = dict(os.environ, QUALIFY_LAUNCHER=launcher)
    started = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.monotonic() - started
    if done.returncode not in (0, 1):
        raise SystemExit(f"{launcher}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    launches = sum(float(m) for m in DONE.findall(done.stdout + done.stderr))
    return wall, launches, digests(run / "candidates")


def main() -> None:
    args = sys.argv[1:]
    only = args[args.index("--only") + 1] if "--only" in args else None
    repeats = int(args[args.index("--repeats") + 1]) if "--repeats" in args else 2
    matrix, run = args[0], Path(args[1])
    results: dict[str, list[tuple[float, float]]] = {"direct": [], "fork": []}
    same = True
    for i in range(repeats):
        seen = {}
        for launcher in ("direct", "fork"):
            wall, launches, files = run_once(matrix, run, only, launcher)
            results[launcher].append((wall, launches))
            seen[launcher] = files
            print(f"repeat {i} {launcher:6s}: command {wall:7.1f} s, launches {launches:7.1f} s, "
                  f"{len(files)} tensor files", flush=True)
        same = same and seen["direct"] == seen["fork"] and bool(seen["fork"])
    mean = {k: (sum(w for w, _ in v) / len(v), sum(lt for _, lt in v) / len(v)) for k, v in results.items()}
    print(f"mean direct: command {mean['direct'][0]:.1f} s, launches {mean['direct'][1]:.1f} s")
    print(f"mean fork:   command {mean['fork'][0]:.1f} s, launches {mean['fork'][1]:.1f} s")
    print(f"ratio direct/fork: command {mean['direct'][0] / mean['fork'][0]:.2f}x, "
          f"launches {mean['direct'][1] / mean['fork'][1]:.2f}x")
    print(f"sealed tensors byte for byte the same under both launchers: {same}")


if __name__ == "__main__":
    main()
