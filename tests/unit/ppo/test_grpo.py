"""qualify.ppo.grpo against slow, obvious Python loops, and its DP splits against the single process.

Independent implementation: TRL 1.16 (the dev extra). Its GRPO loss lives in GRPOTrainer._compute_loss, so a
real GRPOTrainer is built on the tiny Qwen3 (a word-level tokenizer made in memory, nothing downloaded) and
its loss and parameter gradients are compared for loss_type bnpo, grpo and dr_grpo (= token_mean,
seq_mean_token_mean and seq_mean_token_sum_norm with constant = max_completion_length, on a batch whose
rows all have active tokens: TRL divides by all B rows). TRL's default use_bias_correction_kl=True multiplies
the KL term by the ratio, which qualify does not do: it is switched off. trl.trainer.utils.nanstd is compared
with the unbiased group std.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from qualify.errors import QualifyError
from qualify.ppo.grpo import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    DataParallelError,
    all_gather_rewards,
    dp_slices,
    group_advantages,
    group_stats,
    grpo_loss,
    kl_estimate,
    per_sequence_loss,
    token_advantages,
)
from qualify.ppo.share import Normalizers, all_reduce_normalizers, count_normalizers
from tests.unit._ranks import spawn_ranks

NUM_ROWS, NUM_POS, GROUP = 12, 9, 4  # 3 groups of 4: at dp=2 and dp=4, group 1 straddles two ranks
CONSTANT = 16.0


def make_mask(seed: int, num_rows: int = NUM_ROWS, num_positions: int = NUM_POS) -> torch.Tensor:
    """Random rows plus the edge cases: an empty row, a single token, a full row, a prompt + response span."""
    gen = torch.Generator().manual_seed(seed)
    mask_BT = torch.rand(num_rows, num_positions, generator=gen) < 0.6
    mask_BT[0] = False
    mask_BT[1] = False
    mask_BT[1, 4] = True
    mask_BT[5] = True
    mask_BT[6] = False
    mask_BT[6, 3:7] = True
    return mask_BT


def randn(seed: int, *shape: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def agg_args(aggregation: str) -> dict:
    return {"aggregation": aggregation, "constant": CONSTANT if aggregation == "seq_mean_token_sum_norm" else None}


# --- slow references ------------------------------------------------------------------------------------------


def slow_advantages(rewards: list[float], group_size: int, scale_std: bool, unbiased: bool, eps: float) -> list[float]:
    out = []
    for g in range(len(rewards) // group_size):
        rs = rewards[g * group_size : (g + 1) * group_size]
        mean = sum(rs) / len(rs)
        var = sum((r - mean) ** 2 for r in rs) / max(len(rs) - (1 if unbiased else 0), 1)
        for r in rs:
            if all(x == rs[0] for x in rs):
                out.append(0.0)
            elif scale_std:
                out.append((r - mean) / (math.sqrt(var) + eps))
            else:
                out.append(r - mean)
    return out


def slow_kl(logp: torch.Tensor, ref: torch.Tensor, estimator: str, old: torch.Tensor | None = None) -> torch.Tensor:
    """One token's KL estimate from 0-d tensors, written from the textbook formulas (k3_ratio: TRL's
    use_bias_correction_kl, k3 times the importance weight exp(logp - old), kept differentiable)."""
    if estimator == "k3_ratio":
        return slow_kl(logp, ref, "k3") * torch.exp(logp - old)
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    ratio = torch.exp(ref - logp)
    return ratio - torch.log(ratio) - 1


def slow_aggregate(terms: list[list[torch.Tensor | None]], aggregation: str) -> torch.Tensor:
    """terms[b][t] is a 0-d tensor on active tokens, None elsewhere."""
    active_rows = [[x for x in row if x is not None] for row in terms]
    num_tokens = sum(len(r) for r in active_rows)
    rows = [r for r in active_rows if r]
    total = torch.zeros((), dtype=torch.float64)
    if aggregation == "token_mean":
        for r in rows:
            for x in r:
                total = total + x
        return total / max(num_tokens, 1)
    for r in rows:
        row_sum = torch.zeros((), dtype=torch.float64)
        for x in r:
            row_sum = row_sum + x
        total = total + (row_sum / len(r) if aggregation == "seq_mean_token_mean" else row_sum / CONSTANT)
    return total / max(len(rows), 1)


def slow_grpo(logp, logp_old, logp_ref, adv, mask, clip_eps, clip_high, kl_coef, estimator, aggregation):
    """Token by token: (loss, policy_loss, kl) as 0-d tensors that carry autograd back to logp."""
    loss_terms, pg_terms, kl_terms = [], [], []
    for b in range(mask.shape[0]):
        loss_row, pg_row, kl_row = [], [], []
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                loss_row.append(None), pg_row.append(None), kl_row.append(None)
                continue
            ratio = torch.exp(logp[b, t] - logp_old[b, t])
            a = adv[b, t]
            pg = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - clip_eps, 1 + clip_high))
            kl = slow_kl(logp[b, t], logp_ref[b, t], estimator, logp_old[b, t])
            loss_row.append(pg + kl_coef * kl), pg_row.append(pg), kl_row.append(kl)
        loss_terms.append(loss_row), pg_terms.append(pg_row), kl_terms.append(kl_row)
    return tuple(slow_aggregate(x, aggregation) for x in (loss_terms, pg_terms, kl_terms))


def grpo_inputs(seed: int, dtype=torch.float64):
    mask_BT = make_mask(seed)
    logp_BT = (-randn(seed + 1, NUM_ROWS, NUM_POS, dtype=dtype).abs()).requires_grad_()
    logp_old_BT = (logp_BT.detach() + 0.3 * randn(seed + 2, NUM_ROWS, NUM_POS, dtype=dtype)).clamp_max(0)
    logp_ref_BT = (logp_BT.detach() + 0.5 * randn(seed + 3, NUM_ROWS, NUM_POS, dtype=dtype)).clamp_max(0)
    rewards_B = torch.randint(0, 3, (NUM_ROWS,), generator=torch.Generator().manual_seed(seed)).to(dtype)
    rewards_B[8:12] = 1.0  # one group of identical rewards
    return mask_BT, logp_BT, logp_old_BT, logp_ref_BT, rewards_B


# --- dp_slices -------------------------------------------------------------------------------------------------


def test_dp_slices_cover_every_row_in_order():
    assert dp_slices(12, 4) == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 12)]
    assert dp_slices(5, 1) == [slice(0, 5)]


@pytest.mark.parametrize(("num_rows", "dp"), [(10, 4), (13, 2), (3, 4)])
def test_dp_slices_refuse_a_batch_that_does_not_divide(num_rows, dp):
    with pytest.raises(DataParallelError, match=rf"{num_rows} sequences do not split evenly over dp={dp}"):
        dp_slices(num_rows, dp)
    assert issubclass(DataParallelError, QualifyError)


# --- advantages ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_std", [True, False])
@pytest.mark.parametrize("std_estimator", ["population", "unbiased"])
def test_group_advantages_match_slow_loop(scale_std, std_estimator):
    rewards_B = randn(3, NUM_ROWS)
    rewards_B[4:8] = 0.1  # identical group: 0.1 * 4 / 4 does not round back to 0.1
    stats = group_stats(rewards_B, GROUP, std_estimator)
    got_B = group_advantages(rewards_B, stats, GROUP, scale_std=scale_std, eps=1e-6)
    expected = slow_advantages(rewards_B.tolist(), GROUP, scale_std, std_estimator == "unbiased", 1e-6)
    assert torch.allclose(got_B, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert (got_B[4:8] == 0).all()


def test_identical_group_gives_exact_zero_not_nan():
    for value in (0.1, 1.0 / 3.0, 0.0, -7.25):
        rewards_B = torch.full((GROUP,), value, dtype=torch.float32)
        for std_estimator in ("population", "unbiased"):
            stats = group_stats(rewards_B, GROUP, std_estimator)
            adv_B = group_advantages(rewards_B, stats, GROUP, scale_std=True, eps=0.0)
            assert (adv_B == 0).all() and not adv_B.isnan().any(), (value, adv_B)


def test_group_size_one_unbiased_is_zero():
    stats = group_stats(torch.tensor([1.0, 2.0]), 1, "unbiased")
    assert (stats.std == 0).all() and stats.identical.all()


def test_group_stats_refuse_partial_groups_and_unknown_estimator():
    with pytest.raises(ValueError, match="do not form whole groups of 5"):
        group_stats(torch.zeros(12), 5)
    with pytest.raises(ValueError, match="unknown std_estimator 'sample'"):
        group_stats(torch.zeros(12), 4, "sample")


def test_token_advantages_broadcast_on_mask_only():
    mask_BT = make_mask(0)
    adv_B = randn(1, NUM_ROWS)
    got_BT = token_advantages(adv_B, mask_BT)
    for b in range(NUM_ROWS):
        for t in range(NUM_POS):
            assert got_BT[b, t].item() == (adv_B[b].item() if mask_BT[b, t] else 0.0)


def test_unbiased_std_matches_trl_nanstd():
    trl_utils = pytest.importorskip("trl.trainer.utils")
    rewards_B = randn(5, NUM_ROWS)
    ours_G = group_stats(rewards_B, GROUP, "unbiased").std
    theirs_G = trl_utils.nanstd(rewards_B.view(-1, GROUP), dim=1)
    # TRL multiplies the variance by count / (count - 1), an int64 division that torch rounds to float32
    assert torch.allclose(ours_G, theirs_G, rtol=1e-7, atol=0)
    population_G = group_stats(rewards_B, GROUP, "population").std
    assert not torch.allclose(population_G, theirs_G, rtol=1e-3)  # the estimators really differ


# --- KL ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_estimators_and_gradients_match_slow_loop(estimator):
    mask_BT = make_mask(2)
    logp_BT = (-randn(3, NUM_ROWS, NUM_POS).abs()).requires_grad_()
    ref_BT = -randn(4, NUM_ROWS, NUM_POS).abs()
    old_BT = -randn(6, NUM_ROWS, NUM_POS).abs()
    got_BT = kl_estimate(logp_BT, ref_BT, mask_BT, estimator, torch.exp(logp_BT - old_BT))
    weights_BT = randn(5, NUM_ROWS, NUM_POS)
    (grad_BT,) = torch.autograd.grad((got_BT * weights_BT).sum(), logp_BT)

    slow_logp_BT = logp_BT.detach().clone().requires_grad_()
    total = torch.zeros((), dtype=torch.float64)
    for b in range(NUM_ROWS):
        for t in range(NUM_POS):
            if mask_BT[b, t]:
                kl = slow_kl(slow_logp_BT[b, t], ref_BT[b, t], estimator, old_BT[b, t])
                assert math.isclose(got_BT[b, t].item(), kl.item(), rel_tol=1e-12, abs_tol=1e-14)
                total = total + weights_BT[b, t] * kl
            else:
                assert got_BT[b, t].item() == 0.0
    (slow_grad_BT,) = torch.autograd.grad(total, slow_logp_BT)
    assert torch.allclose(grad_BT, slow_grad_BT, rtol=1e-12, atol=1e-14)


def test_kl_ignores_garbage_off_mask():
    mask_BT = make_mask(1)
    logp_BT = torch.where(mask_BT, -1.0, float("-inf")).double().requires_grad_()
    ref_BT = torch.where(mask_BT, -2.0, float("nan")).double()
    for estimator in KL_ESTIMATORS:
        ratio_BT = torch.exp(torch.where(mask_BT, logp_BT - 1.5, 0.0))  # as grpo_loss makes it: 1 off the mask
        kl_BT = kl_estimate(logp_BT, ref_BT, mask_BT, estimator, ratio_BT)
        (grad_BT,) = torch.autograd.grad(kl_BT.sum(), logp_BT)
        assert kl_BT.isfinite().all() and grad_BT.isfinite().all()
        assert (grad_BT[~mask_BT] == 0).all()
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_estimate(logp_BT, ref_BT, mask_BT, "k4")
    with pytest.raises(ValueError, match="k3_ratio KL estimator needs the ratio"):
        kl_estimate(logp_BT, ref_BT, mask_BT, "k3_ratio")


# --- aggregation and the loss ----------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_aggregated_loss_matches_slow_loop(aggregation):
    mask_BT = make_mask(3)
    x_BT = randn(4, NUM_ROWS, NUM_POS)
    got = per_sequence_loss(x_BT, mask_BT, normalizers=count_normalizers(mask_BT), **agg_args(aggregation)).sum()
    terms = [[x_BT[b, t] if mask_BT[b, t] else None for t in range(NUM_POS)] for b in range(NUM_ROWS)]
    assert math.isclose(got.item(), slow_aggregate(terms, aggregation).item(), rel_tol=1e-13)


def test_aggregation_arguments_are_checked():
    mask_BT = make_mask(3)
    x_BT, norms = randn(4, NUM_ROWS, NUM_POS), count_normalizers(mask_BT)
    with pytest.raises(ValueError, match="unknown loss aggregation 'seq_sum'"):
        per_sequence_loss(x_BT, mask_BT, "seq_sum", norms)
    with pytest.raises(ValueError, match="constant is required"):
        per_sequence_loss(x_BT, mask_BT, "seq_mean_token_sum_norm", norms)
    with pytest.raises(ValueError, match="constant is required"):
        per_sequence_loss(x_BT, mask_BT, "token_mean", norms, constant=2.0)
    with pytest.raises(ValueError, match="constant must be > 0"):
        per_sequence_loss(x_BT, mask_BT, "seq_mean_token_sum_norm", norms, constant=0.0)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_grpo_loss_and_gradient_match_slow_loop(aggregation, estimator):
    mask_BT, logp_BT, logp_old_BT, logp_ref_BT, rewards_B = grpo_inputs(10)
    adv_BT = token_advantages(
        group_advantages(rewards_B, group_stats(rewards_B, GROUP), GROUP, scale_std=True), mask_BT
    )
    kwargs = {"clip_eps": 0.2, "clip_eps_high": 0.28, "kl_coef": 0.05, "kl_estimator": estimator}
    out = grpo_loss(logp_BT, logp_old_BT, logp_ref_BT, adv_BT, mask_BT, normalizers=count_normalizers(mask_BT),
                    **kwargs, **agg_args(aggregation))
    (grad_BT,) = torch.autograd.grad(out.loss, logp_BT)

    slow_logp_BT = logp_BT.detach().clone().requires_grad_()
    loss, pg, kl = slow_grpo(slow_logp_BT, logp_old_BT, logp_ref_BT, adv_BT, mask_BT, 0.2, 0.28, 0.05, estimator,
                             aggregation)
    (slow_grad_BT,) = torch.autograd.grad(loss, slow_logp_BT)
    for got, expected in ((out.loss, loss), (out.policy_loss, pg), (out.kl, kl)):
        assert math.isclose(got.item(), expected.item(), rel_tol=1e-12, abs_tol=1e-15)
    assert torch.allclose(grad_BT, slow_grad_BT, rtol=1e-11, atol=1e-15)
    assert torch.equal(out.per_sequence_B.sum(), out.loss)
    # the inputs really exercise clipping on both sides, and the clip fraction is in (0, 1)
    assert 0 < out.clip_frac.item() < 1


def test_clip_fraction_matches_slow_count():
    mask_BT, logp_BT, logp_old_BT, _, rewards_B = grpo_inputs(11)
    adv_BT = token_advantages(rewards_B - 1.0, mask_BT)
    out = grpo_loss(logp_BT, logp_old_BT, None, adv_BT, mask_BT, clip_eps=0.2, kl_coef=0.0,
                    aggregation="token_mean", normalizers=count_normalizers(mask_BT))
    clipped = 0
    for b, t in mask_BT.nonzero().tolist():
        r = math.exp(logp_BT[b, t].item() - logp_old_BT[b, t].item())
        a = adv_BT[b, t].item()
        clipped += -a * min(max(r, 0.8), 1.2) > -a * r
    assert math.isclose(out.clip_frac.item(), clipped / int(mask_BT.sum()), rel_tol=1e-12)
    assert out.kl.item() == 0.0 and torch.equal(out.loss, out.policy_loss)


def test_reference_is_required_with_a_kl_coefficient():
    mask_BT, logp_BT, logp_old_BT, _, _ = grpo_inputs(12)
    with pytest.raises(ValueError, match="reference logprob is required"):
        grpo_loss(logp_BT, logp_old_BT, None, torch.zeros_like(logp_old_BT), mask_BT, clip_eps=0.2, kl_coef=0.1,
                  aggregation="token_mean", normalizers=count_normalizers(mask_BT))


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_active_tokens_give_zero_loss_and_gradient(aggregation, dtype):
    mask_BT = torch.zeros(NUM_ROWS, NUM_POS, dtype=torch.bool)
    # garbage everywhere: none of it may reach a value or a gradient
    logp_BT = torch.full((NUM_ROWS, NUM_POS), float("inf"), dtype=dtype, requires_grad=True)
    logp_old_BT = torch.full((NUM_ROWS, NUM_POS), float("nan"), dtype=dtype)
    logp_ref_BT = torch.full((NUM_ROWS, NUM_POS), float("-inf"), dtype=dtype)
    adv_BT = torch.full((NUM_ROWS, NUM_POS), float("nan"), dtype=dtype)
    norms = count_normalizers(mask_BT)
    assert norms.num_active_tokens.item() == 0 and norms.num_active_sequences.item() == 0
    out = grpo_loss(logp_BT, logp_old_BT, logp_ref_BT, adv_BT, mask_BT, clip_eps=0.2, kl_coef=0.1,
                    kl_estimator="k3", normalizers=norms, **agg_args(aggregation))
    out.loss.backward()
    for value in (out.loss, out.policy_loss, out.kl, out.clip_frac):
        assert value.item() == 0.0
    assert (logp_BT.grad == 0).all() and not logp_BT.grad.isnan().any()


# --- data parallelism --------------------------------------------------------------------------------------------


def rank_losses(inputs, aggregation: str, dp: int, *, local_normalizers=False, local_groups=False):
    """Each DP rank's share, computed from its slice only plus the global normalizers and group stats.

    local_normalizers / local_groups switch on the two bugs the negative controls must catch.
    """
    mask_BT, logp_BT, logp_old_BT, logp_ref_BT, rewards_B = inputs
    global_stats = group_stats(rewards_B, GROUP)
    global_norms = count_normalizers(mask_BT)
    outs = []
    for rows in dp_slices(NUM_ROWS, dp):
        if local_groups:
            adv_b = slice_local_advantages(rewards_B[rows], rows.start)
        else:
            adv_b = group_advantages(rewards_B[rows], global_stats, GROUP, row_start=rows.start, scale_std=True)
        norms = count_normalizers(mask_BT[rows]) if local_normalizers else global_norms
        outs.append(grpo_loss(logp_BT[rows], logp_old_BT[rows], logp_ref_BT[rows],
                              token_advantages(adv_b, mask_BT[rows]), mask_BT[rows], clip_eps=0.2, kl_coef=0.05,
                              normalizers=norms, **agg_args(aggregation)))
    return outs


def slice_local_advantages(rewards_b: torch.Tensor, row_start: int) -> torch.Tensor:
    """The bug: each group normalized over the part of it that this rank holds."""
    group_b = (torch.arange(rewards_b.shape[0]) + row_start) // GROUP
    adv_b = torch.empty_like(rewards_b)
    for g in group_b.unique():
        part = rewards_b[group_b == g]
        std = part.std() if part.numel() > 1 else torch.zeros(())
        adv_b[group_b == g] = torch.where((part == part[0]).all(), 0.0, (part - part.mean()) / (std + 1e-6))
    return adv_b


def ulp(x: torch.Tensor) -> float:
    return torch.finfo(x.dtype).eps * max(abs(x.item()), torch.finfo(x.dtype).tiny)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dp", [2, 4])
def test_dp_ranks_sum_to_the_single_process_loss(aggregation, dtype, dp):
    inputs = grpo_inputs(20, dtype)
    logp_BT = inputs[1]
    single = rank_losses(inputs, aggregation, 1)[0]
    (single_grad_BT,) = torch.autograd.grad(single.loss, logp_BT)
    ranks = rank_losses(inputs, aggregation, dp)
    (split_grad_BT,) = torch.autograd.grad(sum(r.loss for r in ranks), logp_BT)

    # per-sequence contributions and the gradient are bitwise the single process's
    assert torch.equal(torch.cat([r.per_sequence_B for r in ranks]), single.per_sequence_B)
    assert torch.equal(split_grad_BT, single_grad_BT)
    # the sum over ranks differs only by the rounding of that last sum: within one ulp or so of the loss scale
    total = sum(r.loss.detach() for r in ranks)
    scale = single.per_sequence_B.detach().abs().sum()
    assert abs((total - single.loss).item()) <= 2 * ulp(scale), (total.item(), single.loss.item())
    # summing the gathered per-sequence contributions in global order is bitwise
    assert torch.equal(torch.cat([r.per_sequence_B for r in ranks]).sum(), single.loss)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("dp", [2, 4])
def test_negative_control_local_normalizer_does_not_match(aggregation, dp):
    inputs = grpo_inputs(20)
    single = rank_losses(inputs, aggregation, 1)[0].loss
    wrong = sum(r.loss for r in rank_losses(inputs, aggregation, dp, local_normalizers=True))
    assert abs((wrong - single).item()) > 1e-3 * abs(single.item()), (wrong.item(), single.item())


@pytest.mark.parametrize("dp", [2, 4])
def test_negative_control_groups_normalized_per_slice_do_not_match(dp):
    inputs = grpo_inputs(21)
    rewards_B = randn(22, NUM_ROWS)
    inputs = (*inputs[:4], rewards_B)
    stats = group_stats(rewards_B, GROUP)
    right_B = group_advantages(rewards_B, stats, GROUP, scale_std=True)
    wrong_B = torch.cat([slice_local_advantages(rewards_B[rows], rows.start) for rows in dp_slices(NUM_ROWS, dp)])
    # group 1 (rows 4..7) straddles ranks at dp=2 and dp=4; its advantages go wrong, group 0 stays right at dp=2
    assert not torch.allclose(right_B[4:8], wrong_B[4:8], rtol=1e-3)
    single = rank_losses(inputs, "token_mean", 1)[0].loss
    wrong = sum(r.loss for r in rank_losses(inputs, "token_mean", dp, local_groups=True))
    assert abs((wrong - single).item()) > 1e-3 * abs(single.item())


# --- the collectives, for real over gloo ---------------------------------------------------------------------------


def _dp_worker(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mask_BT, logp_BT, logp_old_BT, logp_ref_BT, rewards_B = grpo_inputs(30)
        rows = dp_slices(NUM_ROWS, world)[rank]
        rewards_all_B = all_gather_rewards(rewards_B[rows])
        norms = all_reduce_normalizers(count_normalizers(mask_BT[rows]))
        adv_b = group_advantages(rewards_B[rows], group_stats(rewards_all_B, GROUP), GROUP, row_start=rows.start,
                                 scale_std=True)
        logp_b = logp_BT.detach()[rows].clone().requires_grad_()
        out = grpo_loss(logp_b, logp_old_BT[rows], logp_ref_BT[rows], token_advantages(adv_b, mask_BT[rows]),
                        mask_BT[rows], clip_eps=0.2, kl_coef=0.05, aggregation="seq_mean_token_mean",
                        normalizers=norms)
        out.loss.backward()
        # numpy arrays travel by value; a tensor would travel as a shared-memory handle the exiting rank closes
        queue.put((rank, torch.equal(rewards_all_B, rewards_B), out.per_sequence_B.detach().numpy(),
                   logp_b.grad.numpy(), [int(norms.num_active_tokens), int(norms.num_active_sequences)]))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2])
def test_gloo_ranks_reproduce_the_single_process(world):
    results = spawn_ranks(world, _dp_worker)

    mask_BT, logp_BT, logp_old_BT, logp_ref_BT, rewards_B = grpo_inputs(30)
    norms = count_normalizers(mask_BT)
    adv_BT = token_advantages(group_advantages(rewards_B, group_stats(rewards_B, GROUP), GROUP, scale_std=True),
                              mask_BT)
    single = grpo_loss(logp_BT, logp_old_BT, logp_ref_BT, adv_BT, mask_BT, clip_eps=0.2, kl_coef=0.05,
                       aggregation="seq_mean_token_mean", normalizers=norms)
    single.loss.backward()
    assert all(r[1] for r in results)
    assert all(r[4] == [int(norms.num_active_tokens), int(norms.num_active_sequences)] for r in results)
    assert torch.equal(torch.cat([torch.from_numpy(r[2]) for r in results]), single.per_sequence_B.detach())
    assert torch.equal(torch.cat([torch.from_numpy(r[3]) for r in results]), logp_BT.grad)


def test_normalizers_are_int64_counts():
    mask_BT = make_mask(4)
    norms = count_normalizers(mask_BT)
    assert isinstance(norms, Normalizers)
    assert norms.num_active_tokens.item() == sum(int(x) for row in mask_BT.tolist() for x in row)
    assert norms.num_active_sequences.item() == sum(any(row) for row in mask_BT.tolist())


# --- TRL's GRPOTrainer, for real --------------------------------------------------------------------------------

TRL_LOSS_TYPES = {"bnpo": "token_mean", "grpo": "seq_mean_token_mean", "dr_grpo": "seq_mean_token_sum_norm"}


def trl_trainer(loss_type: str, model_dir: str, max_completion_length: int):
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    vocab = {f"t{i}": i for i in range(64)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1")),
                                        pad_token="t0", eos_token="t63", unk_token="t1")
    args = GRPOConfig(output_dir=f"{model_dir}/out-{loss_type}", loss_type=loss_type, beta=0.05, epsilon=0.2,
                      epsilon_high=0.28, num_generations=4, per_device_train_batch_size=4,
                      max_completion_length=max_completion_length, use_bias_correction_kl=False, report_to=[],
                      use_cpu=True)
    return GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                       train_dataset=Dataset.from_dict({"prompt": ["t3 t4"] * 4}), processing_class=tokenizer)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_loss_and_parameter_gradients_match_trl_grpo_trainer(tmp_path):
    pytest.importorskip("trl")
    from qualify.matrix import TinyModel
    from qualify.models.tiny import build_tiny_model

    build_tiny_model(TinyModel(seed=3, vocab_size=64), "actor").save_pretrained(tmp_path)
    num_rows, prompt_len, num_positions = 4, 2, 6
    gen = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(2, 63, (num_rows, prompt_len), generator=gen)
    completion_ids = torch.randint(2, 63, (num_rows, num_positions), generator=gen)
    completion_mask = torch.ones(num_rows, num_positions, dtype=torch.long)
    completion_mask[1, 4:] = 0
    completion_mask[2, 1:] = 0
    mask_BT = completion_mask.bool()
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([torch.ones_like(prompt_ids), completion_mask], 1)
    advantages_B = torch.tensor([1.0, -0.5, 0.3, -0.8])
    for loss_type, aggregation in TRL_LOSS_TYPES.items():
        trainer = trl_trainer(loss_type, str(tmp_path), num_positions)
        model = trainer.model.eval()
        with torch.no_grad():
            logp_BT = trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, num_positions)[0]
        logp_old_BT = logp_BT + 0.3 * torch.randn(num_rows, num_positions, generator=gen)
        logp_ref_BT = logp_BT + 0.5 * torch.randn(num_rows, num_positions, generator=gen)
        inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
                  "completion_ids": completion_ids, "completion_mask": completion_mask, "advantages": advantages_B,
                  "old_per_token_logps": logp_old_BT, "ref_per_token_logps": logp_ref_BT}
        theirs = trainer._compute_loss(model, inputs)
        theirs_grads = torch.autograd.grad(theirs, list(model.parameters()))

        live_logp_BT = trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, num_positions)[0]
        ours = grpo_loss(live_logp_BT, logp_old_BT, logp_ref_BT, token_advantages(advantages_B, mask_BT), mask_BT,
                         clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.05, kl_estimator="k3", aggregation=aggregation,
                         normalizers=count_normalizers(mask_BT),
                         constant=float(num_positions) if aggregation == "seq_mean_token_sum_norm" else None)
        ours_grads = torch.autograd.grad(ours.loss, list(model.parameters()))
        # fp32, and the loss is a small difference of terms near 1e-2: an absolute bound at that scale
        assert math.isclose(ours.loss.item(), theirs.item(), rel_tol=1e-6, abs_tol=1e-7), (loss_type, ours, theirs)
        for mine, trl_grad in zip(ours_grads, theirs_grads, strict=True):
            assert torch.allclose(mine, trl_grad, rtol=1e-4, atol=1e-7), loss_type
        # negative control: the other aggregations do not match this loss type (rows have 6, 4, 1, 6 tokens)
        for other in set(TRL_LOSS_TYPES.values()) - {aggregation}:
            wrong = grpo_loss(logp_BT, logp_old_BT, logp_ref_BT, token_advantages(advantages_B, mask_BT), mask_BT,
                              clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.05, aggregation=other,
                              normalizers=count_normalizers(mask_BT),
                              constant=float(num_positions) if other == "seq_mean_token_sum_norm" else None)
            assert not math.isclose(wrong.loss.item(), theirs.item(), rel_tol=1e-3), (loss_type, other)
