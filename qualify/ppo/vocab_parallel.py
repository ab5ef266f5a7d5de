"""A deterministic vocab-parallel logprob: bitwise the same for every TP split of the vocabulary.

Formula (the sampler's, as qualify.ppo.logprob): logp[n] = z[n, y_n] - logsumexp_v z[n, v] with
z = fp32(logits[:, :V]) / fp32(T); padded columns [V, Vpad) are -inf. The vocabulary is cut into tiles of
tile_size columns by *global* column index; a TP rank holds whole tiles (its shard width is a multiple of
tile_size) and reduces each to a partial (max_k, sumexp_k). The partials of all ranks, concatenated in
global tile order, are merged in one fixed order. Nothing in that order depends on how TP splits the
vocabulary, so TP = 1, 2, 4 give bitwise identical logprobs and gradients.

Determinism does not rest on torch's reduction kernels, whose summation order follows the tensor's shape
and the thread count: every sum is a fixed binary tree of elementwise adds (exactly rounded, so the same on
any layout), max is exact, and exp/log are elementwise (tests/unit/ppo/test_vocab_parallel.py checks that
torch's exp does not depend on an element's position).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.function import once_differentiable

from qualify.ppo.logprob import _compute_dtype, _temperature_11


def tp_shard_bounds(padded_vocab: int, tp: int, tile_size: int) -> list[tuple[int, int]]:
    """Column ranges [start, end) of TP ranks 0..tp-1: equal contiguous shards of whole tiles."""
    if padded_vocab % tp or (padded_vocab // tp) % tile_size:
        raise ValueError(f"padded vocab {padded_vocab} does not split into {tp} shards of whole {tile_size}-column "
                         f"tiles; pad the vocabulary to a multiple of tp x tile_size = {tp * tile_size}")
    width = padded_vocab // tp
    return [(r * width, (r + 1) * width) for r in range(tp)]


def tree_sum(x_NK: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (N, K) -> (N,) in a fixed pairwise order: K is zero-padded to a power of two,
    then x[:, i] += x[:, i + h] for h = K/2, K/4, ..., 1. Only elementwise adds: the order is the indices'."""
    num = x_NK.shape[-1]
    width = 1 << max(num - 1, 0).bit_length()
    if width != num:
        x_NK = torch.cat([x_NK, x_NK.new_zeros(*x_NK.shape[:-1], width - num)], dim=-1)
    while width > 1:
        width //= 2
        x_NK = x_NK[..., :width] + x_NK[..., width:]
    return x_NK[..., 0]


def scaled_shard(shard_NW: torch.Tensor, vocab_start: int, vocab_size: int, temp_11: torch.Tensor) -> torch.Tensor:
    """z (N, W) of one shard: fp32 (fp64 for fp64 logits) logits / T, padded columns (global index >= V) -inf."""
    z_NW = shard_NW.to(_compute_dtype(shard_NW.dtype), copy=True).div_(temp_11)
    column_W = torch.arange(vocab_start, vocab_start + shard_NW.shape[-1], device=shard_NW.device)
    return torch.where(column_W < vocab_size, z_NW, -float("inf"))


