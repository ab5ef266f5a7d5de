"""The candidate stage's flow is straight: what the judge compares a case with when the case decided a clip otherwise
than the reference (the reference replayed on the case's decisions) is made and sealed as its own step before any
judging (qualify.candidate.stage.seal_replays); the judge, and `qualify report` judging again, only read it and never
run a model. A replay that is not sealed is an error naming it, not a computation."""

from __future__ import annotations

import shutil

import pytest
import torch

from qualify.candidate.stage import seal_replays
from qualify.compare import load_steps
from qualify.errors import EvidenceError
from qualify.judge.decided import aligned_reference, run_decisions
from qualify.layout import RunLayout
from qualify.matrix import Case
from qualify.reference.context import ScoringContext
from qualify.reference.inputs import StepInputs
from qualify.stagelog import StageLog
from qualify.stages import complete_stage, stage_is_complete
from qualify.store import read_json, read_tensors, write_tensors

CASE = Case(engine="torch-tp", precision="bf16", tp=1, role="actor")


def flipped_case(run, matrix) -> None:
    """A case directory that is bf16-r0's actor run with one step-1 token moved just past its clip edge (the token
    nearest the edge, as a correct engine's rounding moves it)."""
    layout = RunLayout(run)
    shutil.copytree(layout.scores("bf16", "r0", "actor"), layout.case(CASE.name))
    inputs = StepInputs.load(matrix.ppo, layout, matrix.rollout.vllm_tp[0])
    path = layout.case(CASE.name) / "step1" / "outputs.safetensors"
    outputs = read_tensors(path)
    (dec,) = run_decisions(matrix.objective, "actor", [load_steps(layout.case(CASE.name))[1]], StepInputs(
        inputs.targets[1:2], inputs.masks[1:2]))
    margin = torch.where(torch.isfinite(dec.margin_BT) & ~dec.clipped_BT, dec.margin_BT, torch.inf)
    r, t = divmod(int(margin.argmin()), margin.shape[1])
    adv = float(inputs.targets[1]["advantages_BT"][r, t])
    ratio = outputs["ratio_BT"].clone()
    ratio[r, t] = 1 + matrix.ppo.clip_eps + 1e-3 if adv > 0 else 1 - matrix.ppo.clip_eps - 1e-3
    write_tensors(path, outputs | {"ratio_BT": ratio})
    complete_stage(layout.case(CASE.name), {})


def test_the_judge_reads_the_sealed_replay_and_never_makes_it(run_copy, tiny_matrix, monkeypatch):
    from qualify.reference import forced

    layout = RunLayout(run_copy)
    flipped_case(run_copy, tiny_matrix)
    ctx = ScoringContext.of(tiny_matrix, layout)
    inputs = ctx.inputs()
    cand, ref = load_steps(layout.case(CASE.name)), load_steps(layout.scores("bf16", "r0", "actor"))
    bounds = read_json(layout.acceptance.parent / "bounds" / "actor-bf16-repeat.json")["bounds"]

    def no_model(*args, **kwargs):
        raise AssertionError("the judge ran the reference model")

    monkeypatch.setattr(forced, "make_replay", no_model)
    with pytest.raises(EvidenceError, match="is not sealed: bf16-r0 actor replayed on these clip decisions is made by "
                                            "'qualify candidate' before judging"):
        aligned_reference(ctx, inputs, CASE.name, "actor", "vs ref", "bf16", list(cand), ref, bounds)
    monkeypatch.undo()
    seal_replays(ctx, CASE, inputs, StageLog("candidate", quiet=True))  # the stage's own step
    [sealed] = list((layout.candidates / "replays").glob("bf16-r0-*/actor"))
    assert stage_is_complete(sealed)
    monkeypatch.setattr(forced, "make_replay", no_model)
    seal_replays(ctx, CASE, inputs, StageLog("candidate", quiet=True))  # sealed already: nothing made
    got, rows = aligned_reference(ctx, inputs, CASE.name, "actor", "vs ref", "bf16", list(cand), ref, bounds)
    assert [s.grads.keys() for s in got] == [s.grads.keys() for s in load_steps(sealed)]
    assert torch.equal(got[1].grads["lm_head.weight"], load_steps(sealed)[1].grads["lm_head.weight"])
    [row] = [r for r in rows if r.step == 1]
    assert row.passed and "1 decided otherwise than bf16-r0" in row.note and sealed.parent.name in row.note
