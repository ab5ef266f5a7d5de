"""The GPU probes a one-GPU user runs (benchmarks/scale_probe.py, benchmarks/mfu_probe.py) run as written: here on the
CPU (--device cpu) against the embedded default's frozen run, so an API change in qualify cannot leave them broken
until they next run on a GPU (both had been: found on an H200)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

pytestmark = [pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
ROLLOUT = REPO / "manifests" / "tiny-qwen3" / "reference" / "rollout"


def probe(script: str, frozen_run: Path, out: Path, *extra: str) -> dict:
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), str(REPO / "matrices" / "tiny-qwen3.yaml"),
                           str(frozen_run), str(out), "--rollout", str(ROLLOUT), "--device", "cpu", *extra],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def actor_parameters(frozen_run: Path) -> int:
    with safe_open(str(frozen_run / "reference" / "models" / "actor" / "model.safetensors"), framework="pt") as f:
        return sum(f.get_tensor(k).numel() for k in f.keys())  # noqa: SIM118


def rollout_tokens() -> int:
    with safe_open(str(ROLLOUT / "tp1" / "rollout.safetensors"), framework="pt") as f:
        return f.get_tensor("input_ids_BT").numel()


def test_scale_probe_runs_and_counts_four_fp32_copies_a_step(frozen_run, tmp_path):
    doc = probe("scale_probe.py", frozen_run, tmp_path / "scale.json", "--configs", "bf16,fp32-host")
    params = actor_parameters(frozen_run)
    assert doc["params"] == params and doc["tokens"] == rollout_tokens()
    assert set(doc["configs"]) == {"bf16", "fp32-host"}
    for row in doc["configs"].values():
        # gradients, update and the two AdamW moments, fp32, of every parameter: the evidence of one step
        assert row["evidence_bytes_per_step"] == 16 * params
        assert row["fwd_bwd_s"] > 0 and row["tokens_per_s"] == pytest.approx(doc["tokens"] / row["fwd_bwd_s"], rel=0.01)


def test_mfu_probe_runs_and_splits_the_step_by_kind(frozen_run, tmp_path):
    doc = probe("mfu_probe.py", frozen_run, tmp_path / "mfu.json")
    assert doc["params"] == actor_parameters(frozen_run) and doc["tokens"] == rollout_tokens()
    kinds = doc["by_kind_s"]
    assert kinds and abs(sum(kinds.values()) - doc["gpu_busy_s"]) <= 1e-3 * len(kinds)
    assert kinds.get("gemm", 0) > 0  # the matrix multiplications are found (aten::mm on the CPU)
    assert doc["top_kernels"] and doc["kernels"] >= len(doc["top_kernels"])
