"""The GPU exact engine's kernels before a chain spends GPU time on them: qualify.examples.vllm_gpu_exact's
vLLM-kernel forward of a tiny bf16 Qwen3 on CUDA against the same forward with the reference formula of every kernel
(close, not equal: bf16), and its backward; with the batch-invariant mode's kernels and without.

    python benchmarks/exact_gpu_smoke.py
"""

from __future__ import annotations

import torch

from qualify.examples.vllm_gpu_exact import (
    RolloutMode,
    install_invariant_settings,
    rope_cache,
    sampler_logprobs,
    torch_kernels,
    vllm_forward,
    vllm_kernels,
)
from qualify.matrix import TinyModel
from qualify.models.tiny import build_tiny_model


def main() -> None:
    install_invariant_settings()
    spec = TinyModel(seed=7, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=32, max_position_embeddings=128)
    model = build_tiny_model(spec, "actor").to(torch.bfloat16).cuda()
    ids = torch.randint(0, spec.vocab_size, (8, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    cache = rope_cache(model.config, torch.bfloat16, torch.device("cuda"))
    ref = vllm_forward(model, ids, torch_kernels(), cache).float()
    for invariant, runner in ((True, "v2"), (True, None), (False, "v2")):
        kernels = vllm_kernels(RolloutMode("bfloat16", invariant, 32, runner))
        logits = vllm_forward(model, ids, kernels, cache)
        logp = sampler_logprobs(logits, ids, 1.0, spec.vocab_size, 32, kernels.log_softmax, kernels.token_logprobs)
        formula = sampler_logprobs(logits, ids, 0.7, spec.vocab_size, 32, lambda z: torch.log_softmax(z, dim=-1))
        at_t = sampler_logprobs(logits, ids, 0.7, spec.vocab_size, 32, kernels.log_softmax, kernels.token_logprobs)
        logp.sum().backward()
        grads = sum(float(p.grad.float().norm()) for p in model.parameters() if p.grad is not None)
        model.zero_grad(set_to_none=True)
        again = vllm_forward(model, ids, kernels, cache)
        print(f"{kernels.name}: max |logits - reference formula's| {float((logits.float() - ref).abs().max()):.4g} "
              f"(logits up to {float(ref.abs().max()):.3g}), repeat bitwise {torch.equal(logits, again)}, "
              f"grad norm sum {grads:.4g}; at T = 0.7 the logprobs vs the fp32 formula's: "
              f"{int((at_t != formula).sum())} of {formula.numel()} differ, max {float((at_t - formula).abs().max()):.3g}")


if __name__ == "__main__":
    main()
