"""qualify.judge.decided: what mutation testing (run N, at 1219bce) found unpinned.

The decisions of a run's steps (run_decisions), the first step two runs decide differently and how many leading steps
are comparable, the reference chosen for a case's tensors (aligned_reference; the replay is a stand-in that records
what it is asked for), the decision rows' notes past SHOWN tokens, and the case's own loss rows. Critic decisions are
made from hand-picked values (old 0, return 1, eps 0.2): v = 0.5 is clipped ((0.2 - 1)^2 > (0.5 - 1)^2), v = -0.5 is
beyond the edge but not clipped ((-0.2 - 1)^2 < (-0.5 - 1)^2), v = 0.1 is inside the range.
"""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import torch

from qualify.compare import RunTensors
from qualify.judge.decided import (
    aligned_reference,
    comparable_steps,
    decision_rows,
    first_divergence,
    own_loss_rows,
    run_decisions,
)
from qualify.ppo.decisions import Decisions
from qualify.reference.inputs import StepInputs

OBJECTIVE = SimpleNamespace(ppo=SimpleNamespace(clip_eps=0.2, value_clip_eps=0.2, token_normalizer="global",
                                                normalizer_constant=None), grpo=None)
CTX = SimpleNamespace(objective=OBJECTIVE)  # what aligned_reference reads of a ScoringContext (and hands to the replay)
RULE = "decided as the reference, or where the reference is within its values_BT bound of the clip edge"


def critic_step(values, loss=None) -> RunTensors:
    outputs = {"values_BT": torch.tensor([values])}
    if loss is not None:
        outputs["loss"] = torch.tensor(loss)
    return RunTensors(outputs, {}, {}, {})


def inputs_of(num_steps: int, width: int = 2) -> StepInputs:
    targets = {"old_values_BT": torch.zeros(1, width), "returns_BT": torch.ones(1, width)}
    return StepInputs([targets] * num_steps, [torch.ones(1, width, dtype=torch.bool)] * num_steps)


def dec(clipped, margin=0.5) -> Decisions:
    c = torch.tensor([clipped])
    return Decisions(c, torch.full(c.shape, margin), "values_BT", "value_clip")


def test_run_decisions_are_each_steps_decisions_and_none_past_the_inputs():
    steps = [critic_step([0.5, -0.5]), critic_step([0.1, 0.5]), critic_step([0.5, 0.5])]
    got = run_decisions(OBJECTIVE, "critic", steps, inputs_of(2))
    assert got[2] is None and len(got) == 3
    assert got[0].clipped_BT.tolist() == [[True, False]] and got[1].clipped_BT.tolist() == [[False, True]]
    assert got[0].quantity == "values_BT" and got[0].name == "value_clip"


def test_first_divergence_skips_steps_without_decisions():
    a = [dec([False, False]), dec([False, True]), dec([True, True])]
    b = [dec([False, False]), dec([False, False]), dec([False, False])]
    assert first_divergence(a, b) == 1
    assert first_divergence([a[0], None, a[2]], b) == 2 and first_divergence(a, [b[0], None, b[2]]) == 2
    assert first_divergence(a, a) is None and first_divergence(a[:1], b) is None


def test_comparable_steps_are_the_leading_steps_decided_alike():
    base = [critic_step([0.5, -0.5]), critic_step([0.1, 0.1]), critic_step([0.1, 0.1])]
    cand = [critic_step([0.5, -0.5]), critic_step([0.5, 0.1]), critic_step([0.1, 0.1])]
    k, mine, theirs = comparable_steps(OBJECTIVE, "critic", cand, base, inputs_of(3))
    assert k == 1
    assert [d.clipped_BT.tolist() for d in mine] == [[[True, False]], [[True, False]], [[False, False]]]
    assert [d.clipped_BT.tolist() for d in theirs] == [[[True, False]], [[False, False]], [[False, False]]]
    assert comparable_steps(OBJECTIVE, "critic", base[:2], base, inputs_of(3))[0] == 2  # never: the shorter's length
    assert comparable_steps(OBJECTIVE, "critic", base, base[:2], inputs_of(3))[0] == 2


