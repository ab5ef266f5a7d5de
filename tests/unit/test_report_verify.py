"""`qualify report` never says PASSED for what does not verify: each false pass fails here.

These use hand-made run directories (no vLLM); tests/integration/test_html_report.py tampers with a
real run's evidence.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qualify.cli.app import app
from qualify.layout import RunLayout
from qualify.report import FAILED, NO_VERDICT, NOT_VERIFIED, PASSED, status_of, summarize, to_markdown
from qualify.report_verify import (
    Verification,
    acceptance_problems,
    compare_rows,
    discover_rounds,
    rounds_problems,
    sealed_problems,
    verdict_problems,
)
from qualify.stages import complete_stage

ACC = {"digest": "sha256:acc", "rollout_digest": "sha256:roll"}
CASE = "torch-tp-fp32-tp1-actor"


def reference_doc() -> dict:
    return {"matrix": {"name": "tiny"}, "rollout_digest": "sha256:roll", "tp_agreement": {},
            "rollout_mismatch": {"fp32": {"num_tokens": 4, "num_not_bitwise": 1, "max_abs": 1e-6, "mean_abs": 2e-7}},
            "controls": ["r0", "r1"], "precisions": ["fp32"], "versions": {"torch": "x"}, "host": {}, "git": {}}


def make_run(tmp_path: Path, verdict: dict | None = None) -> Path:
    run = tmp_path / "run"
    layout = RunLayout(run)
    layout.reference.mkdir(parents=True)
    layout.reference_summary.write_text(json.dumps(reference_doc()))
    if verdict is not None:
        layout.candidates.mkdir(parents=True)
        layout.verdict.write_text(json.dumps(verdict))
    return run


def row(value: float = 0.5, bound: float = 1.0, passed: bool | None = None, **kw) -> dict:
    ok = math.isfinite(value) and value <= bound if passed is None else passed
    return {"case": CASE, "role": "actor", "comparison": "vs ref fp32-r0 [fp32-repeat]", "tensor": "outputs/loss",
            "metric": "max_abs", "value": value, "bound": bound, "ratio": value / bound, "passed": ok, "note": "",
            **kw}


def verdict(rows: list[dict] | None = None) -> dict:
    rows = [row()] if rows is None else rows
    failed = sum(not r["passed"] for r in rows)
    return {"schema": "qualify.verdict/1", "matrix": "tiny", "acceptance_digest": ACC["digest"],
            "rollout_digest": ACC["rollout_digest"], "complete": True, "passed": failed == 0 and bool(rows),
            "cases": {CASE: {"passed": failed == 0 and bool(rows), "num_checks": len(rows), "num_failed": failed,
                             "worst": None}},
            "rows": rows}


def test_hand_written_pass_without_acceptance_is_not_verified(tmp_path):
    run = make_run(tmp_path, {"passed": True, "complete": True, "cases": {}})
    summary = summarize(run)
    assert summary["status"] == NOT_VERIFIED
    assert any("no acceptance" in p for p in summary["verification"]["problems"])
    assert "PASSED" not in to_markdown(summary)
    result = CliRunner().invoke(app, ["report", str(run), "--format", "markdown"])
    assert result.exit_code == 1, result.output
    assert "PASSED" not in result.output and "NOT VERIFIED" in result.output


def test_hand_written_pass_with_no_cases_fails_verdict_checks():
    problems = verdict_problems({"passed": True, "complete": True, "cases": {}, "rows": []}, ACC)
    assert any("names no case" in p for p in problems)
    assert any("schema" in p for p in problems)
    assert any("acceptance_digest" in p for p in problems)


def test_consistent_verdict_has_no_problems():
    assert verdict_problems(verdict(), ACC) == []


@pytest.mark.parametrize("edit, expect", [
    (lambda v: v["rows"][0].update(passed=True, value=2.0), "does not follow from value"),
    (lambda v: v["rows"][0].update(value="nan"), "does not follow from value"),
    (lambda v: v["rows"][0].update(value=[1]), "not a number"),
    (lambda v: v["rows"][0].pop("bound"), "lacks one of"),
    (lambda v: v["rows"][0].update(case="other-fp32-tp1-actor"), "does not list"),
    (lambda v: v["cases"][CASE].update(num_checks=7), "disagrees with its 1 rows"),
    (lambda v: v.update(passed=False), "disagrees with its cases"),
    (lambda v: v.update(complete=False), "not complete"),
    (lambda v: v.update(rollout_digest="sha256:other"), "rollout_digest"),
    (lambda v: v.update(cases={"not a case name": v["cases"][CASE]}, rows=[]), "is not an <engine>"),
    (lambda v: v.pop("rows"), "not a qualify verdict"),
    (lambda v: v["rows"][0].update(comparison="run", value=0.0, bound=0.0), "a case that did not run cannot pass"),
])
def test_each_inconsistency_of_a_verdict_is_named(edit, expect):
    v = verdict()
    edit(v)
    problems = verdict_problems(v, ACC)
    assert any(expect in p for p in problems), problems


def test_failing_row_must_fail_its_case():
    v = verdict([row(2.0, 1.0)])
    assert verdict_problems(v, ACC) == []
    v["cases"][CASE]["passed"] = True
    v["passed"] = True
    assert any("disagrees" in p for p in verdict_problems(v, ACC))


def test_compare_rows_names_lacking_surplus_and_changed_checks():
    judged = [row(0.5), row(0.25, tensor="outputs/kl_mean")]
    assert compare_rows(CASE, judged, [dict(r) for r in judged]) == []
    assert "lacks checks" in compare_rows(CASE, judged, judged[:1])[0]
    assert "does not give" in compare_rows(CASE, judged[:1], judged)[0]
    changed = [row(0.4), judged[1]]
    assert "differs" in compare_rows(CASE, judged, changed)[0]
    widened = [row(0.5, bound=10.0), judged[1]]
    assert "differs" in compare_rows(CASE, judged, widened)[0]
    moved = [row(0.5, tensor="step1/outputs/loss", step=1)]  # the reports read the step from the row, not the name
    assert "step or outcome differs" in compare_rows(CASE, moved, [moved[0] | {"step": 0}])[0]
    assert compare_rows(CASE, moved, [dict(moved[0])]) == []
    assert compare_rows(CASE, [row(math.inf, passed=False) | {"value": "inf"}],
                        [row(math.inf, passed=False) | {"value": "inf"}]) == []


def test_case_evidence_must_be_sealed_for_that_case_on_the_frozen_rollout(tmp_path):
    layout = RunLayout(tmp_path)
    assert "missing, partial or modified" in sealed_problems(layout, ACC, [CASE])[0]
    where = layout.case(CASE)
    where.mkdir(parents=True)
    (where / "outputs.safetensors").write_bytes(b"x")
    complete_stage(where, {"case": CASE, "rollout_digest": ACC["rollout_digest"]})
    assert "does not record the spec" in sealed_problems(layout, ACC, [CASE])[0]  # no meta.json
    spec = {"name": CASE, "engine": "torch-tp", "precision": "fp32", "tp": 1, "role": "actor"}
    (where / "meta.json").write_text(json.dumps({"case": spec | {"engine": "deepspeed"}}))
    complete_stage(where, {"case": CASE, "rollout_digest": ACC["rollout_digest"]})
    assert "its evidence was made from the spec of" in sealed_problems(layout, ACC, [CASE])[0]
    (where / "meta.json").write_text(json.dumps({"case": spec}))
    complete_stage(where, {"case": CASE, "rollout_digest": ACC["rollout_digest"]})
    assert sealed_problems(layout, ACC, [CASE]) == []
    (where / "outputs.safetensors").write_bytes(b"y")
    assert "modified since it was sealed" in sealed_problems(layout, ACC, [CASE])[0]
    (where / "outputs.safetensors").write_bytes(b"x")
    complete_stage(where, {"case": CASE, "rollout_digest": "sha256:another"})
    assert "not for this case on the frozen rollout" in sealed_problems(layout, ACC, [CASE])[0]


def test_no_acceptance_is_a_problem(tmp_path):
    assert "no acceptance" in acceptance_problems(RunLayout(tmp_path), reference_doc(), None)[0]


def rounds_doc(passed: bool = True) -> dict:
    return {"passed": passed, "failure": None, "num_checks": 1, "num_failed": 0,
            "rows": [{"check": "version installed", "passed": True}]}


def seal_rounds(layout: RunLayout, tp: int, doc: dict) -> None:
    where = layout.rounds_dir(tp)
    where.mkdir(parents=True)
    (where / "verdict.json").write_text(json.dumps(doc))
    complete_stage(where, {"passed": doc["passed"]})


def test_rounds_are_found_per_vllm_tp_and_shown(tmp_path):
    run = make_run(tmp_path)
    layout = RunLayout(run)
    seal_rounds(layout, 2, rounds_doc())
    (layout.rounds / "verdict.json").write_text(json.dumps(rounds_doc(False)))  # the old, wrong place: ignored
    assert discover_rounds(layout) == {2: layout.rounds_dir(2) / "verdict.json"}
    summary = summarize(run)
    assert summary["rounds"] == [{"vllm_tp": 2, "passed": True, "num_checks": 1, "num_failed": 0}]
    assert "rounds vLLM tp2: PASS" in to_markdown(summary)
    assert summary["status"] == NOT_VERIFIED  # a rounds result needs a frozen acceptance behind it


def test_rounds_verdict_must_be_sealed_and_agree_with_its_rows(tmp_path):
    layout = RunLayout(tmp_path)
    assert "missing, partial or modified" in rounds_problems(layout, 1, rounds_doc())[0]
    doc = rounds_doc()
    seal_rounds(layout, 1, doc)
    assert rounds_problems(layout, 1, doc) == []
    assert "disagrees" in rounds_problems(layout, 1, doc | {"passed": False})[0]
    assert "disagrees" in rounds_problems(layout, 1, doc | {"failure": "vLLM died"})[0]
    assert "no readable rows" in rounds_problems(layout, 1, doc | {"rows": "x"})[0]


def test_status_is_pass_or_fail_only_when_verified():
    ok, bad = Verification(("x",), ()), Verification(("x",), ("tampered",))
    assert status_of(ok, {"passed": True}, {}) == PASSED
    assert status_of(ok, {"passed": False}, {}) == FAILED
    assert status_of(ok, {"passed": True}, {1: {"passed": False}}) == FAILED
    assert status_of(bad, {"passed": True}, {}) == NOT_VERIFIED
    assert status_of(ok, None, {}) == NO_VERDICT
    assert status_of(ok, None, {1: {"passed": False}}) == FAILED


@pytest.mark.parametrize("fmt", ["text", "markdown", "json", "html", "junit"])
def test_a_run_without_verdict_fails_in_every_format(tmp_path, fmt):
    """A report of a qualification that has not happened (no acceptance, no candidate verdict) is no success: exit 1
    in every format, and the JUnit file holds a failing testcase naming the stage that did not finish."""
    from junitparser import JUnitXml

    run = make_run(tmp_path)
    out = tmp_path / f"report.{fmt}"
    result = CliRunner().invoke(app, ["report", str(run), "--format", fmt, "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert "NO VERDICT" in result.output
    text = out.read_text()
    if fmt == "json":
        summary = json.loads(text)
        assert summary["status"] == NO_VERDICT
        assert {"stage": "candidate", "reason": "no verdict"} in summary["unfinished"]
    elif fmt == "junit":
        failing = [tc for suite in JUnitXml.fromfile(str(out)) for tc in suite if not tc.is_passed]
        assert any("candidate stage did not finish: no verdict" in tc.result[0].message for tc in failing), text
        assert any("freeze stage did not finish: no acceptance" in tc.result[0].message for tc in failing), text
    else:
        assert "candidate stage did not finish: no verdict" in text


def test_cases_started_but_missing_from_the_verdict_are_named(tmp_path):
    """A candidate stage that did not finish leaves cases the verdict (an older one) does not list: their evidence
    started, sealed or not (a case directory, or only its .work/ with the spec). Each is a problem, never a pass."""
    from qualify.layout import work_dir
    from qualify.report import load_docs, unfinished_stages
    from qualify.report_verify import case_set_problems, started_cases

    layout = RunLayout(make_run(tmp_path, verdict()))
    other = "torch-tp-fp32-tp2-actor"
    assert started_cases(layout) == [] and case_set_problems(layout, verdict()) == []
    layout.case(other).mkdir()  # partial: never sealed
    work_dir(layout.case("deepspeed-fp32-tp1-actor")).mkdir()  # its spec written, nothing launched yet
    (layout.candidates / "replays").mkdir()  # not a case
    assert started_cases(layout) == ["deepspeed-fp32-tp1-actor", other]
    problems = case_set_problems(layout, verdict())
    assert len(problems) == 1 and "cases missing from the verdict: deepspeed-fp32-tp1-actor, " + other in problems[0]
    assert {"stage": "candidate", "reason": f"cases missing from the verdict: deepspeed-fp32-tp1-actor, {other}"} \
        in unfinished_stages(load_docs(layout.root))


def test_report_out_into_a_missing_directory_is_a_usage_error(tmp_path):
    run = make_run(tmp_path)
    result = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "nope" / "r.md")])
    assert result.exit_code == 2
    assert "does not exist" in result.output


def test_junit_of_an_unverified_run_has_no_passing_candidate_testcases(tmp_path):
    from junitparser import JUnitXml

    run = make_run(tmp_path, verdict())
    out = tmp_path / "junit.xml"
    result = CliRunner().invoke(app, ["report", str(run), "--format", "junit", "--out", str(out)])
    assert result.exit_code == 1, result.output
    suites = {s.name: s for s in JUnitXml.fromfile(str(out))}
    assert sorted(suites) == ["qualify tiny: stages", "qualify tiny: verification"]
    (tc,) = list(suites["qualify tiny: verification"])
    assert not tc.is_passed and "no acceptance" in tc.result[0].text
    (stage,) = list(suites["qualify tiny: stages"])
    assert not stage.is_passed and "freeze stage did not finish: no acceptance" in stage.result[0].message


def test_a_case_that_did_not_run_needs_no_evidence_and_fails(tmp_path):
    from qualify.report_verify import evidence_problems

    crashed = row(1.0, passed=False) | {"comparison": "run", "tensor": "case", "metric": "exit", "bound": 0.0,
                                        "ratio": "inf"}
    v = verdict([crashed])
    assert verdict_problems(v, ACC) == [] and v["passed"] is False
    assert evidence_problems(RunLayout(tmp_path), reference_doc(), ACC, v) == []
    ran = verdict([row()])
    assert "missing, partial or modified" in evidence_problems(RunLayout(tmp_path), reference_doc(), ACC, ran)[0]


def test_an_expected_acceptance_digest_is_checked_by_the_report(tmp_path):
    """`qualify report --expect`: the acceptance's digest pinned outside the run; any other is not verified."""
    from qualify.report_verify import verify_run

    layout = RunLayout(make_run(tmp_path))
    other = verify_run(layout, reference_doc(), ACC, None, {}, expect="sha256:pinned")
    assert "the acceptance's digest sha256:acc is not the expected sha256:pinned" in other.problems
    same = verify_run(layout, reference_doc(), ACC, None, {}, expect=ACC["digest"])
    assert not any("is not the expected" in p for p in same.problems)
    assert "the acceptance's digest is the expected sha256:acc" in same.checked


