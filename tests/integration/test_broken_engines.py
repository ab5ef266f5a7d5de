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
