"""The candidate's own objective is what gets judged, and several steps make its bugs visible.

qualify.examples.own_objective brings its own PPO loss code (written from the formulas) through the
engine's objective() hook and must pass. Each plugin in tests.integration.plugins puts one bug from
the field back into that loss code and must fail on a named tensor. A matrix whose steps leave a
required branch inert is refused by freeze, naming the branch.
"""

from __future__ import annotations

import pytest
import yaml

from qualify.candidate.stage import run_candidates
from qualify.errors import FrozenError, MatrixError
from qualify.freeze import freeze
from qualify.matrix import load_matrix
from qualify.reference.stage import run_reference
from qualify.store import read_json
from tests.conftest import COMMITTED, TINY
from tests.integration._support import matrix_with, plugins_importable  # noqa: F401  (autouse fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.engines]
OWN = "qualify.examples.own_objective:engine"
PLUGINS = "tests.integration.plugins"


def failing(verdict, case):
    return {(r["tensor"], r["metric"]) for r in verdict["rows"] if r["case"] == case and not r["passed"]}


def case_of(matrix, engine):
    return next(c.name for c in matrix.cases() if c.engine == engine)


def test_own_objective_passes_and_actor_loss_bugs_fail_on_named_tensors(run_copy):
    bugs = [f"{PLUGINS}:wrong_clip_range", f"{PLUGINS}:per_sequence_normalizer", f"{PLUGINS}:padding_in_denominator"]
    m = matrix_with(run_copy.parent, engines=[OWN, *bugs], precisions=["fp32"], tp=[1], roles=["actor"])
    verdict = run_candidates(m, run_copy).to_json()
    own = case_of(m, OWN)
    assert verdict["cases"][own]["passed"], sorted(failing(verdict, own))[:5]
    assert read_json(run_copy / "candidates" / own / "meta.json")["own_objective"] is True
    clip = failing(verdict, case_of(m, bugs[0]))
    # the ratio leaves [0.8, 1.2] from step 1 on: a clip at 1 +- 0.3 counts and weighs those tokens differently
    assert not any(t.startswith("step0/") for t, _ in clip), sorted(clip)[:5]
    assert ("step1/outputs/loss", "max_abs") in clip, sorted(clip)[:5]
    # the clip fraction it reports is not the matrix's (1 +- 0.2) fraction of its own ratios
    assert ("step1/outputs/clip_frac", "derived_abs") in clip, sorted(clip)[:5]
    # and by its own outputs: tokens with a ratio in (1.2, 1.3] kept unclipped make a loss that is not the matrix's
    # objective of the ratios it reports (decisions are read from the outputs with the matrix's clip range, so the
    # decision rows see the reference's decisions: the bug shows in the loss and, from step 1, in the gradients)
    assert ("step1/outputs/loss", "objective_abs") in clip and ("step0/outputs/loss", "objective_abs") not in clip
    for bug in bugs[1:]:  # a wrong normalizer is wrong from the first, on-policy step
        bad = failing(verdict, case_of(m, bug))
        assert ("step0/outputs/loss", "max_abs") in bad, (bug, sorted(bad)[:5])
        assert any(t.startswith("step0/grads/") for t, _ in bad), (bug, sorted(bad)[:5])
        # and the loss is not the matrix's objective of the case's own outputs, whatever the reference's bounds
        assert ("step0/outputs/loss", "objective_abs") in bad, (bug, sorted(bad)[:5])
    own_rows = [r for r in verdict["rows"] if r["case"] == own and r["metric"] == "objective_abs"]
    assert len(own_rows) == 4 and all(r["passed"] and r["value"] < 0.1 * r["bound"] for r in own_rows), own_rows


def test_own_objective_critic_passes_and_a_missing_value_clip_fails(run_copy):
    bug = f"{PLUGINS}:no_value_clip"
    m = matrix_with(run_copy.parent, engines=[OWN, bug], precisions=["fp32"], tp=[1], roles=["critic"])
    verdict = run_candidates(m, run_copy).to_json()
    own = case_of(m, OWN)
    assert verdict["cases"][own]["passed"], sorted(failing(verdict, own))[:5]
    bad = failing(verdict, case_of(m, bug))
    assert not any(t.startswith("step0/") for t, _ in bad), sorted(bad)[:5]  # no value has moved at step 0
    # from step 1 the loss drops the clipped term: the loss and the gradients move; and the clip fraction it reports
    # (nothing clipped) is not the value-clip fraction of its own values, which the derivation row recomputes (a clip
    # fraction is judged by derivation and decisions only, never against a bound made of a few controls' token counts)
    assert ("step1/outputs/loss", "max_abs") in bad and ("step1/outputs/grad_norm", "max_abs") in bad, sorted(bad)[:5]
    assert ("step1/outputs/clip_frac", "derived_abs") in bad, sorted(bad)[:5]
    assert not any(t.endswith("/outputs/clip_frac") and m == "max_abs" for t, m in bad)  # no bound row any more
    assert any(t.startswith("step1/grads/") for t, _ in bad), sorted(bad)[:5]
    assert ("step1/outputs/loss", "objective_abs") in bad, sorted(bad)[:5]  # not the objective of its own values
    [row] = [r for r in verdict["rows"] if r["case"] == case_of(m, bug) and r["tensor"] == "step1/outputs/loss"
             and r["metric"] == "objective_abs"]
    assert "the matrix's objective of this case's own outputs" in row["note"], row


def test_freeze_refuses_a_single_step_matrix_that_requires_coverage(tmp_path):
    data = yaml.safe_load(TINY.read_text())
    data["ppo"]["epochs"] = 1
    path = tmp_path / "one-step.yaml"
    path.write_text(yaml.safe_dump(data))
    # Adam past its first step can never be taken in one step: refused when the matrix loads, before any reference
    with pytest.raises(MatrixError, match="freeze.require lists adam_past_first_step, which no reference of this "
                                          "matrix can exercise: set ppo.epochs x ppo.minibatches >= 2"):
        load_matrix(path)
    data["freeze"]["require"].remove("adam_past_first_step")
    path.write_text(yaml.safe_dump(data))
    run = tmp_path / "run"
    run_reference(load_matrix(path), run, rollout=COMMITTED / "reference" / "rollout")
    with pytest.raises(FrozenError) as info:  # the clips could have been taken; this reference left them inert
        freeze(run)
    message = str(info.value)
    for branch in ("policy_clip_high", "policy_clip_low", "value_clip"):
        assert f"{branch}:" in message, message
    assert "grad_clip:" not in message and "kl:" not in message  # exercised already at step 0
    assert not (run / "acceptance").exists()
