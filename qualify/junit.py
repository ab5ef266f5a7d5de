"""JUnit XML of a verdict, for CI systems: one testcase per case x tensor family (or check group).

The verdict's rows are read as typed rows (qualify.verdict.Row: its group, bound family and step), never parsed
from their text. A testcase fails when any of its rows fails; its failure lists every failing row with tensor,
metric, value, bound and the rule that set the bound. `qualify report --format junit` adds a
testcase for the verification of the evidence, one per rounds run, and a failing one per stage that
did not finish (no acceptance, no verdict, cases missing from it), so a report that does not verify,
or of a qualification that never finished, fails in CI too. Written with the standard library (xml.etree), in the de-facto schema
Jenkins, GitHub Actions and GitLab read (testsuites > testsuite > testcase > failure).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import defaultdict
from typing import Any

from qualify.bounds.rule import FORMULA
from qualify.childlog import printable
from qualify.verdict import Row
from qualify.waivers import waiver_text, waivers_of

BOUND_RULE = f"value <= bound; {FORMULA}, frozen per (role, tensor, metric)"


def rule_of(row: Row) -> str:
    """The rule a row was judged by, naming the bound family that set its bound."""
    if row.comparison == "run":
        return "the case must run to completion"
    if row.comparison == "rounds":
        return "every check of the rounds run must pass (its verdict.json names them)"
    if row.comparison == "evidence":
        return "must be exactly 0 (structural evidence of the candidate run)"
    if row.comparison == "rollout" and row.rule:
        return f"compared with the sealed rollout's logprobs, {row.rule}"
    if row.comparison in ("derived", "own outputs", "layout") and row.rule:
        return f"recomputed from the case's own values, {row.rule}"
    family = row.family or "?"
    if row.metric == "structure":
        return f"candidate tensors must match the reference's names, shapes and dtypes ({family})"
    return f"{BOUND_RULE}; family {family}"


def failure_line(row: Row) -> str:
    if row.comparison == "verification":
        return f"does not verify: {row.value}"
    if row.comparison == "stage":
        return str(row.value)
    note = f" [{row.note}]" if row.note else ""
    return (f"{row.tensor} {row.metric}: value {row.value} > bound {row.bound} "
            f"({row.comparison}; rule: {rule_of(row)}){note}")


def xml_text(text: str) -> str:
    """text with every character XML 1.0 cannot hold (a crash message's escape codes, NUL: ElementTree writes them as
    they are, and the document no longer parses), and every other control character a CI log would act on, written
    as \\xNN (\\uNNNN): qualify.childlog.printable, the document's own newlines kept."""
    return printable(text, newlines=True)


def _testcase(suite: ET.Element, classname: str, name: str, rows: list[Row]) -> bool:
    """Add one testcase; returns True when it failed."""
    case = ET.SubElement(suite, "testcase", classname=xml_text(classname), name=xml_text(name))
    failing = [r for r in rows if not r.passed]
    waived = waiver_text(waivers_of(r.to_json() for r in rows))  # a waived check passes, and says so
    ET.SubElement(case, "system-out").text = xml_text(f"{len(rows)} checks, {len(failing)} failed{waived}")
    if failing:
        message = f"{len(failing)} of {len(rows)} checks failed; first: {failure_line(failing[0])}"
        ET.SubElement(case, "failure", message=xml_text(message),
                      type=xml_text(failing[0].comparison.split(" ", 1)[0])).text = \
            xml_text("\n".join(failure_line(r) for r in failing))
    return bool(failing)


def _suite(root: ET.Element, name: str, cases: list[tuple[str, str, list[Row]]]) -> tuple[int, int]:
    suite = ET.SubElement(root, "testsuite", name=xml_text(name))
    waivers = waivers_of(r.to_json() for _, _, rows in cases for r in rows)
    if waivers:  # beside the suite's result: what the matrix waived (qualify.waivers)
        properties = ET.SubElement(suite, "properties")
        for w in waivers:
            ET.SubElement(properties, "property", name="waived", value=xml_text(w))
    failures = sum(_testcase(suite, classname, tc, rows) for classname, tc, rows in cases)
    suite.set("tests", str(len(cases)))
    suite.set("failures", str(failures))
    suite.set("errors", "0")
    suite.set("skipped", "0")
    return len(cases), failures


def verdict_cases(verdict: dict[str, Any]) -> list[tuple[str, str, list[Row]]]:
    """(classname, name, rows): one per case x check group (Row.group), in case order; a case without rows is one
    failure."""
    grouped: dict[str, dict[str, list[Row]]] = {name: defaultdict(list) for name in verdict["cases"]}
    for row in map(Row.from_json, verdict["rows"]):
        grouped[row.case][row.group].append(row)
    out = []
    for case, groups in grouped.items():
        if not groups:
            out.append((case, "checks", [Row(case, "", "run", "case", "num_checks", 0, 0, False, "no checks recorded")]))
        out += [(case, group, rows) for group, rows in sorted(groups.items())]
    return out


def to_junit(verdict: dict[str, Any] | None, *, name: str, problems: list[str] | None = None,
             rounds: list[dict[str, Any]] | None = None, unfinished: list[dict[str, str]] | None = None) -> bytes:
    """The JUnit XML document (UTF-8 bytes). problems: the report's verification (None: not verified here);
    unfinished: the stages that did not finish ({'stage', 'reason'}, qualify.report.unfinished_stages), each a
    failing testcase."""
    root = ET.Element("testsuites", name=xml_text(f"qualify {name}"))
    totals = [0, 0]
    suites: list[tuple[str, list[tuple[str, str, list[Row]]]]] = []
    if problems is not None:
        rows = [Row("", "", "verification", "evidence", "problem", p, None, False) for p in problems]
        ok = [Row("", "", "verification", "evidence", "verifies", 0, 0, True)]
        suites.append((f"qualify {name}: verification", [("verification", "evidence verifies", rows or ok)]))
    if unfinished:
        suites.append((f"qualify {name}: stages", [
            ("stages", f"{u['stage']} stage finished", [Row("", "", "stage", u["stage"], "finished",
                                                            f"{u['stage']} stage did not finish: {u['reason']}", None,
                                                            False)]) for u in unfinished]))
    if verdict is not None:
        suites.append((f"qualify {name}: candidates", verdict_cases(verdict)))
    if rounds:
        suites.append((f"qualify {name}: rounds", [
            ("rounds", f"vllm-tp{r['vllm_tp']}", [Row("", "", "rounds", f"rounds vllm-tp{r['vllm_tp']}", "num_failed",
                                                      r["num_failed"], 0, r["passed"] is True)]) for r in rounds]))
    for suite_name, cases in suites:
        tests, failures = _suite(root, suite_name, cases)
        totals[0] += tests
        totals[1] += failures
    root.set("tests", str(totals[0]))
    root.set("failures", str(totals[1]))
    root.set("errors", "0")
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"
