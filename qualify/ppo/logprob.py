"""Sampler-formula logprobs of given tokens, chunked so that no [tokens, vocab] fp32 tensor exists.

The full formula is vLLM's 'processed_logprobs' with top-k/top-p/min-p off (vllm/v1/sample/sampler.py):
logits.to(float32), in-place division by a float32 temperature tensor on the logits' device,
log_softmax(dim=-1, dtype=float32), gather. The chunked version is bitwise equal to it in the
forward and recomputes the softmax chunk by chunk in the backward.

processed_logprobs adds the truncation vLLM's CPU sampler applies after the temperature (min-p,
then top-k and top-p) and renormalizes over the kept set, in the same fp32 operations; it is
forward-only evidence.
"""

from __future__ import annotations

from typing import NamedTuple

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


# --- vLLM's processed logprobs under min-p, top-k and top-p (forward only) ---------------------------


class ProcessedLogprobs(NamedTuple):
    """Per-token evidence of the sampler's processed logprobs; every field has the tokens' shape."""

    processed: torch.Tensor
    """fp32: log_softmax over the kept set (renormalized); -inf for a token outside it."""
    full: torch.Tensor
    """fp32: log_softmax over the whole vocabulary (the full formula, bitwise sampler_logprobs)."""
    log_kept_mass: torch.Tensor
    """fp32: log of the kept set's full-vocabulary probability (<= 0; exactly 0 when nothing is cut)."""
    kept_size: torch.Tensor
    """int64: number of tokens in the kept set."""


def _fp32_11(value: float, device: torch.device) -> torch.Tensor:
    """A sampling parameter as vLLM's input batch holds it: a float32 tensor on the logits' device."""
    return torch.full((1, 1), value, dtype=torch.float32, device=device)


def truncation_is_off(vocab_size: int, top_k: int, top_p: float, min_p: float) -> bool:
    """True when vLLM applies no min-p, top-k or top-p: its input batch treats top_k outside
    (0, vocab) as off, top_p >= 1 as off, and min_p == 0 as off."""
    return not (0 < top_k < vocab_size) and top_p >= 1 and min_p == 0


def _mask_min_p_(z_CV: torch.Tensor, min_p: float) -> None:
    """vLLM's MinPLogitsProcessor.apply: drop tokens whose probability is below min_p x the largest."""
    probs_CV = torch.nn.functional.softmax(z_CV, dim=-1)
    adjusted_C1 = torch.amax(probs_CV, dim=-1, keepdim=True).mul_(_fp32_11(min_p, z_CV.device))
    z_CV.masked_fill_(probs_CV < adjusted_C1, -float("inf"))


def _mask_top_k_top_p_(z_CV: torch.Tensor, top_k: int, top_p: float) -> None:
    """vLLM's apply_top_k_top_p_pytorch (the CPU path, no Triton), for one (top_k, top_p) on every row.

    top-k keeps every token >= the k-th largest value (ties at the boundary are all kept). top-p
    sorts ascending with torch's (unstable) sort, takes the fp32 softmax of the sorted row and its
    cumsum, and drops the prefix whose cumsum is <= 1 - p, never the largest token: which of several
    tokens tied at the top-p boundary survive is the sort's order, exactly as in vLLM when the row
    is bitwise the same; the kept size and mass do not depend on it.
    """
    vocab = z_CV.shape[-1]
    use_k = 0 < top_k < vocab
    if top_p >= 1:  # vLLM's apply_top_k_only: no sort
        kth_C1 = z_CV.topk(top_k, dim=-1).values[:, -1:]
        z_CV.masked_fill_(z_CV < kth_C1, -float("inf"))
        return
    sort_CV, idx_CV = z_CV.sort(dim=-1, descending=False)
    if use_k:
        kth_C1 = sort_CV.gather(1, torch.full_like(idx_CV[:, :1], vocab - top_k))
        sort_CV.masked_fill_(sort_CV < kth_C1, -float("inf"))
    probs_sort_CV = sort_CV.softmax(dim=-1)
    probs_sum_CV = torch.cumsum(probs_sort_CV, dim=-1, out=probs_sort_CV)
    top_p_mask_CV = probs_sum_CV <= 1 - _fp32_11(top_p, z_CV.device)
    top_p_mask_CV[:, -1] = False  # at least one token
    sort_CV.masked_fill_(top_p_mask_CV, -float("inf"))
    z_CV.scatter_(dim=-1, index=idx_CV, src=sort_CV)


