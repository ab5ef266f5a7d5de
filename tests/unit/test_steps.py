"""Several optimizer steps: the schedule, AdamW past step 1, the per-step replay starts, coverage."""

from __future__ import annotations

import pytest
import torch

from qualify import metrics
from qualify.compare import RunTensors, params_before_steps, split_step, with_step
from qualify.judge.steps import judge_steps
from qualify.ppo.coverage import BRANCHES, exercised, inert, step_coverage
from qualify.ppo.objective import step_rows


def test_step_rows_cover_every_row_once_per_epoch_in_order():
    rows = step_rows(8, epochs=2, minibatches=4)
    assert rows == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)] * 2
    assert step_rows(8, 3, 1) == [slice(0, 8)] * 3


@pytest.mark.parametrize("num_rows,minibatches", [(8, 3), (5, 2), (8, 0)])
def test_step_rows_refuse_a_batch_that_does_not_divide(num_rows, minibatches):
    with pytest.raises(ValueError, match="equal minibatches"):
        step_rows(num_rows, 1, minibatches)


def test_adamw_update_matches_torch_adamw_at_every_step():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64))
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, foreach=False)
    for step in range(1, 6):
        before = p.detach().clone()
        p.grad = torch.randn(64)
        opt.step()
        state = opt.state[p]
        expected = metrics.adamw_update(before, state["exp_avg"], state["exp_avg_sq"], lr=1e-2, betas=(0.9, 0.999),
                                        eps=1e-8, weight_decay=0.01, step=step)
        # torch steps in fp32: a few ulps of the parameters (|p| < 8: ulp <= 1e-6) apart from the float64 formula
        assert float((expected - (p.detach().double() - before.double())).abs().max()) < 2e-6, step
        if step > 1:  # the first step's bias correction is wrong from step 2 on: the replay must see it
            wrong = metrics.adamw_update(before, state["exp_avg"], state["exp_avg_sq"], lr=1e-2, betas=(0.9, 0.999),
                                         eps=1e-8, weight_decay=0.01, step=1)
            assert float((wrong - (p.detach().double() - before.double())).abs().max()) > 1e-5, step


def _run(updates: dict[str, torch.Tensor]) -> RunTensors:
    return RunTensors(outputs={}, grads={}, updates=updates, moments={})


def test_params_before_steps_are_the_run_s_own_cumulative_updates():
    initial = {"w": torch.tensor([1.0, 2.0])}
    steps = [_run({"w": torch.tensor([0.5, -1.0])}), _run({"w": torch.tensor([0.25, 0.0])})]
    starts = params_before_steps(steps, initial)
    assert torch.equal(starts[0]["w"], torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert torch.equal(starts[1]["w"], torch.tensor([1.5, 1.0], dtype=torch.float64))


def test_step_keys_round_trip():
    assert with_step(3, {"grads/x": 1}) == {"step3/grads/x": 1}
    assert split_step("step12/outputs/loss") == (12, "outputs/loss")


class _ADAMW:
    lr, betas, eps, weight_decay = 1e-3, (0.9, 0.999), 1e-8, 0.0


def test_judge_steps_fails_a_candidate_that_took_fewer_steps_and_names_the_step():
    ref = [RunTensors({"loss": torch.tensor(1.0)}, {}, {}, {}), RunTensors({"loss": torch.tensor(2.0)}, {}, {}, {})]
    bounds = {"step0/outputs/loss": {"max_abs": {"bound": 0.1}}, "step1/outputs/loss": {"max_abs": {"bound": 0.1}}}
    rows = judge_steps("c", "actor", "vs ref", ref[:1], ref, bounds, [{}], optimizer=_ADAMW)
    bad = [r for r in rows if not r.passed]
    assert [(r.tensor, r.metric) for r in bad] == [("steps", "num_steps")]
    assert [r.tensor for r in rows if r.passed] == ["step0/outputs/loss"]
    off = [RunTensors({"loss": torch.tensor(1.0)}, {}, {}, {}), RunTensors({"loss": torch.tensor(2.5)}, {}, {}, {})]
    bad = [r for r in judge_steps("c", "actor", "vs ref", off, ref, bounds, [{}, {}], _ADAMW) if not r.passed]
    assert [(r.tensor, r.value) for r in bad] == [("step1/outputs/loss", 0.5)]


class _PPO:
    clip_eps = 0.2
    value_clip_eps = 0.2


def test_step_coverage_counts_both_clip_sides_and_the_value_clip():
    mask = torch.tensor([[True, True, True], [True, True, False]])
    ratio = torch.tensor([[1.3, 0.7, 1.0], [1.1, 0.79, 5.0]])  # 5.0 is off the mask
    actor = step_coverage("actor", _PPO, 0.5, {"ratio_BT": ratio, "kl_BT": torch.zeros(2, 3)}, {}, mask, 0.4, 1)
    assert (actor["policy_clip_high"], actor["policy_clip_low"], actor["kl"]) == (1, 2, 0)
    assert actor["grad_clip"] is False and actor["padded_rows"] == 1 and actor["adam_step"] == 1
    values = torch.tensor([[0.5, 0.0, 0.1], [0.0, 0.0, 9.0]])
    critic = step_coverage("critic", _PPO, 0.5, {"values_BT": values}, {"old_values_BT": torch.zeros(2, 3)}, mask,
                           0.6, 2)
    assert critic["value_clip"] == 1 and critic["grad_clip"] is True


def test_inert_names_each_missing_branch_with_what_wakes_it():
    actor = [{"policy_clip_high": 0, "policy_clip_low": 3, "kl": 5, "grad_clip": False, "padded_rows": 1,
              "adam_step": 1}]
    critic = [{"value_clip": 0, "grad_clip": True, "padded_rows": 1, "adam_step": 1}]
    missing = inert(tuple(BRANCHES), {"actor": actor, "critic": critic})
    # policy_clip_dual is recorded only with a dual clip (ppo.dual_clip_c): never recorded, never taken
    assert [m.split(":")[0] for m in missing] == ["policy_clip_high", "policy_clip_dual", "value_clip",
                                                   "adam_past_first_step"]
    assert "ppo.epochs" in missing[-1]
    assert exercised(actor)["grad_clip"] is False and exercised(critic)["grad_clip"] is True
    assert inert((), {"actor": actor}) == []
