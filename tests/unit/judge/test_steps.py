"""The judge row by row: the threshold itself, the replay target, and the rows a broken candidate leaves.

Each test names the row (tensor, metric) that must fail or pass, rather than trusting any failing
row: a check that stopped working would otherwise hide behind another one that still fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from qualify import metrics
from qualify.bounds.rule import bound_entry
from qualify.compare import RunTensors
from qualify.judge.steps import evidence_rows, judge_pair
from qualify.verdict import Row
from tests.unit._runs import OPT, adamw_run, params, role_run

FLOORS = {"logprob": 2.0 ** -20, "grad": 2.0 ** -22, "update": 2.0 ** -20,
          "relative": 2.0 ** -20, "loss": 2.0 ** -20, "grad_norm": 2.0 ** -20}


def one_tensor_runs(value: float) -> tuple[RunTensors, RunTensors]:
    """(candidate, reference) holding one logprob tensor; the candidate is off by value at one element."""
    ref = torch.zeros(2, 3)
    cand = ref.clone()
    cand[1, 2] = value
    return (RunTensors({"logprobs_BT": cand}, {}, {}, {}), RunTensors({"logprobs_BT": ref}, {}, {}, {}))


def judge_one(value: float, bound: dict) -> Row:
    cand, ref = one_tensor_runs(value)
    [row] = judge_pair("c", "actor", "x", cand, ref, {"outputs/logprobs_BT": {"max_abs": bound}}, {}, OPT)
    return row


# bound = 3 * 2^-12 + 2^-20: exactly representable in float32, so a candidate can sit exactly on it.
BOUND = bound_entry("logprob", 2.0 ** -12, 3.0, FLOORS)
EXACT = BOUND["bound"]
ABOVE = float(torch.nextafter(torch.tensor(EXACT, dtype=torch.float32), torch.tensor(1.0)))
BELOW = float(torch.nextafter(torch.tensor(EXACT, dtype=torch.float32), torch.tensor(0.0)))


def test_the_bound_is_representable():
    assert EXACT == 3 * 2.0 ** -12 + 2.0 ** -20 == float(torch.tensor(EXACT, dtype=torch.float32))
    assert BELOW < EXACT < ABOVE < 1.01 * EXACT


@pytest.mark.parametrize("value, passed", [(0.0, True), (0.5 * EXACT, True), (BELOW, True), (EXACT, True),
                                           (ABOVE, False), (1.5 * EXACT, False), (-ABOVE, False), (-EXACT, True)])
def test_a_candidate_passes_up_to_its_bound_and_fails_just_above(value, passed):
    row = judge_one(value, BOUND)
    assert (row.tensor, row.metric, row.value, row.bound, row.passed) == (
        "outputs/logprobs_BT", "max_abs", abs(value), EXACT, passed)
    assert row.note == ""


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_candidate_row_fails_and_says_why(bad):
    row = judge_one(bad, BOUND)
    assert not row.passed and math.isinf(row.value) and row.note == "NaN or Inf in candidate"


def test_row_ratio_and_json():
    assert Row("c", "actor", "x", "t", "m", 1.0, 4.0, True).ratio == 0.25
    assert Row("c", "actor", "x", "t", "m", 0.0, 0.0, True).ratio == 0.0
    assert Row("c", "actor", "x", "t", "m", 1e-9, 0.0, False).ratio == math.inf
    assert Row("c", "actor", "cmp", "t", "m", math.inf, 2.0, False, "why").to_json() == {
        "case": "c", "role": "actor", "comparison": "cmp", "tensor": "t", "metric": "m", "value": "inf",
        "bound": 2.0, "passed": False, "note": "why", "ratio": "inf", "step": None, "rule": ""}
    assert Row("c", "actor", "x", "t", "m", 3.0, 0.0, False).to_json()["ratio"] == "inf"
    assert Row("c", "actor", "x", "t", "m", 1.0, 2.0, True).to_json()["ratio"] == 0.5


# --- updates and moments ------------------------------------------------------------------------------------------

def tight_bounds(ref: RunTensors) -> dict:
    """Bounds of a tiny control error for every tensor of ref, the update checks included."""
    bounds: dict = {}
    for group, kind in (("outputs", None), ("grads", "grad")):
        for name in getattr(ref, group):
            k = kind or {"logprobs_BT": "logprob", "loss": "loss", "grad_norm": "grad_norm"}[name]
            bounds[f"{group}/{name}"] = {"max_abs": bound_entry(k, 1e-9, 4.0, FLOORS)}
            if group != "outputs":
                bounds[f"{group}/{name}"]["rel_l2"] = bound_entry("relative", 1e-9, 4.0, FLOORS)
    for name in ref.updates:
        bounds[f"updates/{name}"] = {"replay_max_abs": bound_entry("update", 2e-10, 4.0, FLOORS)}
    return bounds


def failed(rows: list[Row]) -> set[tuple[str, str]]:
    return {(r.tensor, r.metric) for r in rows if not r.passed}


def with_(run: RunTensors, **groups) -> RunTensors:
    parts = {g: {**getattr(run, g), **groups.get(g, {})} for g in ("outputs", "grads", "updates", "moments")}
    return RunTensors(parts["outputs"], parts["grads"], parts["updates"], parts["moments"])


@pytest.fixture(scope="module")
def ref():
    return role_run("actor", 0.0)


def test_the_reference_against_itself_passes_every_row(ref):
    rows = judge_pair("c", "actor", "x", ref, ref, tight_bounds(ref), params(), OPT)
    assert failed(rows) == set() and len(rows) == sum(len(v) for v in tight_bounds(ref).values())
    replay = {r.tensor: r.value for r in rows if r.metric == "replay_max_abs"}
    assert set(replay) == {"updates/w", "updates/b"} and all(0 <= v < 2.0 ** -21 for v in replay.values())  # fp32 rounding


def test_a_corrupted_update_fails_its_replay_row(ref):
    cand = with_(ref, updates={"w": ref.updates["w"] * 1.5})  # the step of a 1.5x learning rate, same moments
    assert failed(judge_pair("c", "actor", "x", cand, ref, tight_bounds(ref), params(), OPT)) == {
        ("updates/w", "replay_max_abs")}


def test_corrupted_moments_fail_the_replay_of_the_candidates_own_moments(ref):
    """The update is the reference's, the moments are not what produced it: only a replay of the
    candidate's own moments sees that (a replay of the reference's would pass). The moments themselves are not
    compared with the reference's: their derivation from the case's gradients judges them (test_derived)."""
    cand = with_(ref, moments={"exp_avg_sq/w": ref.moments["exp_avg_sq/w"] * 4})
    assert failed(judge_pair("c", "actor", "x", cand, ref, tight_bounds(ref), params(), OPT)) == {
        ("updates/w", "replay_max_abs")}


def test_a_self_consistent_step_from_other_gradients_passes_replay_and_fails_the_gradients(ref):
    """Gradients scaled by 1.3: AdamW of them is self-consistent (replay passes), the gradients are off, and the
    update barely moves (Adam normalizes the scale away)."""
    grads = {n: g * 1.3 for n, g in ref.grads.items()}
    updates, moments = adamw_run(params(), grads)
    cand = RunTensors(dict(ref.outputs), grads, updates, moments)
    bad = failed(judge_pair("c", "actor", "x", cand, ref, tight_bounds(ref), params(), OPT))
    assert not {m for t, m in bad if m == "replay_max_abs"}
    assert {("grads/w", "max_abs"), ("grads/b", "rel_l2")} <= bad


def test_a_bound_without_a_value_is_a_failing_row(ref):
    bounds = tight_bounds(ref) | {"grads/ghost": {"max_abs": bound_entry("grad", 0.0, 4.0, FLOORS),
                                                  "rel_l2": bound_entry("relative", 0.0, 4.0, FLOORS)}}
    rows = judge_pair("c", "actor", "x", ref, ref, bounds, params(), OPT)
    ghost = [r for r in rows if r.tensor == "grads/ghost"]
    assert ghost == [Row("c", "actor", "x", "grads/ghost", "max_abs", math.inf, FLOORS["grad"], False, "not measured",
                         rule=f"<= {FLOORS['grad']:.3g} = k x control 0 + floor {FLOORS['grad']:.3g}"),
                     Row("c", "actor", "x", "grads/ghost", "rel_l2", math.inf, FLOORS["relative"], False, "not measured",
                         rule=f"<= {FLOORS['relative']:.3g} = k x control 0 + floor {FLOORS['relative']:.3g}")]
    assert len(rows) == sum(len(v) for v in bounds.values())
    assert failed(rows) == {("grads/ghost", "max_abs"), ("grads/ghost", "rel_l2")}


def test_a_structure_problem_is_one_failing_row_in_place_of_the_metrics(ref):
    cand = with_(ref, grads={"w": torch.zeros(3, 4)})
    all_rows = judge_pair("case", "critic", "cmp", cand, ref, tight_bounds(ref), params(), OPT)
    rows = [r for r in all_rows if r.tensor == "grads/w"]
    assert rows == [Row("case", "critic", "cmp", "grads/w", "structure", math.inf, 0.0, False, "shape (3, 4) != (4, 3)",
                        rule="names, shapes and dtypes equal the reference's")]
    others = {k: v for k, v in tight_bounds(ref).items() if k != "grads/w"}
    assert len(all_rows) == 1 + sum(len(v) for v in others.values())  # every other tensor is still judged


# --- evidence rows -------------------------------------------------------------------------------------------------

GOOD = {"grad_dtypes": {"w": "float32", "b": "float32"}, "state_dtypes": {"w": "float32", "b": "float32"},
        "replica_max_abs": {"q_norm": 0.0, "k_norm": 0.0},
        "padded_rows": {"lm_head.weight": {"rows": 24, "changed_max_abs": 0.0}}, "extra_params": []}
CHECKS = [("evidence/grad_buffers", "num_not_fp32"), ("evidence/optimizer_state", "num_not_fp32"),
          ("evidence/optimizer_state", "num_params"), ("evidence/replicas", "max_abs_across_ranks"),
          ("evidence/padded_vocab_rows", "changed_max_abs"), ("evidence/padded_vocab_rows", "num_unexposed"),
          ("evidence/params", "num_extra")]


def evidence(meta: dict) -> dict[tuple[str, str], Row]:
    rows = evidence_rows("case", "actor", meta)
    assert [(r.tensor, r.metric) for r in rows] == CHECKS
    assert all((r.case, r.role, r.comparison, r.bound) == ("case", "actor", "evidence", 0.0) for r in rows)
    return {(r.tensor, r.metric): r for r in rows}


def test_good_evidence_passes_every_check_with_zero_values():
    rows = evidence(GOOD)
    assert all(r.passed and r.value == 0.0 for r in rows.values())
    assert rows[("evidence/optimizer_state", "num_params")].note == "parameters without optimizer state"
    assert rows[("evidence/replicas", "max_abs_across_ranks")].note == "q_norm"  # the first of equal maxima


def test_empty_evidence_passes():
    meta = {"grad_dtypes": {}, "state_dtypes": {}, "replica_max_abs": {}, "padded_rows": {}, "extra_params": []}
    rows = evidence(meta)
    assert all(r.passed and r.value == 0.0 for r in rows.values())
    assert rows[("evidence/replicas", "max_abs_across_ranks")].note == ""


@pytest.mark.parametrize("change, check, value, note", [
    ({"grad_dtypes": {"z": "bfloat16", "w": "float32", "a": "float16", "c": "bfloat16", "d": "bfloat16"},
      "state_dtypes": {n: "float32" for n in "zwacd"}},
     ("evidence/grad_buffers", "num_not_fp32"), 4.0, "a, c, d"),
    ({"state_dtypes": {"w": "bfloat16", "b": "float32"}}, ("evidence/optimizer_state", "num_not_fp32"), 1.0, "w"),
    ({"grad_dtypes": {n: "float32" for n in "pqrs"}, "state_dtypes": {n: "bfloat16" for n in "srqp"}},
     ("evidence/optimizer_state", "num_not_fp32"), 4.0, "p, q, r"),
    ({"state_dtypes": {"w": "float32"}}, ("evidence/optimizer_state", "num_params"), 1.0,
     "parameters without optimizer state"),
    ({"replica_max_abs": {"q_norm": 1e-9, "k_norm": 3e-9}}, ("evidence/replicas", "max_abs_across_ranks"), 3e-9,
     "k_norm"),
    ({"padded_rows": {"a": {"rows": 2, "changed_max_abs": 1e-3}, "b": {"rows": 2, "changed_max_abs": 2e-3}}},
     ("evidence/padded_vocab_rows", "changed_max_abs"), 2e-3, ""),
    ({"extra_params": ["x", "y", "z", "zz"]}, ("evidence/params", "num_extra"), 4.0, "x, y, z"),
    ({"replica_max_abs": {"q_norm": math.nan}}, ("evidence/replicas", "max_abs_across_ranks"), math.nan, "q_norm"),
    # NaN after a finite value: a plain max() would keep the 0.0 and pass
    ({"replica_max_abs": {"q_norm": 0.0, "k_norm": math.nan, "z_norm": 1e-9}},
     ("evidence/replicas", "max_abs_across_ranks"), math.nan, "k_norm"),
    ({"replica_max_abs": {"q_norm": 0.0, "k_norm": "nan"}}, ("evidence/replicas", "max_abs_across_ranks"), math.nan,
     "k_norm"),  # meta.json stores non-finite numbers as text
    ({"padded_rows": {"a": {"rows": 2, "changed_max_abs": 0.0}, "b": {"rows": 2, "changed_max_abs": "nan"},
                      "c": {"rows": 2, "changed_max_abs": 1e-3}}},
     ("evidence/padded_vocab_rows", "changed_max_abs"), math.nan, ""),
])
def test_each_bad_fact_fails_its_own_row_and_names_it(change, check, value, note):
    rows = evidence(GOOD | change)
    assert {key for key, r in rows.items() if not r.passed} == {check}
    row = rows[check]
    assert (row.value == value or (math.isnan(value) and math.isnan(row.value))) and row.note == note


# --- several optimizer steps -------------------------------------------------------------------------------------

def two_adamw_steps() -> list[RunTensors]:
    """Two torch AdamW steps from params() with different gradients: each step's updates and moments."""
    p0 = params()
    live = {n: torch.nn.Parameter(p.clone()) for n, p in p0.items()}
    opt = torch.optim.AdamW(live.values(), lr=OPT.lr, betas=OPT.betas, eps=OPT.eps, weight_decay=OPT.weight_decay,
                            foreach=False)
    steps = []
    for k in range(2):
        before = {n: p.detach().clone() for n, p in live.items()}
        grads = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(40 + k)) * 1e-2
                 for n, p in live.items()}
        for n, p in live.items():
            p.grad = grads[n].clone()
        opt.step()
        steps.append(RunTensors({"loss": torch.tensor(0.5 + k)}, grads,
                                {n: p.detach() - before[n] for n, p in live.items()},
                                {f"{m}/{n}": opt.state[p][m].clone() for n, p in live.items()
                                 for m in ("exp_avg", "exp_avg_sq")}))
    return steps