def _processed_rows(logits_CV, tokens_C, temp_11, vocab_size: int, top_k: int, top_p: float, min_p: float):
    """(processed, full, log_kept_mass, kept_size) of a block of rows; its (C, V) buffers are freed on return."""
    z_CV = logits_CV[:, :vocab_size].to(torch.float32, copy=True)
    z_CV.div_(temp_11)
    full_logp_CV = z_CV.log_softmax(dim=-1, dtype=torch.float32)
    full_C = full_logp_CV.gather(-1, tokens_C[:, None])[:, 0]
    if truncation_is_off(vocab_size, top_k, top_p, min_p):
        size_C = torch.full_like(tokens_C, vocab_size)
        return full_C, full_C, torch.zeros_like(full_C), size_C
    if min_p > 0:
        _mask_min_p_(z_CV, min_p)
    if 0 < top_k < vocab_size or top_p < 1:
        _mask_top_k_top_p_(z_CV, top_k, top_p)
    kept_CV = z_CV != -float("inf")
    size_C = kept_CV.sum(dim=-1)
    processed_C = z_CV.log_softmax(dim=-1, dtype=torch.float32).gather(-1, tokens_C[:, None])[:, 0]
    kept_mass_C = torch.logsumexp(full_logp_CV.masked_fill_(~kept_CV, -float("inf")), dim=-1)
    # The whole vocabulary is kept: its mass is 1, not the rounding of a sum of V probabilities.
    kept_mass_C = torch.where(size_C == vocab_size, 0.0, kept_mass_C)
    return processed_C, full_C, kept_mass_C, size_C


@torch.no_grad()
def processed_logprobs(
    logits_BTV: torch.Tensor,
    tokens_BT: torch.Tensor,
    *,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
    chunk_tokens: int,
    vocab_size: int | None = None,
) -> ProcessedLogprobs:
    """vLLM's processed logprobs of tokens_BT under temperature, min-p, top-k and top-p, chunk by chunk.

    The order is vLLM's sampler (vllm/v1/sample/sampler.py, CPU path), all in fp32:
        z = fp32(logits[b, t, :V]) / fp32(T)                       # Sampler.apply_temperature
        z[p < min_p * max p] = -inf,  p = softmax(z)                # MinPLogitsProcessor (argmax invariant)
        z[z < k-th largest] = -inf; sorted top-p cut of the rest    # apply_top_k_top_p_pytorch
        processed = log_softmax(z)[token]   full = log_softmax(fp32(logits) / fp32(T))[token]
    top_k -1 (or >= V), top_p 1 and min_p 0 are off; with all three off processed is bitwise full,
    and full is bitwise sampler_logprobs. log_kept_mass = log sum_{kept} exp(full), so that
    full - processed = log_kept_mass for a kept token (up to rounding). logits_BTV is (B, T, Vpad)
    in any float dtype; columns beyond vocab_size are tensor-parallel padding. At most a few
    (chunk_tokens, V) fp32 buffers exist at a time. On GPU vLLM samples top-k/top-p with a Triton
    kernel whose top-p boundary is searched, not sorted: there the kept set may differ at the boundary.
    """
    assert chunk_tokens >= 1, chunk_tokens
    padded_vocab = logits_BTV.shape[-1]
    vocab_size = padded_vocab if vocab_size is None else vocab_size
    assert 0 < vocab_size <= padded_vocab, (vocab_size, padded_vocab)
    assert 0 < top_p <= 1 and 0 <= min_p < 1 and (top_k == -1 or top_k >= 1), (top_k, top_p, min_p)
    temp_11 = _temperature_11(temperature, logits_BTV.device)
    logits_NV, tokens_N = logits_BTV.reshape(-1, padded_vocab), tokens_BT.reshape(-1).long()
    parts = [_processed_rows(logits_NV[s:s + chunk_tokens], tokens_N[s:s + chunk_tokens], temp_11, vocab_size,
                             top_k, top_p, min_p) for s in range(0, logits_NV.shape[0], chunk_tokens)]
    return ProcessedLogprobs(*(torch.cat(column).view(tokens_BT.shape) for column in zip(*parts, strict=True)))
