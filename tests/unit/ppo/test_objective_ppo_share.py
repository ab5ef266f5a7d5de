"""PPO's share of a step (qualify.ppo.objective.PPOShare: the step's normalizers) against an obvious loop: the DP
ranks' (or micro-batches') losses, clip fractions and KL means sum to the whole step's for every token normalizer,
with unequal active tokens per rank; each rank's per-token gradient is bitwise the whole step's; a rank that divides
by its own tokens instead (a mean of per-rank means) is off; over real gloo ranks the normalizers are global."""

from __future__ import annotations

import math
import os

import pytest
import torch

from qualify.matrix import PPO
from qualify.ppo.grpo import dp_slices
from qualify.ppo.objective import PPOShare, ppo_dp_share, ppo_share, role_objective
from qualify.ppo.share import count_normalizers
from tests.unit._ranks import spawn_ranks

ROWS, POS, DP = 8, 7, 2
NORMALIZERS = [("global", None), ("per_sequence", None), ("constant", 9.0)]


def inputs(seed: int = 11) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """float64 inputs whose DP ranks hold unequal active tokens (rank 0: 24, rank 1: 9) and a row without any."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [7, 6, 6, 5, 4, 0, 3, 2]
    mask_BT = torch.arange(POS)[None, :] < torch.tensor(lengths)[:, None]
    logp_BT = -torch.rand(ROWS, POS, generator=gen, dtype=torch.float64) * 3
    values_BT = torch.randn(ROWS, POS, generator=gen, dtype=torch.float64)
    targets = {"old_logprobs_BT": logp_BT + 0.3 * torch.randn(ROWS, POS, generator=gen, dtype=torch.float64),
               "ref_logprobs_BT": logp_BT + 0.2 * torch.randn(ROWS, POS, generator=gen, dtype=torch.float64),
               "advantages_BT": torch.randn(ROWS, POS, generator=gen, dtype=torch.float64),
               "old_values_BT": values_BT + 0.3 * torch.randn(ROWS, POS, generator=gen, dtype=torch.float64),
               "returns_BT": torch.randn(ROWS, POS, generator=gen, dtype=torch.float64)}
    return mask_BT, {"actor": logp_BT, "critic": values_BT}, targets


def loop_terms(role: str, ppo: PPO, mask_BT, scores_BT, targets) -> dict[str, list[list[float]]]:
    """Per row, the list of (loss term, clipped, kl) of each active token, one element at a time."""
    rows = []
    for b in range(ROWS):
        row = []
        for t in range(POS):
            if not mask_BT[b, t]:
                continue
            x = float(scores_BT[b, t])
            if role == "actor":
                ratio, a = math.exp(x - float(targets["old_logprobs_BT"][b, t])), float(targets["advantages_BT"][b, t])
                plain, clipped = -a * ratio, -a * min(max(ratio, 1 - ppo.clip_eps), 1 + ppo.clip_eps)
                kl = x - float(targets["ref_logprobs_BT"][b, t])
            else:
                old, ret = float(targets["old_values_BT"][b, t]), float(targets["returns_BT"][b, t])
                v_clip = old + min(max(x - old, -ppo.value_clip_eps), ppo.value_clip_eps)
                plain, clipped, kl = 0.5 * (x - ret) ** 2, 0.5 * (v_clip - ret) ** 2, 0.0
            row.append((max(plain, clipped), float(clipped > plain), kl))
        rows.append(row)
    return rows


def loop_mean(rows: list[list[tuple]], k: int, normalizer: str, constant: float | None) -> float:
    """The step's mean of term k over active tokens, as the normalizer says."""
    if normalizer == "global":
        return sum(r[k] for row in rows for r in row) / sum(len(row) for row in rows)
    if normalizer == "constant":
        return sum(r[k] for row in rows for r in row) / constant
    means = [sum(r[k] for r in row) / len(row) for row in rows if row]
    return sum(means) / len(means)


