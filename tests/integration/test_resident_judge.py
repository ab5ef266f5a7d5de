"""Judging a case from the copies qualify.resident holds gives the rows judged tensor by tensor from the sealed files,
number for number. Here the copies are held in host memory (a Resident on the CPU: the case's run, its TP1 case, each
r0 and the fp64 start read whole once, where without one every comparison reads each tensor from its file again);
tests/integration/test_resident_gpu.py holds them on the metrics GPU."""

from __future__ import annotations

import json

import pytest
import torch

from qualify.candidate.stage import run_candidates
from qualify.compare import load_steps
from qualify.judge.case import case_families, case_replays, judge_case
from qualify.layout import RunLayout
from qualify.store import TensorFile
from tests.integration._support import matrix_with, plugins_importable  # noqa: F401  (autouse fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.engines, pytest.mark.slow]


def judged(ctx, case, bounds, before, resident) -> list[str]:
    return [json.dumps(r.to_json(), sort_keys=True) for r in judge_case(ctx, case, bounds, before, resident=resident)]


def test_rows_judged_from_held_copies_are_the_rows_judged_per_tensor(run_copy):
    """bf16 TP1 and TP2 actors (two families, a TP1 comparison, four steps of starts): the same rows, rtol=0 and
    atol=0, with the runs held whole or read per tensor; and a held copy is what is judged (one r0 gradient changed in
    the held copy fails that gradient's rows, where the sealed file is unchanged)."""
    from qualify.acceptance import Acceptance
    from qualify.models.checkpoint import initial_parameters
    from qualify.reference.context import ScoringContext
    from qualify.resident import Resident

    m = matrix_with(run_copy.parent, engines=["torch-tp"], precisions=["bf16"], tp=[1, 2], roles=["actor"])
    verdict = run_candidates(m, run_copy).to_json()  # on the CPU the stage's Resident holds nothing: per tensor
    layout = RunLayout(run_copy)
    ctx = ScoringContext.of(m, layout)
    acc = Acceptance.load(layout.acceptance, layout.reference)
    bounds = {key: fam["bounds"] for key, fam in acc.families.items()}
    before = initial_parameters(ctx.models["actor"])
    held, per_tensor = Resident(torch.device("cpu")), {}
    for case in m.cases():
        per_tensor[case.name] = judged(ctx, case, bounds, before, Resident(None))
        assert per_tensor[case.name] == [json.dumps(r, sort_keys=True) for r in verdict["rows"]
                                         if r["case"] == case.name]
        assert judged(ctx, case, bounds, before, held) == per_tensor[case.name], case.name
    assert sorted(k[0] for k in held.kept) == ["base", "base", "start"]  # bf16-r0 and fp32-r0, the actor's start

    # a run that does not fit where the copies are held is read onto that device tensor by tensor (qualify.resident
    # .on_demand: at 8B a case's coded run is decoded on the GPU, not on the host): the same rows again
    class Full(Resident):
        def room(self) -> int:
            return 0

    full = Full(torch.device("cpu"))
    steps = full.transient(load_steps(layout.case(m.cases()[0].name)))
    assert all(isinstance(s.grads, TensorFile) and s.grads.device == torch.device("cpu") for s in steps)
    for case in m.cases():
        assert judged(ctx, case, bounds, before, full) == per_tensor[case.name], case.name

    # negative control: a held r0 with one gradient moved by 1.0 is what a case compared with that r0 itself (not with
    # r0 replayed on its clip decisions) is judged against
    inputs = ctx.inputs()
    case, family, ref_run = next((c, f, r) for c in m.cases() for f, r in case_families(c)
                                 if r not in {x for x, _ in case_replays(ctx, c, inputs)})
    steps = held.kept[("base", layout.scores(*ref_run.split("-", 1), "actor"))]
    name = min(steps[0].grads)
    steps[0].grads[name] = steps[0].grads[name] + 1.0
    changed = [json.loads(r) for r in judged(ctx, case, bounds, before, held)]
    failing = {(r["comparison"], r["tensor"]) for r in changed if not r["passed"]}
    assert (f"vs ref {ref_run} [{family}]", f"step0/grads/{name}") in failing, failing
    assert {tensor for _, tensor in failing} == {f"step0/grads/{name}"}, failing
    assert judged(ctx, case, bounds, before, Resident(None)) == per_tensor[case.name]  # the sealed file as it was