def test_decision_rows_name_at_most_four_tokens_and_skip_steps_without_decisions():
    ref = dec([False] * 6, 0.02)
    cand = dec([True] * 6)
    rows = decision_rows("c", "critic", "vs ref", [None, cand], [dec([False] * 6), ref], {})
    assert len(rows) == 1
    (row,) = rows
    assert (row.tensor, row.metric, row.value, row.bound, row.passed, row.step, row.rule) == (
        "step1/decisions/value_clip", "unexplained_flips", 6.0, 0.0, False, 1, RULE)
    # no bound for step 1: 0, so every flip is unexplained; six flips: four named and "and 2 more"
    assert row.note == ("6 decided otherwise with the edge beyond the values_BT bound 0: row 0 token 0 at 0.02, "
                        "row 0 token 1 at 0.02, row 0 token 2 at 0.02, row 0 token 3 at 0.02 and 2 more")
    within = decision_rows("c", "critic", "vs ref", [cand], [ref],
                           {"step0/outputs/values_BT": {"max_abs": {"bound": 0.05}}})
    assert within[0].passed and within[0].value == 0.0 and within[0].note == (
        "6 within the bound of the edge (legitimate): row 0 token 0 at 0.02, row 0 token 1 at 0.02, "
        "row 0 token 2 at 0.02, row 0 token 3 at 0.02 and 2 more")
    four = decision_rows("c", "critic", "vs ref", [dec([True] * 4)], [dec([False] * 4, 0.02)], {})
    assert four[0].note.endswith("row 0 token 3 at 0.02")  # exactly SHOWN: nothing more
    # a margin exactly at the bound (0.25, exact in fp32 and fp64) is explained
    at = decision_rows("c", "critic", "vs ref", [dec([True])], [dec([False], 0.25)],
                       {"step0/outputs/values_BT": {"max_abs": {"bound": 0.25}}})
    assert at[0].passed and at[0].note == "1 within the bound of the edge (legitimate): row 0 token 0 at 0.25"
    # both kinds in one step: the unexplained first, then the explained, joined by '; '
    ref = Decisions(torch.tensor([[False, False]]), torch.tensor([[0.5, 0.125]]), "ratio_BT", "policy_clip")
    both = decision_rows("case", "actor", "vs tp1", [dec([True, True])], [ref],
                         {"step0/outputs/ratio_BT": {"max_abs": {"bound": 0.25}}})
    assert [(r.case, r.role, r.comparison, r.tensor, r.value, r.passed) for r in both] == [
        ("case", "actor", "vs tp1", "step0/decisions/policy_clip", 1.0, False)]
    assert both[0].note == ("1 decided otherwise with the edge beyond the ratio_BT bound 0.25: row 0 token 0 at 0.5; "
                            "1 within the bound of the edge (legitimate): row 0 token 1 at 0.125")
    assert both[0].rule == "decided as the reference, or where the reference is within its ratio_BT bound of the clip edge"


def _no_replay(monkeypatch):
    calls = []
    forced = types.ModuleType("qualify.reference.forced")
    forced.sealed_replay = lambda *a: calls.append(a) or (_ for _ in ()).throw(AssertionError("replayed"))
    monkeypatch.setitem(sys.modules, "qualify.reference.forced", forced)
    return calls


def test_the_case_decided_as_the_reference_is_compared_with_the_reference_itself(monkeypatch):
    calls = _no_replay(monkeypatch)
    ref = [critic_step([0.5, -0.5]), critic_step([0.1, 0.5])]
    got, rows = aligned_reference(CTX, inputs_of(2), "c", "critic", "vs ref", "fp32", list(ref), ref, {})
    assert got is ref and [(r.tensor, r.passed, r.note) for r in rows] == [
        ("step0/decisions/value_clip", True, ""), ("step1/decisions/value_clip", True, "")]
    # a step whose decisions cannot be read, or another number of steps: the reference itself, no replay
    unreadable = [ref[0], RunTensors({}, {}, {}, {})]
    flipped = [critic_step([0.1, -0.5]), critic_step([0.1, 0.5])]
    assert aligned_reference(CTX, inputs_of(2), "c", "critic", "vs ref", "fp32", unreadable, ref, {})[0] is ref
    assert aligned_reference(CTX, inputs_of(2), "c", "critic", "vs ref", "fp32", flipped[:1], ref, {})[0] is ref
    # a reference step whose decisions cannot be read does not stop the comparison with the reference itself
    ref_unreadable = [RunTensors({}, {}, {}, {}), ref[1]]
    got, rows = aligned_reference(CTX, inputs_of(2), "c", "critic", "vs ref", "fp32", flipped, ref_unreadable,
                                  {})
    assert got is ref_unreadable and [(r.case, r.role, r.comparison, r.tensor) for r in rows] == [
        ("c", "critic", "vs ref", "step1/decisions/value_clip")]
    assert calls == []


