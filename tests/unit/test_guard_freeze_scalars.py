"""Freeze's scalar control errors (the loss's per-token terms, the grad norm's whole-gradient difference) fall back to
the plain |difference| when the pairs cannot give them, without an error and without touching the errors
(survivors of the freeze mutation run at 6eaeb6d)."""

from __future__ import annotations

import math

import torch

from qualify.bounds.control_error import LOSS_KEY, NORM_KEY, grad_difference_error, loss_terms_error, step_family_bounds
from qualify.bounds.rule import BoundRule
from qualify.compare import RunTensors
from tests.unit._runs import OPT


def _run(grads: dict[str, torch.Tensor], loss: float | None = 1.0) -> RunTensors:
    outputs = {"grad_norm": torch.tensor(1.0)}
    if loss is not None:
        outputs["loss"] = torch.tensor(loss)
    return RunTensors(outputs, grads, {}, {})


def _errors() -> dict[str, dict[str, float]]:
    return {LOSS_KEY: {"max_abs": 0.25}, NORM_KEY: {"max_abs": 0.5}}


def test_no_pairs_give_no_grad_difference():
    errors = _errors()
    assert grad_difference_error([], errors) is False and errors == _errors()


def test_a_control_with_other_gradient_shapes_gives_no_grad_difference():
    base = _run({"w": torch.zeros(2, 2)})
    other = _run({"w": torch.ones(4)})
    errors = _errors()
    assert grad_difference_error([(other, base)], errors) is False and errors == _errors()
    also = _run({"w": torch.ones(2, 2), "b": torch.ones(1)})  # a gradient the base does not have
    assert grad_difference_error([(also, base)], errors) is False and errors == _errors()


def test_a_base_without_gradients_gives_no_grad_difference():
    errors = _errors()
    assert grad_difference_error([(_run({}), _run({}))], errors) is False and errors == _errors()


def test_the_grad_difference_is_the_largest_pair_norm_and_only_raises():
    base = _run({"w": torch.zeros(2), "b": torch.zeros(1)})
    near, far = _run({"w": torch.tensor([0.3, 0.4]), "b": torch.zeros(1)}), _run({"w": torch.zeros(2),
                                                                                "b": torch.tensor([2.0])})
    errors = _errors()
    assert grad_difference_error([(near, base), (far, base)], errors) is True
    assert math.isclose(errors[NORM_KEY]["max_abs"], 2.0, rel_tol=1e-12)
    small = _errors()
    small[NORM_KEY]["max_abs"] = 9.0
    assert grad_difference_error([(near, base)], small) is True and small[NORM_KEY]["max_abs"] == 9.0


def test_loss_terms_that_cannot_be_read_or_compared_give_no_loss_error():
    base, other = _run({}), _run({})
    errors = _errors()
    shapes = {id(base): torch.zeros(2, 3), id(other): torch.ones(3, 2)}
    assert loss_terms_error([(other, base)], lambda r: shapes[id(r)], errors) is False and errors == _errors()
    unread = {id(base): torch.zeros(2), id(other): None}
    assert loss_terms_error([(other, base)], lambda r: unread[id(r)], errors) is False and errors == _errors()
    unread_base = {id(base): None, id(other): torch.zeros(2)}
    assert loss_terms_error([(other, base)], lambda r: unread_base[id(r)], errors) is False and errors == _errors()
    assert loss_terms_error([], lambda r: torch.zeros(2), errors) is False and errors == _errors()


def test_terms_given_for_runs_without_a_loss_make_no_loss_bound():
    base, other = _run({"w": torch.zeros(2)}, loss=None), _run({"w": torch.ones(2)}, loss=None)
    rule = BoundRule(4.0, {"grad_norm": 0.0, "grad": 0.0, "relative": 0.0, "loss": 0.0}, 0.0, "fp32", False)
    bounds = step_family_bounds(base, {"c": other}, rule, {"base": {}, "c": {}}, "base", OPT, 1,
                                lambda r: torch.zeros(2))
    assert LOSS_KEY not in bounds and bounds["grads/w"]["max_abs"]["control_error"] == 1.0


