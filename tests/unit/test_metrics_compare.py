"""qualify.metrics and qualify.compare against values written out by hand, edge cases included.

Small tensors with exactly representable values, so every expected number is exact: a metric that
changes its comparison, its default or its reduction shows.
"""

from __future__ import annotations

import math

import pytest
import torch

from qualify import metrics
from qualify.bounds.rule import metric_kind
from qualify.compare import (
    RunTensors,
    flips,
    load_run,
    merge_max,
    pair_metrics,
    replay_metrics,
    structure_problems,
)
from tests.unit._runs import OPT, params, role_run, write_run

T = torch.tensor


def test_max_abs_exact_values_and_edges():
    assert metrics.max_abs(T([1.0, -2.0, 0.5]), T([1.5, 1.0, 0.5])) == 3.0
    assert metrics.max_abs(T([]), T([])) == 0.0
    assert metrics.max_abs(T([2.0]), T([2.0])) == 0.0
    assert metrics.max_abs(T([1.0, math.nan]), T([1.0, 0.0])) == math.inf
    assert metrics.max_abs(T([1.0]), T([math.nan])) != 0.0  # only the candidate is checked; NaN propagates


def test_rel_l2_exact_values_and_a_zero_reference():
    assert metrics.rel_l2(T([3.0, 4.0]), T([0.0, 0.0])) == 5.0  # ||c - r|| when the reference is zero
    assert metrics.rel_l2(T([3.0, 4.0]), T([3.0, 0.0])) == 4.0 / 3.0
    assert metrics.rel_l2(T([3.0, 0.0]), T([3.0, 0.0])) == 0.0
    assert metrics.rel_l2(T([math.inf]), T([1.0])) == math.inf


def test_flip_frac_counts_sign_changes():
    assert metrics.flip_frac(T([1.0, -1.0, 1.0, 1.0]), T([1.0, 1.0, 1.0, 1.0])) == 0.25
    assert metrics.flip_frac(T([2.0]), T([3.0])) == 0.0
    assert metrics.flip_frac(T([-2.0]), T([3.0])) == 1.0
    assert metrics.flip_frac(T([]), T([])) == 0.0
    assert metrics.flip_frac(T([0.0, 1.0]), T([1.0, 1.0])) == 0.5  # zero has its own sign


def adamw_direct(p, m, v, lr=OPT.lr, betas=OPT.betas, eps=OPT.eps, wd=OPT.weight_decay):
    """AdamW's first step from its moments, element by element in Python floats."""
    out = []
    for pi, mi, vi in zip(p.tolist(), m.tolist(), v.tolist()):
        step = lr * (mi / (1 - betas[0])) / (math.sqrt(vi / (1 - betas[1])) + eps)
        out.append(pi * (1 - lr * wd) - step - pi)
    return out


def test_replay_max_abs_against_a_python_adamw():
    p, m, v = T([1.0, -2.0, 0.5], dtype=torch.float64), T([1e-3, -2e-3, 0.0]).double(), T([1e-6, 4e-6, 1e-8]).double()
    update = T(adamw_direct(p, m, v), dtype=torch.float64)
    adamw = {"lr": OPT.lr, "betas": OPT.betas, "eps": OPT.eps, "weight_decay": OPT.weight_decay}
    assert metrics.replay_max_abs(update, p, m, v, **adamw) < 1e-15
    off = update.clone()
    off[2] += 1e-4
    assert metrics.replay_max_abs(off, p, m, v, **adamw) == pytest.approx(1e-4, rel=1e-9)
    no_decay = T(adamw_direct(p, m, v, wd=0.0), dtype=torch.float64)
    assert metrics.replay_max_abs(no_decay, p, m, v, **adamw) == pytest.approx(2.0 * OPT.lr * OPT.weight_decay)
    for bad in ("update", "m", "v"):
        args = {"update": update, "m": m, "v": v} | {bad: T([math.nan, 0.0, 0.0]).double()}
        assert metrics.replay_max_abs(args["update"], p, args["m"], args["v"], **adamw) == math.inf, bad
    empty = T([]).double()
    assert metrics.replay_max_abs(empty, empty, empty, empty, **adamw) == 0.0


# --- compare ---------------------------------------------------------------------------------------------------