def test_grpo_steps_are_decided_and_their_loss_judged_with_the_matrixs_grpo():
    grpo = SimpleNamespace(kl_coef=0.5, aggregation="token_mean", constant=None)
    grpo_objective = SimpleNamespace(ppo=OBJECTIVE.ppo, grpo=grpo)
    # A = 1 for the row; ratios 1.5 (clipped to 1.2: -1.2 > -1.5) and 1.0; kl 0.25 and 0.5
    outputs = {"ratio_BT": torch.tensor([[1.5, 1.0]]), "advantages_B": torch.tensor([1.0]),
               "kl_BT": torch.tensor([[0.25, 0.5]])}
    objective = ((-1.2 + 0.5 * 0.25) + (-1.0 + 0.5 * 0.5)) / 2
    outputs["loss"] = torch.tensor(objective)
    step = RunTensors(outputs, {}, {}, {})
    inputs = StepInputs([{}], [torch.ones(1, 2, dtype=torch.bool)])
    (d,) = run_decisions(grpo_objective, "actor", [step], inputs)
    assert d.clipped_BT.tolist() == [[True, False]] and d.quantity == "ratio_BT"
    (row,) = own_loss_rows("g", "actor", grpo_objective, [step], inputs)
    assert row.passed and row.tensor == "step0/outputs/loss" and row.value < 1e-7


def test_a_case_decided_otherwise_is_compared_with_the_reference_replayed_on_its_decisions(monkeypatch):
    ref = [critic_step([-0.5] * 6), critic_step([0.1] * 6)]
    cand = [critic_step([-0.5] * 6), critic_step([0.5, 0.5, 0.5, 0.5, 0.5, 0.1])]  # five flips at step 1
    replay = [critic_step([-0.5] * 6), critic_step([0.5, 0.5, 0.5, 0.5, 0.1, 0.1])]  # decided as cand but token 4
    calls = []
    forced = types.ModuleType("qualify.reference.forced")
    forced.sealed_replay = lambda *a: calls.append(a) or (replay, Path("/runs/x/replays/abc123/sealed"))
    monkeypatch.setitem(sys.modules, "qualify.reference.forced", forced)
    ctx = SimpleNamespace(objective=OBJECTIVE, layout=object())
    got, rows = aligned_reference(ctx, inputs_of(2, 6), "c", "critic", "vs ref", "bf16", cand, ref, {})
    assert got is replay
    ((c, precision, role, decided),) = calls
    assert c is ctx and (precision, role) == ("bf16", "critic")
    assert [d.tolist() for d in decided] == [[[False] * 6], [[True] * 5 + [False]]]
    assert [(r.tensor, r.passed, r.note) for r in rows[:1]] == [("step0/decisions/value_clip", True, "")]
    # step 1: judged against the replay's decisions (one token otherwise, no bound: unexplained), and the note says
    # the case is compared with the replay
    assert not rows[1].passed and rows[1].value == 1.0 and rows[1].note == (
        "1 decided otherwise with the edge beyond the values_BT bound 0: row 0 token 4 at 0.1; "
        "5 decided otherwise than bf16-r0 (row 0 token 0, row 0 token 1, row 0 token 2, row 0 token 3 and 1 more): "
        "compared with bf16-r0 replayed on this case's decisions (abc123)")
    assert [(r.case, r.role, r.comparison) for r in rows] == [("c", "critic", "vs ref")] * 2
    replay[1] = critic_step([0.5, 0.5, 0.5, 0.5, 0.5, 0.1])  # the replay decided as the case: only the comparison
    _, rows = aligned_reference(ctx, inputs_of(2, 6), "c", "critic", "vs ref", "bf16", cand, ref, {})
    assert rows[1].passed and rows[1].note == (
        "5 decided otherwise than bf16-r0 (row 0 token 0, row 0 token 1, row 0 token 2, row 0 token 3 and 1 more): "
        "compared with bf16-r0 replayed on this case's decisions (abc123)")


