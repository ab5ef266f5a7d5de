"""How sharp the frozen bounds of an acceptance are: per bound file, how often the floor (not k x control error) sets a
bound, the median bound / control error, and the logprob and gradient bounds a reader compares with PPO's clip range.

    python benchmarks/bound_sharpness.py RUN_DIR [RUN_DIR ...]   (each a run or a committed acceptance's directory)

Prints one table per run, side by side in one invocation, so two rules can be compared on the same reference.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def summarize(bounds_dir: Path) -> list[tuple]:
    out = []
    for f in sorted(bounds_dir.glob("*.json")):
        doc = json.loads(f.read_text())
        k = doc["k"]
        entries = [(key, m, b) for key, ms in doc["bounds"].items() for m, b in ms.items()]
        floor_sets = sum(b["floor"] > k * b["control_error"] for _, _, b in entries)
        ratios = [b["bound"] / b["control_error"] for _, _, b in entries if b["control_error"] > 0]
        lp = [b["bound"] for key, m, b in entries if key.endswith("outputs/logprobs_BT") and m == "max_abs"]
        lp_mean = [b["bound"] for key, m, b in entries if key.endswith("outputs/logprobs_BT") and m == "mean_abs"]
        rel = [b["bound"] for key, m, b in entries if "/grads/" in key and m == "rel_l2"]
        out.append((f.stem, len(entries), floor_sets, statistics.median(ratios) if ratios else float("nan"),
                    max(lp) if lp else float("nan"), max(lp_mean) if lp_mean else float("nan"),
                    statistics.median(rel) if rel else float("nan")))
    return out


def main(paths: list[str]) -> None:
    for p in paths:
        root = Path(p)
        bounds = next(d for d in (root / "acceptance" / "bounds", root / "bounds") if d.is_dir())
        print(f"\n{root}")
        print(f"{'family':22s} {'entries':>7s} {'floor sets':>10s} {'median bound/ctrl':>17s} "
              f"{'logprob max_abs':>15s} {'logprob mean_abs':>16s} {'grad rel_l2 median':>18s}")
        for name, n, floors, med, lp, lpm, rel in summarize(bounds):
            print(f"{name:22s} {n:7d} {floors:10d} {med:17.2f} {lp:15.3g} {lpm:16.3g} {rel:18.3g}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["manifests/tiny-qwen3"])
