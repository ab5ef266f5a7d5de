"""The TRL adapter's objective (qualify.examples.trl_grpo, TRL's own GRPOTrainer._compute_loss) on two real gloo DP
ranks holding unequal tokens: for each aggregation with its TRL loss type ('dapo' for token_mean) the ranks' losses,
KL means, clip fractions and per-row contributions sum to the single-process GRPO objective of the whole step, and
their logprob gradients are the whole step's; TRL's 'bnpo' (this process's tokens) is off at DP2."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from qualify.matrix import GRPO, PPO
from qualify.ppo.grpo import dp_slices
from qualify.ppo.objective import grpo_dp_share, role_objective
from tests.unit._ranks import spawn_ranks

ROWS, POS, G, DP = 8, 6, 4, 2
CASES = {"token_mean": GRPO(group_size=G, kl_coef=0.04, eps=1e-4),
         "seq_mean_token_mean": GRPO(group_size=G, kl_coef=0.04, eps=1e-4, aggregation="seq_mean_token_mean"),
         "seq_mean_token_sum_norm": GRPO(group_size=G, kl_coef=0.04, eps=1e-4, aggregation="seq_mean_token_sum_norm",
                                         constant=6.0)}


def inputs():
    """Every row holds a response token; rank 0 holds 20 active tokens, rank 1 holds 9; group 0 and 1 each whole on
    one rank (groups of 4, 4 rows per rank); the policy off the old one so that some tokens clip."""
    gen = torch.Generator().manual_seed(17)
    lengths = [6, 5, 5, 4, 3, 2, 2, 2]
    mask_BT = torch.arange(POS)[None, :] < torch.tensor(lengths)[:, None]
    logp_BT = -torch.rand(ROWS, POS, generator=gen) * 3
    targets = {"old_logprobs_BT": logp_BT + 0.4 * torch.randn(ROWS, POS, generator=gen),
               "ref_logprobs_BT": logp_BT + 0.2 * torch.randn(ROWS, POS, generator=gen),
               "score_B": torch.randn(ROWS, generator=gen)}
    return mask_BT, logp_BT, targets


def _worker(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    from qualify.examples.trl_grpo import TRLGRPOEngine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mask_BT, logp_BT, targets = inputs()
        rows = dp_slices(ROWS, world)[rank]
        out = {}
        for name, grpo in [*CASES.items(), ("bnpo", CASES["token_mean"])]:
            engine = TRLGRPOEngine({"loss_type": "bnpo"} if name == "bnpo" else None)
            engine.ctx, engine.dp_group = SimpleNamespace(dp=world, dp_rank=rank), dist.group.WORLD
            mine = {k: v[rows] for k, v in targets.items()}
            share = grpo_dp_share(grpo, mine["score_B"], mask_BT[rows], rows.start, dist.group.WORLD)
            logp_b = logp_BT[rows].clone().requires_grad_()
            loss, outputs = engine.objective("actor", PPO(clip_eps=0.2), logp_b, mask_BT[rows], mine, grpo=grpo,
                                             share=share)
            loss.backward()
            out[name] = {"loss": float(loss.detach()), "grad": logp_b.grad.numpy(),
                         **{k: float(outputs[k]) for k in ("kl_mean", "clip_frac", "policy_loss")},
                         "seq_loss_B": outputs["seq_loss_B"].numpy()}
        queue.put((rank, out, int(mask_BT[rows].sum())))
    finally:
        dist.destroy_process_group()


def test_trl_adapter_at_dp2_is_the_steps_grpo_objective():
    pytest.importorskip("trl")
    results = spawn_ranks(DP, _worker, timeout=300)
    assert [r[2] for r in results] == [20, 9]  # unequal tokens per rank
    mask_BT, logp_BT, targets = inputs()
    for name, grpo in CASES.items():
        whole = logp_BT.clone().requires_grad_()
        loss, out = role_objective("actor", PPO(clip_eps=0.2), whole, mask_BT, targets, grpo=grpo)
        loss.backward()
        ranks = [r[1][name] for r in results]
        assert sum(r["loss"] for r in ranks) == pytest.approx(float(loss.detach()), rel=1e-6), name
        assert sum(r["policy_loss"] for r in ranks) == pytest.approx(float(out["policy_loss"]), rel=1e-5), name
        if name == "token_mean":  # TRL logs the KL and the clip ratio as token means: the matrix's under token_mean
            assert sum(r["kl_mean"] for r in ranks) == pytest.approx(float(out["kl_mean"]), rel=1e-6)
            assert sum(r["clip_frac"] for r in ranks) == pytest.approx(float(out["clip_frac"]), rel=1e-6)
            assert 0 < float(out["clip_frac"]) < 1
        seq_B = torch.cat([torch.from_numpy(r["seq_loss_B"]) for r in ranks])
        torch.testing.assert_close(seq_B, out["seq_loss_B"], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(torch.cat([torch.from_numpy(r["grad"]) for r in ranks]), whole.grad,
                                   rtol=1e-5, atol=1e-9)
    # 'bnpo': each process's own token mean, averaged by DDP: off the step's token mean by far more than rounding
    whole_loss, _ = role_objective("actor", PPO(clip_eps=0.2), logp_BT, mask_BT, targets, grpo=CASES["token_mean"])
    bnpo = sum(r[1]["bnpo"]["loss"] for r in results)
    assert abs(bnpo - float(whole_loss)) > 1e-3 * abs(float(whole_loss))