def ppo_of(normalizer: str, constant: float | None) -> PPO:
    return PPO(token_normalizer=normalizer, normalizer_constant=constant)


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize(("normalizer", "constant"), NORMALIZERS)
def test_dp_shares_sum_to_the_obvious_loop(role, normalizer, constant):
    mask_BT, scores, targets = inputs()
    ppo = ppo_of(normalizer, constant)
    whole_share = ppo_share(mask_BT)
    assert [int(mask_BT[rows].sum()) for rows in dp_slices(ROWS, DP)] == [24, 9]  # unequal tokens per rank
    sums: dict[str, float] = {}
    for rows in dp_slices(ROWS, DP):
        loss, out = role_objective(role, ppo, scores[role][rows], mask_BT[rows],
                                   {k: v[rows] for k, v in targets.items()}, share=whole_share)
        for key, value in (("loss", loss), ("clip_frac", out["clip_frac"]), ("kl_mean", out.get("kl_mean"))):
            if value is not None:
                sums[key] = sums.get(key, 0.0) + float(value)
    rows = loop_terms(role, ppo, mask_BT, scores[role], targets)
    assert sums["loss"] == pytest.approx(loop_mean(rows, 0, normalizer, constant), rel=1e-12)
    assert sums["clip_frac"] == pytest.approx(loop_mean(rows, 1, normalizer, constant), rel=1e-12)
    assert 0 < sums["clip_frac"] < 1  # both branches are taken, on both ranks' rows
    if role == "actor":  # PPO's KL mean is a global token mean whatever the loss's normalizer
        assert sums["kl_mean"] == pytest.approx(loop_mean(rows, 2, "global", None), rel=1e-12)
    else:
        assert "kl_mean" not in sums


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize(("normalizer", "constant"), NORMALIZERS)
def test_each_ranks_gradient_is_bitwise_the_whole_steps(role, normalizer, constant):
    """The per-token gradient of a rank's share is exactly the whole step's (rtol=0, atol=0): only the engine's DP
    sum of parameter gradients is left to round differently."""
    mask_BT, scores, targets = inputs(5)
    ppo = ppo_of(normalizer, constant)
    whole = scores[role].clone().requires_grad_()
    role_objective(role, ppo, whole, mask_BT, targets)[0].backward()
    parts = scores[role].clone().requires_grad_()
    share = ppo_share(mask_BT)
    for rows in dp_slices(ROWS, DP):
        role_objective(role, ppo, parts[rows], mask_BT[rows], {k: v[rows] for k, v in targets.items()},
                       share=share)[0].backward()
    torch.testing.assert_close(parts.grad, whole.grad, rtol=0, atol=0)


def test_a_mean_of_per_rank_means_is_not_the_steps_loss():
    """The companion of the exactness tests: each rank dividing by its own tokens, the ranks' losses averaged (DDP's
    average of rank-local token means) is off the step's loss by far more than rounding when tokens per rank differ."""
    mask_BT, scores, targets = inputs()
    ppo = ppo_of("global", None)
    step, _ = role_objective("actor", ppo, scores["actor"], mask_BT, targets)
    local = [role_objective("actor", ppo, scores["actor"][rows], mask_BT[rows],
                            {k: v[rows] for k, v in targets.items()})[0] for rows in dp_slices(ROWS, DP)]
    wrong = sum(local) / DP
    assert abs(float(wrong - step)) > 1e-3 * abs(float(step))


def test_the_step_share_of_the_whole_step_changes_nothing():
    """At DP1 the share is the batch's own counts: the loss and outputs are bitwise those without a share."""
    mask_BT, scores, targets = inputs(2)
    for role in ("actor", "critic"):
        for normalizer, constant in NORMALIZERS:
            ppo = ppo_of(normalizer, constant)
            plain = role_objective(role, ppo, scores[role].float(), mask_BT, {k: v.float() for k, v in targets.items()})
            shared = role_objective(role, ppo, scores[role].float(), mask_BT, {k: v.float() for k, v in targets.items()},
                                    share=PPOShare(count_normalizers(mask_BT)))
            assert torch.equal(plain[0], shared[0])
            assert all(torch.equal(plain[1][k], shared[1][k]) for k in plain[1])


# --- over real gloo ranks -------------------------------------------------------------------------------------------


def _dp_worker(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mask_BT, scores, targets = inputs()
        rows = dp_slices(ROWS, world)[rank]
        share = ppo_dp_share(mask_BT[rows])
        logp_b = scores["actor"][rows].clone().requires_grad_()
        loss, out = role_objective("actor", ppo_of("per_sequence", None), logp_b, mask_BT[rows],
                                   {k: v[rows] for k, v in targets.items()}, share=share)
        loss.backward()
        n = share.normalizers
        queue.put((rank, [int(n.num_active_tokens), int(n.num_active_sequences)], float(loss.detach()),
                   float(out["clip_frac"]), float(out["kl_mean"]), logp_b.grad.numpy()))
    finally:
        dist.destroy_process_group()


def test_gloo_ranks_share_the_steps_normalizers():
    results = spawn_ranks(DP, _dp_worker)
    mask_BT, scores, targets = inputs()
    whole = scores["actor"].clone().requires_grad_()
    loss, out = role_objective("actor", ppo_of("per_sequence", None), whole, mask_BT, targets)
    loss.backward()
    assert all(r[1] == [33, 7] for r in results)  # 24 + 9 tokens, 7 of 8 rows with one
    for i, key in ((2, None), (3, "clip_frac"), (4, "kl_mean")):
        assert sum(r[i] for r in results) == pytest.approx(float((loss if key is None else out[key]).detach()), rel=1e-12)
    torch.testing.assert_close(torch.cat([torch.from_numpy(r[5]) for r in results]), whole.grad, rtol=0, atol=0)
