"""`qualify rounds` against real vLLM: two rounds with a verified live install, every probe rejected.

One rounds run at vLLM TP1 (one engine process, rebuilt in place for the probes that fail it; torch-tp trainer)
is shared by the module's tests; they read its verdict and evidence. The negative controls are in
that same run: the warm-cache probe must make the cold-cache and the logprob checks fail, the
agreement check must fail against the previous version, a one-ulp shard must fail its digest.
"""

from __future__ import annotations

import shutil
import time

import pytest

from qualify.rounds.stage import RoundsOptions, run_rounds
from qualify.store import read_json
from tests.integration._support import probe_problems

pytestmark = pytest.mark.vllm

PROBES = ("stale-reinstall-v0", "stale-skip-to-v2", "wrong-shard", "missing-ack", "duplicate-ack", "warm-cache")


def copy_run(frozen_run, dst):
    for part in ("reference", "acceptance"):
        shutil.copytree(frozen_run / part, dst / part)
    return dst


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
