"""The deepspeed engine (ZeRO-0, AutoTP over gloo) against the frozen embedded default, with negative controls.

Each plugin below is the deepspeed engine with one DeepSpeed trap put back in; named in matrices as
'tests.integration.test_deepspeed_engine:<factory>'. Qualification must fail for every one of them
while the engine itself passes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from qualify.candidate.stage import run_candidates
from qualify.engines.deepspeed_engine import DeepSpeedEngine
from tests.integration._support import matrix_with, plugins_importable  # noqa: F401  (autouse fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.engines,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")]
REPO = Path(__file__).resolve().parents[2]
PLUGINS = "tests.integration.test_deepspeed_engine"


class DefaultClipping(DeepSpeedEngine):
    """Leaves gradient_clipping unset: DeepSpeed clips at its default 1.0, not the matrix's max_grad_norm."""

    name = "deepspeed-default-clipping"
    gradient_clipping_from_matrix = False


class MastersFromBf16(DeepSpeedEngine):
    """bf16: keeps the FP32 masters DeepSpeed clones from the bf16-cast model (bf16-rounded weights)."""

    name = "deepspeed-masters-from-bf16"
    masters_from_checkpoint = False


class ZeroGradStep(DeepSpeedEngine):
    """bf16: keeps the AdamW state of DeepSpeed's zero-gradient step at construction (step count 1)."""

    name = "deepspeed-zero-grad-step"
    forget_zero_grad_step = False


class UnmarkedShardedGrads(DeepSpeedEngine):
    """bf16, TP2: DeepSpeed's global norm drops the sharded gradients of TP rank 1; the clip uses it."""

    name = "deepspeed-unmarked-sharded-grads"
    mark_sharded_grads = False


def default_clipping_engine() -> DeepSpeedEngine:
    return DefaultClipping()


def masters_from_bf16_engine() -> DeepSpeedEngine:
    return MastersFromBf16()


def zero_grad_step_engine() -> DeepSpeedEngine:
    return ZeroGradStep()


def unmarked_sharded_grads_engine() -> DeepSpeedEngine:
    return UnmarkedShardedGrads()




def failed_tensors(verdict, case: str, step: int | None = None) -> set[str]:
    """Failing tensors of a case without their 'step<k>/' prefix (of one step, when given)."""
    out = set()
    for r in verdict["rows"]:
        if r["case"] != case or r["passed"]:
            continue
        head, _, rest = r["tensor"].partition("/")
        if head.startswith("step") and head[4:].isdigit():
            if step is None or int(head[4:]) == step:
                out.add(rest)
        elif step is None:
            out.add(r["tensor"])
    return out


def test_default_clipping_fails_where_deepspeed_passes(run_copy, tiny_matrix):
    assert 0 < tiny_matrix.optimizer.max_grad_norm != 1.0  # else DeepSpeed's default would be right by chance
    m = matrix_with(run_copy.parent, engines=["deepspeed", f"{PLUGINS}:default_clipping_engine"],
                    precisions=["fp32"], tp=[1], roles=["actor"])
    verdict = run_candidates(m, run_copy).to_json()
    real, control = (c.name for c in m.cases())
    assert verdict["cases"][real]["passed"], sorted(failed_tensors(verdict, real))[:5]
    assert not verdict["cases"][control]["passed"]
    # A clip at 1.0 instead of 0.5 scales the clipped gradients by 2: the first moment by 2, the second by 4, which
    # the moments' derivation from the case's own gradients and the matrix's clip names
    assert "moments" in failed_tensors(verdict, control, step=0)
    [row] = [r for r in verdict["rows"] if r["case"] == control and r["tensor"] == "step0/moments"]
    assert row["comparison"] == "derived" and row["note"].startswith("exp_avg")


@pytest.mark.slow
def test_zero0_bf16_traps_fail_where_deepspeed_passes(run_copy):
    m = matrix_with(run_copy.parent, engines=["deepspeed", f"{PLUGINS}:masters_from_bf16_engine",
                                              f"{PLUGINS}:zero_grad_step_engine"],
                    precisions=["bf16"], tp=[1], roles=["actor"])
    verdict = run_candidates(m, run_copy).to_json()
    real, masters, zero_step = (c.name for c in m.cases())
    assert verdict["cases"][real]["passed"], sorted(failed_tensors(verdict, real))[:5]
    for control in (masters, zero_step):  # bf16-rounded start, or the bias correction of step 2
        assert any(t.startswith("updates/") for t in failed_tensors(verdict, control, step=0)), control
    m = matrix_with(run_copy.parent, engines=[f"{PLUGINS}:unmarked_sharded_grads_engine"],
                    precisions=["bf16"], tp=[2], roles=["actor"])
    verdict = run_candidates(m, run_copy).to_json()
    unmarked = failed_tensors(verdict, m.cases()[0].name)
    # the norm it reports is not the norm of its gradients (the derivation row) nor the reference's (the bound row);
    # its moments follow from its gradients and that norm's clip, so their derivation has nothing to say
    assert "outputs/grad_norm" in unmarked
    assert any(r["comparison"] == "derived" and r["tensor"].endswith("/outputs/grad_norm") and not r["passed"]
               for r in verdict["rows"])
    assert "outputs/grad_norm" in failed_tensors(verdict, m.cases()[0].name, step=0)


ZERO_ENGINES = ["deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"]


@pytest.mark.extended
def test_zero_stages_pass_fp32_and_bf16_actor_and_critic(run_copy):
    """ZeRO 1, 2 and 3 at TP1 x DP1 on the embedded default (PPO): stage 1's BF16_Optimizer and stage 2/3's ZeRO
    optimizers with FP32 gradient accumulation under bf16, every tensor read through DeepSpeed's own gathers, the
    norm DeepSpeed's. Three launches (one per stage) of four cases. DP2 runs in test_grpo_chain.py."""
    m = matrix_with(run_copy.parent, engines=ZERO_ENGINES, tp=[1])
    verdict = run_candidates(m, run_copy).to_json()
    assert set(verdict["cases"]) == {c.name for c in m.cases()} and len(verdict["cases"]) == 12
    failed = [(r["case"], r["comparison"], r["tensor"], r["metric"]) for r in verdict["rows"] if not r["passed"]]
    assert verdict["passed"] and not failed, failed[:8]
    for case in verdict["cases"]:  # the gradients the optimizer read are FP32, and every parameter has its state
        rows = {(r["tensor"], r["metric"]): float(r["value"]) for r in verdict["rows"]
                if r["case"] == case and r["comparison"] == "evidence" and r["tensor"].startswith("evidence/")}
        assert rows[("evidence/grad_buffers", "num_not_fp32")] == 0.0
        assert rows[("evidence/optimizer_state", "num_params")] == 0.0
        assert rows[("evidence/optimizer_state", "num_not_fp32")] == 0.0
