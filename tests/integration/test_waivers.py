"""An actor without a logits() hook cannot pass silently: its logprob derivation row fails, naming the hook, unless the
matrix waives sampler_derivation for its engine by name; with the waiver, added after the freeze, it passes and every
report names the waiver beside the verdict (qualify.waivers)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from typer.testing import CliRunner

from qualify.candidate.stage import run_candidates
from qualify.cli.app import app
from qualify.layout import WORK_SUFFIX, RunLayout
from tests.integration._support import matrix_with, plugins_importable  # noqa: F401  (autouse fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.engines]
PLUGINS = "tests.integration.plugins"
NO_HOOK, BF16_LSE = f"{PLUGINS}:no_logits_hook", f"{PLUGINS}:bf16_logsumexp_without_logits"
WAIVER = f"sampler_derivation for engine {NO_HOOK}"


def failing(verdict: dict, case: str) -> list[dict]:
    return [r for r in verdict["rows"] if r["case"] == case and not r["passed"]]


def test_an_actor_without_logits_fails_unless_its_engine_is_waived(run_copy, tmp_path):
    # bf16: where the reference's bounds are widest, so that what fails is the missing derivation
    m = matrix_with(tmp_path, engines=[NO_HOOK, BF16_LSE], precisions=["bf16"], tp=[1], roles=["actor"])
    verdict = run_candidates(m, run_copy).to_json()
    correct, broken = (c.name for c in m.cases())
    assert not verdict["passed"] and not verdict["cases"][correct]["passed"]
    # the correct engine without the hook fails on that row alone, and the row names the hook and the waiver
    [row] = failing(verdict, correct)
    assert (row["comparison"], row["tensor"], row["metric"]) == ("derived", "outputs/logprobs_BT", "not_derived")
    assert "no logits() hook" in row["note"] and f"candidates.waive: {{{NO_HOOK}: [sampler_derivation]}}" in row["note"]
    # the negative control: a bf16 log-sum-exp without the hook fails the same row, naming the hook
    hook_rows = [r for r in failing(verdict, broken) if r["metric"] == "not_derived"]
    assert len(hook_rows) == 1 and "no logits() hook" in hook_rows[0]["note"], failing(verdict, broken)
    others = sorted({(r["tensor"], r["metric"], r["ratio"]) for r in failing(verdict, broken)} - {
        (hook_rows[0]["tensor"], "not_derived", hook_rows[0]["ratio"])})
    print(f"{broken}: besides the hook, {len(others)} failing rows: {others[:6]}")

    # the waiver, added after the freeze (candidates is not frozen): the case runs again with it and passes
    # (its sealed evidence and its work directory: a started case left unsealed is an unfinished stage)
    broken_dir = RunLayout(run_copy).case(broken)
    for path in (broken_dir, broken_dir.with_name(broken_dir.name + WORK_SUFFIX)):
        shutil.rmtree(path, ignore_errors=path != broken_dir)
    m = matrix_with(tmp_path, engines=[NO_HOOK], precisions=["bf16"], tp=[1], roles=["actor"],
                    waive={NO_HOOK: ["sampler_derivation"]})
    junit = tmp_path / "candidate-junit.xml"
    result = CliRunner().invoke(app, ["candidate", str(m.source), "--run", str(run_copy), "--junit", str(junit)])
    assert result.exit_code == 0, result.output
    assert f"PASSED: 1/1 cases pass (waived: {WAIVER})" in " ".join(result.output.split()), result.output
    assert f"(waived: {WAIVER})" in junit.read_text()
    waived = [r for r in json.loads(RunLayout(run_copy).verdict.read_text())["rows"] if r["metric"] == "waived"]
    assert [(r["tensor"], r["passed"]) for r in waived] == [("outputs/logprobs_BT", True)]

    # every report format, judged again from the sealed evidence (the waiver is in the case's sealed spec)
    def report(*args: str) -> str:
        out = CliRunner().invoke(app, ["report", str(run_copy), *args])
        assert out.exit_code == 0, out.output
        return out.output

    summary = json.loads(report("--format", "json"))
    assert summary["status"] == "PASSED" and summary["candidates"]["waivers"] == [WAIVER], summary["verification"]
    assert report("--format", "markdown").endswith(f"**PASSED** (waived: {WAIVER})\n")
    assert f"PASSED (waived: {WAIVER})" in " ".join(report().split())
    assert f"(waived: {WAIVER})" in report("--format", "junit")
    html = report("--format", "html")
    assert re.search(r'<div id="banner"[^>]*>(.*?)</div>', html)[1] == f"PASS: 1/1 cases pass (waived: {WAIVER})"
