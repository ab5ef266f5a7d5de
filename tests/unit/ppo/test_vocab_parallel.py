"""qualify.ppo.vocab_parallel: bitwise across TP splits, close to torch.log_softmax, padding inert, real gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch

from qualify.ppo.grpo import (
    dp_slices,
    group_advantages,
    group_stats,
    grpo_loss,
    token_advantages,
)
from qualify.ppo.logprob import naive_sampler_logprobs
from qualify.ppo.share import count_normalizers
from qualify.ppo.vocab_parallel import (
    merge_partials,
    tile_partials,
    tp_rank_logprobs,
    tp_shard_bounds,
    tree_sum,
    vocab_parallel_logprobs,
)
from tests.unit._ranks import spawn_ranks

VOCAB, PADDED, TILE = 250, 256, 16  # TP=4 shards of 64 columns; the last shard ends in 6 padding columns
NUM_TOKENS, TEMPERATURE = 96, 0.7


def make_logits(seed: int, dtype=torch.float32, num_tokens: int = NUM_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits_NV = (3 * torch.randn(num_tokens, PADDED, generator=gen)).to(dtype)
    logits_NV[:, VOCAB:] = 1e4  # garbage in the padding: it must never reach a value or a gradient
    tokens_N = torch.randint(0, VOCAB, (num_tokens,), generator=gen)
    tokens_N[:3] = torch.tensor([0, VOCAB - 1, 128])  # first and last real column, a shard boundary
    return logits_NV, tokens_N


def split_logprobs(logits_NV: torch.Tensor, tokens_N: torch.Tensor, tp: int, temperature: float = TEMPERATURE,
                   chunk_tokens: int | None = None):
    """(logp, d sum(w * logp) / d logits) through tp column shards."""
    shards = [logits_NV[:, a:b].clone().requires_grad_() for a, b in tp_shard_bounds(PADDED, tp, TILE)]
    logp_N = vocab_parallel_logprobs(shards, tokens_N, vocab_size=VOCAB, temperature=temperature, tile_size=TILE,
                                     chunk_tokens=chunk_tokens)
    weights_N = torch.linspace(-1.0, 2.0, tokens_N.shape[0])
    (logp_N * weights_N).sum().backward()
    return logp_N.detach(), torch.cat([s.grad for s in shards], dim=-1)


def test_torch_exp_does_not_depend_on_position():
    """The premise of the module: an element's exp is the same wherever it sits and however many threads run."""
    x = 20 * torch.randn(70001, generator=torch.Generator().manual_seed(0))
    reference = torch.exp(x)
    for offset in range(0, 33, 3):
        for length in (1, 5, 16, 33, 1000, 40000):
            assert torch.equal(torch.exp(x[offset:offset + length]), reference[offset:offset + length])
            assert torch.equal(torch.exp(x[offset:offset + 2 * length:2]), reference[offset:offset + 2 * length:2])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(torch.exp(x), reference)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_tp_splits_are_bitwise_identical(dtype):
    logits_NV, tokens_N = make_logits(1, dtype)
    logp_1, grad_1 = split_logprobs(logits_NV, tokens_N, 1)
    for tp in (2, 4):
        logp_tp, grad_tp = split_logprobs(logits_NV, tokens_N, tp)
        assert torch.equal(logp_tp, logp_1), tp
        assert torch.equal(grad_tp, grad_1), tp
    assert grad_1.dtype == dtype and logp_1.dtype == torch.promote_types(dtype, torch.float32)


def test_token_chunking_changes_no_bit():
    logits_NV, tokens_N = make_logits(9)
    logp_all, grad_all = split_logprobs(logits_NV, tokens_N, 2)
    for chunk in (1, 7, 32, 1000):
        logp_chunked, grad_chunked = split_logprobs(logits_NV, tokens_N, 2, chunk_tokens=chunk)
        assert torch.equal(logp_chunked, logp_all) and torch.equal(grad_chunked, grad_all), chunk


def test_agrees_with_log_softmax_and_its_gradient():
    logits_NV, tokens_N = make_logits(2)
    logp_N, grad_NV = split_logprobs(logits_NV, tokens_N, 2)
    naive_logits_NV = logits_NV.clone().requires_grad_()
    naive_N = naive_sampler_logprobs(naive_logits_NV, tokens_N, TEMPERATURE, vocab_size=VOCAB)
    (naive_N * torch.linspace(-1.0, 2.0, NUM_TOKENS)).sum().backward()
    direct_N = torch.log_softmax(logits_NV[:, :VOCAB] / TEMPERATURE, dim=-1).gather(-1, tokens_N[:, None])[:, 0]
    # |logp| reaches ~20, where one fp32 ulp is 1.9e-6: the bound is 1e-6 relative (about 8 ulps) plus 1e-6
    assert_within(logp_N, direct_N, 1e-6)
    assert_within(logp_N, naive_N, 1e-6)
    assert_within(grad_NV, naive_logits_NV.grad, 1e-6)
    assert (grad_NV[:, VOCAB:] == 0).all()


