"""The reference -> freeze -> candidate chain on the embedded default, with real vLLM and torch-tp over gloo.

Negative controls: engines with a known trap put back in must fail qualification; the correct
engine passes, repeatedly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qualify.candidate.stage import run_candidates
from qualify.errors import EvidenceError, FrozenError
from qualify.freeze import freeze
from qualify.layout import RunLayout
from qualify.store import read_json
from tests.integration._support import (  # noqa: F401  (plugins_importable: autouse fixture)
    agreement_bound,
    bf16_temperature_problems,
    matrix_with,
    plugins_importable,
    require_module,
)

pytestmark = [pytest.mark.vllm, pytest.mark.engines]
REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "manifests" / "tiny-qwen3"




def failing_rows(verdict, case):
    return [r for r in verdict["rows"] if r["case"] == case and not r["passed"]]


def test_reference_rollout_and_mismatch(frozen_run):
    layout = RunLayout(frozen_run)
    summary = read_json(layout.reference_summary)
    assert summary["tp_agreement"]["tp2_vs_tp1"]["tokens_equal"] is True
    fp32 = summary["rollout_mismatch"]["fp32"]
    # The frozen rule of this comparison (qualify.rounds bounds vLLM against HF fp32 the same way): this run's
    # k and logprob floor applied to the vLLM-vs-HF fp32 control frozen with the committed rollout.
    frozen = read_json(COMMITTED / "reference" / "reference.json")["rollout_mismatch"]["fp32"]["max_abs"]
    assert 0 < frozen
    bound = agreement_bound(read_json(layout.acceptance)["rule"], frozen)
    assert fp32["num_tokens"] > 0 and fp32["max_abs"] <= bound, (fp32, bound)
    assert summary["rollout_mismatch"]["bf16"]["num_not_bitwise"] > 0  # bf16 never matches vLLM's fp32 sampler
    assert summary["controls"][:2] == ["r0", "r1"]


def test_freeze_is_idempotent_and_refuses_change(run_copy):
    layout = RunLayout(run_copy)
    before = layout.acceptance.read_bytes()
    freeze(run_copy)  # byte-identical: accepted, nothing rewritten
    assert layout.acceptance.read_bytes() == before
    bound_file = layout.bounds / "actor-fp32-repeat.json"
    doc = json.loads(bound_file.read_text())
    doc["bounds"]["step0/outputs/logprobs_BT"]["max_abs"]["bound"] *= 10  # an attempt to widen
    bound_file.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    with pytest.raises(FrozenError):
        freeze(run_copy)


def test_candidate_refuses_modified_reference(run_copy, tiny_matrix):
    targets = RunLayout(run_copy).targets / "targets.json"
    targets.write_text(targets.read_text().replace('"gamma"', '"gamma" '))
    with pytest.raises(EvidenceError, match="does not match"):
        run_candidates(tiny_matrix, run_copy, only="torch-tp-fp32-tp1-actor").to_json()


def test_candidate_refuses_widened_bound(run_copy, tiny_matrix):
    bound_file = RunLayout(run_copy).bounds / "critic-bf16-repeat.json"
    bound_file.write_text(bound_file.read_text().replace('"k": 4.0', '"k": 40.0'))
    with pytest.raises(EvidenceError, match="bound file"):
        run_candidates(tiny_matrix, run_copy, only="torch-tp-fp32-tp1-critic").to_json()


def test_torch_tp_passes_every_case(run_copy, tiny_matrix):
    m = matrix_with(run_copy.parent, engines=["torch-tp"])
    verdict = run_candidates(m, run_copy).to_json()
    assert verdict["passed"], [failing_rows(verdict, c)[:3] for c in verdict["cases"]]
    assert len(verdict["cases"]) == 8
    tp_rows = [r for r in verdict["rows"] if r["comparison"].startswith("vs tp1")]
    assert tp_rows and all(r["passed"] for r in tp_rows)


@pytest.mark.extended
def test_deepspeed_passes_every_case(run_copy):
    require_module("deepspeed")
    m = matrix_with(run_copy.parent, engines=["deepspeed"])
    verdict = run_candidates(m, run_copy).to_json()
    assert verdict["passed"], [failing_rows(verdict, c)[:3] for c in verdict["cases"]]
    assert len(verdict["cases"]) == 8


def test_correct_engine_passes_three_repeated_runs(run_copy, tiny_matrix):
    m = matrix_with(run_copy.parent, engines=["torch-tp"], precisions=["fp32"], tp=[2], roles=["actor"])
    layout = RunLayout(run_copy)
    evidence = []
    for attempt in range(3):
        verdict = run_candidates(m, run_copy).to_json()
        assert verdict["passed"], failing_rows(verdict, "torch-tp-fp32-tp2-actor")[:3]
        evidence.append(b"".join((layout.case("torch-tp-fp32-tp2-actor") / f"step{k}" / "grads.safetensors").read_bytes()
                                 for k in range(m.ppo.epochs * m.ppo.minibatches)))
        shutil.rmtree(layout.case("torch-tp-fp32-tp2-actor"))
    assert evidence[0] == evidence[1] == evidence[2]


def test_skipping_norm_allreduce_fails_under_tp2(run_copy):
    m = matrix_with(run_copy.parent, engines=["tests.integration.plugins:skip_norm_allreduce"],
                    precisions=["fp32"], tp=[2], roles=["actor"])
    verdict = run_candidates(m, run_copy).to_json()
    assert not verdict["passed"]
    failed = {r["tensor"] for r in failing_rows(verdict, m.cases()[0].name)}
    assert any("q_norm" in t or "k_norm" in t for t in failed)
    assert "evidence/replicas" in failed  # q/k norms drift apart across ranks after the step


def test_bf16_temperature_fails(run_copy, tiny_matrix):
    assert tiny_matrix.rollout.temperature != 1.0
    m = matrix_with(run_copy.parent, engines=["tests.integration.plugins:bf16_temperature"],
                    precisions=["fp32", "bf16"], tp=[1], roles=["actor"])
    verdict = run_candidates(m, run_copy).to_json()
    assert not verdict["passed"]
    assert bf16_temperature_problems(verdict) == []
    # its actor computes its scores without keeping logits (no logits() hook to derive them from): that row fails too,
    # naming the hook (the matrix does not waive it: tests/integration/test_waivers.py)
    hook = [r for r in verdict["rows"] if r["metric"] == "not_derived"]
    assert [(r["case"], r["passed"]) for r in hook] == [(c.name, False) for c in m.cases()], hook
    assert all("no logits() hook" in r["note"] for r in hook)