def test_an_update_the_reference_run_lacks_is_bounded_at_magnitude_zero():
    """A control updates a parameter the family's reference run does not hold: its replay bound takes magnitude 0
    (the floor of the kind alone, no fp32 ulps of a magnitude that is not there) and no quantum."""
    from tests.unit._runs import adamw_run

    start = {"w": torch.full((3,), 0.75), "extra": torch.full((2,), 0.5)}
    grads = {"w": torch.tensor([0.1, -0.2, 0.3]), "extra": torch.tensor([0.05, -0.05])}
    updates, moments = adamw_run(start, grads)
    base = RunTensors({}, {"w": grads["w"]}, {"w": updates["w"]},
                      {k: v for k, v in moments.items() if k.endswith("/w")})
    control = RunTensors({}, grads, updates, moments)
    rule = BoundRule(4.0, {"grad": 0.0, "relative": 0.0, "update": 1e-12}, 16.0, "fp32", True)
    bounds = step_family_bounds(base, {"c": control}, rule, {"base": {"w": start["w"]}, "c": start}, "base", OPT, 1)
    extra = bounds["updates/extra"]["replay_max_abs"]
    assert extra["magnitude"] == 0.0 and extra["floor"] == 1e-12 and extra["quantum"] == 0.0
    w = bounds["updates/w"]["replay_max_abs"]
    assert w["floor"] == 16.0 * 2.0 ** (math.floor(math.log2(float(updates["w"].abs().max()))) - 23) > 1e-12
    assert w["quantum"] == 2.0 ** (math.floor(math.log2(0.75)) - 23)  # one fp32 step of the parameter


def test_family_bounds_take_each_steps_loss_terms_from_terms_of_that_step(tmp_path):
    """terms(step, run) sets the loss's control error step by step: the largest sum of |term differences| at that
    step (here terms that grow with the step and with the run's loss), marked as such."""
    from qualify.bounds.control_error import LOSS_TERMS_TEXT, family_bounds
    from qualify.layout import RunLayout
    from tests.unit._runs import COEF, FLOORS, K, params, role_steps, write_steps

    layout = RunLayout(tmp_path)
    runs = {c: role_steps("critic", COEF[("fp32", c)], 2) for c in ("r0", "r1", "r2")}
    for control, steps in runs.items():
        write_steps(layout.scores("fp32", control, "critic"), steps)
    calls = []

    def terms(step, run):
        calls.append(step)
        return torch.full((3,), float(run.outputs["loss"]) * (10.0 + step), dtype=torch.float64)

    doc = family_bounds(layout, "critic", "fp32-repeat", ["r0", "r1", "r2"], K, FLOORS, params(), OPT, False, 0.0,
                        terms)
    assert sorted(set(calls)) == [0, 1]
    for step in (0, 1):
        loss = [float(runs[c][step].outputs["loss"]) for c in ("r0", "r1", "r2")]
        expect = max(3 * abs(x - loss[0]) * (10.0 + step) for x in loss[1:])
        entry = doc["bounds"][f"step{step}/outputs/loss"]["max_abs"]
        assert math.isclose(entry["control_error"], expect, rel_tol=1e-6) and entry["control_error_of"] == LOSS_TERMS_TEXT


def test_terms_of_a_grpo_matrix_reads_the_grpo_objective(tmp_path):
    """The GRPO actor's per-token terms come from its outputs (ratio, advantages per row, KL) and the grpo section;
    without the grpo section they could not be read (PPO's advantages_BT are not in a GRPO target)."""
    from qualify.freeze import terms_of
    from qualify.matrix import load_matrix
    from qualify.ppo.decisions import loss_terms
    from qualify.reference.inputs import StepInputs
    from tests.unit._runs import REPO

    matrix = load_matrix(REPO / "matrices" / "tiny-qwen3-grpo.yaml")
    mask = torch.tensor([[False, True, True], [False, True, False]])
    outputs = {"ratio_BT": torch.tensor([[1.0, 1.1, 0.7], [1.0, 0.95, 1.0]]), "advantages_B": torch.tensor([0.5, -1.0]),
               "kl_BT": torch.tensor([[0.0, 0.01, 0.02], [0.0, 0.03, 0.0]])}
    run = RunTensors(outputs, {}, {}, {})
    inputs = StepInputs([{}], [mask])
    got = terms_of(matrix.objective, "actor", inputs)(0, run)
    expect = loss_terms("actor", matrix.ppo, matrix.grpo, outputs, {}, mask)
    assert got is not None and expect is not None and torch.equal(got, expect)
    assert loss_terms("actor", matrix.ppo, None, outputs, {}, mask) is None