def assert_within(got: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    excess = (got - expected).abs() - tol * (1 + expected.abs())
    assert not (excess > 0).any(), f"max |diff| {(got - expected).abs().max().item():.3g}"


def test_fp64_agrees_with_log_softmax_tightly():
    logits_NV, tokens_N = make_logits(3, torch.float64)
    logp_N, _ = split_logprobs(logits_NV, tokens_N, 4)
    temperature = torch.tensor(TEMPERATURE, dtype=torch.float32).double()  # the sampler's fp32 temperature
    direct_N = torch.log_softmax(logits_NV[:, :VOCAB] / temperature, dim=-1).gather(-1, tokens_N[:, None])[:, 0]
    assert (logp_N - direct_N).abs().max() <= 1e-12


def test_padding_columns_are_inert():
    logits_NV, tokens_N = make_logits(4)
    other_NV = logits_NV.clone()
    other_NV[:, VOCAB:] = float("nan")
    logp_a, grad_a = split_logprobs(logits_NV, tokens_N, 4)
    logp_b, grad_b = split_logprobs(other_NV, tokens_N, 4)
    assert torch.equal(logp_a, logp_b) and torch.equal(grad_a, grad_b)
    assert not logp_b.isnan().any() and (grad_b[:, VOCAB:] == 0).all()


def test_greedy_temperature_divides_by_one():
    logits_NV, tokens_N = make_logits(5)
    logp_N, _ = split_logprobs(logits_NV, tokens_N, 2, temperature=0.0)
    direct_N = torch.log_softmax(logits_NV[:, :VOCAB], dim=-1).gather(-1, tokens_N[:, None])[:, 0]
    assert (logp_N - direct_N).abs().max() <= 1e-6


def test_all_padding_tile_is_the_identity_partial():
    z_NW = torch.full((2, 2 * TILE), -float("inf"))
    z_NW[:, :3] = torch.tensor([1.0, 2.0, 3.0])
    m_NL, s_NL = tile_partials(z_NW, TILE)
    assert m_NL[:, 1].eq(-float("inf")).all() and s_NL[:, 1].eq(0).all()
    lse_N = merge_partials(m_NL, s_NL)
    assert torch.allclose(lse_N, torch.logsumexp(torch.tensor([1.0, 2.0, 3.0]), 0).expand(2))


def test_tree_sum_is_the_pairwise_order():
    x_NK = torch.randn(4, 11, generator=torch.Generator().manual_seed(6))
    for row, got in zip(x_NK.tolist(), tree_sum(x_NK).tolist(), strict=True):
        values = row + [0.0] * 5
        while len(values) > 1:
            half = len(values) // 2
            values = [float(torch.tensor(a) + torch.tensor(b)) for a, b in zip(values[:half], values[half:],
                                                                               strict=True)]
        assert got == values[0]


def test_shards_must_hold_whole_tiles():
    assert tp_shard_bounds(256, 4, 16) == [(0, 64), (64, 128), (128, 192), (192, 256)]
    with pytest.raises(ValueError, match="does not split into 3 shards"):
        tp_shard_bounds(256, 3, 16)
    with pytest.raises(ValueError, match="multiple of tp x tile_size = 128"):
        tp_shard_bounds(192, 2, 64)


def test_negative_control_a_per_shard_logsumexp_is_not_split_invariant():
    """The naive TP merge (torch.logsumexp per shard, then over shards) moves bits with the split, which is
    what the fixed tile order prevents: this is what the bitwise test would catch."""
    logits_NV, _ = make_logits(7, num_tokens=512)
    z_NV = logits_NV[:, :VOCAB] / TEMPERATURE

    def naive(tp: int) -> torch.Tensor:
        parts = [torch.logsumexp(z_NV[:, a:min(b, VOCAB)], -1) for a, b in tp_shard_bounds(PADDED, tp, TILE)]
        return torch.logsumexp(torch.stack(parts, -1), -1)

    assert not torch.equal(naive(1), naive(2)) or not torch.equal(naive(1), naive(4))


# --- the GRPO loss on top, across TP x DP ---------------------------------------------------------------------------


def grpo_case(tp: int, dp: int, aggregation: str):
    """(per-sequence totals, summed rank losses, d loss / d logits) of a TP x DP split, each DP rank computing
    from its own rows' logit shards with the global normalizers and group statistics."""
    num_rows, num_positions, group_size = 12, 5, 4  # at dp=2 and dp=4, group 1 (rows 4..7) straddles ranks
    gen = torch.Generator().manual_seed(11)
    logits_BTV = 3 * torch.randn(num_rows, num_positions, PADDED, generator=gen)
    tokens_BT = torch.randint(0, VOCAB, (num_rows, num_positions), generator=gen)
    mask_BT = torch.rand(num_rows, num_positions, generator=gen) < 0.7
    mask_BT[2] = False
    logp_old_BT = naive_sampler_logprobs(logits_BTV, tokens_BT, TEMPERATURE, VOCAB) + 0.2 * torch.randn(
        num_rows, num_positions, generator=gen)
    logp_ref_BT = logp_old_BT + 0.3 * torch.randn(num_rows, num_positions, generator=gen)
    rewards_B = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    stats, norms = group_stats(rewards_B, group_size), count_normalizers(mask_BT)
    per_seq, losses, grad_rows = [], [], []
    for rows in dp_slices(num_rows, dp):
        shards = [logits_BTV[rows, :, a:b].clone().requires_grad_() for a, b in tp_shard_bounds(PADDED, tp, TILE)]
        logp_bT = vocab_parallel_logprobs(shards, tokens_BT[rows], vocab_size=VOCAB, temperature=TEMPERATURE,
                                          tile_size=TILE, chunk_tokens=3)
        adv_b = group_advantages(rewards_B[rows], stats, group_size, row_start=rows.start, scale_std=True)
        out = grpo_loss(logp_bT, logp_old_BT[rows], logp_ref_BT[rows], token_advantages(adv_b, mask_BT[rows]),
                        mask_BT[rows], clip_eps=0.2, kl_coef=0.05, aggregation=aggregation, normalizers=norms,
                        constant=8.0 if aggregation == "seq_mean_token_sum_norm" else None)
        out.loss.backward()
        per_seq.append(out.per_sequence_B.detach())
        losses.append(out.loss.detach())
        grad_rows.append(torch.cat([s.grad for s in shards], dim=-1))
    return torch.cat(per_seq), sum(losses), torch.cat(grad_rows)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_grpo_loss_per_sequence_totals_and_logit_gradients_are_bitwise_across_tp_x_dp(aggregation):
    per_seq_11, loss_11, grad_11 = grpo_case(1, 1, aggregation)
    assert grad_11.abs().sum() > 0 and (grad_11[..., VOCAB:] == 0).all()
    for tp, dp in ((2, 1), (1, 2), (2, 2), (4, 2), (2, 4)):
        per_seq, loss, grad = grpo_case(tp, dp, aggregation)
        assert torch.equal(per_seq, per_seq_11), (tp, dp)
        assert torch.equal(grad, grad_11), (tp, dp)
        assert torch.equal(per_seq.sum(), loss_11)  # the gathered totals summed in global order: bitwise
        # the ranks' own scalar losses summed: the rounding of that last sum only
        assert abs((loss - loss_11).item()) <= 2 * torch.finfo(torch.float32).eps * per_seq_11.abs().sum().item()


# --- real TP ranks over gloo --------------------------------------------------------------------------------------


def _tp_worker(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        logits_NV, tokens_N = make_logits(8)
        start, end = tp_shard_bounds(PADDED, world, TILE)[rank]
        shard_NW = logits_NV[:, start:end].clone().requires_grad_()
        logp_N = tp_rank_logprobs(shard_NW, tokens_N, vocab_start=start, vocab_size=VOCAB, temperature=TEMPERATURE,
                                  tile_size=TILE, chunk_tokens=40)  # chunks of 40, 40, 16 tokens
        (logp_N * torch.linspace(-1.0, 2.0, NUM_TOKENS)).sum().backward()
        # numpy arrays travel by value; a tensor would travel as a shared-memory handle the exiting rank closes
        queue.put((rank, logp_N.detach().numpy(), shard_NW.grad.numpy()))
    finally:
        dist.destroy_process_group()


def test_gloo_tp2_ranks_are_bitwise_the_single_process():
    results = spawn_ranks(2, _tp_worker)
    logp_N, grad_NV = split_logprobs(*make_logits(8), 1)
    for _, logp_rank, _ in results:
        assert torch.equal(torch.from_numpy(logp_rank), logp_N)
    assert torch.equal(torch.cat([torch.from_numpy(g) for _, _, g in results], dim=-1), grad_NV)
