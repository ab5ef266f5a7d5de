"""qualify.compare: what mutation testing found unpinned.

Every tensor after a skipped one is still measured (a skip is a continue, not the end of the group). Values are
exact (small tensors of representable numbers).
"""

from __future__ import annotations

import math

import torch

from qualify.compare import RunTensors, pair_metrics, replay_metrics
from tests.unit._runs import OPT, params, role_run

T = torch.tensor


def run_of(**groups) -> RunTensors:
    return RunTensors(*(groups.get(g, {}) for g in ("outputs", "grads", "updates", "moments")))


def test_a_tensor_with_a_structure_problem_does_not_stop_the_ones_after_it():
    ref = run_of(grads={"a": torch.zeros(2), "b": torch.zeros(1), "c": torch.zeros(1)})
    cand = run_of(grads={"a": torch.zeros(3), "b": T([0.5]), "c": T([-0.25])})  # 'a' (first) has the wrong shape
    assert pair_metrics(cand, ref) == {"grads/b": {"max_abs": 0.5, "rel_l2": 0.5},
                                       "grads/c": {"max_abs": 0.25, "rel_l2": 0.25}}


def test_updates_and_moments_are_not_compared_with_the_reference_and_the_other_groups_are():
    ref = run_of(outputs={"loss": T(0.5)}, grads={"a": T([1.0])}, updates={"a": T([1.0])},
                 moments={"exp_avg/a": T([1.0])})
    cand = run_of(outputs={"loss": T(0.25)}, grads={"a": T([0.5])}, updates={"a": T([0.5])},
                  moments={"exp_avg/a": T([0.5])})
    # updates: judged by the AdamW replay; moments: by their derivation from the case's own gradients
    assert set(pair_metrics(cand, ref)) == {"outputs/loss", "grads/a"}


def test_a_scalar_output_has_no_distribution_metrics_and_a_two_element_one_has():
    ref = run_of(outputs={"loss": T(0.5), "values_BT": T([[0.0, 1.0]])})
    cand = run_of(outputs={"loss": T(0.25), "values_BT": T([[0.5, 1.0]])})
    assert pair_metrics(cand, ref) == {"outputs/loss": {"max_abs": 0.25},
                                       "outputs/values_BT": {"max_abs": 0.5, "mean_abs": 0.25, "p99_abs": 0.5}}


def test_replay_metrics_go_on_after_a_broken_update():
    run, p = role_run("actor", 0.0), params()
    assert list(run.updates) == ["w", "b"]
    no_m = RunTensors(run.outputs, run.grads, run.updates,
                      {k: v for k, v in run.moments.items() if k != "exp_avg/w"})
    out = replay_metrics(no_m, p, OPT)
    assert set(out) == {"updates/w", "updates/b"}
    assert out["updates/w"] == {"replay_max_abs": math.inf} and out["updates/b"]["replay_max_abs"] < 2.0 ** -21
