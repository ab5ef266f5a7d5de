"""candidates.waive: an actor without a logits() hook fails its logprob derivation unless the matrix waives the check
for its engine by name; a waived row passes, and every report names each waiver beside the verdict. The cases that
run engines are in tests/integration/test_waivers.py."""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from qualify.compare import RunTensors
from qualify.errors import MatrixError
from qualify.judge.derived import sampler_rows
from qualify.matrix import load_matrix
from qualify.report_verify import Verification, row_problems
from qualify.rolemeta import RoleMeta
from qualify.verdict import VERDICT_SCHEMA, make_verdict
from qualify.waivers import WAIVABLE, WAIVED, waiver_text, waivers_of

MATRICES = Path(__file__).resolve().parents[2] / "matrices"
PLUGIN = "team_trainer:engine"
CASE = "team_trainer-engine-fp32-tp1-actor"


def matrix_file(tmp_path: Path, **candidates) -> Path:
    data = yaml.safe_load((MATRICES / "tiny-qwen3.yaml").read_text())
    data["candidates"].update(candidates)
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def no_logits(spec: dict) -> list:
    """The rows of an actor case whose engine gave no logits (meta.json records no sampler derivation)."""
    meta = RoleMeta.from_json({"sampler_derivation": None, "case": spec})
    return sampler_rows(CASE, "actor", [RunTensors(outputs={}, grads={}, updates={}, moments={}, meta=meta)])


def test_without_the_hook_the_row_fails_naming_the_hook_and_the_waiver():
    [row] = no_logits({"engine": PLUGIN})
    assert not row.passed and row.metric == "not_derived" and row.tensor == "outputs/logprobs_BT"
    assert "no logits() hook" in row.note and f"candidates.waive: {{{PLUGIN}: [sampler_derivation]}}" in row.note
    assert row.ratio == math.inf and row_problems(row.to_json(), 0, {CASE: {}}) == []  # passed follows value, bound
    assert waivers_of([row.to_json()]) == []


def test_a_waived_row_passes_and_names_its_waiver():
    [row] = no_logits({"engine": PLUGIN, "waive": ["sampler_derivation"]})
    assert row.passed and row.metric == WAIVED and row.note.startswith(f"waived: sampler_derivation for engine {PLUGIN}")
    assert row_problems(row.to_json(), 0, {CASE: {}}) == []
    assert waivers_of([row.to_json()]) == [f"sampler_derivation for engine {PLUGIN}"]
    assert waiver_text(waivers_of([row.to_json()])) == f" (waived: sampler_derivation for engine {PLUGIN})"
    # a row edited to 'waived' without passing, or a note that does not say what was waived, names no waiver
    assert waivers_of([row.to_json() | {"passed": False}, row.to_json() | {"note": "waived"}]) == []


def test_a_waiver_does_not_excuse_a_derivation_that_was_made():
    """Where the engine gave its logits the check is made whatever the matrix waives: a bad token fails."""
    w = {"value": 1e-3, "bound": 1e-7, "ratio": 1e4, "row": 1, "position": 7, "case": -2.0, "derived": -2.001}
    meta = RoleMeta.from_json({"sampler_derivation": [w], "case": {"engine": PLUGIN, "waive": ["sampler_derivation"]}})
    [row] = sampler_rows(CASE, "actor", [RunTensors(outputs={}, grads={}, updates={}, moments={}, meta=meta)])
    assert not row.passed and row.metric == "derived_abs" and "row 1 position 7" in row.note


def test_waive_is_per_engine_and_reaches_the_case_spec(tmp_path):
    from qualify.case.spec import make_spec

    m = load_matrix(matrix_file(tmp_path, engines=["torch-tp", PLUGIN], roles=["actor"],
                                waive={PLUGIN: ["sampler_derivation"]}))
    assert m.candidates.waive == {PLUGIN: ("sampler_derivation",)}
    specs = {c.engine: make_spec(m.case_settings, c, model_dir=tmp_path, rollout_dir=tmp_path, targets_dir=tmp_path,
                                 rollout_digest="r", targets_digest="t", case_dir=tmp_path / c.name, vocab_size=512,
                                 device="cpu").to_json() for c in m.cases()}
    assert specs[PLUGIN]["waive"] == ["sampler_derivation"]
    assert "waive" not in specs["torch-tp"]  # an engine without a waiver: its spec (and resume key) as before