def step_bounds(steps: list[RunTensors]) -> dict:
    from qualify.compare import with_step

    out = {}
    for k, s in enumerate(steps):
        out |= with_step(k, tight_bounds(s))
    return out


def test_every_step_is_judged_with_its_own_bounds_and_adam_step():
    from qualify.compare import params_before_steps
    from qualify.judge.steps import judge_steps

    steps = two_adamw_steps()
    starts = params_before_steps(steps, params())
    rows = judge_steps("c", "actor", "x", steps, steps, step_bounds(steps), starts, OPT)
    assert failed(rows) == set() and {(r.case, r.role, r.comparison) for r in rows} == {("c", "actor", "x")}
    assert {r.tensor.split("/")[0] for r in rows} == {"step0", "step1"}
    assert len(rows) == sum(len(v) for v in step_bounds(steps).values())
    replay = {r.tensor: r.value for r in rows if r.metric == "replay_max_abs"}
    assert set(replay) == {"step0/updates/w", "step0/updates/b", "step1/updates/w", "step1/updates/b"}
    assert all(v < 2.0 ** -21 for v in replay.values())  # step 2's bias correction, from step 2's own start
    late = [steps[0], RunTensors(steps[1].outputs, steps[1].grads, {**steps[1].updates, "b": steps[1].updates["b"] * 2},
                                 steps[1].moments)]
    assert failed(judge_steps("c", "actor", "x", late, steps, step_bounds(steps), starts, OPT)) == {
        ("step1/updates/b", "replay_max_abs")}