def tile_partials(z_NW: torch.Tensor, tile_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tile (max, sumexp), each (N, W / tile_size): m_k = max_{v in k} z_v, s_k = sum_{v in k} exp(z_v - m_k).

    An all-padding tile gives the identity partial (m, s) = (-inf, 0), without evaluating exp(-inf + inf).
    """
    num_rows, width = z_NW.shape
    z_NLS = z_NW.reshape(num_rows, width // tile_size, tile_size)
    m_NL = z_NLS.amax(-1)
    shift_NL = torch.where(m_NL == -float("inf"), 0.0, m_NL)
    return m_NL, tree_sum(torch.exp(z_NLS - shift_NL[..., None]))


def merge_partials(m_NK: torch.Tensor, s_NK: torch.Tensor) -> torch.Tensor:
    """logsumexp (N,) from all K tiles' partials in global tile order: M + log(sum_k s_k exp(m_k - M)), M = max m_k."""
    max_N = m_NK.amax(-1)
    # identity partials have s = 0 and exp(-inf - M) = 0: they add exactly 0
    return max_N + torch.log(tree_sum(s_NK * torch.exp(m_NK - max_N[:, None])))


def picked_logit(z_NW: torch.Tensor, tokens_N: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """z[n, y_n] where this shard owns token y_n, else 0 (N,). Summed over shards it is exact: one term is not 0."""
    local_N = tokens_N - vocab_start
    owned_N = (local_N >= 0) & (local_N < z_NW.shape[-1])
    return torch.where(owned_N, z_NW.gather(-1, local_N.clamp(0, z_NW.shape[-1] - 1)[:, None])[:, 0], 0.0)


def shard_grad(z_NW, tokens_N, vocab_start: int, lse_N, g_N, temp_11) -> torch.Tensor:
    """d(sum_n g_n logp_n) / d logits on one shard (N, W): g * (onehot(y) - exp(z - lse)) / T, 0 on padding."""
    onehot_NW = (torch.arange(z_NW.shape[-1], device=z_NW.device) + vocab_start) == tokens_N[:, None]
    p_NW = torch.exp(z_NW - lse_N[:, None])
    return (g_N[:, None] * (onehot_NW.to(z_NW.dtype) - p_NW)).div_(temp_11)


def _starts(shards_NW: Sequence[torch.Tensor]) -> list[int]:
    starts = [0]
    for shard in shards_NW[:-1]:
        starts.append(starts[-1] + shard.shape[-1])
    return starts


def _lse_and_target(shards_NW, tokens_N, temp_11, vocab_size: int, tile_size: int):
    """(lse, z[y]) (N,) of a block of rows, every shard reduced to its tile partials as its TP rank would."""
    zs = [scaled_shard(s, start, vocab_size, temp_11) for s, start in zip(shards_NW, _starts(shards_NW), strict=True)]
    partials = [tile_partials(z, tile_size) for z in zs]
    lse_N = merge_partials(torch.cat([m for m, _ in partials], -1), torch.cat([s for _, s in partials], -1))
    target_N = picked_logit(zs[0], tokens_N, 0)
    for z, start in zip(zs[1:], _starts(shards_NW)[1:], strict=True):
        target_N = target_N + picked_logit(z, tokens_N, start)
    return lse_N, target_N


class _VocabParallelLogprob(torch.autograd.Function):
    """Every TP shard in one process: forward(tokens, temp, vocab_size, tile_size, chunk, *shards) -> logp (N,).

    Rows are processed chunk_tokens at a time, so at most a few (chunk_tokens, W) compute-dtype buffers per
    shard exist; rows are independent, so the chunking changes no bit.
    """

    @staticmethod
    def forward(ctx, tokens_N, temp_11, vocab_size: int, tile_size: int, chunk_tokens: int, *shards_NW):
        num_rows = tokens_N.shape[0]
        lse_N = temp_11.new_empty(num_rows, dtype=_compute_dtype(shards_NW[0].dtype))
        logp_N = torch.empty_like(lse_N)
        for start in range(0, num_rows, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            lse_C, target_C = _lse_and_target([s[rows] for s in shards_NW], tokens_N[rows], temp_11, vocab_size,
                                              tile_size)
            lse_N[rows], logp_N[rows] = lse_C, target_C - lse_C
        ctx.save_for_backward(tokens_N, temp_11, lse_N, *shards_NW)
        ctx.vocab_size, ctx.chunk_tokens = vocab_size, chunk_tokens
        return logp_N

    @staticmethod
    @once_differentiable
    def backward(ctx, g_N):
        tokens_N, temp_11, lse_N, *shards_NW = ctx.saved_tensors
        grads = [torch.empty_like(s) for s in shards_NW]
        for start in range(0, tokens_N.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            for s, grad, col in zip(shards_NW, grads, _starts(shards_NW), strict=True):
                z_CW = scaled_shard(s[rows], col, ctx.vocab_size, temp_11)
                grad[rows] = shard_grad(z_CW, tokens_N[rows], col, lse_N[rows], g_N[rows], temp_11)
        return None, None, None, None, None, *grads


def vocab_parallel_logprobs(
    shards: Sequence[torch.Tensor],
    tokens: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float,
    tile_size: int,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """logprobs (...) of tokens (...) from the TP column shards (..., W_r) of the padded logits, rank order.

        logp = z[y] - merge_partials(tile_partials of every shard),  z = fp32(logits) / fp32(T), -inf on padding

    Each shard must hold whole tiles of tile_size columns (tp_shard_bounds); columns at global index
    >= vocab_size are padding. Differentiable w.r.t. every shard: d logp / d z = onehot(y) - softmax(z),
    divided by T, 0 on padding columns, in the shard's dtype. chunk_tokens (default: all) bounds the
    (tokens, W) buffers of the compute dtype. Bitwise the same for any split and any chunking.
    """
    assert all(s.shape[-1] % tile_size == 0 for s in shards), ([s.shape[-1] for s in shards], tile_size)
    assert sum(s.shape[-1] for s in shards) >= vocab_size
    flat = [s.reshape(-1, s.shape[-1]) for s in shards]
    temp_11 = _temperature_11(temperature, flat[0].device)
    chunk = max(flat[0].shape[0], 1) if chunk_tokens is None else chunk_tokens
    assert chunk >= 1, chunk
    logp_N = _VocabParallelLogprob.apply(tokens.reshape(-1).long(), temp_11, vocab_size, tile_size, chunk, *flat)
    return logp_N.view(tokens.shape)


def _rank_lse_and_target(shard_NW, tokens_N, vocab_start: int, vocab_size: int, tile_size: int, temp_11, group):
    """(lse, z[y]) (N,) of a block of rows on one TP rank: its partials all-gathered, the picked logit all-reduced."""
    import torch.distributed as dist

    z_NW = scaled_shard(shard_NW, vocab_start, vocab_size, temp_11)
    m_NL, s_NL = tile_partials(z_NW, tile_size)
    world = dist.get_world_size(group)
    ms = [torch.empty_like(m_NL) for _ in range(world)]
    ss = [torch.empty_like(s_NL) for _ in range(world)]
    dist.all_gather(ms, m_NL.contiguous(), group=group)
    dist.all_gather(ss, s_NL.contiguous(), group=group)
    lse_N = merge_partials(torch.cat(ms, -1), torch.cat(ss, -1))  # rank order = global tile order
    target_N = picked_logit(z_NW, tokens_N, vocab_start)
    dist.all_reduce(target_N, group=group)  # one owner, zeros elsewhere: exact in any order
    return lse_N, target_N


class _TPRankLogprob(torch.autograd.Function):
    """One TP rank's shard: forward(shard, tokens, start, vocab, tile, temp, chunk, group) -> logp (N,), replicated."""

    @staticmethod
    def forward(ctx, shard_NW, tokens_N, vocab_start: int, vocab_size: int, tile_size: int, temp_11,
                chunk_tokens: int, group):
        num_rows = tokens_N.shape[0]
        lse_N = temp_11.new_empty(num_rows, dtype=_compute_dtype(shard_NW.dtype))
        logp_N = torch.empty_like(lse_N)
        for start in range(0, num_rows, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            lse_C, target_C = _rank_lse_and_target(shard_NW[rows], tokens_N[rows], vocab_start, vocab_size,
                                                   tile_size, temp_11, group)
            lse_N[rows], logp_N[rows] = lse_C, target_C - lse_C
        ctx.save_for_backward(shard_NW, tokens_N, temp_11, lse_N)
        ctx.vocab_start, ctx.vocab_size, ctx.chunk_tokens = vocab_start, vocab_size, chunk_tokens
        return logp_N

    @staticmethod
    @once_differentiable
    def backward(ctx, g_N):
        shard_NW, tokens_N, temp_11, lse_N = ctx.saved_tensors
        grad_NW = torch.empty_like(shard_NW)
        for start in range(0, tokens_N.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            z_CW = scaled_shard(shard_NW[rows], ctx.vocab_start, ctx.vocab_size, temp_11)
            grad_NW[rows] = shard_grad(z_CW, tokens_N[rows], ctx.vocab_start, lse_N[rows], g_N[rows], temp_11)
        return grad_NW, None, None, None, None, None, None, None


def tp_rank_logprobs(
    shard: torch.Tensor,
    tokens: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    temperature: float,
    tile_size: int,
    chunk_tokens: int | None = None,
    group=None,
) -> torch.Tensor:
    """vocab_parallel_logprobs on a real TP rank holding columns [vocab_start, vocab_start + W) of the
    padded logits: per chunk of tokens, two all_gathers of the (chunk, W / tile_size) partials and one
    all_reduce of the picked logit in the forward; no collective in the backward (the upstream gradient
    is replicated over TP). Ranks of group hold the shards in rank order and call it with the same tokens
    and chunk_tokens (the same number of collectives). Bitwise the same as the single-process function.
    """
    assert shard.shape[-1] % tile_size == 0 and vocab_start % tile_size == 0, (shard.shape, vocab_start, tile_size)
    flat_NW = shard.reshape(-1, shard.shape[-1])
    temp_11 = _temperature_11(temperature, flat_NW.device)
    chunk = max(flat_NW.shape[0], 1) if chunk_tokens is None else chunk_tokens
    assert chunk >= 1, chunk
    logp_N = _TPRankLogprob.apply(flat_NW, tokens.reshape(-1).long(), vocab_start, vocab_size, tile_size, temp_11,
                                  chunk, group)
    return logp_N.view(tokens.shape)
