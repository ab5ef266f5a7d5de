"""The assertions of the integration negative controls (tests/integration/_support.py), on outcomes written here.

The integration tests read a real rounds run and a real verdict with these functions; here each is
shown to accept the outcome a correct harness records and to reject each way a check could stop
looking (an empty problem list, the wrong rank, a probe that reports itself passed, a deleted comparison).
"""

from __future__ import annotations

import math

import pytest

from tests.integration._support import (
    BF16_TEMPERATURE_CASE,
    agreement_bound,
    bf16_temperature_problems,
    exceeds,
    probe_problems,
    rows_for,
)

AFTER = {"generate": "unusable", "install": "unusable", "state": {"state": "failed", "version": 0}}
TARGET = "model.layers.1.mlp.down_proj.weight"


def fault(problems: list[str], **changes) -> dict:
    return {"observed": "install_failed", "problems": problems, "after": AFTER, "passed": True,
            "error": "install of v1 failed"} | changes


GOOD = {
    "missing-ack": fault(["rank 0: no acknowledgment"]),
    "duplicate-ack": fault(["rank 0: 2 acknowledgments (duplicate)"]),
    "wrong-shard": fault([f"rank 0: {TARGET} holds 0123456789ab, expected ba9876543210"]),
    "stale-reinstall-v0": {"reply": {"ok": False, "kind": "stale_version"}, "passed": True,
                           "state_after": {"state": "ready", "version": 0}},
}


@pytest.mark.parametrize("probe", sorted(GOOD))
def test_a_rejected_fault_has_no_problem(probe):
    assert probe_problems(probe, GOOD[probe], tp=1, num_layers=2) == []


@pytest.mark.parametrize("probe, outcome, expect", [
    ("wrong-shard", fault([]), "the engine named no problem"),
    ("missing-ack", fault([]), "the engine named no problem"),
    ("missing-ack", fault(["rank 0: 2 acknowledgments (duplicate)"]), "not the fault"),
    ("duplicate-ack", fault(["rank 0: no acknowledgment"]), "not the fault"),
    ("wrong-shard", fault(["rank 0: model.layers.0.mlp.down_proj.weight holds 1, expected 2"]), "not the fault"),
    ("wrong-shard", fault([f"rank 0: {TARGET} holds 1, expected 2", "rank 0: x missing"]), "'rank 0: x missing'"),
    ("missing-ack", fault(["rank 0: no acknowledgment"], observed="installed and acked"), "not install_failed"),
    ("duplicate-ack", fault(["rank 0: 2 acknowledgments (duplicate)"],
                            after=AFTER | {"generate": "served"}), "after the failed install"),
    ("missing-ack", fault(["rank 0: no acknowledgment"], after=AFTER | {"state": {"state": "ready"}}),
     "after the failed install"),
    ("stale-skip-to-v2", {"reply": {"ok": True}, "state_after": {"state": "ready", "version": 2}, "passed": True},
     "not a stale_version refusal"),
    ("stale-skip-to-v2", {"reply": {"ok": False, "kind": "stale_version"},
                          "state_after": {"state": "ready", "version": 2}}, "not ready at v0"),
])
def test_a_probe_that_reports_itself_passed_is_still_judged_on_what_the_engine_said(probe, outcome, expect):
    problems = probe_problems(probe, outcome, tp=1, num_layers=2)
    assert any(expect in p for p in problems), problems


def test_the_fault_is_expected_on_the_last_rank_at_tp2():
    assert probe_problems("missing-ack", fault(["rank 1: no acknowledgment"]), tp=2, num_layers=2) == []
    assert probe_problems("missing-ack", fault(["rank 0: no acknowledgment"]), tp=2, num_layers=2) != []
    shard = fault(["rank 1: model.layers.3.mlp.down_proj.weight holds 1, expected 2"])
    assert probe_problems("wrong-shard", shard, tp=2, num_layers=4) == []
    assert probe_problems("wrong-shard", shard, tp=2, num_layers=2) != []


