"""Every broken candidate gets a verdict: NaN evidence and a skipped step are failing rows naming the tensor."""

from __future__ import annotations

import pytest

from qualify.candidate.run import run_candidates
from tests.integration._support import matrix_with, plugins_importable  # noqa: F401  (autouse fixture)
from tests.integration.plugins import NAN_PARAM

pytestmark = [pytest.mark.vllm, pytest.mark.engines]
PLUGINS = "tests.integration.plugins"


def test_nan_gradient_and_skipped_step_fail_with_named_rows(run_copy):
    m = matrix_with(run_copy.parent, engines=[f"{PLUGINS}:nan_gradient", f"{PLUGINS}:skips_non_finite_step"],
                    precisions=["fp32"], tp=[1], roles=["actor"])
    verdict = run_candidates(m, run_copy).to_json()
    assert not verdict["passed"] and verdict["complete"]
    nan_case, skip_case = (c.name for c in m.cases())
    for case in (nan_case, skip_case):
        bad = {(r["tensor"], r["metric"]) for r in verdict["rows"] if r["case"] == case and not r["passed"]}
        assert ("case", "exit") not in bad, bad  # a verdict, not a crash
        assert (f"step0/grads/{NAN_PARAM}", "max_abs") in bad
        assert ("step0/outputs/grad_norm", "max_abs") in bad
    skipped = [r for r in verdict["rows"] if r["case"] == skip_case and not r["passed"]
               and r["tensor"].startswith("step0/moments/exp_avg/")]
    assert skipped and all(r["note"] == "missing in candidate" for r in skipped)
    assert any(r["case"] == nan_case and r["tensor"] == f"step0/grads/{NAN_PARAM}"
               and r["note"] == "NaN or Inf in candidate" for r in verdict["rows"])


def test_a_bf16_log_softmax_fails_the_precision_evidence_naming_the_logprobs(run_copy):
    """Its error sits under the bf16 max_abs bound; the precision evidence (fp32 quantities must not be bf16 values)
    names it, and the correct engine of the same case passes the same check with margin."""
    m = matrix_with(run_copy.parent, engines=[f"{PLUGINS}:low_precision_log_softmax", "torch-tp"],
                    precisions=["bf16"], tp=[1], roles=["actor"])
    verdict = run_candidates(m, run_copy).to_json()
    broken, correct = (c.name for c in m.cases())
    bad = {(r["tensor"], r["metric"]) for r in verdict["rows"] if r["case"] == broken and not r["passed"]}
    assert ("step0/outputs/logprobs_BT", "bf16_exact_excess") in bad, bad
    assert not verdict["cases"][broken]["passed"] and verdict["cases"][correct]["passed"]
    excess = [r for r in verdict["rows"] if r["case"] == correct and r["metric"] == "bf16_exact_excess"]
    assert excess and max(float(r["ratio"]) for r in excess) < 0.1
