"""The reference's evidence kept as summaries vs in full (reference.evidence), side by side in one run.

The same matrix (default: the embedded default) is scored twice from one committed rollout, once per mode, each in
its own run directory, then frozen: evidence bytes, the reference's and freeze's wall time of each, the ratios,
and whether the bound files are byte-identical. The real CLI runs (`.venv/bin/qualify`).

    .venv/bin/python benchmarks/evidence_bench.py [--matrix matrices/tiny-qwen3.yaml]
        [--rollout manifests/tiny-qwen3/reference/rollout] [--dir /tmp] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
QUALIFY = Path(sys.executable).parent / "qualify"


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def timed(args: list[str]) -> float:
    """Wall seconds of one CLI call; raises on failure."""
    env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1"}
    start = time.perf_counter()
    subprocess.run([str(QUALIFY), *args], check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrix", default=str(REPO / "matrices" / "tiny-qwen3.yaml"))
    parser.add_argument("--rollout", default=str(REPO / "manifests" / "tiny-qwen3" / "reference" / "rollout"))
    parser.add_argument("--dir", default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="evidence-bench-", dir=args.dir))
    results = {}
    try:
        for mode in ("summary", "full"):
            data = yaml.safe_load(Path(args.matrix).read_text())
            data["reference"]["evidence"] = mode
            matrix = work / f"{mode}.yaml"
            matrix.write_text(yaml.safe_dump(data))
            run = work / mode
            ref_s = timed(["reference", str(matrix), "--run", str(run), "--rollout", args.rollout])
            freeze_s = timed(["freeze", str(run)])
            results[mode] = {"run": run, "bytes": tree_bytes(run / "reference"), "reference_s": ref_s,
                             "freeze_s": freeze_s}
            print(f"{mode:8s} evidence {results[mode]['bytes'] / 1e6:9.1f} MB  reference {ref_s:7.1f} s  "
                  f"freeze {freeze_s:6.1f} s", flush=True)
        s, f = results["summary"], results["full"]
        print(f"ratios (full / summary): evidence {f['bytes'] / s['bytes']:.1f}x, reference time "
              f"{f['reference_s'] / s['reference_s']:.2f}x, freeze time {f['freeze_s'] / s['freeze_s']:.2f}x")
        same = []
        for sub in ("bounds", "layers"):
            for path in sorted((s["run"] / "acceptance" / sub).glob("*.json")):
                same.append(path.read_bytes() == (f["run"] / "acceptance" / sub / path.name).read_bytes())
        print(f"bound files byte-identical: {sum(same)}/{len(same)}")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