def test_agreement_bound_is_k_times_the_frozen_control_plus_the_logprob_floor():
    rule = {"k": 4.0, "floors": {"logprob": 1e-6, "grad": 5.0}}
    assert agreement_bound(rule, 1.9073486328125e-06) == 4.0 * 1.9073486328125e-06 + 1e-6


def row(case: str, family: str, tensor: str, value, bound, note: str = "") -> dict:
    return {"case": case, "comparison": f"vs ref x [{family}]", "tensor": tensor, "value": value, "bound": bound,
            "note": note, "passed": not (float(value) > float(bound))}


def test_exceeds_reads_the_numbers():
    assert exceeds(row("c", "f", "t", 2.0, 1.0)) and not exceeds(row("c", "f", "t", 1.0, 1.0))
    assert exceeds(row("c", "f", "t", "inf", 1.0)) and exceeds({"value": "nan", "bound": 1.0})
    assert not exceeds(row("c", "f", "t", 0.0, "inf"))


def test_rows_for_matches_the_tensor_at_any_step_and_the_family_exactly():
    rows = [row("a", "fp32-repeat", "outputs/logprobs_BT", 1, 2), row("a", "fp32-repeat", "step3/outputs/logprobs_BT", 1, 2),
            row("a", "fp32-repeat", "outputs/logprobs_BT_x", 1, 2), row("a", "fp32-vs-bf16", "outputs/logprobs_BT", 1, 2),
            row("b", "fp32-repeat", "outputs/logprobs_BT", 1, 2)]
    assert rows_for({"rows": rows}, "a", "outputs/logprobs_BT", "fp32-repeat") == rows[:2]


FP32, BF16 = BF16_TEMPERATURE_CASE.format("fp32"), BF16_TEMPERATURE_CASE.format("bf16")
LOGP = "step0/outputs/logprobs_BT"


def verdict_rows(**drop) -> dict:
    rows = [row(FP32, "fp32-repeat", LOGP, 3e-3, 1e-6), row(FP32, "fp32-repeat", "step0/grads/w", 0.0, 1e-6),
            row(BF16, "bf16-repeat", LOGP, 1e-3, 2e-2), row(BF16, "fp32-vs-bf16", LOGP, 4e-2, 5e-2)]
    return {"rows": [r for r in rows if not any(r["case"] == c and f"[{f}]" in r["comparison"]
                                                for c, f in drop.values())]}


def test_bf16_temperature_control_accepts_what_a_correct_harness_records():
    assert bf16_temperature_problems(verdict_rows()) == []


@pytest.mark.parametrize("drop, expect", [
    ({"x": (BF16, "fp32-vs-bf16")}, "not judged in fp32-vs-bf16"),  # the fp32-vs-bf16 comparison deleted
    ({"x": (BF16, "bf16-repeat")}, "not judged in bf16-repeat"),
    ({"x": (FP32, "fp32-repeat")}, "no fp32-repeat logprob row above its bound"),
])
def test_bf16_temperature_control_misses_nothing(drop, expect):
    problems = bf16_temperature_problems(verdict_rows(**drop))
    assert any(expect in p for p in problems), problems


def test_bf16_temperature_control_reads_values_not_verdicts():
    verdict = verdict_rows()
    verdict["rows"][0] |= {"value": 5e-7, "passed": False}  # says it failed, but its value is within the bound
    assert any("no fp32-repeat logprob row above" in p for p in bf16_temperature_problems(verdict))
    verdict = verdict_rows()
    verdict["rows"][3] |= {"value": math.inf, "note": "not measured"}
    assert any("not judged in fp32-vs-bf16" in p for p in bf16_temperature_problems(verdict))
    verdict = verdict_rows()
    verdict["rows"].append(row(FP32, "fp32-vs-bf16", LOGP, 1.0, 2.0))
    assert any("compared with the bf16 family" in p for p in bf16_temperature_problems(verdict))
