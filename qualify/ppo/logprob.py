"""Sampler-formula logprobs of given tokens, chunked so that no [tokens, vocab] fp32 tensor exists.

The formula is vLLM's 'processed_logprobs' (vllm/v1/sample/sampler.py, no top-k/top-p):
logits.to(float32), in-place division by a float32 temperature tensor on the logits' device,
log_softmax(dim=-1, dtype=float32), gather. The chunked version is bitwise equal to it in the
forward and recomputes the softmax chunk by chunk in the backward.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

# vllm.v1.sample.sampler._SAMPLING_EPS: a request below it is greedy and vLLM divides by 1.0.
SAMPLING_EPS = 1e-5


def _compute_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    # fp32 as in vLLM; fp64 logits stay fp64 so that gradcheck can run on the same code.
    return torch.promote_types(logits_dtype, torch.float32)


def _temperature_11(temperature: float, device: torch.device) -> torch.Tensor:
    """The temperature as vLLM holds it: float32, on the logits' device, broadcast over the vocab.

    Not a Python float and not a CPU 0-d tensor: on CUDA either one is a 'CPU scalar', for which
    torch computes x * (1 / T) instead of x / T, which is not bitwise the same. Never bf16 either.
    """
    temp_11 = torch.full((1, 1), temperature, dtype=torch.float32, device=device)
    return torch.where(temp_11 < SAMPLING_EPS, 1.0, temp_11)


def _log_softmax_rows(logits_CV: torch.Tensor, temp_11: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """vLLM's formula on a block of rows: (C, Vpad) logits -> (C, vocab_size) logprobs."""
    # Drop TP padding columns before the softmax; copy=True so the in-place division never writes
    # into the caller's logits when they are already fp32 and unpadded.
    z_CV = logits_CV[:, :vocab_size].to(_compute_dtype(logits_CV.dtype), copy=True)
    z_CV.div_(temp_11)
    return z_CV.log_softmax(dim=-1, dtype=z_CV.dtype)


def _gather_rows(logits_CV, tokens_C, temp_11, vocab_size: int) -> torch.Tensor:
    """(C,) logprobs of a block of rows; its (C, V) buffers are freed on return."""
    return _log_softmax_rows(logits_CV, temp_11, vocab_size).gather(-1, tokens_C[:, None])[:, 0]


def _write_grad_rows(grad_CV, logits_CV, tokens_C, g_C, temp_11, vocab_size: int) -> None:
    """Write d(sum g * logp)/d logits of a block of rows into grad_CV (logits' dtype, padding untouched)."""
    logp_CV = _log_softmax_rows(logits_CV, temp_11, vocab_size)
    g_C1 = g_C[:, None].to(logp_CV.dtype)
    onehot_g_CV = torch.zeros_like(logp_CV).scatter_(-1, tokens_C[:, None], g_C1)
    # g * onehot - exp(logp) * sum(g * onehot) = g * (onehot - p), by the kernel autograd uses for
    # log_softmax: torch.exp is not the softmax kernels' own exp, and this way the gradient is
    # bitwise the naive formula's, not just close to it.
    dlogp_CV = torch._log_softmax_backward_data(onehot_g_CV, logp_CV, -1, logp_CV.dtype)
    grad_CV[:, :vocab_size] = dlogp_CV.div_(temp_11)


class SamplerLogprob(torch.autograd.Function):
    """Chunked sampler logprobs of flat (N, Vpad) logits and (N,) int64 tokens -> (N,) logprobs.

    Backward, per chunk, with p = softmax(z[:, :V] / T) recomputed:
        d logp_y / d z = (onehot(y) - p) / T        on the first V columns, 0 on padding columns
    returned in the logits' dtype. Only the logits (in their own dtype) are saved for backward.
    Each chunk's work is a function call, so its buffers are gone before the next chunk starts.
    """

    @staticmethod
    def forward(ctx, logits_NV, tokens_N, temp_11, chunk_tokens: int, vocab_size: int):
        num_tokens = logits_NV.shape[0]
        logp_N = logits_NV.new_empty(num_tokens, dtype=_compute_dtype(logits_NV.dtype))
        for start in range(0, num_tokens, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logp_N[rows] = _gather_rows(logits_NV[rows], tokens_N[rows], temp_11, vocab_size)
        ctx.save_for_backward(logits_NV, tokens_N, temp_11)
        ctx.chunk_tokens = chunk_tokens
        ctx.vocab_size = vocab_size
        return logp_N

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_N):
        logits_NV, tokens_N, temp_11 = ctx.saved_tensors
        grad_logits_NV = torch.empty_like(logits_NV)
        grad_logits_NV[:, ctx.vocab_size :] = 0  # TP padding columns do not reach the logprobs
        for start in range(0, logits_NV.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            _write_grad_rows(
                grad_logits_NV[rows], logits_NV[rows], tokens_N[rows], grad_N[rows], temp_11, ctx.vocab_size
            )
        return grad_logits_NV, None, None, None, None


def sampler_logprobs(
    logits_BTV: torch.Tensor,
    tokens_BT: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Logprobs (B, T) of tokens_BT under vLLM's sampler formula, chunk_tokens tokens at a time.

        logp[b, t] = log_softmax(fp32(logits[b, t, :V]) / fp32(T))[tokens[b, t]]

    logits_BTV is (B, T, Vpad) in any float dtype; V = vocab_size (default Vpad): columns beyond it
    are tensor-parallel padding and are dropped before the softmax. The result is float32
    (float64 for float64 logits) and bitwise equal to naive_sampler_logprobs, gradient included.
    Differentiable with respect to the logits; the forward holds at most two and the backward three
    (chunk_tokens, V) buffers of the compute dtype at a time, besides the (B, T, Vpad) gradient in
    the logits' dtype.
    """
    assert chunk_tokens >= 1, chunk_tokens
    padded_vocab = logits_BTV.shape[-1]
    vocab_size = padded_vocab if vocab_size is None else vocab_size
    assert 0 < vocab_size <= padded_vocab, (vocab_size, padded_vocab)
    temp_11 = _temperature_11(temperature, logits_BTV.device)
    logp_N = SamplerLogprob.apply(
        logits_BTV.reshape(-1, padded_vocab), tokens_BT.reshape(-1).long(), temp_11, chunk_tokens, vocab_size
    )
    return logp_N.view(tokens_BT.shape)


def naive_sampler_logprobs(
    logits_BTV: torch.Tensor,
    tokens_BT: torch.Tensor,
    temperature: float,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """The same formula in one piece, through plain autograd: the reference for tests and benchmarks.

    It materializes (B, T, V) in the compute dtype (twice, and once more saved for backward).
    """
    vocab_size = logits_BTV.shape[-1] if vocab_size is None else vocab_size
    z_BTV = logits_BTV[..., :vocab_size].to(_compute_dtype(logits_BTV.dtype), copy=True)
    z_BTV.div_(_temperature_11(temperature, logits_BTV.device))
    logp_BTV = z_BTV.log_softmax(dim=-1, dtype=z_BTV.dtype)
    return logp_BTV.gather(-1, tokens_BT.long()[..., None])[..., 0]