@pytest.mark.parametrize("waive, expected", [
    ({PLUGIN: ["sampler_derivaton"]}, re.escape(f"waive.{PLUGIN}: unknown check(s) ['sampler_derivaton'] (checks "
                                                f"that can be waived: {', '.join(WAIVABLE)})")),
    ({"deepspeed": ["sampler_derivation"]}, re.escape("waive names ['deepspeed'], which are not among engines")),
    ({PLUGIN: ["sampler_derivation", "sampler_derivation"]}, "lists \\['sampler_derivation'\\] more than once"),
    ({PLUGIN: []}, f"waive.{PLUGIN} must list at least one value"),
    ({PLUGIN: "sampler_derivation"}, "expected a list"),
    (["sampler_derivation"], "expected a mapping"),
])
def test_a_bad_waiver_is_refused_at_load(tmp_path, waive, expected):
    with pytest.raises(MatrixError, match=expected):
        load_matrix(matrix_file(tmp_path, engines=["torch-tp", PLUGIN], waive=waive))


def test_candidates_may_change_after_the_freeze(tmp_path):
    """A waiver added after the freeze changes no frozen field (candidates is not a frozen section)."""
    from qualify.acceptance import FROZEN_SECTIONS, frozen_field_differences
    from qualify.schema import to_dict

    frozen = to_dict(load_matrix(matrix_file(tmp_path, engines=[PLUGIN])))
    waived = to_dict(load_matrix(matrix_file(tmp_path, engines=[PLUGIN], waive={PLUGIN: ["sampler_derivation"]})))
    assert "candidates" not in FROZEN_SECTIONS and frozen_field_differences(frozen, waived) == []


def verdict_of(waived: bool) -> dict:
    spec = {"engine": PLUGIN, **({"waive": ["sampler_derivation"]} if waived else {})}
    return make_verdict(VERDICT_SCHEMA, "tiny", no_logits(spec), [CASE]).to_json()


def test_candidate_table_names_the_waiver_beside_the_verdict():
    from qualify.cli.verdict_view import render_verdict

    for waived, result in ((True, "PASSED: 1/1 cases pass"), (False, "FAILED: 0/1 cases pass")):
        out = io.StringIO()
        render_verdict(verdict_of(waived), Console(file=out, width=400, highlight=False))
        text = out.getvalue()
        waiver = f"(waived: sampler_derivation for engine {PLUGIN})"
        assert (f"{result} {waiver}" in text) is waived and (f"{result}\n" in text) is not waived, text
        assert (f"; waived: sampler_derivation for engine {PLUGIN}" in text) is waived  # on the case's line too


def test_junit_names_the_waiver_beside_the_passing_testcase(tmp_path):
    from junitparser import JUnitXml

    from qualify.junit import to_junit

    path = tmp_path / "junit.xml"
    path.write_bytes(to_junit(verdict_of(True), name="tiny"))
    [suite] = JUnitXml.fromfile(str(path))
    [case] = list(suite)
    assert case.name == "derived" and case.is_passed
    assert case.system_out == f"1 checks, 0 failed (waived: sampler_derivation for engine {PLUGIN})"
    assert [(p.name, p.value) for p in suite.properties()] == [("waived", f"sampler_derivation for engine {PLUGIN}")]
    path.write_bytes(to_junit(verdict_of(False), name="tiny"))
    [suite] = JUnitXml.fromfile(str(path))
    [case] = list(suite)
    assert not case.is_passed and "no logits() hook" in case.result[0].text


def test_report_formats_name_the_waiver_beside_the_verdict(tmp_path):
    """Markdown (and the text format, which renders it), JSON and the HTML banner, on a verified verdict."""
    from qualify.cli.report import ReportFormat, render
    from qualify.report import load_docs, summarize_docs
    from tests.unit.test_report_verify import make_run

    v = verdict_of(True)
    docs = load_docs(make_run(tmp_path, v | {"cases": {CASE: v["cases"][CASE]}}))
    summary = summarize_docs(docs, Verification(("hand-made data",), ()))
    assert summary["status"] == "PASSED"
    waiver = f"sampler_derivation for engine {PLUGIN}"
    assert json.loads(render(ReportFormat.json, docs, summary))["candidates"]["waivers"] == [waiver]
    assert render(ReportFormat.markdown, docs, summary).decode().endswith(f"**PASSED** (waived: {waiver})\n")
    banner = re.search(r'<div id="banner"[^>]*>(.*?)</div>', render(ReportFormat.html, docs, summary).decode())[1]
    assert banner == f"PASS: 1/1 cases pass (waived: {waiver})"
    assert f"(waived: {waiver})" in render(ReportFormat.junit, docs, summary).decode()
