"""The micro-batch-layout invariance tier (qualify.judge.layout_probe) on real launches: an engine that scores each
row on its own, declared invariant, passes with every token bitwise in every layout; a value head whose split-K follows
the row count, declared invariant, fails naming the layouts; an undeclared engine's probe is reported, never judged.

The exact train-rollout tier (qualify.judge.rollout_exact) on the same launches: torch-tp declared rollout_exact
fails its fp32 actor case on that row alone (an HF-style forward is not vLLM's decode on this CPU: the count of tokens
that differ is named), while the undeclared engines' actor cases report their counts."""

from __future__ import annotations

import pytest

from qualify.candidate.stage import run_candidates
from tests.integration._support import matrix_with, plugins_importable  # noqa: F401  (autouse fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.engines]
ROWWISE, SPLIT_K = "qualify.examples.rowwise:engine", "tests.integration.plugins:split_k_head"


def test_declared_layout_invariance_is_judged_and_undeclared_is_reported(run_copy):
    m = matrix_with(run_copy.parent, engines=[ROWWISE, SPLIT_K, "torch-tp"], precisions=["fp32"], tp=[1],
                    roles=["actor", "critic"], layout_invariant=[ROWWISE, SPLIT_K], rollout_exact=["torch-tp"])
    verdict = run_candidates(m, run_copy).to_json()
    exact = {r["case"]: r for r in verdict["rows"] if r["comparison"] == "rollout"}
    assert set(exact) == {c for c in verdict["cases"] if c.endswith("actor")}  # one row per actor case
    for case, row in exact.items():
        assert row["tensor"] == "step0/outputs/logprobs_BT" and row["metric"] == "num_not_bitwise"
        if case.startswith("torch-tp"):  # declared: fails on the tokens that differ, and on nothing else
            assert not row["passed"] and float(row["value"]) > 0 and row["bound"] == 0, row
            assert row["note"].startswith("not exact: ") and "response tokens differ" in row["note"]
            failing = [r for r in verdict["rows"] if r["case"] == case and not r["passed"]]
            assert [r["comparison"] for r in failing] == ["rollout"], failing[:3]
        else:
            assert row["passed"] and row["bound"] == "inf" and "reported, not judged" in row["rule"]
    layout = {r["case"]: r for r in verdict["rows"] if r["comparison"] == "layout"}
    assert set(layout) == set(verdict["cases"])
    for case, row in layout.items():
        if "rowwise" in case:
            assert row["passed"] and float(row["value"]) == 0 and float(row["bound"]) == 0
            assert row["note"].startswith("layout-invariant (micro-batch 1: 0 of")
            assert verdict["cases"][case]["passed"]
        elif "split_k" in case and case.endswith("critic"):
            assert not row["passed"] and float(row["value"]) > 0, row
            assert row["note"].startswith("not layout-invariant (") and "micro-batch 1:" in row["note"]
        elif "split_k" in case:  # its actor is torch-tp's own
            assert row["bound"] == 0
        else:  # torch-tp does not declare it: whatever it measures here is reported with an infinite bound
            assert row["passed"] and row["bound"] == "inf" and "reported, not judged" in row["rule"]
            assert verdict["cases"][case]["passed"] == case.endswith("critic")  # its actor fails the exact tier
    split_critic = next(c for c in verdict["cases"] if "split_k" in c and c.endswith("critic"))
    failing = [r for r in verdict["rows"] if r["case"] == split_critic and not r["passed"]]
    assert [r["comparison"] for r in failing] == ["layout"], failing[:3]  # within every bound: only the tier fails
