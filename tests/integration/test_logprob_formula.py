"""candidates.logprob_formula on a rollout sampled with top_p 0.9: a case's logprobs are judged against the
reference's formula of the name it declares.

One small reference (matrices/tiny-qwen3-sweep/t1.0-p0.9.yaml: 4 prompts, one step) is captured with real
vLLM, scored and frozen for this module. torch-tp declaring 'processed' passes; an engine that reports the full
formula while declaring 'processed', and one that reports the processed formula while declaring 'full', each fail
on outputs/logprobs_BT with a note naming the formula mismatch, and on nothing else (the loss is built from the
full formula either way). On the embedded default (top_k -1, top_p 1) 'processed' is the full formula.
"""

from __future__ import annotations

import pytest

from qualify.candidate.stage import run_candidates
from qualify.freeze import freeze
from qualify.ppo.formula import PROCESSED_KEY
from qualify.reference.stage import run_reference
from qualify.store import read_tensors
from tests.integration._support import REPO, matrix_with, plugins_importable  # noqa: F401  (autouse fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.engines]
TRUNCATED = REPO / "matrices" / "tiny-qwen3-sweep" / "t1.0-p0.9.yaml"
PLUGINS = "tests.integration.plugins"
ACTOR_FP32 = {"precisions": ["fp32"], "tp": [1], "roles": ["actor"]}


@pytest.fixture(scope="module")
def truncated_run(tmp_path_factory):
    """The t1.0-p0.9 sweep matrix's reference (real vLLM rollout), frozen; read-only."""
    work = tmp_path_factory.mktemp("top-p")
    run = work / "run"
    run_reference(matrix_with(work, base=TRUNCATED), run)
    freeze(run)
    return run


def rows_of(verdict, case, failing=True):
    return [r for r in verdict["rows"] if r["case"] == case and r["passed"] != failing]


def show(rows):
    return [(r["tensor"], r["metric"], r["value"], r["bound"], r["note"]) for r in rows][:6]


def test_the_reference_records_both_formulas_when_the_sampling_truncates(truncated_run):
    step = truncated_run / "reference" / "scores" / "fp32-r1" / "actor" / "step0" / "outputs.safetensors"
    outputs = read_tensors(step)
    full, processed = outputs["logprobs_BT"], outputs[PROCESSED_KEY]
    assert (processed >= full).all() and (processed > full).any()  # renormalized over a kept mass below 1
    bounds = (truncated_run / "acceptance" / "bounds" / "actor-fp32-repeat.json").read_text()
    assert f'"step0/outputs/{PROCESSED_KEY}"' in bounds


def test_processed_declared_torch_tp_passes_and_full_formula_fails(truncated_run):
    liar = f"{PLUGINS}:full_while_declaring_processed"
    m = matrix_with(truncated_run.parent, base=TRUNCATED, engines=["torch-tp", liar], logprob_formula="processed",
                    **ACTOR_FP32 | {"precisions": ["fp32", "bf16"]})
    verdict = run_candidates(m, truncated_run).to_json()
    for case in (c.name for c in m.cases() if c.engine == "torch-tp"):
        assert verdict["cases"][case]["passed"], show(rows_of(verdict, case))
        logprobs = [r for r in rows_of(verdict, case, failing=False) if r["tensor"].endswith("outputs/logprobs_BT")]
        assert logprobs, case
        closest = max(logprobs, key=lambda r: float(r["value"]) / float(r["bound"]))
        print(f"\n{case}: closest logprobs row {closest['tensor']} {closest['comparison']}: "
              f"{closest['value']} <= {closest['bound']}")
    for case in (c.name for c in m.cases() if c.engine == liar):
        bad = rows_of(verdict, case)
        assert bad and {r["tensor"] for r in bad} == {"step0/outputs/logprobs_BT"}, show(bad)
        assert all("formula mismatch" in r["note"] and "processed-formula" in r["note"] for r in bad), show(bad)
        print(f"{case}: {show(bad)}")


def test_full_declared_with_processed_logprobs_fails(truncated_run):
    liar = f"{PLUGINS}:processed_while_declaring_full"
    m = matrix_with(truncated_run.parent, base=TRUNCATED, engines=[liar], **ACTOR_FP32)
    assert m.candidates.logprob_formula == "full"
    verdict = run_candidates(m, truncated_run).to_json()
    case = m.cases()[0].name
    failing = rows_of(verdict, case)
    bad = [r for r in failing if r["comparison"] != "derived"]
    assert bad and {r["tensor"] for r in bad} == {"step0/outputs/logprobs_BT"}, show(bad)
    assert all("formula mismatch" in r["note"] and "full-formula" in r["note"] for r in bad), show(bad)
    # the derivation checks see the same lie: the logprobs it reports are not the ones its ratio was made from
    derived = {r["tensor"].split("/", 1)[1] for r in failing if r["comparison"] == "derived"}
    assert derived <= {"outputs/ratio_BT", "outputs/kl_BT"}, derived
    print(f"\n{case}: {show(bad)}")


def test_processed_on_the_untruncated_default_is_the_full_formula(run_copy):
    m = matrix_with(run_copy.parent, engines=["torch-tp"], logprob_formula="processed", **ACTOR_FP32)
    verdict = run_candidates(m, run_copy).to_json()
    case = m.cases()[0].name
    assert verdict["cases"][case]["passed"], show(rows_of(verdict, case))
