"""Freeze calibrates as the judge judges: a control that decided a clip otherwise than the family's r0 is compared
with r0 replayed on the control's decisions (qualify.reference.forced), not with r0's own trajectory.

Expected values are computed here from the tensors with plain loops, not by qualify.compare.
"""

from __future__ import annotations

import math

import pytest
import torch

from qualify.bounds.control_error import NORM_TEXT, family_bounds, step_family_bounds
from qualify.bounds.rule import BoundRule
from qualify.compare import RunTensors
from qualify.errors import EvidenceError
from qualify.layout import RunLayout
from qualify.reference.context import ScoringContext
from qualify.reference.forced import control_replay, recorded_decisions, replay_dir
from qualify.reference.inputs import StepInputs
from tests.unit._runs import COEF, FLOORS, OPT, K, params, role_steps, synthetic_matrix, write_steps


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return max(abs(x - y) for x, y in zip(a.double().flatten().tolist(), b.double().flatten().tolist()))


def _layout_with_controls(tmp_path):
    layout = RunLayout(tmp_path)
    runs = {c: role_steps("actor", COEF[("fp32", c)], 2) for c in ("r0", "r1", "r2")}
    for control, steps in runs.items():
        write_steps(layout.scores("fp32", control, "actor"), steps)
    return layout, runs


def test_a_control_with_a_replay_is_measured_against_the_replay_not_r0(tmp_path):
    """r1 (the family's largest error against r0) has a replay that equals r1 itself: its error is then 0, and the
    family's control error is r2's against r0 alone, at every step; the bound file says what each was compared with."""
    layout, runs = _layout_with_controls(tmp_path)
    replay = layout.reference / "replays" / "fp32-r0-0123456789abcdef" / "actor"
    write_steps(replay, runs["r1"])
    asked = []

    def replay_of(base, control):
        asked.append((base, control))
        return replay if control == "fp32-r1" else None

    doc = family_bounds(layout, "actor", "fp32-repeat", ["r0", "r1", "r2"], K, FLOORS, params(), OPT, False,
                        replay_of=replay_of)
    plain = family_bounds(layout, "actor", "fp32-repeat", ["r0", "r1", "r2"], K, FLOORS, params(), OPT, False)
    assert sorted(asked) == [("fp32-r0", "fp32-r1"), ("fp32-r0", "fp32-r2")]
    assert doc["compared_with"] == {"fp32-r1": "replays/fp32-r0-0123456789abcdef/actor", "fp32-r2": "fp32-r0"}
    assert plain["compared_with"] == {"fp32-r1": "fp32-r0", "fp32-r2": "fp32-r0"}
    for step in (0, 1):
        r0, r1, r2 = (runs[c][step] for c in ("r0", "r1", "r2"))
        got = doc["bounds"][f"step{step}/grads/w"]["max_abs"]["control_error"]
        assert got == pytest.approx(_max_abs(r2.grads["w"], r0.grads["w"]), rel=1e-12) and got > 0
        natural = plain["bounds"][f"step{step}/grads/w"]["max_abs"]["control_error"]
        assert natural == pytest.approx(max(_max_abs(r1.grads["w"], r0.grads["w"]), got), rel=1e-12)
        assert natural > 2 * got  # r1's error was the larger one: the replay removed it
        name = "logprobs_BT"
        assert doc["bounds"][f"step{step}/outputs/{name}"]["max_abs"]["control_error"] == pytest.approx(
            _max_abs(r2.outputs[name], r0.outputs[name]), rel=1e-12)


def test_a_replay_freeze_needs_and_cannot_find_is_named_with_the_advice(tmp_path):
    layout, _ = _layout_with_controls(tmp_path)
    missing = layout.reference / "replays" / "fp32-r0-feedfacefeedface" / "actor"
    with pytest.raises(EvidenceError) as caught:
        family_bounds(layout, "actor", "fp32-repeat", ["r0", "r1", "r2"], K, FLOORS, params(), OPT, False,
                      replay_of=lambda base, control: missing if control == "fp32-r2" else None)
    text = str(caught.value)
    assert str(missing) in text and "fp32-r0 actor replayed on fp32-r2's clip decisions" in text
    assert "'qualify reference' again" in text


def test_a_replay_with_another_number_of_steps_is_refused(tmp_path):
    layout, runs = _layout_with_controls(tmp_path)
    short = layout.reference / "replays" / "fp32-r0-0000000000000000" / "actor"
    write_steps(short, runs["r1"][:1])
    with pytest.raises(EvidenceError, match=r"1 steps, fp32-r0 took 2"):
        family_bounds(layout, "actor", "fp32-repeat", ["r0", "r1", "r2"], K, FLOORS, params(), OPT, False,
                      replay_of=lambda base, control: short if control == "fp32-r1" else None)


