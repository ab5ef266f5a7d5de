"""The shipped verl adapter (qualify.examples.verl_ppo: torch-tp with verl 0.9.1's own PPO/GRPO loss code as its
objective) on the embedded default's frozen run: PPO actor and critic pass at fp32 TP1xDP1 and TP1xDP2, every row;
its mismatched variant (verl's loss_agg_mode 'seq-mean-token-mean' where the matrix says a token mean) fails naming
the loss and the gradients from step 0 by 10x their bounds or more while the forward passes; on the GRPO default a
packed case (verl's remove-padding actor) passes too. The settings mapping and its refusals:
tests/unit/examples/test_verl_ppo.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from qualify.candidate.stage import run_candidates
from tests.integration._support import matrix_with, plugins_importable, require_module  # noqa: F401  (autouse)

pytestmark = [pytest.mark.engines]
GRPO_MATRIX = Path(__file__).resolve().parents[2] / "matrices" / "tiny-qwen3-grpo.yaml"
ENGINE, MISMATCHED = "qualify.examples.verl_ppo:engine", "qualify.examples.verl_ppo:mismatched"


def ratio(row: dict) -> float:
    return float(row["value"]) / float(row["bound"]) if float(row["bound"]) > 0 else float("inf")


def closest(verdict: dict, case: str, frozen: bool) -> dict:
    """The case's row nearest its bound (value / bound) among rows with a bound above 0; frozen: only rows bounded by
    a family of the reference's controls ('... [<family>]'), else only derivation rows."""
    rows = [r for r in verdict["rows"] if r["case"] == case and float(r["bound"] or 0) > 0
            and r["comparison"].endswith("]") == frozen]
    return max(rows, key=ratio)


def said(row: dict) -> str:
    return f"{row['comparison']} {row['tensor']} {row['metric']} {float(row['value']):.3g} / " \
           f"{float(row['bound']):.3g} = {ratio(row):.3f}"


def test_verl_adapter_passes_ppo_actor_and_critic_at_dp1_and_dp2(run_copy, tmp_path):
    require_module("verl")
    m = matrix_with(tmp_path, engines=[ENGINE], precisions=["fp32"], tp=[1], dp=[1, 2], roles=["actor", "critic"])
    verdict = run_candidates(m, run_copy).to_json()
    cases = verdict["cases"]
    assert set(cases) == {c.name for c in m.cases()} and len(cases) == 4
    failed = [r for r in verdict["rows"] if not r["passed"]]
    assert verdict["passed"] and not failed, failed[:5]
    for case in sorted(cases):
        judged = {r["tensor"].split("/", 1)[1] for r in verdict["rows"] if r["case"] == case}
        role = {"outputs/logprobs_BT", "outputs/ratio_BT", "outputs/kl_mean"} if case.endswith("actor") \
            else {"outputs/values_BT"}
        assert {"outputs/loss", "outputs/clip_frac", "outputs/grad_norm"} | role <= judged, case
        if "-dp2-" in case:
            tiers = cases[case]["invariance"]["vs dp1"]["counts"]
            assert tiers["failing"] == 0 and sum(tiers.values()) > 0, case
        print(f"{case}: closest frozen-bound row {said(closest(verdict, case, True))}; closest derivation row "
              f"{said(closest(verdict, case, False))}")


def test_verl_mismatched_aggregation_fails_naming_the_tensors_it_moves(run_copy, tmp_path):
    """The mismatched engine (the negative control of the test above): its loss and gradients fail from step 0 by
    10x their bounds or more, the forward's outputs (the same weights as the reference at step 0) pass."""
    require_module("verl")
    m = matrix_with(tmp_path, engines=[MISMATCHED], precisions=["fp32"], tp=[1], dp=[1], roles=["actor", "critic"])
    verdict = run_candidates(m, run_copy).to_json()
    assert not verdict["passed"]
    assert all(r["passed"] for r in verdict["rows"] if r["comparison"] in ("evidence", "run")), "no crash, no NaN"
    for case in (c.name for c in m.cases()):
        step0 = [r for r in verdict["rows"] if r["case"] == case and r["tensor"].startswith("step0/")]
        failed = {r["tensor"].removeprefix("step0/") for r in step0 if not r["passed"]}
        forward = "outputs/logprobs_BT" if case.endswith("actor") else "outputs/values_BT"
        assert "outputs/loss" in failed and forward not in failed, sorted(failed)[:10]
        loss = max(ratio(r) for r in step0 if r["tensor"] == "step0/outputs/loss" and not r["passed"])
        grads = [r for r in step0 if r["tensor"].startswith("step0/grads/") and not r["passed"]]
        worst = max(grads, key=ratio)
        moved = sorted({r["tensor"] for r in verdict["rows"] if r["case"] == case and not r["passed"]
                        and "/grads/" not in r["tensor"]})
        print(f"{case}: step0/outputs/loss {loss:.3g}x, {worst['tensor']} {worst['metric']} {ratio(worst):.3g}x, "
              f"{len(grads)} gradient rows failing at step 0; failing outputs over the steps: {moved}")
        assert loss >= 10 and ratio(worst) >= 10


@pytest.mark.vllm
def test_verl_adapter_passes_a_packed_grpo_case(grpo_run, tmp_path):
    """GRPO's actor at fp32 TP1, packed as verl's remove-padding actor feeds its loss: the adapter's objective takes
    each micro-batch's unpacked rows with the step's share and passes against the reference and its padded case. The
    negative control: the mismatched engine's packed case fails naming the loss and the rows' losses at step 0."""
    require_module("verl")
    m = matrix_with(tmp_path, base=GRPO_MATRIX, engines=[ENGINE, MISMATCHED], precisions=["fp32"], tp=[1], dp=[1],
                    packing=["padded", "packed"])
    verdict = run_candidates(m, grpo_run).to_json()
    good = {c.name for c in m.cases() if c.engine == ENGINE}
    assert len(good) == 2 and good <= set(verdict["cases"])
    failed = [r for r in verdict["rows"] if r["case"] in good and not r["passed"]]
    assert not failed, failed[:5]
    [packed] = [c for c in good if "packed" in c]
    assert any(r["comparison"].startswith("vs padded ") for r in verdict["rows"] if r["case"] == packed)
    for case in sorted(good):
        print(f"{case}: closest frozen-bound row {said(closest(verdict, case, True))}")
    [bad] = [c.name for c in m.cases() if c.engine == MISMATCHED and c.packing == "packed"]
    step0 = [r for r in verdict["rows"] if r["case"] == bad and r["tensor"].startswith("step0/")]
    wrong = {r["tensor"]: ratio(r) for r in step0 if not r["passed"]}
    assert {"step0/outputs/loss", "step0/outputs/seq_loss_B"} <= set(wrong), sorted(wrong)[:10]
    assert "step0/outputs/logprobs_BT" not in wrong and "step0/outputs/advantages_B" not in wrong
    print(f"{bad}: " + ", ".join(f"{t} {wrong[t]:.3g}x" for t in ("step0/outputs/loss", "step0/outputs/seq_loss_B")))
    assert wrong["step0/outputs/loss"] >= 10
