"""A fresh reference run against the committed acceptance of the embedded default.

Reports which artifacts reproduce bit for bit. The set of artifacts must be the same and the
rollout tensors must reproduce (same seeds, same vLLM, same machine kind); other artifacts that do
not reproduce bitwise are listed, not failed: metadata carries timings and provenance, and numbers
are what moves between machines and versions.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from qualify.layout import RunLayout
from qualify.manifest import verify_manifest

pytestmark = pytest.mark.vllm
COMMITTED = Path(__file__).resolve().parents[2] / "manifests" / "tiny-qwen3" / "acceptance.json"


def test_fresh_reference_against_committed_acceptance(frozen_run, capsys):
    report = verify_manifest(COMMITTED, RunLayout(frozen_run).reference, progress=False)
    reproduced = report.num_files - len(report.missing) - len(report.modified)
    with capsys.disabled():
        print(f"\ncommitted acceptance {COMMITTED.name}: {reproduced}/{report.num_files} artifacts reproduce bit for bit")
        for m in report.modified:
            print(f"  differs: {m.path}")
    assert not report.missing and not report.extra, (report.missing, report.extra)
    # metadata (timings, host, git) may differ; the sampled tokens and logprobs must not
    assert not any(m.path.startswith("rollout/") and m.path.endswith(".safetensors") for m in report.modified)
