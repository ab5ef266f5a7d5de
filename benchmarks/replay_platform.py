"""Replay the committed acceptance on this machine's platform and print how it judges.

Scores the HF reference of the embedded default from the committed rollout (`run_reference(...,
rollout=manifests/tiny-qwen3/reference/rollout)`), then judges it against the committed acceptance
with qualify.replay: bitwise where this platform and the numerics versions are the acceptance's and the
bytes reproduce, within the committed bounds where they are not (or where bytes differ under a matching
fingerprint: mode 'bounds (fingerprint matched, bytes differ)'). Prints the platform on both sides, the mode,
the differences that decided it, the files whose bytes differed, the closest value/bound and every failing row;
writes the same as JSON to OUT_DIR/replay-<device>.json.
Usage: python benchmarks/replay_platform.py OUT_DIR   (CUDA_VISIBLE_DEVICES= keeps the reference on the CPU)
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qualify.hardware import describe, platform_fingerprint
from qualify.layout import RunLayout
from qualify.matrix import load_matrix
from qualify.reference.stage import run_reference
from qualify.replay import judge_replay
from qualify.store import read_json

COMMITTED = REPO / "manifests" / "tiny-qwen3"


def main(out: Path) -> int:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    acceptance = COMMITTED / "acceptance" / "acceptance.json"
    run = Path(tempfile.mkdtemp(prefix="qualify-replay-")) / "tiny-qwen3"
    started = time.monotonic()
    run_reference(load_matrix(REPO / "matrices" / "tiny-qwen3.yaml"), run, rollout=COMMITTED / "reference" / "rollout")
    scored = time.monotonic() - started
    result = judge_replay(acceptance, run)
    judged = [r for r in result.rows if r.bound > 0]
    closest = max(judged, key=lambda r: r.ratio, default=None)
    doc = {"device": device, "acceptance_platform": read_json(acceptance).get("platform"),
           "platform": read_json(RunLayout(run).reference_summary)["platform"], "mode": result.mode,
           "differences": result.differences, "bytes_differ": result.bytes_differ, "passed": result.passed, "num_checks": len(result.rows),
           "failing": [r.to_json() for r in result.rows if not r.passed],
           "closest": closest.to_json() if closest else None, "info": result.info, "score_seconds": round(scored, 1)}
    print(f"acceptance frozen on: {describe(doc['acceptance_platform'])}")
    print(f"replayed on ({device}):  {describe(platform_fingerprint())}")
    print(f"mode {result.mode}; differences: {'; '.join(result.differences) or 'none'}")
    if result.bytes_differ:
        print(f"fingerprint matched, bytes differ in {len(result.bytes_differ)} file(s), judged within the bounds: "
              f"{', '.join(result.bytes_differ)}")
    print(f"{'PASSED' if result.passed else 'FAILED'}: {len(result.rows)} checks, {len(doc['failing'])} failing; "
          f"reference scored in {scored:.1f} s")
    if closest:
        print(f"closest value/bound {closest.ratio:.3f}: {closest.comparison} {closest.tensor} {closest.metric} "
              f"{closest.value:.3g} <= {closest.bound:.3g}")
    for run, d in sorted(result.info.get("decisions", {}).items()):
        if d["tokens_decided_otherwise"]:
            print(f"decided otherwise: {run}: tokens per step {d['tokens_decided_otherwise']}; {d['replay']}")
    for row in doc["failing"][:20]:
        print(f"  FAIL {row['comparison']} {row['tensor']} {row['metric']} {row['value']} > {row['bound']}")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"replay-{device}.json").write_text(json.dumps(doc, indent=2, sort_keys=True, default=str))
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