def run_of(**groups) -> RunTensors:
    return RunTensors(*(groups.get(g, {}) for g in ("outputs", "grads", "updates", "moments")))


@pytest.mark.parametrize("key, kind", [("outputs/logprobs_BT", "logprob"), ("outputs/ratio_BT", "logprob"),
                                       ("outputs/kl_BT", "logprob"), ("outputs/values_BT", "value"),
                                       ("outputs/loss", "loss"), ("outputs/clip_frac", "loss"),
                                       ("outputs/kl_mean", "loss"), ("outputs/grad_norm", "grad_norm"),
                                       ("grads/a.b", "grad"), ("updates/a.b", "update")])
def test_metric_kind(key, kind):
    assert metric_kind(key) == kind


def test_structure_problems_name_every_mismatch_in_group_order():
    ref = run_of(outputs={"loss": T(0.5)}, grads={"w": torch.zeros(2, 3), "b": torch.zeros(3)},
                 moments={"exp_avg/w": torch.zeros(2)})
    cand = run_of(outputs={"loss": T(0.5, dtype=torch.float64)}, grads={"w": torch.zeros(3, 2), "x": torch.zeros(1)},
                  updates={"w": torch.zeros(1)}, moments={"exp_avg/w": torch.zeros(2)})
    assert structure_problems(cand, ref) == [
        ("outputs/loss", "dtype torch.float64 != torch.float32"),
        ("grads/b", "missing in candidate"), ("grads/x", "not in reference"), ("grads/w", "shape (3, 2) != (2, 3)"),
        ("updates/w", "not in reference")]
    assert structure_problems(ref, ref) == []


def test_pair_metrics_measure_each_group_with_its_metrics():
    ref = run_of(outputs={"loss": T(0.5)}, grads={"w": T([3.0, 0.0])}, updates={"w": T([-1.0, 1.0])},
                 moments={"exp_avg/w": T([0.3, 0.0])})
    cand = run_of(outputs={"loss": T(0.75)}, grads={"w": T([3.0, 4.0])}, updates={"w": T([-1.0, -1.0])},
                  moments={"exp_avg/w": T([0.3, 0.5])})
    assert pair_metrics(cand, ref) == {"outputs/loss": {"max_abs": 0.25},
                                       "grads/w": {"max_abs": 4.0, "rel_l2": 4 / 3, "mean_abs": 2.0, "p99_abs": 4.0}}
    # updates are not compared with the reference's (their conditioning is unbounded): the replay judges them; nor
    # are the moments (a function of the gradients, which are): their derivation judges them
    assert "updates/w" not in pair_metrics(cand, ref) and "moments/exp_avg/w" not in pair_metrics(cand, ref)


def test_pair_metrics_skip_tensors_with_structure_problems():
    ref = run_of(grads={"w": torch.zeros(2), "b": torch.zeros(1)})
    cand = run_of(grads={"w": torch.zeros(3), "b": torch.ones(1)})
    assert pair_metrics(cand, ref) == {"grads/b": {"max_abs": 1.0, "rel_l2": 1.0}}


def test_replay_metrics_make_a_missing_input_an_infinite_error():
    run = role_run("actor", 0.0)
    p = params()
    good = replay_metrics(run, p, OPT)
    assert set(good) == {"updates/w", "updates/b"} and all(v["replay_max_abs"] < 2.0 ** -21 for v in good.values())
    no_m = RunTensors(run.outputs, run.grads, run.updates, {k: v for k, v in run.moments.items() if k != "exp_avg/w"})
    no_v = RunTensors(run.outputs, run.grads, run.updates, {k: v for k, v in run.moments.items()
                                                             if k != "exp_avg_sq/b"})
    for r, params_before, broken in ((no_m, p, "w"), (no_v, p, "b"), (run, {"w": p["w"]}, "b"),
                                     (run, {"w": p["w"], "b": torch.ones(4)}, "b")):
        out = replay_metrics(r, params_before, OPT)
        assert out[f"updates/{broken}"] == {"replay_max_abs": math.inf}
        assert all(v["replay_max_abs"] < 2.0 ** -21 for k, v in out.items() if k != f"updates/{broken}")