OPT_ = OPT


def test_the_scalar_control_errors_take_each_control_against_its_own_base():
    """The grad norm's control error (norm of the whole gradient difference) and the loss's (sum of |per-token
    contribution differences|) of a control with a replay are measured against the replay."""
    g = torch.Generator().manual_seed(3)
    base_grads = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}

    def run(grads, values):
        norm = torch.sqrt(sum(x.double().square().sum() for x in grads.values())).float()
        return RunTensors({"grad_norm": norm, "loss": values.sum().reshape(()), "values_BT": values}, grads, {}, {})

    v0 = torch.randn(2, 5, generator=g)
    far = {n: x + 0.5 for n, x in base_grads.items()}      # a flip's effect: far from base, equal to its replay
    near = {n: x * 1.001 for n, x in base_grads.items()}   # numerics alone
    base = run(base_grads, v0)
    flipped, its_replay = run(far, v0 + 0.3), run(far, v0 + 0.3)
    controls = {"flipped": flipped, "near": run(near, v0 + 1e-3)}
    rule = BoundRule(4.0, {"grad_norm": 0.0, "grad": 0.0, "relative": 0.0, "loss": 0.0, "value": 0.0}, 0.0, "fp32",
                     False)
    terms = lambda r: r.outputs["values_BT"].double()  # per-token contributions: the values themselves
    starts = {"base": {}, "flipped": {}, "near": {}}
    bounds = step_family_bounds(base, controls, rule, starts, "base", OPT_, 1, terms, {"flipped": its_replay})
    expect_norm = math.sqrt(sum((x - y) ** 2 for n in base_grads
                                for x, y in zip(near[n].flatten().tolist(), base_grads[n].flatten().tolist())))
    assert bounds["outputs/grad_norm"]["max_abs"]["control_error"] == pytest.approx(expect_norm, rel=1e-9)
    assert bounds["outputs/grad_norm"]["max_abs"]["control_error_of"] == NORM_TEXT
    expect_loss = sum(abs(1e-3) for _ in range(10))
    assert bounds["outputs/loss"]["max_abs"]["control_error"] == pytest.approx(expect_loss, rel=1e-4)
    assert bounds["grads/w"]["max_abs"]["control_error"] == pytest.approx(
        _max_abs(near["w"], base_grads["w"]), rel=1e-9)
    natural = step_family_bounds(base, controls, rule, starts, "base", OPT_, 1, terms)
    assert natural["outputs/grad_norm"]["max_abs"]["control_error"] > 100 * expect_norm
    assert natural["grads/w"]["max_abs"]["control_error"] == pytest.approx(0.5, rel=1e-6)


def _critic_run(values: torch.Tensor) -> RunTensors:
    return RunTensors({"values_BT": values, "loss": values.sum().reshape(())}, {"w": torch.zeros(2)},
                      {"w": torch.zeros(2)}, {"exp_avg/w": torch.zeros(2), "exp_avg_sq/w": torch.zeros(2)})


def test_control_replay_is_found_from_the_recorded_decisions(tmp_path):
    """A critic control whose value of one token crosses old + value_clip_eps (clipped: its return lies beyond the edge) while
    r0's sits just inside: control_replay names the replay of fp32-r0 on the control's decisions, keyed by them;
    a control that decided as r0 (a value moved inside the range) has none."""
    matrix = synthetic_matrix(tmp_path)
    eps = matrix.ppo.value_clip_eps
    layout = RunLayout(tmp_path / "run")
    mask = torch.ones(1, 4, dtype=torch.bool)
    old, returns = torch.zeros(1, 4), torch.full((1, 4), 1.0)
    inputs = StepInputs([{"old_values_BT": old, "returns_BT": returns}], [mask])
    r0 = torch.tensor([[eps - 1e-3, 0.05, -0.05, 0.0]])
    crossed = r0.clone()
    crossed[0, 0] = eps + 1e-3
    inside = r0 + 1e-4
    for name, values in (("r0", r0), ("crossed", crossed), ("inside", inside)):
        write_steps(layout.scores("fp32", name, "critic"), [_critic_run(values)])
    mine = recorded_decisions(matrix.objective, "critic", layout.scores("fp32", "crossed", "critic"), inputs)
    assert mine[0].clipped_BT.tolist() == [[True, False, False, False]]
    ctx = ScoringContext.of(matrix, layout, "sha256:rollout", "sha256:targets")
    found = control_replay(ctx, "critic", "fp32-r0", "fp32-crossed", inputs)
    assert found is not None
    where, decided = found
    assert [d.tolist() for d in decided] == [[[True, False, False, False]]]
    assert where == replay_dir(layout.reference, "fp32", "critic", decided, ctx.settings)
    assert where.parent.parent == layout.reference / "replays" and where.name == "critic"
    assert control_replay(ctx, "critic", "fp32-r0", "fp32-inside", inputs) is None
    with pytest.raises(ValueError, match="a replay is of an r0 run, not fp32-inside"):
        control_replay(ctx, "critic", "fp32-inside", "fp32-crossed", inputs)