def test_a_symlink_anywhere_in_the_runs_evidence_is_a_problem(tmp_path):
    """A case directory linked to another run's case (or any linked directory or file under reference/,
    acceptance/, candidates/, rounds/) is refused, never followed; the .work/ scratch beside a stage is not evidence."""
    from qualify.layout import work_dir
    from qualify.report_verify import link_problems, verify_run

    layout = RunLayout(make_run(tmp_path, verdict()))
    other = tmp_path / "other-run" / "candidates" / CASE
    other.mkdir(parents=True)
    (other / "meta.json").write_text("{}")
    complete_stage(other, {"case": CASE, "rollout_digest": ACC["rollout_digest"]})
    assert link_problems(layout) == []
    layout.case(CASE).symlink_to(other, target_is_directory=True)
    work_dir(layout.case(CASE)).mkdir()
    (work_dir(layout.case(CASE)) / "scratch").symlink_to(other)  # scratch: not evidence
    (layout.reference / "linked.json").symlink_to(other / "meta.json")
    linked_file = layout.reference / "linked.json"
    assert link_problems(layout) == [f"refusing symlink in evidence: {linked_file} -> {other / 'meta.json'}",
                                     f"refusing symlinked directory in evidence: {layout.case(CASE)} -> {other}"]
    problems = verify_run(layout, reference_doc(), ACC, verdict(), {}).problems
    assert f"refusing symlinked directory in evidence: {layout.case(CASE)}" in problems


def test_a_case_name_with_control_characters_is_printed_escaped(tmp_path):
    """A forged verdict's case name (or any string from the run) is shown with its control characters escaped."""
    hostile = "x\x1b[2J\x1b]0;pwned\x07-fp32-tp1-actor"
    v = verdict([row() | {"case": hostile}])
    v["cases"] = {hostile: v["cases"][CASE]}
    run = make_run(tmp_path, v)
    for fmt in ("text", "markdown"):
        result = CliRunner().invoke(app, ["report", str(run), "--format", fmt])
        assert result.exit_code == 1 and "\x1b" not in result.output and "\x07" not in result.output, fmt
        assert "x\\x1b[2J\\x1b]0;pwned\\x07-fp32-tp1-actor" in result.output.replace("\n", "")
