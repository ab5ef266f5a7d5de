"""The shipped GPU exact engine (qualify.examples.vllm_gpu_exact) with one bug each that seed 002's review names
(named 'tests.integration.exact_gpu_plugins:<factory>'). Declared rollout_exact by benchmarks/gpu-tiny-exact.yaml,
each but settings_too_late must fail the exact tier's row (comparison 'rollout', tensor step0/outputs/logprobs_BT),
naming how many tokens differ; measured on one H200 (benchmarks/gpu_vllm_chain.sh exact, BENCHMARKS.md).

  logsumexp_branch    the logprobs as z - logsumexp(z) (fp32) instead of the sampler's log_softmax
  bf16_branch         log_softmax computed in bf16
  fused_path          each token's logprob from an online logsumexp over vocabulary chunks (a fused path that skips
                      the sampler formula)
  norm_not_routed     RMSNorm (alone and fused with the residual add) in torch, not through vLLM's kernels
  settings_too_late   vLLM's batch-invariant cuBLAS settings put in place after this process's first GEMM (passes:
                      in the mode this engine's GEMMs are vLLM's Triton matmul, which those settings do not reach)
  cublas_gemms        every GEMM by cuBLAS (F.linear), as a trainer's that does not route them through vLLM's matmul,
                      with the settings in place before its first GEMM: the correct twin of the layout tier
  cublas_settings_too_late  cublas_gemms with the settings put in place after one GEMM, declared layout_invariant
                      (benchmarks/gpu-wide-exact.yaml): passes on one H200 with torch 2.11 (see below)
  cublas_settings_left_out  cublas_gemms with none of the settings, declared layout_invariant: must fail the layout
                      tier (comparison 'layout', step0/outputs/logprobs_BT) where cuBLAS's kernel follows the row count

Measured (one H200, benchmarks/gpu-tiny-exact.yaml, 2026-12-03, b63c60b): the engine itself gives 0 of 192; each bug moves
the rollout row off 0: the bf16 branch (192 of 192, max 0.0156), norm_not_routed (192, max 0.045), fused_path (54,
one fp32 step) and logsumexp_branch (19, one fp32 step). settings_too_late passes (0 of 192), which is the right
verdict for this engine: in batch-invariant mode it computes every GEMM with vLLM's Triton matmul, as vLLM's own linear
layers do, and no cuBLAS setting reaches it. The failure seed 002's review names belongs to a trainer whose GEMMs are
cuBLAS's; it is kept as the record that this engine is immune to it.

At Qwen3-0.6B widths (benchmarks/gpu-wide-exact.yaml, one H200, 2026-12-04, b3b7433) the cuBLAS twins are layout-invariant with
the settings in time and also put in place after a first GEMM (cublas_settings_too_late passes): torch reads the
settings that decide it at each GEMM or at cuBLASLt's first use, after them here
(benchmarks/cublas_settings_probe.py). Without them at all, a K = 3072 GEMM's rows follow the row count (242 of 320
rows at micro-batch 1), and torch-tp's HF forward, which puts none in place, is not layout-invariant there (189 of 192
tokens at micro-batch 1). cublas_settings_left_out fails the layout tier there (at 6cfdf1e: 191 of 192 tokens at
micro-batch 1, max 0.00975; micro-batch 4 and the reversed order 0).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from qualify.engines.base import EngineContext
from qualify.examples.vllm_gpu_exact import (
    Kernels,
    RolloutMode,
    VllmGpuExactEngine,
    torch_add_rms_norm,
    torch_rms_norm,
    vllm_kernels,
)
from tests.integration import exact_plugins


class Formula(VllmGpuExactEngine):
    """The exact engine with its own log-softmax in the sampler formula (in place of the rollout's logprob kernel, the
    V2 runner's too)."""

    def log_softmax(self, z: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def make_kernels(self, mode: RolloutMode) -> Kernels:
        return replace(vllm_kernels(mode), log_softmax=self.log_softmax, token_logprobs=None)


class LogsumexpBranch(Formula):
    def log_softmax(self, z: torch.Tensor) -> torch.Tensor:
        return exact_plugins.LogsumexpBranch.formula(self, z)


class Bf16Branch(Formula):
    def log_softmax(self, z: torch.Tensor) -> torch.Tensor:
        return exact_plugins.Bf16Branch.formula(self, z).float()


class FusedPath(Formula):
    """The CPU twin's online logsumexp over vocabulary chunks (tests/integration/exact_plugins.py)."""

    CHUNK = exact_plugins.FusedPath.CHUNK

    def log_softmax(self, z: torch.Tensor) -> torch.Tensor:
        return exact_plugins.FusedPath.formula(self, z)


class NormNotRouted(VllmGpuExactEngine):
    def make_kernels(self, mode: RolloutMode) -> Kernels:
        return replace(vllm_kernels(mode), rms_norm=torch_rms_norm, add_rms_norm=torch_add_rms_norm)


def first_gemm(device: str) -> None:
    """One cuBLAS GEMM: cuBLAS starts here, with the workspace sizes the environment gives it now."""
    if device.startswith("cuda"):
        a = torch.ones(64, 64, dtype=torch.bfloat16, device=device)
        (a @ a).sum().item()


class SettingsTooLate(VllmGpuExactEngine):
    """A GEMM runs (cuBLAS starts) before the mode's settings are put in place."""

    def setup(self, ctx: EngineContext) -> None:
        first_gemm(ctx.device)
        super().setup(ctx)


def cublas_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


class CublasGemms(VllmGpuExactEngine):
    """The exact engine with every GEMM (the LM head's too) by cuBLAS rather than vLLM's batch-invariant matmul: a
    trainer's GEMMs. Its forward follows the row count only through cuBLAS's choice of kernel, which vLLM's settings
    (a 16 KiB workspace: no split-K) pin when cuBLAS starts under them; setup() puts them in place first."""

    def make_kernels(self, mode: RolloutMode) -> Kernels:
        return replace(vllm_kernels(mode), linear=cublas_linear)


class CublasSettingsTooLate(CublasGemms):
    """CublasGemms whose process ran a GEMM before the settings were put in place: cuBLAS keeps the workspace it
    started with, and its heuristics may split K differently for different row counts."""

    def setup(self, ctx: EngineContext) -> None:
        first_gemm(ctx.device)
        super().setup(ctx)


class CublasSettingsLeftOut(CublasGemms):
    """CublasGemms with torch's cuBLAS defaults: none of the mode's settings is put in place."""

    def install_settings(self) -> dict[str, str]:
        return {}


def logsumexp_branch() -> VllmGpuExactEngine:
    return LogsumexpBranch()


def bf16_branch() -> VllmGpuExactEngine:
    return Bf16Branch()


def fused_path() -> VllmGpuExactEngine:
    return FusedPath()


def norm_not_routed() -> VllmGpuExactEngine:
    return NormNotRouted()


def settings_too_late() -> VllmGpuExactEngine:
    return SettingsTooLate()


def cublas_gemms() -> VllmGpuExactEngine:
    return CublasGemms()


def cublas_settings_too_late() -> VllmGpuExactEngine:
    return CublasSettingsTooLate()


def cublas_settings_left_out() -> VllmGpuExactEngine:
    return CublasSettingsLeftOut()
