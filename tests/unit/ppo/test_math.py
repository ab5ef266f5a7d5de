"""qualify.ppo.math against slow, obvious Python loops over b and t, on random inputs and masks.

No independent PPO implementation is importable here: TRL 1.x no longer ships PPO math (only
GRPO/RLOO), and verl's core_algos imports ray, tensordict, omegaconf and hydra and pins
transformers < 5.11, so neither is compared against.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from qualify.ppo.math import (
    NORMALIZERS,
    clipped_policy_loss,
    clipped_value_loss,
    kl_terms,
    last_active_index,
    masked_gae,
    masked_mean,
    masked_sum,
    token_rewards,
)

CONSTANT = 7.0
GAMMA_LAM = list(itertools.product([0.0, 1.0, 0.95], [0.0, 1.0, 0.95]))


def assert_near(got: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    """torch.testing.assert_close without its import of torch.distributed.tensor (seconds here)."""
    assert got.shape == expected.shape and got.dtype == expected.dtype, (got.shape, expected.shape)
    excess = (got - expected).abs() - (atol + rtol * expected.abs())
    assert not (excess > 0).any() and not got.isnan().any(), f"max |diff| {(got - expected).abs().max().item():.3g}"


def make_mask(num_rows: int, num_positions: int, seed: int) -> torch.Tensor:
    """Rows of every kind: all False, one active token, a contiguous span, random, all True."""
    gen = torch.Generator().manual_seed(seed)
    mask_BT = torch.rand(num_rows, num_positions, generator=gen) < 0.5
    mask_BT[0] = False
    mask_BT[1] = False
    mask_BT[1, num_positions // 2] = True
    mask_BT[2] = False
    mask_BT[2, 2 : num_positions - 3] = True  # prompt, response, right padding
    mask_BT[3] = True
    mask_BT[4] = False
    mask_BT[4, 0] = True  # a single active token at position 0
    return mask_BT


def randn(num_rows: int, num_positions: int, seed: int) -> torch.Tensor:
    return torch.randn(num_rows, num_positions, generator=torch.Generator().manual_seed(seed))


def normalizer_args(normalizer: str) -> dict:
    return {"normalizer": normalizer, "constant": CONSTANT if normalizer == "constant" else None}


# --- slow references -------------------------------------------------------------------------------


def ref_masked_mean(x_BT, mask_BT, normalizer, constant=None) -> float:
    num_rows, num_positions = mask_BT.shape
    rows = [[float(x_BT[b, t]) for t in range(num_positions) if mask_BT[b, t]] for b in range(num_rows)]
    active = [v for row in rows for v in row]
    if normalizer == "global":
        return sum(active) / len(active) if active else 0.0
    if normalizer == "constant":
        return sum(active) / constant
    row_means = [sum(row) / len(row) for row in rows if row]
    return sum(row_means) / len(row_means) if row_means else 0.0


def ref_active_positions(mask_BT, b) -> list[int]:
    return [t for t in range(mask_BT.shape[1]) if mask_BT[b, t]]


def ref_token_rewards(score_B, logp_old_BT, logp_ref_BT, mask_BT, kl_coef):
    rewards = torch.zeros(mask_BT.shape, dtype=torch.float64)
    for b in range(mask_BT.shape[0]):
        active = ref_active_positions(mask_BT, b)
        for t in active:
            rewards[b, t] = -kl_coef * (float(logp_old_BT[b, t]) - float(logp_ref_BT[b, t]))
        if active:
            rewards[b, active[-1]] += float(score_B[b])
    return rewards


def ref_gae(rewards_BT, values_BT, mask_BT, gamma, lam):
    advantages = torch.zeros(mask_BT.shape, dtype=torch.float64)
    returns = torch.zeros(mask_BT.shape, dtype=torch.float64)
    for b in range(mask_BT.shape[0]):
        active = ref_active_positions(mask_BT, b)
        next_value, next_adv = 0.0, 0.0
        for t in reversed(active):
            delta = float(rewards_BT[b, t]) + gamma * next_value - float(values_BT[b, t])
            adv = delta + gamma * lam * next_adv
            advantages[b, t] = adv
            returns[b, t] = adv + float(values_BT[b, t])
            next_value, next_adv = float(values_BT[b, t]), adv
    return advantages, returns


def ref_policy_terms(logp_BT, logp_old_BT, adv_BT, clip_eps):
    loss = torch.zeros(logp_BT.shape, dtype=torch.float64)
    clipped = torch.zeros(logp_BT.shape, dtype=torch.float64)
    for b, t in itertools.product(range(logp_BT.shape[0]), range(logp_BT.shape[1])):
        ratio = math.exp(float(logp_BT[b, t]) - float(logp_old_BT[b, t]))
        adv = float(adv_BT[b, t])
        unclipped_term = -adv * ratio
        clipped_term = -adv * min(max(ratio, 1 - clip_eps), 1 + clip_eps)
        loss[b, t] = max(unclipped_term, clipped_term)
        clipped[b, t] = float(clipped_term > unclipped_term)
    return loss, clipped


def ref_value_terms(values_BT, old_BT, returns_BT, clip_eps):
    loss = torch.zeros(values_BT.shape, dtype=torch.float64)
    clipped = torch.zeros(values_BT.shape, dtype=torch.float64)
    for b, t in itertools.product(range(values_BT.shape[0]), range(values_BT.shape[1])):
        v, old, ret = float(values_BT[b, t]), float(old_BT[b, t]), float(returns_BT[b, t])
        v_clip = old + min(max(v - old, -clip_eps), clip_eps)
        loss[b, t] = 0.5 * max((v - ret) ** 2, (v_clip - ret) ** 2)
        clipped[b, t] = float((v_clip - ret) ** 2 > (v - ret) ** 2)
    return loss, clipped


# --- masked reductions -----------------------------------------------------------------------------


def test_masked_sum_matches_loop():
    x_BT, mask_BT = randn(9, 13, 0), make_mask(9, 13, 1)
    expected = sum(float(x_BT[b, t]) for b in range(9) for t in range(13) if mask_BT[b, t])
    assert masked_sum(x_BT, mask_BT).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("seed", range(3))
def test_masked_mean_matches_loop(normalizer, seed):
    x_BT, mask_BT = randn(9, 13, seed), make_mask(9, 13, seed + 100)
    got = masked_mean(x_BT, mask_BT, **normalizer_args(normalizer))
    assert got.dtype == torch.float32 and got.shape == ()
    assert got.item() == pytest.approx(ref_masked_mean(x_BT, mask_BT, **normalizer_args(normalizer)), rel=1e-5)


def test_normalizers_differ_on_unequal_lengths():
    x_BT = torch.tensor([[1.0, 1.0, 1.0, 0.0], [5.0, 0.0, 0.0, 0.0]])
    mask_BT = torch.tensor([[True, True, True, False], [True, False, False, False]])
    assert masked_mean(x_BT, mask_BT, "global").item() == 2.0  # (1 + 1 + 1 + 5) / 4
    assert masked_mean(x_BT, mask_BT, "per_sequence").item() == 3.0  # (1 + 5) / 2
    assert masked_mean(x_BT, mask_BT, "constant", 8.0).item() == 1.0  # 8 / 8


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_masked_mean_without_active_tokens_is_zero_with_gradient(normalizer):
    x_BT = randn(3, 5, 0).requires_grad_()
    got = masked_mean(x_BT, torch.zeros(3, 5, dtype=torch.bool), **normalizer_args(normalizer))
    assert got.item() == 0.0 and got.requires_grad
    got.backward()
    assert torch.equal(x_BT.grad, torch.zeros(3, 5))


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_masked_mean_ignores_garbage_off_the_mask(normalizer):
    x_BT, mask_BT = randn(9, 13, 0), make_mask(9, 13, 1)
    dirty_BT = x_BT.masked_fill(~mask_BT, float("nan")).requires_grad_()
    dirty_BT.data[~mask_BT & (torch.arange(13) % 2 == 0)] = float("inf")
    got = masked_mean(dirty_BT, mask_BT, **normalizer_args(normalizer))
    assert torch.equal(got, masked_mean(x_BT, mask_BT, **normalizer_args(normalizer)))
    got.backward()
    assert torch.isfinite(dirty_BT.grad).all() and (dirty_BT.grad[~mask_BT] == 0).all()


def test_per_sequence_gradient_weighs_each_row_equally():
    x_BT = torch.zeros(2, 4, requires_grad=True)
    mask_BT = torch.tensor([[True, True, True, True], [True, False, False, False]])
    masked_mean(x_BT, mask_BT, "per_sequence").backward()
    assert torch.equal(x_BT.grad, torch.tensor([[0.125, 0.125, 0.125, 0.125], [0.5, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize(
    ("normalizer", "constant", "message"),
    [
        ("token", None, "unknown normalizer 'token'; known: global, per_sequence, constant"),
        ("constant", None, "constant is required"),
        ("global", 4.0, "constant is required with normalizer 'constant' and only then"),
        ("constant", 0.0, "constant must be > 0"),
    ],
)
def test_masked_mean_rejects_bad_normalizer(normalizer, constant, message):
    with pytest.raises(ValueError, match=message):
        masked_mean(randn(2, 3, 0), torch.ones(2, 3, dtype=torch.bool), normalizer, constant)


# --- last active index and token rewards -----------------------------------------------------------


def test_last_active_index_matches_loop():
    mask_BT = make_mask(9, 13, 3)
    index_B, has_any_B = last_active_index(mask_BT)
    assert index_B.dtype == torch.int64 and has_any_B.dtype == torch.bool
    for b in range(9):
        active = ref_active_positions(mask_BT, b)
        assert bool(has_any_B[b]) == bool(active)
        assert int(index_B[b]) == (active[-1] if active else 0)
    assert not has_any_B[0] and index_B[4] == 0 and has_any_B[4]  # 0 as placeholder vs a real 0


@pytest.mark.parametrize("seed", range(3))
def test_token_rewards_match_loop(seed):
    mask_BT = make_mask(9, 13, seed)
    score_B = torch.randn(9, generator=torch.Generator().manual_seed(seed)) * 3
    logp_old_BT, logp_ref_BT = randn(9, 13, seed + 1), randn(9, 13, seed + 2)
    got = token_rewards(score_B, logp_old_BT, logp_ref_BT, mask_BT, kl_coef=0.05)
    assert got.dtype == torch.float32
    expected = ref_token_rewards(score_B, logp_old_BT, logp_ref_BT, mask_BT, 0.05)
    assert_near(got.double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[0], torch.zeros(13))  # all-False row: its score is nowhere, not at t = 0
    assert (got[~mask_BT] == 0).all()


def test_token_rewards_single_token_and_position_zero():
    mask_BT = torch.tensor([[False, False, True, False], [True, False, False, False], [False] * 4])
    score_B = torch.tensor([2.0, 3.0, 4.0])
    logp_old_BT = torch.full((3, 4), -1.0)
    logp_ref_BT = torch.full((3, 4), -1.5)
    got = token_rewards(score_B, logp_old_BT, logp_ref_BT, mask_BT, kl_coef=0.5)
    expected = torch.tensor([[0.0, 0.0, 2.0 - 0.25, 0.0], [3.0 - 0.25, 0.0, 0.0, 0.0], [0.0] * 4])
    assert torch.equal(got, expected)


def test_kl_terms_is_k1():
    logp_BT, logp_ref_BT = randn(3, 4, 0), randn(3, 4, 1)
    assert torch.equal(kl_terms(logp_BT, logp_ref_BT), logp_BT - logp_ref_BT)
    assert torch.equal(kl_terms(logp_BT, logp_BT), torch.zeros(3, 4))


# --- masked GAE ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("gamma", "lam"), GAMMA_LAM)
def test_masked_gae_matches_loop(gamma, lam):
    mask_BT = make_mask(9, 13, 7)
    rewards_BT, values_BT = randn(9, 13, 8), randn(9, 13, 9)
    advantages_BT, returns_BT = masked_gae(rewards_BT, values_BT, mask_BT, gamma, lam)
    assert advantages_BT.dtype == returns_BT.dtype == torch.float32
    ref_adv, ref_ret = ref_gae(rewards_BT, values_BT, mask_BT, gamma, lam)
    assert_near(advantages_BT.double(), ref_adv, rtol=1e-5, atol=1e-5)
    assert_near(returns_BT.double(), ref_ret, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("gamma", "lam"), GAMMA_LAM)
def test_masked_gae_contiguous_mask_is_the_textbook_recursion(gamma, lam):
    # Response at positions [3, 9): the textbook GAE on that slice, with V after the end = 0.
    mask_BT = torch.zeros(4, 12, dtype=torch.bool)
    mask_BT[:, 3:9] = True
    rewards_BT, values_BT = randn(4, 12, 1).double(), randn(4, 12, 2).double()
    advantages_BT, returns_BT = masked_gae(rewards_BT, values_BT, mask_BT, gamma, lam)
    r, v = rewards_BT[:, 3:9], torch.cat([values_BT[:, 3:9], torch.zeros(4, 1, dtype=torch.float64)], 1)
    expected = torch.zeros(4, 6, dtype=torch.float64)
    running = torch.zeros(4, dtype=torch.float64)
    for t in range(5, -1, -1):
        running = r[:, t] + gamma * v[:, t + 1] - v[:, t] + gamma * lam * running
        expected[:, t] = running
    assert_near(advantages_BT[:, 3:9], expected, rtol=1e-12, atol=1e-12)
    assert (advantages_BT[~mask_BT] == 0).all() and (returns_BT[~mask_BT] == 0).all()
    assert_near(returns_BT[:, 3:9], expected + values_BT[:, 3:9], rtol=1e-12, atol=1e-12)


def test_masked_gae_skips_inactive_positions_and_never_bootstraps_from_zero():
    mask_BT = torch.tensor([[True, False, True, False], [False, False, False, False]])
    rewards_BT = torch.tensor([[1.0, float("nan"), 2.0, 9.0], [5.0, 5.0, 5.0, 5.0]])
    values_BT = torch.tensor([[0.5, float("inf"), 0.25, 9.0], [100.0, 1.0, 1.0, 1.0]])
    advantages_BT, returns_BT = masked_gae(rewards_BT, values_BT, mask_BT, gamma=0.5, lam=0.5)
    adv_2 = 2.0 - 0.25  # last active: terminal, no bootstrap from position 3
    adv_0 = 1.0 + 0.5 * 0.25 - 0.5 + 0.25 * adv_2  # next active is position 2, not 1
    assert torch.equal(advantages_BT, torch.tensor([[adv_0, 0.0, adv_2, 0.0], [0.0] * 4]))
    assert torch.equal(returns_BT, torch.tensor([[adv_0 + 0.5, 0.0, adv_2 + 0.25, 0.0], [0.0] * 4]))


def test_masked_gae_has_no_gradient():
    rewards_BT, values_BT = randn(3, 5, 0).requires_grad_(), randn(3, 5, 1).requires_grad_()
    advantages_BT, returns_BT = masked_gae(rewards_BT, values_BT, make_mask(5, 5, 0)[:3], 1.0, 0.95)
    assert not advantages_BT.requires_grad and not returns_BT.requires_grad


# --- clipped losses --------------------------------------------------------------------------------


def policy_inputs(seed: int):
    logp_old_BT = randn(9, 13, seed) - 2
    logp_BT = logp_old_BT + 0.3 * randn(9, 13, seed + 1)  # ratios on both sides of the clip range
    return logp_BT, logp_old_BT, randn(9, 13, seed + 2), make_mask(9, 13, seed + 3)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("seed", range(3))
def test_clipped_policy_loss_matches_loop(normalizer, seed):
    logp_BT, logp_old_BT, adv_BT, mask_BT = policy_inputs(seed)
    loss, ratio_BT, clip_frac = clipped_policy_loss(
        logp_BT, logp_old_BT, adv_BT, mask_BT, 0.2, **normalizer_args(normalizer)
    )
    ref_loss_BT, ref_clipped_BT = ref_policy_terms(logp_BT, logp_old_BT, adv_BT, 0.2)
    args = normalizer_args(normalizer)
    assert loss.item() == pytest.approx(ref_masked_mean(ref_loss_BT, mask_BT, **args), rel=1e-5, abs=1e-6)
    assert clip_frac.item() == pytest.approx(ref_masked_mean(ref_clipped_BT, mask_BT, **args), abs=1e-6)
    assert clip_frac.item() > 0 and ref_clipped_BT[mask_BT].min() == 0  # both branches exercised
    assert torch.equal(ratio_BT[mask_BT], torch.exp(logp_BT - logp_old_BT)[mask_BT])
    assert (ratio_BT[~mask_BT] == 1).all()
    assert loss.dtype == clip_frac.dtype == ratio_BT.dtype == torch.float32


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_clipped_policy_loss_gradient_matches_finite_differences(normalizer):
    # Central differences in fp64, element by element (torch's gradcheck would import sympy: seconds).
    logp_BT, logp_old_BT, adv_BT, mask_BT = (t.double() if t.is_floating_point() else t for t in policy_inputs(0))
    args = normalizer_args(normalizer)

    def loss_of(lp):
        return clipped_policy_loss(lp, logp_old_BT, adv_BT, mask_BT, 0.2, **args)[0]

    logp = logp_BT.clone().requires_grad_()
    (grad_BT,) = torch.autograd.grad(loss_of(logp), logp)
    numeric_BT = torch.zeros_like(logp_BT)
    for b, t in itertools.product(range(logp_BT.shape[0]), range(logp_BT.shape[1])):
        step_BT = torch.zeros_like(logp_BT)
        step_BT[b, t] = 1e-6
        numeric_BT[b, t] = (loss_of(logp_BT + step_BT) - loss_of(logp_BT - step_BT)) / 2e-6
    assert_near(grad_BT, numeric_BT, rtol=1e-5, atol=1e-8)
    assert (grad_BT[~mask_BT] == 0).all()


def exact_log_ratio(target: float) -> float:
    """A float32 log-ratio whose float32 exp is exactly float32(target)."""
    want = torch.tensor(target, dtype=torch.float32)
    x = torch.tensor(math.log(target), dtype=torch.float32)
    for _ in range(64):
        got = torch.exp(x)
        if got == want:
            return x.item()
        x = torch.nextafter(x, torch.tensor(math.inf if got < want else -math.inf))
    raise AssertionError(f"no float32 x with exp(x) == {target}")


def test_clip_boundaries_are_exclusive():
    eps = 0.2
    at_hi, at_lo = exact_log_ratio(1 + eps), exact_log_ratio(1 - eps)
    beyond_hi, beyond_lo = at_hi + 1e-3, at_lo - 1e-3
    # Columns: ratio exactly at 1+eps, at 1-eps, beyond 1+eps, beyond 1-eps; rows: A > 0, A < 0.
    logp_BT = torch.tensor([[at_hi, at_lo, beyond_hi, beyond_lo]] * 2, requires_grad=True)
    adv_BT = torch.tensor([[1.0] * 4, [-1.0] * 4])
    mask_BT = torch.ones(2, 4, dtype=torch.bool)
    loss, ratio_BT, _ = clipped_policy_loss(logp_BT, torch.zeros(2, 4), adv_BT, mask_BT, eps, "constant", 1.0)
    assert ratio_BT[0, 0] == torch.tensor(1 + eps, dtype=torch.float32)
    assert ratio_BT[0, 1] == torch.tensor(1 - eps, dtype=torch.float32)
    clipped_BT = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    for b, t in itertools.product(range(2), range(4)):
        one_BT = torch.zeros(2, 4, dtype=torch.bool)
        one_BT[b, t] = True
        _, _, clip_frac = clipped_policy_loss(logp_BT, torch.zeros(2, 4), adv_BT, one_BT, eps, "global")
        assert clip_frac.item() == clipped_BT[b, t], (b, t)
        assert not clip_frac.requires_grad
    loss.backward()
    # Clipped tokens get no gradient; at the boundary the full gradient -A * ratio flows.
    expected_grad_BT = torch.where(clipped_BT.bool(), 0.0, -adv_BT * ratio_BT.detach())
    assert_near(logp_BT.grad, expected_grad_BT, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("seed", range(3))
def test_clipped_value_loss_matches_loop(normalizer, seed):
    old_BT, returns_BT, mask_BT = randn(9, 13, seed), randn(9, 13, seed + 1), make_mask(9, 13, seed + 2)
    values_BT = old_BT + 0.3 * randn(9, 13, seed + 3)
    loss, clip_frac = clipped_value_loss(values_BT, old_BT, returns_BT, mask_BT, 0.2, **normalizer_args(normalizer))
    ref_loss_BT, ref_clipped_BT = ref_value_terms(values_BT, old_BT, returns_BT, 0.2)
    args = normalizer_args(normalizer)
    assert loss.item() == pytest.approx(ref_masked_mean(ref_loss_BT, mask_BT, **args), rel=1e-5, abs=1e-6)
    assert clip_frac.item() == pytest.approx(ref_masked_mean(ref_clipped_BT, mask_BT, **args), abs=1e-6)
    assert clip_frac.item() > 0 and ref_clipped_BT[mask_BT].min() == 0
    assert loss.dtype == clip_frac.dtype == torch.float32 and not clip_frac.requires_grad


def test_value_clip_boundary_is_exclusive():
    eps = 0.2
    at = torch.tensor(eps, dtype=torch.float32).item()  # v - old == float32(eps) exactly: v_clip == v
    # (value, return, clipped?) with old value 0. Clipped means the clipped error is the larger one:
    # the value moved past the return by more than eps, so clipping pulls it back further away.
    cases = [
        (at, 1.0, 0.0),
        (-at, -1.0, 0.0),
        (at + 1e-3, -1.0, 0.0),  # beyond eps, away from the return: the unclipped error is larger
        (-at - 1e-3, 1.0, 0.0),
        (0.6, 0.5, 1.0),  # overshoot: |0.6 - 0.5| < |0.2 - 0.5|
        (-0.6, -0.5, 1.0),
    ]
    values_BT = torch.tensor([[c[0] for c in cases]], requires_grad=True)
    returns_BT = torch.tensor([[c[1] for c in cases]])
    mask_BT = torch.ones(1, len(cases), dtype=torch.bool)
    for t, (_, _, clipped) in enumerate(cases):
        one_BT = torch.zeros_like(mask_BT)
        one_BT[0, t] = True
        _, clip_frac = clipped_value_loss(values_BT, torch.zeros_like(returns_BT), returns_BT, one_BT, eps, "global")
        assert clip_frac.item() == clipped, cases[t]
    loss, _ = clipped_value_loss(values_BT, torch.zeros_like(returns_BT), returns_BT, mask_BT, eps, "constant", 1.0)
    loss.backward()
    # Clipped tokens get no gradient; the others get v - R.
    expected_grad = [0.0 if c[2] else c[0] - c[1] for c in cases]
    assert_near(values_BT.grad, torch.tensor([expected_grad]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_losses_ignore_garbage_off_the_mask(normalizer):
    args = normalizer_args(normalizer)
    logp_BT, logp_old_BT, adv_BT, mask_BT = policy_inputs(5)
    nan, inf = float("nan"), float("inf")
    dirty = [t.masked_fill(~mask_BT, v) for t, v in ((logp_BT, inf), (logp_old_BT, -inf), (adv_BT, nan))]
    clean_logp_BT, dirty_logp_BT = logp_BT.clone().requires_grad_(), dirty[0].clone().requires_grad_()
    clean = clipped_policy_loss(clean_logp_BT, logp_old_BT, adv_BT, mask_BT, 0.2, **args)
    got = clipped_policy_loss(dirty_logp_BT, dirty[1], dirty[2], mask_BT, 0.2, **args)
    assert torch.equal(got[0], clean[0]) and torch.equal(got[2], clean[2])
    clean[0].backward()
    got[0].backward()
    assert torch.equal(dirty_logp_BT.grad, clean_logp_BT.grad)

    values_BT = randn(9, 13, 0).masked_fill(~mask_BT, inf).requires_grad_()
    returns_BT = randn(9, 13, 1).masked_fill(~mask_BT, nan)
    loss, clip_frac = clipped_value_loss(values_BT, randn(9, 13, 2), returns_BT, mask_BT, 0.2, **args)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(clip_frac)
    assert torch.isfinite(values_BT.grad).all() and (values_BT.grad[~mask_BT] == 0).all()


def test_check_mode_names_the_kind_in_full_only_where_the_mode_is_unknown():
    from qualify.ppo.math import check_mode

    check_mode("aggregation", "b", ("a", "b"), "b", 2.0)
    with pytest.raises(ValueError, match=r"^unknown loss aggregation 'c'; known: a, b$"):
        check_mode("aggregation", "c", ("a", "b"), "b", None, kind_in_full="loss aggregation")
    with pytest.raises(ValueError, match=r"^constant is required with aggregation 'b' and only then$"):
        check_mode("aggregation", "a", ("a", "b"), "b", 1.0, kind_in_full="loss aggregation")
