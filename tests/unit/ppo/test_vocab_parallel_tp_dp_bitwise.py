"""The deterministic vocab-parallel logprob (qualify.ppo.vocab_parallel) under the GRPO objective (qualify.ppo.objective)
on real gloo ranks: given identical logits, TP1xDP2, TP2xDP1 and TP2xDP2 give per-sequence loss terms, the loss (the
per-sequence terms summed in one fixed tree) and the logits' gradient bitwise equal to the single process; a group
of the batch straddles the two DP ranks, and one row has no active token."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from qualify.matrix import GRPO, PPO
from qualify.ppo.grpo import dp_slices
from qualify.ppo.objective import grpo_dp_share, grpo_objective, grpo_share
from qualify.ppo.vocab_parallel import tp_rank_logprobs, tp_shard_bounds, tree_sum, vocab_parallel_logprobs

ROWS, POS, VOCAB, PADDED, TILE, G, TEMPERATURE = 12, 5, 250, 256, 32, 4, 0.7
SETTINGS = GRPO(group_size=G, aggregation="seq_mean_token_mean", kl_coef=0.04), PPO(clip_eps=0.2)


def inputs():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(ROWS, POS, PADDED, generator=gen) * 3
    tokens = torch.randint(0, VOCAB, (ROWS, POS), generator=gen)
    mask = torch.rand(ROWS, POS, generator=gen) > 0.25
    mask[7] = False  # a row with no active token
    targets = {"old_logprobs_BT": -torch.rand(ROWS, POS, generator=gen) * 6,
               "ref_logprobs_BT": -torch.rand(ROWS, POS, generator=gen) * 6, "score_B": torch.randn(ROWS, generator=gen)}
    return logits, tokens, mask, targets


def total(seq_B: torch.Tensor) -> torch.Tensor:
    """The loss as the per-sequence terms summed in one fixed pairwise tree (not torch.sum's layout-dependent order)."""
    return tree_sum(seq_B[None])[0]


def single():
    logits, tokens, mask, targets = inputs()
    x = logits.clone().requires_grad_()
    logp = vocab_parallel_logprobs([x], tokens, vocab_size=VOCAB, temperature=TEMPERATURE, tile_size=TILE)
    grpo, ppo = SETTINGS
    loss, out = grpo_objective(ppo, grpo, logp, mask, targets, grpo_share(grpo, targets["score_B"], mask))
    loss.backward()
    return out["seq_loss_B"], total(out["seq_loss_B"]), x.grad


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, tp: int, dp: int, port: int, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=tp * dp)
    try:
        dp_rank, tp_rank = divmod(rank, tp)
        tp_groups = [dist.new_group([d * tp + t for t in range(tp)]) for d in range(dp)]
        dp_groups = [dist.new_group([d * tp + t for d in range(dp)]) for t in range(tp)]
        logits, tokens, mask, targets = inputs()
        rows = dp_slices(ROWS, dp)[dp_rank]
        start, end = tp_shard_bounds(PADDED, tp, TILE)[tp_rank]
        shard = logits[rows, :, start:end].clone().requires_grad_()
        logp = tp_rank_logprobs(shard, tokens[rows], vocab_start=start, vocab_size=VOCAB, temperature=TEMPERATURE,
                                tile_size=TILE, group=tp_groups[dp_rank])
        grpo, ppo = SETTINGS
        mine = {k: v[rows] for k, v in targets.items()}
        share = grpo_dp_share(grpo, mine["score_B"], mask[rows], rows.start, dp_groups[tp_rank])
        loss, out = grpo_objective(ppo, grpo, logp, mask[rows], mine, share)
        loss.backward()
        gathered = [torch.empty_like(out["seq_loss_B"]) for _ in range(dp)]
        dist.all_gather(gathered, out["seq_loss_B"].contiguous(), group=dp_groups[tp_rank])
        # numpy arrays travel by value; a tensor would travel as a shared-memory handle the exiting rank closes
        queue.put((rank, rows.start, start, out["seq_loss_B"].numpy(), total(torch.cat(gathered)).numpy(),
                   shard.grad.numpy()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("tp", "dp"), [(1, 2), (2, 1), (2, 2)])
def test_tp_x_dp_ranks_are_bitwise_the_single_process(tp, dp):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, tp, dp, port, queue)) for r in range(tp * dp)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * (tp * dp)
    seq_B, loss, grad = single()
    grad_parts = torch.zeros_like(grad)
    for _, row0, col0, seq_b, loss_r, grad_r in results:
        seq_b, grad_r = torch.from_numpy(seq_b), torch.from_numpy(grad_r)
        assert torch.equal(seq_b, seq_B[row0:row0 + seq_b.shape[0]])  # per-sequence terms
        assert torch.equal(torch.from_numpy(loss_r), loss)  # the loss, every rank
        grad_parts[row0:row0 + grad_r.shape[0], :, col0:col0 + grad_r.shape[-1]] = grad_r
    assert torch.equal(grad_parts, grad)  # the logits' gradient, every (row, column) block
    assert not grad[7].any() and grad.abs().sum() > 0