def test_replay_metrics_use_the_declared_optimizer():
    run, p = role_run("actor", 0.0), params()
    for change in ({"lr": 2 * OPT.lr}, {"weight_decay": 0.5}, {"eps": 1e-2}, {"betas": (0.5, 0.999)},
                   {"betas": (0.9, 0.5)}):
        opt = type(OPT)(**({"lr": OPT.lr, "betas": OPT.betas, "eps": OPT.eps, "weight_decay": OPT.weight_decay,
                            "max_grad_norm": OPT.max_grad_norm} | change))
        assert max(v["replay_max_abs"] for v in replay_metrics(run, p, opt).values()) > 1e-6, change


def test_flips_per_update_with_equal_shapes_only():
    ref = run_of(updates={"w": T([1.0, 1.0, -1.0, 1.0]), "b": T([1.0]), "z": T([1.0])})
    cand = run_of(updates={"w": T([1.0, -1.0, -1.0, 1.0]), "b": T([1.0, 1.0]), "y": T([1.0])})
    assert flips(cand, ref) == {"w": 0.25}


def test_load_run_reads_a_written_run(tmp_path):
    run = role_run("critic", 1e-3)
    write_run(tmp_path / "r", run, {"control": "r1"})
    loaded = load_run(tmp_path / "r")
    for group in ("outputs", "grads", "updates", "moments"):
        a, b = getattr(loaded, group), getattr(run, group)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), group
    assert loaded.meta.to_json() == {"num_steps": 1, "control": "r1"} and (loaded.meta.num_steps, loaded.meta.lean) == (1, False)


def test_merge_max_starts_from_zero():
    into = {}
    merge_max(into, {"k": {"m": 0.0}})
    assert into == {"k": {"m": 0.0}}
    merge_max(into, {"k": {"m": 0.5}})
    merge_max(into, {"k": {"m": 0.25}})
    assert into == {"k": {"m": 0.5}}


# --- steps -------------------------------------------------------------------------------------------------------

def test_step_keys_round_trip():
    from qualify.compare import split_step, step_dir, with_step

    assert step_dir(3) == "step3"
    assert with_step(2, {"grads/w": 1, "outputs/loss": 2}) == {"step2/grads/w": 1, "step2/outputs/loss": 2}
    assert split_step("step12/moments/exp_avg/w") == (12, "moments/exp_avg/w")
    assert metric_kind("step3/outputs/values_BT") == "value" and metric_kind("step0/updates/w") == "update"


def test_steps_written_by_write_step_load_in_order(tmp_path):
    from qualify.compare import load_steps, num_steps, write_step

    runs = [role_run("actor", c) for c in (0.0, 1e-3, 2e-3)]
    for k, run in enumerate(runs):
        write_step(tmp_path / f"step{k}", {g: getattr(run, g) for g in ("outputs", "grads", "updates", "moments")})
    (tmp_path / "meta.json").write_text('{"num_steps": 3, "case": "x"}')
    assert num_steps(tmp_path) == 3
    loaded = load_steps(tmp_path)
    assert len(loaded) == 3 and all(s.meta.to_json() == {"num_steps": 3, "case": "x"} for s in loaded)
    assert all(s.meta.num_steps == 3 and not s.meta.lean for s in loaded)
    for run, got in zip(runs, loaded):
        for group in ("outputs", "grads", "updates", "moments"):
            a, b = getattr(got, group), getattr(run, group)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), group
    (tmp_path / "meta.json").write_text("{}")
    assert num_steps(tmp_path) == 1 and len(load_steps(tmp_path)) == 1


def test_params_before_each_step_accumulate_the_runs_own_updates_in_fp64():
    from qualify.compare import params_before_steps

    initial = {"w": T([1.0, 2.0]), "b": T([0.5]), "frozen": T([7.0])}
    steps = [run_of(updates={"w": T([0.25, -0.5]), "b": T([0.125, 1.0])}),  # b: wrong shape, not applied
             run_of(updates={"w": T([0.25, 0.25])}), run_of()]
    starts = params_before_steps(steps, initial)
    assert len(starts) == 3
    expected = [{"w": [1.0, 2.0], "b": [0.5], "frozen": [7.0]}, {"w": [1.25, 1.5], "b": [0.5], "frozen": [7.0]},
                {"w": [1.5, 1.75], "b": [0.5], "frozen": [7.0]}]
    for got, want in zip(starts, expected):
        assert {n: t.tolist() for n, t in got.items()} == want
        assert all(t.dtype == torch.float64 for t in got.values())
