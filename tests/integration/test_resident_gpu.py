"""qualify.resident on a GPU: records made, and cases judged, from copies held on the metrics GPU are the records and
rows made by moving each tensor per comparison. Needs CUDA, not vLLM (the reference scores the committed rollout), so
it runs on a GPU host without vLLM."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from qualify.layout import RunLayout
from qualify.store import read_json
from tests.conftest import COMMITTED, TINY
from tests.integration._support import matrix_with, plugins_importable  # noqa: F401  (autouse fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the metrics GPU: resident copies need CUDA")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    from qualify.matrix import load_matrix
    from qualify.reference.stage import run_reference

    base = tmp_path_factory.mktemp("full-evidence")
    data = yaml.safe_load(TINY.read_text())
    data["reference"]["evidence"] = "full"
    (base / "matrix.yaml").write_text(yaml.safe_dump(data))
    run_dir = base / "tiny-qwen3"
    run_reference(load_matrix(base / "matrix.yaml"), run_dir, rollout=COMMITTED / "reference" / "rollout")
    return run_dir


def test_records_made_from_resident_gpu_copies_are_the_records_made_per_tensor(full_run):
    """qualify.resident moves a control's tensors, the r0 it is compared with and its fp64 start to the
    metrics GPU once; without it every comparison moves them again tensor by tensor. The records are the same number
    for number (the metrics run on the GPU either way)."""
    from qualify.matrix import load_matrix
    from qualify.models.checkpoint import initial_parameters
    from qualify.reference import summary
    from qualify.reference.context import ScoringContext
    from qualify.resident import Resident

    layout = RunLayout(full_run)
    ctx = ScoringContext.of(load_matrix(full_run.parent / "matrix.yaml"), layout)
    controls = read_json(layout.reference_summary)["controls"]
    for role in ctx.objective.roles:
        run_name = "bf16-r1"
        from qualify.compare import load_steps

        steps = load_steps(layout.scores(*run_name.split("-", 1), role))
        result = {"meta": steps[0].meta.to_json(), "steps": [
            {"outputs": s.outputs, **{g: dict(getattr(s, g).items()) for g in ("grads", "updates", "moments")}}
            for s in steps]}
        before = initial_parameters(ctx.models[role])
        on_host = Resident()
        on_host.device = None  # every comparison moves its tensors itself
        resident = Resident()
        assert resident.device is not None
        got = summary.control_record(ctx, role, run_name, result, controls, before, resident=resident)
        want = summary.control_record(ctx, role, run_name, result, controls, before, resident=on_host)
        assert resident.kept, "nothing was kept on the GPU"
        assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)


def test_rows_judged_from_resident_gpu_copies_are_the_rows_judged_per_tensor(run_copy):
    """The candidate stage's judging with its Resident (the case's run, each r0 and the fp64 start on the GPU, moved
    once) gives the rows of judging with none (every comparison moves its tensors itself): rtol=0, atol=0."""
    from qualify.acceptance import Acceptance
    from qualify.candidate.stage import run_candidates
    from qualify.judge.case import judge_case
    from qualify.models.checkpoint import initial_parameters
    from qualify.reference.context import ScoringContext
    from qualify.resident import Resident

    m = matrix_with(run_copy.parent, engines=["torch-tp"], precisions=["bf16"], tp=[1], roles=["actor", "critic"])
    verdict = run_candidates(m, run_copy).to_json()
    layout = RunLayout(run_copy)
    ctx = ScoringContext.of(m, layout)
    acc = Acceptance.load(layout.acceptance, layout.reference)
    bounds = {key: fam["bounds"] for key, fam in acc.families.items()}
    resident = Resident()
    assert resident.device is not None and resident.device.type == "cuda"
    for case in m.cases():
        before = initial_parameters(ctx.models[case.role])
        per_tensor = [json.dumps(r.to_json(), sort_keys=True)
                      for r in judge_case(ctx, case, bounds, before, resident=Resident(None))]
        assert per_tensor == [json.dumps(r, sort_keys=True) for r in verdict["rows"] if r["case"] == case.name]
        assert [json.dumps(r.to_json(), sort_keys=True)
                for r in judge_case(ctx, case, bounds, before, resident=resident)] == per_tensor, case.name
    assert sorted(k[0] for k in resident.kept) == ["base"] * 4 + ["start"] * 2, sorted(resident.kept)
