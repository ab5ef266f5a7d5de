"""The shipped exact engine (qualify.examples.vllm_cpu_exact) with one bug each that seed 002's review names
(named 'tests.integration.exact_plugins:<factory>'). Each is declared rollout_exact by its test and must fail the exact
tier's row (comparison 'rollout', tensor step0/outputs/logprobs_BT), naming how many tokens differ.

  logsumexp_branch   the logprobs as logits/T - logsumexp(logits/T) (fp32) instead of log_softmax
  bf16_branch        log_softmax computed in bf16
  kernel_not_routed  vLLM's rotary in the forward, but HF's sdpa attention (one kernel not routed through vLLM's)
  routed_too_late    vLLM's kernels installed after the first forward (the CPU form of settings installed too late)
  fused_path         a fused path that skips the sampler formula: each token's logprob from an online logsumexp
                     over vocabulary chunks, as fused linear-cross-entropy kernels make it without the whole logits
"""

from __future__ import annotations

import torch

from qualify.engines.torch_tp import TorchTPEngine
from qualify.examples.vllm_cpu_exact import ATTENTION, VllmCpuExactEngine, install


class OwnFormula(VllmCpuExactEngine):
    """The exact engine scoring the actor with its own logprob formula (what the loss is built from too)."""

    def formula(self, logits_BTV: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def scores_from(self, out_BTX: torch.Tensor, ids_BT: torch.Tensor) -> torch.Tensor:
        if self.ctx.role != "actor":
            return super().scores_from(out_BTX, ids_BT)
        self.declared_BT, self.last_logits = None, out_BTX.detach()
        logp_BTV = self.formula(out_BTX[:, :-1, :self.ctx.vocab_size].float() / self.ctx.temperature)
        logp_BT1 = logp_BTV.gather(-1, ids_BT[:, 1:, None])[..., 0].float()
        return torch.nn.functional.pad(logp_BT1, (1, 0)).cpu()


class LogsumexpBranch(OwnFormula):
    def formula(self, z: torch.Tensor) -> torch.Tensor:
        return z - torch.logsumexp(z, dim=-1, keepdim=True)


class Bf16Branch(OwnFormula):
    def formula(self, z: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(z.to(torch.bfloat16), dim=-1)


class FusedPath(OwnFormula):
    """The logprobs a fused linear-cross-entropy kernel makes: the log-normalizer accumulated chunk by chunk over the
    vocabulary (online logsumexp), never log_softmax over the whole row."""

    CHUNK = 128

    def formula(self, z: torch.Tensor) -> torch.Tensor:
        lse = None
        for lo in range(0, z.shape[-1], self.CHUNK):
            part = torch.logsumexp(z[..., lo:lo + self.CHUNK], dim=-1, keepdim=True)
            lse = part if lse is None else torch.logaddexp(lse, part)
        return z - lse


class KernelNotRouted(VllmCpuExactEngine):
    """vLLM's rotary, HF's own sdpa attention. (HF's rotary is not the kernel left out: on some CPUs, this project's
    AMD EPYC 7003 among them, HF's fp32 rotary equals vLLM's bit for bit, so leaving it in is no bug there; the
    attention kernels' reduction orders differ on every CPU tried.)"""

    def setup(self, ctx) -> None:
        super().setup(ctx)
        for model in {id(m): m for m in (self.master, self.compute)}.values():
            model.set_attn_implementation("sdpa")


class RoutedTooLate(TorchTPEngine):
    """torch-tp that routes its rotary and attention through vLLM's kernels only after its first forward."""

    def score(self, batch):
        scores = super().score(batch)
        if not getattr(self, "routed", False):
            install(self.master.config, (torch.float32, torch.bfloat16), int(self.master.config.max_position_embeddings))
            for model in {id(m): m for m in (self.master, self.compute)}.values():
                model.set_attn_implementation(ATTENTION)
            self.routed = True
        return scores


def logsumexp_branch() -> VllmCpuExactEngine:
    return LogsumexpBranch()


def bf16_branch() -> VllmCpuExactEngine:
    return Bf16Branch()


def kernel_not_routed() -> VllmCpuExactEngine:
    return KernelNotRouted()


def routed_too_late() -> TorchTPEngine:
    return RoutedTooLate()


def fused_path() -> VllmCpuExactEngine:
    return FusedPath()