def test_a_candidate_that_took_fewer_steps_fails_a_row_that_says_so():
    from qualify.compare import params_before_steps
    from qualify.judge.steps import judge_steps

    steps = two_adamw_steps()
    rows = judge_steps("case", "critic", "cmp", steps[:1], steps, step_bounds(steps),
                       params_before_steps(steps, params()), OPT)
    assert rows[0] == Row("case", "critic", "cmp", "steps", "num_steps", 1.0, 2.0, False,
                          "the candidate took 1 optimizer steps, the reference 2")
    assert {r.tensor.split("/")[0] for r in rows[1:]} == {"step0"} and failed(rows[1:]) == set()


def test_a_replay_bound_without_an_exp_avg_bound_is_still_measured(ref):
    """The replay is measured with no other bound of the tensor."""
    bounds = {"updates/b": {"replay_max_abs": bound_entry("update", 2e-10, 4.0, FLOORS)}}
    [row] = judge_pair("c", "actor", "x", ref, ref, bounds, params(), OPT)
    assert (row.tensor, row.metric, row.passed) == ("updates/b", "replay_max_abs", True) and row.value < 2.0 ** -21


# --- precision evidence: fp32 quantities must not be bf16 values widened -------------------------------------------

def _precision_runs(candidate_logprobs: torch.Tensor, reference_logprobs: torch.Tensor, grads_bf16: bool):
    g = torch.Generator().manual_seed(11)
    grad = torch.randn(8, 8, generator=g)
    ref_grad = grad.to(torch.bfloat16).float() if grads_bf16 else grad
    cand = RunTensors({"logprobs_BT": candidate_logprobs, "loss": torch.tensor(0.5)}, {"w": ref_grad.clone()}, {}, {})
    ref = RunTensors({"logprobs_BT": reference_logprobs, "loss": torch.tensor(0.5)}, {"w": ref_grad}, {}, {})
    return [cand], [ref]


