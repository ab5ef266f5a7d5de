"""Metrics and the judge, against direct computations; every failing input must fail."""

from __future__ import annotations

import math

import pytest
import torch

from qualify import metrics
from qualify.bounds.rule import bound_entry, quantum
from qualify.compare import RunTensors, pair_metrics, replay_metrics, structure_problems
from qualify.judge.steps import evidence_rows, judge_pair
from qualify.matrix import Optimizer
from tests.unit._runs import OPT, adamw_run


def make_run(seed: int = 0, scale: float = 1.0) -> tuple[RunTensors, dict]:
    g = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(99)), "b": torch.ones(3)}
    grads = {n: torch.randn(p.shape, generator=g) * scale for n, p in params.items()}
    updates, moments = adamw_run(params, grads)
    outputs = {"logprobs_BT": torch.randn(2, 5, generator=g), "loss": torch.tensor(0.5)}
    run = RunTensors(outputs, grads, updates, moments)
    return run, params


def test_max_abs_and_rel_l2_match_direct_formulas():
    a, b = torch.randn(100), torch.randn(100)
    assert metrics.max_abs(a, b) == pytest.approx(float((a.double() - b.double()).abs().max()))
    assert metrics.rel_l2(a, b) == pytest.approx(float((a.double() - b.double()).norm() / b.double().norm()))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_candidate_is_infinite_error(bad):
    c = torch.zeros(5)
    c[2] = bad
    for f in (metrics.max_abs, metrics.rel_l2, metrics.flip_frac):
        assert math.isinf(f(c, torch.zeros(5)))


def fp32_ulp(params: dict) -> float:
    """Spacing of fp32 at the largest parameter: new - old carries that rounding."""
    return 2.0 ** (math.floor(math.log2(max(float(p.abs().max()) for p in params.values()))) - 23)


def test_adamw_first_step_matches_torch():
    run, params = make_run()
    for n in params:
        expected = metrics.adamw_update(params[n], run.moments[f"exp_avg/{n}"], run.moments[f"exp_avg_sq/{n}"],
                                        lr=OPT.lr, betas=OPT.betas, eps=OPT.eps, weight_decay=OPT.weight_decay)
        assert float((expected - run.updates[n].double()).abs().max()) <= fp32_ulp(params)


def test_replay_catches_wrong_learning_rate():
    run, params = make_run()
    assert max(v["replay_max_abs"] for v in replay_metrics(run, params, OPT).values()) <= fp32_ulp(params)
    wrong = Optimizer(lr=2e-3, betas=OPT.betas, eps=OPT.eps, weight_decay=OPT.weight_decay)
    assert max(v["replay_max_abs"] for v in replay_metrics(run, params, wrong).values()) > 5e-4


def test_quantum_is_one_rounding_step():
    assert quantum("bf16", "max_abs", 0.39) == 2.0 ** -9  # bf16 spacing in [0.25, 0.5)
    assert quantum("fp32", "max_abs", 1.5) == 2.0 ** -23
    assert quantum("bf16", "rel_l2", 123.0) == 2.0 ** -7
    assert quantum("bf16", "max_abs", 0.0) == 0.0
    assert torch.tensor(0.39, dtype=torch.bfloat16).item() + 2.0 ** -9 == torch.tensor(
        0.39 + 2.0 ** -9, dtype=torch.bfloat16).item()


def _bounds_from(errors: dict, floor: float = 1e-6) -> dict:
    floors = {k: floor for k in ("logprob", "value", "loss", "grad", "grad_norm", "update", "target",
                                 "relative")}
    from qualify.bounds.rule import metric_kind

    return {key: {m: bound_entry("relative" if m == "rel_l2" else metric_kind(key), v, 4.0, floors) for m, v in ms.items()}
            for key, ms in errors.items()}


def _self_bounds(run, params):
    errors = pair_metrics(run, run)
    for key, ms in replay_metrics(run, params, OPT).items():
        errors.setdefault(key, {}).update(ms)
    return _bounds_from(errors)


def test_judge_passes_identical_and_fails_each_corruption():
    run, params = make_run()
    bounds = _self_bounds(run, params)
    assert all(r.passed for r in judge_pair("c", "actor", "x", run, run, bounds, params, OPT))

    def with_(group, name, tensor):
        d = {g: dict(getattr(run, g)) for g in ("outputs", "grads", "updates", "moments")}
        if tensor is None:
            del d[group][name]
        else:
            d[group][name] = tensor
        return RunTensors(d["outputs"], d["grads"], d["updates"], d["moments"])

    nan = run.outputs["logprobs_BT"].clone()
    nan[0, 0] = float("nan")
    cases = {
        "nan": with_("outputs", "logprobs_BT", nan),
        "missing": with_("grads", "w", None),
        "shape": with_("grads", "w", torch.zeros(3, 4)),
        "dtype": with_("grads", "w", run.grads["w"].double()),
        "off": with_("grads", "b", run.grads["b"] + 1e-3),
        "extra": with_("grads", "extra", torch.zeros(1)),
    }
    for label, bad in cases.items():
        rows = judge_pair("c", "actor", "x", bad, run, bounds, params, OPT)
        assert any(not r.passed for r in rows), label


def test_structure_problems_lists_everything():
    run, _ = make_run()
    other = RunTensors({}, {"w": torch.zeros(1)}, {}, {})
    problems = dict(structure_problems(other, run))
    assert problems["grads/w"].startswith("shape") and problems["grads/b"] == "missing in candidate"


def test_evidence_rows_fail_on_each_bad_fact():
    good = {"grad_dtypes": {"w": "float32"}, "state_dtypes": {"w": "float32"}, "replica_max_abs": {"n": 0.0},
            "padded_rows": {"lm_head.weight": {"rows": 24, "changed_max_abs": 0.0}}, "extra_params": []}
    assert all(r.passed for r in evidence_rows("c", "actor", good))
    bads = [{"grad_dtypes": {"w": "bfloat16"}}, {"state_dtypes": {"w": "bfloat16"}}, {"replica_max_abs": {"n": 1e-9}},
            {"padded_rows": {"lm_head.weight": {"rows": 24, "changed_max_abs": 1e-3}}}, {"extra_params": ["x"]},
            {"state_dtypes": {}}]
    for bad in bads:
        assert any(not r.passed for r in evidence_rows("c", "actor", good | bad)), bad