def test_a_control_whose_decisions_cannot_be_read_has_no_replay(tmp_path):
    """Outputs without values_BT: no decisions, so the control is compared with r0 itself (its structure is what
    fails, elsewhere), never an error here."""
    matrix = synthetic_matrix(tmp_path)
    layout = RunLayout(tmp_path / "run")
    mask = torch.ones(1, 2, dtype=torch.bool)
    inputs = StepInputs([{"old_values_BT": torch.zeros(1, 2), "returns_BT": torch.zeros(1, 2)}], [mask])
    write_steps(layout.scores("fp32", "r0", "critic"), [_critic_run(torch.zeros(1, 2))])
    blind = RunTensors({"loss": torch.zeros(())}, {"w": torch.zeros(2)}, {"w": torch.zeros(2)},
                       {"exp_avg/w": torch.zeros(2), "exp_avg_sq/w": torch.zeros(2)})
    write_steps(layout.scores("fp32", "blind", "critic"), [blind])
    assert recorded_decisions(matrix.objective, "critic", layout.scores("fp32", "blind", "critic"), inputs) == [None]
    ctx = ScoringContext.of(matrix, layout, "sha256:rollout", "sha256:targets")
    assert control_replay(ctx, "critic", "fp32-r0", "fp32-blind", inputs) is None


def _crossing_reference(tmp_path):
    """A critic reference with r0, a control that crossed the value-clip edge on one token and one that did not."""
    matrix = synthetic_matrix(tmp_path)
    eps = matrix.ppo.value_clip_eps
    layout = RunLayout(tmp_path / "run")
    mask = torch.ones(1, 4, dtype=torch.bool)
    inputs = StepInputs([{"old_values_BT": torch.zeros(1, 4), "returns_BT": torch.full((1, 4), 1.0)}], [mask])
    r0 = torch.tensor([[eps - 1e-3, 0.05, -0.05, 0.0]])
    crossed = r0.clone()
    crossed[0, 0] = eps + 1e-3
    for name, values in (("r0", r0), ("crossed", crossed), ("inside", r0 + 1e-4)):
        write_steps(layout.scores("fp32", name, "critic"), [_critic_run(values)])
    return matrix, layout, inputs


def test_freeze_finds_a_control_replay_under_the_scoring_settings_of_the_recorded_rollout(tmp_path):
    from qualify.freeze import replays_of
    from qualify.reference.evidence import scoring_settings

    matrix, layout, inputs = _crossing_reference(tmp_path)
    replay_of = replays_of(ScoringContext.of(matrix, layout, "sha256:abc", "sha256:t"), "critic", inputs)
    decided = [torch.tensor([[True, False, False, False]])]
    expect = replay_dir(layout.reference, "fp32", "critic", decided, scoring_settings(matrix, "sha256:abc"))
    assert replay_of("fp32-r0", "fp32-crossed") == expect
    assert expect != replay_dir(layout.reference, "fp32", "critic", decided, scoring_settings(matrix, "sha256:abd"))
    assert replay_of("fp32-r0", "fp32-inside") is None


def test_terms_of_gives_each_steps_loss_contributions_and_none_past_the_last_step(tmp_path):
    from qualify.freeze import terms_of
    from qualify.ppo.decisions import loss_terms

    matrix, _layout, inputs = _crossing_reference(tmp_path)
    run = _critic_run(torch.tensor([[0.3, 0.05, -0.05, 0.0]]))
    terms = terms_of(matrix.objective, "critic", inputs)
    got = terms(0, run)
    expect = loss_terms("critic", matrix.ppo, matrix.grpo, run.outputs, inputs.targets[0], inputs.masks[0])
    assert got is not None and torch.equal(got, expect)
    # the value-clip loss by hand: 0.5 x max((v - R)^2, (clip(v) - R)^2) / tokens, token 0 clipped at 0.2
    eps = matrix.ppo.value_clip_eps
    by_hand = [0.5 * max((v - 1.0) ** 2, (max(min(v, eps), -eps) - 1.0) ** 2) / 4 for v in (0.3, 0.05, -0.05, 0.0)]
    assert got.flatten().tolist() == pytest.approx(by_hand, rel=1e-6)
    assert terms(1, run) is None