def test_an_fp32_logprob_computed_in_bf16_fails_naming_the_tensor():
    from qualify.judge.steps import PRECISION_MARGIN, precision_rows

    fp32 = -torch.rand(4, 32, generator=torch.Generator().manual_seed(3)) * 8
    cand, ref = _precision_runs(fp32.to(torch.bfloat16).float(), fp32, grads_bf16=True)
    rows = precision_rows("c", "actor", cand, ref)
    bad = [r for r in rows if not r.passed]
    assert [(r.tensor, r.metric) for r in bad] == [("step0/outputs/logprobs_BT", "bf16_exact_excess")]
    assert bad[0].value > 0.9 and bad[0].bound == PRECISION_MARGIN and "where the contract says fp32" in bad[0].note
    # the scalar loss is not judged (one value is bf16-exact by chance too often to mean anything); bf16 gradients
    # that the reference also holds as bf16 values claim nothing
    assert {r.tensor for r in rows} == {"step0/outputs/logprobs_BT", "step0/grads/w"}
    assert next(r for r in rows if r.tensor == "step0/grads/w").value == 0.0


def test_fp32_logprobs_pass_with_margin():
    from qualify.judge.steps import precision_rows

    fp32 = -torch.rand(4, 32, generator=torch.Generator().manual_seed(3)) * 8
    cand, ref = _precision_runs(fp32 + 1e-6, fp32, grads_bf16=False)
    assert all(r.passed and r.ratio < 0.1 for r in precision_rows("c", "actor", cand, ref))


