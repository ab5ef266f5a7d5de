"""Benchmark `qualify verify` against `sha256sum -c` and a parallel `find | xargs -P sha256sum`.

Two data sets in one temp dir: (a) 4 files of 256 MiB, (b) 10,000 files of 16 KiB. Each tool
runs on the same warm (page-cached) files; every measurement is repeated and the median kept.
The real CLI is timed (`.venv/bin/qualify`, Python start-up and imports included).

    .venv/bin/python benchmarks/verify_bench.py [--repeats 7] [--dir /tmp] [--keep] [--reuse DIR] [--sets ab]

Ratios are throughput ratios on the median wall times: qualify vs single = t(sha256sum -c) / t(qualify),
qualify vs parallel = t(xargs -P) / t(qualify); above 1 means qualify is faster.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20
SETS = {"a": (4, 256 * MiB, 1), "b": (10_000, 16 << 10, 100)}  # name -> (num_files, bytes each, num_dirs)
QUALIFY = Path(sys.executable).parent / "qualify"


def make_files(root: Path, num_files: int, size: int, num_dirs: int) -> None:
    """num_files random files of size bytes spread over num_dirs directories."""
    for d in range(num_dirs):
        (root / f"d{d:03d}").mkdir(parents=True)
    block = os.urandom(min(size, 64 * MiB))
    for i in range(num_files):
        path = root / f"d{i % num_dirs:03d}" / f"f{i:05d}.bin"
        with open(path, "wb") as handle:
            # every file differs: a unique prefix, then the shared random block repeated
            handle.write(i.to_bytes(8, "little"))
            written = 8
            while written < size:
                n = min(len(block), size - written)
                handle.write(block[:n])
                written += n


def prepare(work: Path, name: str) -> tuple[Path, Path, Path, int]:
    """Make one data set (unless work already has it) with its qualify manifest and sha256sum list."""
    num_files, size, num_dirs = SETS[name]
    data = work / name / "data"
    manifest = work / name / "manifest.json"
    sums = work / name / "SHA256SUMS"
    if not sums.is_file():
        make_files(data, num_files, size, num_dirs)
        subprocess.run([str(QUALIFY), "manifest", "create", str(data), "--out", str(manifest)], check=True,
                       stdout=subprocess.DEVNULL)
        with open(sums, "wb") as out:
            subprocess.run("find . -type f -print0 | sort -z | xargs -0 sha256sum", shell=True, cwd=data,
                           check=True, stdout=out)
    return data, manifest, sums, num_files * size


def commands(data: Path, manifest: Path, sums: Path, num_files: int) -> dict[str, str]:
    """The three commands, as shell lines run in the data directory."""
    nproc = os.cpu_count() or 1
    per_proc = -(-num_files // nproc)  # split the files evenly so every core gets work (xargs -n)
    return {
        "qualify": f"{shlex.quote(str(QUALIFY))} verify {shlex.quote(str(manifest))} --evidence .",
        "single": f"sha256sum --quiet -c {shlex.quote(str(sums))}",
        "parallel": f"find . -type f -print0 | xargs -0 -P{nproc} -n{per_proc} sha256sum > /dev/null",
    }


def time_once(line: str, cwd: Path) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + sys of the command and its children)."""
    before = os.times()
    start = time.perf_counter()
    done = subprocess.run(line, shell=True, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    elapsed = time.perf_counter() - start
    after = os.times()
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {line}\n{done.stderr.decode()}")
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return elapsed, cpu


def measure(lines: dict[str, str], cwd: Path, repeats: int) -> dict[str, tuple[float, float, float]]:
    """Per command: median wall, best wall and median CPU seconds. The commands are interleaved so
    that load from other processes hits all of them alike."""
    for line in lines.values():
        time_once(line, cwd)  # warm the page cache and the interpreter's .pyc files
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in lines}
    for _ in range(repeats):
        for key, line in lines.items():
            samples[key].append(time_once(line, cwd))
    return {k: (statistics.median(w for w, _ in v), min(w for w, _ in v), statistics.median(c for _, c in v))
            for k, v in samples.items()}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", type=Path, default=None, help="parent of the temp dir (default: system temp)")
    parser.add_argument("--reuse", type=Path, default=None, help="a directory kept by an earlier --keep run")
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    parser.add_argument("--sets", default="ab", help="which data sets to run: a, b or ab")
    args = parser.parse_args()
    work = args.reuse or Path(tempfile.mkdtemp(prefix="verify-bench-", dir=args.dir))
    sha = subprocess.run(["sha256sum", "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    print(f"machine: nproc={os.cpu_count()}, cpu={cpu_model()}, python={sys.version.split()[0]}, {sha}, "
          f"load average before: {os.getloadavg()[0]:.2f}")
    print("| set | MiB | qualify s (best) | sha256sum -c s (best) | xargs -P s (best) | qualify vs single "
          "| qualify vs parallel | CPU s: qualify / single / parallel |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    try:
        for name in args.sets:
            num_files, size, _ = SETS[name]
            data, manifest, sums, total = prepare(work, name)
            t = measure(commands(data, manifest, sums, num_files), data, args.repeats)
            q, s1, par = t["qualify"], t["single"], t["parallel"]
            print(f"| ({name}) {num_files} x {size >> 10} KiB | {total / MiB:.0f} | {q[0]:.3f} ({q[1]:.3f}) | "
                  f"{s1[0]:.3f} ({s1[1]:.3f}) | {par[0]:.3f} ({par[1]:.3f}) | {s1[0] / q[0]:.2f}x | "
                  f"{par[0] / q[0]:.2f}x | {q[2]:.2f} / {s1[2]:.2f} / {par[2]:.2f} |", flush=True)
    finally:
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        if args.keep or args.reuse:
            print(f"kept {work}")
        else:
            shutil.rmtree(work)


if __name__ == "__main__":
    main()
