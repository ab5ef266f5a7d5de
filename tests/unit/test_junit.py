"""JUnit XML of a verdict: one testcase per case x tensor family, failures that name what failed; parsed by junitparser."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from junitparser import Failure, JUnitXml

from qualify.junit import rule_of, to_junit
from qualify.verdict import Row

CASES = ("torch-tp-fp32-tp1-actor", "torch-tp-bf16-tp2-critic")


def row(case: str, comparison: str, tensor: str, metric: str, value: float, bound: float, note: str = "",
        step: int | None = None) -> dict:
    return {"case": case, "role": case.rsplit("-", 1)[1], "comparison": comparison, "tensor": tensor,
            "metric": metric, "value": value, "bound": bound, "ratio": value / bound if bound else 0.0,
            "passed": value <= bound, "note": note, "step": step}


def sample_verdict() -> dict:
    a, b = CASES
    rows = [row(a, "vs ref fp32-r0 [fp32-repeat]", "outputs/logprobs_BT", "max_abs", 1e-7, 1e-6),
            row(a, "vs ref fp32-r0 [fp32-repeat]", "grads/lm_head.weight", "max_abs", 1e-5, 2e-6),
            row(a, "vs ref fp32-r0 [fp32-repeat]", "grads/lm_head.weight", "rel_l2", 1e-3, 1e-2),
            row(a, "evidence", "evidence/replicas", "max_abs_across_ranks", 0.0, 0.0),
            row(b, "vs ref fp32-r0 [fp32-vs-bf16]", "updates/model.norm.weight", "replay_max_abs", 0.1, 0.2),
            row(b, "evidence", "evidence/optimizer_state", "num_not_fp32", 2.0, 0.0, "exp_avg/x")]
    cases = {c: {"passed": all(r["passed"] for r in rows if r["case"] == c)} for c in CASES}
    return {"cases": cases, "rows": rows, "passed": False}


def parse(data: bytes, tmp_path) -> JUnitXml:
    path = tmp_path / "junit.xml"
    path.write_bytes(data)
    return JUnitXml.fromfile(str(path))


def test_one_testcase_per_case_and_group_with_named_failures(tmp_path):
    xml = parse(to_junit(sample_verdict(), name="tiny"), tmp_path)
    suites = list(xml)
    assert [s.name for s in suites] == ["qualify tiny: candidates"]
    cases = {(tc.classname, tc.name): tc for tc in suites[0]}
    assert set(cases) == {(CASES[0], "outputs"), (CASES[0], "grads"), (CASES[0], "evidence"),
                          (CASES[1], "updates"), (CASES[1], "evidence")}
    assert suites[0].tests == 5 and suites[0].failures == 2
    assert cases[(CASES[0], "outputs")].is_passed and cases[(CASES[1], "updates")].is_passed
    grads = cases[(CASES[0], "grads")].result
    assert len(grads) == 1 and isinstance(grads[0], Failure)
    text = grads[0].text
    assert "grads/lm_head.weight max_abs" in text and "value 1e-05" in text and "bound 2e-06" in text
    assert "k * control_error + floor" in text and "family fp32-repeat" in text
    assert "rel_l2" not in text  # the passing metric of the same tensor is not a failure
    assert "1 of 2 checks failed" in grads[0].message
    evidence = cases[(CASES[1], "evidence")].result[0]
    assert "num_not_fp32" in evidence.text and "must be exactly 0" in evidence.text and "exp_avg/x" in evidence.text


def test_verification_problems_and_rounds_are_testcases(tmp_path):
    data = to_junit(sample_verdict(), name="tiny", problems=["reference evidence modified: targets/targets.json"],
                    rounds=[{"vllm_tp": 1, "passed": True, "num_failed": 0},
                            {"vllm_tp": 2, "passed": False, "num_failed": 3}])
    xml = parse(data, tmp_path)
    by_name = {s.name: s for s in xml}
    (verification,) = list(by_name["qualify tiny: verification"])
    assert not verification.is_passed and "targets/targets.json" in verification.result[0].text
    rounds = {tc.name: tc for tc in by_name["qualify tiny: rounds"]}
    assert rounds["vllm-tp1"].is_passed and not rounds["vllm-tp2"].is_passed
    root = ET.fromstring(data)
    assert root.tag == "testsuites" and int(root.get("tests")) == 8 and int(root.get("failures")) == 4


def test_verified_evidence_is_a_passing_testcase(tmp_path):
    xml = parse(to_junit(None, name="tiny", problems=[]), tmp_path)
    (suite,) = list(xml)
    (tc,) = list(suite)
    assert tc.name == "evidence verifies" and tc.is_passed


def test_a_stage_that_did_not_finish_is_a_failing_testcase(tmp_path):
    """Evidence that verifies is not a pass when the candidate stage never finished: the testcase says which stage."""
    xml = parse(to_junit(None, name="tiny", problems=[],
                         unfinished=[{"stage": "candidate", "reason": "no verdict"}]), tmp_path)
    suites = {s.name: s for s in xml}
    (stage,) = list(suites["qualify tiny: stages"])
    assert stage.name == "candidate stage finished" and not stage.is_passed
    assert "candidate stage did not finish: no verdict" in stage.result[0].message
    assert int(ET.fromstring(to_junit(None, name="tiny", problems=[], unfinished=[
        {"stage": "candidate", "reason": "no verdict"}])).get("failures")) == 1


def test_a_case_without_rows_fails(tmp_path):
    xml = parse(to_junit({"cases": {CASES[0]: {"passed": False}}, "rows": []}, name="tiny"), tmp_path)
    (suite,) = list(xml)
    (tc,) = list(suite)
    assert not tc.is_passed and "no checks recorded" in tc.result[0].text


def test_the_document_follows_the_junit_shape(tmp_path):
    """The de-facto schema: testsuites > testsuite(name, tests, failures, errors) > testcase(classname, name)."""
    root = ET.fromstring(to_junit(sample_verdict(), name="tiny", problems=[]))
    for suite in root:
        assert suite.tag == "testsuite" and {"name", "tests", "failures", "errors"} <= set(suite.keys())
        assert int(suite.get("tests")) == len(suite.findall("testcase"))
        assert int(suite.get("failures")) == len(suite.findall("testcase/failure"))
        for tc in suite:
            assert tc.tag == "testcase" and {"classname", "name"} <= set(tc.keys())
            assert {child.tag for child in tc} <= {"failure", "system-out"}
            for f in tc.findall("failure"):
                assert f.get("message") and f.get("type")


def test_groups_and_rules():
    def typed(comparison: str, tensor: str, metric: str = "max_abs", step: int | None = None) -> Row:
        return Row("c", "actor", comparison, tensor, metric, 0.0, 0.0, True, step=step)

    assert typed("vs tp1 [bf16-repeat]", "moments/exp_avg/x").group == "moments"
    assert typed("vs tp1 [bf16-repeat]", "step3/moments/exp_avg/x", step=3).group == "moments"
    assert typed("run", "case").group == "run"
    assert "run to completion" in rule_of(typed("run", "case", "exit"))
    structure = rule_of(typed("vs ref bf16-r0 [bf16-repeat]", "grads/x", "structure"))
    assert "names, shapes and dtypes" in structure and "(bf16-repeat)" in structure
    assert rule_of(typed("vs tp1 [bitwise]", "grads/x")).endswith("; family bitwise")
    assert rule_of(typed("vs tp1", "grads/x")).endswith("; family ?")


def test_steps_are_grouped_into_their_tensor_family(tmp_path):
    a = CASES[0]
    rows = [row(a, "vs ref fp32-r0 [fp32-repeat]", f"step{k}/grads/lm_head.weight", "max_abs", v, 1e-6, step=k)
            for k, v in ((0, 1e-7), (1, 5e-6))]
    xml = parse(to_junit({"cases": {a: {"passed": False}}, "rows": rows}, name="tiny"), tmp_path)
    (tc,) = list(next(iter(xml)))
    assert tc.name == "grads" and "1 of 2 checks failed" in tc.result[0].message
    assert "step1/grads/lm_head.weight max_abs" in tc.result[0].text


def test_control_characters_of_a_crash_message_keep_the_document_valid(tmp_path):
    """A case that crashed carries its exception's text into the failure; escape codes and NUL from it must not make
    the XML unparseable (ElementTree writes them as they are)."""
    v = sample_verdict()
    v["rows"][0] |= {"passed": False, "note": "RuntimeError: \x1b[31mboom\x1b[0m at \x00 byte"}
    v["cases"][v["rows"][0]["case"]]["passed"] = False
    data = to_junit(v, name="tiny\x07")
    root = ET.fromstring(data)  # parses
    text = "".join(root.itertext()) + " ".join(f.get("message", "") for f in root.iter("failure"))
    assert "\\x1b[31mboom\\x1b[0m at \\x00 byte" in text and "\x1b" not in text and "\x00" not in text
    assert root.get("name") == "qualify tiny\\x07"
    assert parse(data, tmp_path)  # and junitparser reads it


def test_an_engines_message_is_escaped_beyond_what_xml_refuses(tmp_path):
    """What XML holds but a CI log or terminal would act on: C1 controls (CSI), a bidirectional override, CR."""
    v = sample_verdict()
    v["rows"][0] |= {"passed": False, "note": "RuntimeError: \x9b2J wiped\u202eexe.txt\rover"}
    v["cases"][v["rows"][0]["case"]]["passed"] = False
    root = ET.fromstring(to_junit(v, name="tiny"))
    text = "".join(root.itertext()) + " ".join(f.get("message", "") for f in root.iter("failure"))
    assert "\\x9b2J wiped\\u202eexe.txt\\x0dover" in text
    assert not any(c in text for c in "\x9b\u202e\r")