def test_an_update_is_not_compared_with_the_references_update():
    """AdamW's update is ill-conditioned in its moments (w[0]: a first moment near zero against its second, where a
    moment error within bound flips the step): the update row is the replay of the candidate's own moments, and a
    candidate whose moments are the reference's and whose update is AdamW's of them passes whatever the reference's
    update was."""
    ref = RunTensors({}, {}, {"w": torch.tensor([-1e-4, -1e-4])},
                     {"exp_avg/w": torch.tensor([1e-9, 2e-3]), "exp_avg_sq/w": torch.tensor([1e-6, 1e-6])})
    bounds = {"updates/w": {"replay_max_abs": {"bound": 1e-9}}}
    start = {"w": torch.zeros(2)}
    own = {n: m for n, m in ref.moments.items()}
    update = metrics.adamw_update(start["w"], own["exp_avg/w"], own["exp_avg_sq/w"], lr=OPT.lr, betas=OPT.betas,
                                  eps=OPT.eps, weight_decay=OPT.weight_decay).float() - start["w"]
    cand = RunTensors({}, {}, {"w": update}, own)
    rows = judge_pair("c", "actor", "x", cand, ref, bounds, start, OPT)
    assert [(r.tensor, r.metric, r.passed) for r in rows] == [("updates/w", "replay_max_abs", True)]
    wrong = RunTensors({}, {}, {"w": update * 2}, own)
    [row] = judge_pair("c", "actor", "x", wrong, ref, bounds, start, OPT)
    assert not row.passed and row.value > 1e-5


def test_a_small_fp32_tensor_may_hold_a_few_bf16_values_by_chance_but_not_all():
    from qualify.judge.steps import CHANCE_ELEMENTS, precision_rows

    g = torch.Generator().manual_seed(5)
    ref_grad = torch.randn(32, generator=g)
    one_coincidence = ref_grad.clone()
    one_coincidence[3] = one_coincidence[3].to(torch.bfloat16).float()  # 1 of 32: 3% more than the reference
    widened = ref_grad.to(torch.bfloat16).float()
    ref = [RunTensors({}, {"w": ref_grad}, {}, {})]
    for grad, passes in ((one_coincidence, True), (widened, False)):
        [row] = precision_rows("c", "actor", [RunTensors({}, {"w": grad}, {}, {})], ref)
        assert row.bound == CHANCE_ELEMENTS / 32 and row.passed is passes, row
