"""The entropy of the sampler's distribution at each position, chunked so that no [tokens, vocab] fp32 tensor exists.

The distribution is the one the rollout samples from and the logprobs are taken under (qualify.ppo.logprob's full
formula): p = softmax(fp32(logits[:V]) / fp32(T)). Its entropy is what an entropy bonus (verl's entropy_coeff) adds
to the policy loss; verl computes it from logits already divided by the temperature (verl.utils.torch_functional
.entropy_from_logits: logsumexp(z) - sum(softmax(z) * z)), which is this formula.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from qualify.ppo.logprob import _compute_dtype, _temperature_11


def _scaled_rows(logits_CV: torch.Tensor, temp_11: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """z = fp32(logits[:, :V]) / fp32(T) of a block of rows, as the logprobs take it (a copy: never the caller's)."""
    z_CV = logits_CV[:, :vocab_size].to(_compute_dtype(logits_CV.dtype), copy=True)
    return z_CV.div_(temp_11)


def _entropy_rows(z_CV: torch.Tensor) -> torch.Tensor:
    """(C,) H = logsumexp(z) - sum_v p_v z_v, p = softmax(z)."""
    return torch.logsumexp(z_CV, dim=-1) - (torch.softmax(z_CV, dim=-1) * z_CV).sum(-1)


class SamplerEntropy(torch.autograd.Function):
    """Chunked entropy of flat (N, Vpad) logits -> (N,).

    Backward, per chunk, with z and p = softmax(z) recomputed (E_p z = sum_v p_v z_v):
        d H / d logits_v = -p_v (z_v - E_p z) / T        on the first V columns, 0 on padding columns
    returned in the logits' dtype. Only the logits are saved for backward.
    """

    @staticmethod
    def forward(ctx, logits_NV, temp_11, chunk_tokens: int, vocab_size: int):
        num_tokens = logits_NV.shape[0]
        h_N = logits_NV.new_empty(num_tokens, dtype=_compute_dtype(logits_NV.dtype))
        for start in range(0, num_tokens, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            h_N[rows] = _entropy_rows(_scaled_rows(logits_NV[rows], temp_11, vocab_size))
        ctx.save_for_backward(logits_NV, temp_11)
        ctx.chunk_tokens = chunk_tokens
        ctx.vocab_size = vocab_size
        return h_N

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_N):
        logits_NV, temp_11 = ctx.saved_tensors
        grad_logits_NV = torch.empty_like(logits_NV)
        grad_logits_NV[:, ctx.vocab_size:] = 0  # TP padding columns are not part of the distribution
        for start in range(0, logits_NV.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            z_CV = _scaled_rows(logits_NV[rows], temp_11, ctx.vocab_size)
            p_CV = torch.softmax(z_CV, dim=-1)
            mean_C1 = (p_CV * z_CV).sum(-1, keepdim=True)
            g_C1 = grad_N[rows, None].to(z_CV.dtype)
            grad_logits_NV[rows, :ctx.vocab_size] = (-g_C1 * p_CV * (z_CV - mean_C1)).div_(temp_11)
        return grad_logits_NV, None, None, None


def sampler_entropy(logits_BTV: torch.Tensor, temperature: float, chunk_tokens: int,
                    vocab_size: int | None = None) -> torch.Tensor:
    """(B, T) entropy of softmax(fp32(logits[b, t, :V]) / fp32(T)), chunk_tokens positions at a time; fp32 (fp64 for
    fp64 logits), differentiable with respect to the logits. Columns beyond vocab_size (default Vpad) are TP padding."""
    assert chunk_tokens >= 1, chunk_tokens
    padded_vocab = logits_BTV.shape[-1]
    vocab_size = padded_vocab if vocab_size is None else vocab_size
    assert 0 < vocab_size <= padded_vocab, (vocab_size, padded_vocab)
    temp_11 = _temperature_11(temperature, logits_BTV.device)
    h_N = SamplerEntropy.apply(logits_BTV.reshape(-1, padded_vocab), temp_11, chunk_tokens, vocab_size)
    return h_N.view(logits_BTV.shape[:-1])


def naive_sampler_entropy(logits_BTV: torch.Tensor, temperature: float, vocab_size: int | None = None) -> torch.Tensor:
    """The same entropy in one piece through plain autograd, -sum p log p: the reference for tests."""
    vocab_size = logits_BTV.shape[-1] if vocab_size is None else vocab_size
    z_BTV = logits_BTV[..., :vocab_size].to(_compute_dtype(logits_BTV.dtype)) / _temperature_11(temperature,
                                                                                                 logits_BTV.device)
    logp_BTV = z_BTV.log_softmax(dim=-1)
    return -(logp_BTV.exp() * logp_BTV).sum(-1)