def test_own_loss_rows_hold_the_loss_to_its_objective_within_fp32_rounding():
    # v = (0.5, -0.5): terms 0.5 max(0.25, 0.64) / 2 and 0.5 max(2.25, 1.44) / 2 (global mean over 2 tokens)
    objective = 0.5 * (0.2 - 1) ** 2 / 2 + 0.5 * (-0.5 - 1) ** 2 / 2
    f32 = float(torch.tensor(objective, dtype=torch.float32))
    steps = [critic_step([0.5, -0.5], objective), critic_step([0.5, -0.5], 1.0), critic_step([0.5, -0.5]),
             RunTensors({"loss": torch.tensor(1.0)}, {}, {}, {}), critic_step([0.0, 0.0], 0.0),
             critic_step([0.5, -0.5], math.nan), critic_step([0.5, -0.5], 1.0)]
    targets = {"old_values_BT": torch.zeros(1, 2), "returns_BT": torch.ones(1, 2)}
    zero = {"old_values_BT": torch.zeros(1, 2), "returns_BT": torch.zeros(1, 2)}
    inputs = StepInputs([targets, targets, targets, targets, zero, targets], [torch.ones(1, 2, dtype=torch.bool)] * 6)
    rows = own_loss_rows("c", "critic", OBJECTIVE, steps, inputs)
    # step 2 has no loss, step 3 no values, step 6 no inputs: no rows
    assert [r.step for r in rows] == [0, 1, 4, 5]
    rule = "<= (active tokens + 4) x 2^-24 x sum |per-token contribution|: fp32 rounding of the loss's sum"
    assert all((r.case, r.role, r.comparison, r.metric, r.rule) == ("c", "critic", "own outputs", "objective_abs", rule)
               for r in rows)
    assert [r.tensor for r in rows] == ["step0/outputs/loss", "step1/outputs/loss", "step4/outputs/loss",
                                        "step5/outputs/loss"]
    bound = 6 * 2.0 ** -24 * objective
    assert rows[0].passed and rows[0].note == ""
    assert abs(rows[0].value - abs(f32 - objective)) < 1e-15 and abs(rows[0].bound - bound) < 1e-18
    assert not rows[1].passed and abs(rows[1].value - (1.0 - objective)) < 1e-15
    assert rows[1].note == "the loss is 1, the matrix's objective of this case's own outputs 0.7225"
    assert (rows[2].value, rows[2].bound, rows[2].passed, rows[2].note) == (0.0, 0.0, True, "")  # 0 <= 0 passes
    assert rows[3].value == math.inf and not rows[3].passed


def test_a_replayed_case_with_four_flips_and_an_unreadable_reference_step(monkeypatch):
    ref = [RunTensors({}, {}, {}, {}), critic_step([0.1] * 5)]
    cand = [critic_step([0.1] * 5), critic_step([0.5, 0.5, 0.5, 0.5, 0.1])]  # four flips at step 1
    replay = [critic_step([0.1] * 5), critic_step([0.5, 0.5, 0.5, 0.5, 0.1])]
    forced = types.ModuleType("qualify.reference.forced")
    forced.sealed_replay = lambda *a: (replay, Path("/runs/x/replays/r4/sealed"))
    monkeypatch.setitem(sys.modules, "qualify.reference.forced", forced)
    got, rows = aligned_reference(CTX, inputs_of(2, 5), "c", "critic", "vs ref", "fp32", cand, ref, {})
    assert got is replay
    # step 0: the reference's decisions cannot be read: no flips named; step 1: the four, without "and ... more"
    assert [(r.tensor, r.passed, r.note) for r in rows] == [
        ("step0/decisions/value_clip", True, ""),
        ("step1/decisions/value_clip", True, ("4 decided otherwise than fp32-r0 (row 0 token 0, row 0 token 1, "
         "row 0 token 2, row 0 token 3): compared with fp32-r0 replayed on this case's decisions (r4)"))]
