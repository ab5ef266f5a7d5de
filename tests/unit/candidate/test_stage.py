"""A candidate run on another platform than its reference says so in the verdict, and passes or fails on its rows alone."""

from __future__ import annotations

import copy

from qualify.candidate.stage import case_platforms, verdict_document
from qualify.hardware import platform_fingerprint
from qualify.layout import RunLayout
from qualify.matrix import Case, load_matrix
from qualify.store import write_json
from qualify.verdict import Row
from tests.conftest import TINY


def _case_meta(layout: RunLayout, case: Case, platform: dict) -> None:
    write_json(layout.case(case.name) / "meta.json", {"platform": platform})


def test_other_platform_is_information_not_failure(tmp_path):
    matrix = load_matrix(TINY)
    layout = RunLayout(tmp_path)
    here = platform_fingerprint()
    elsewhere = copy.deepcopy(here) | {"cpu_model": "Another CPU", "gpus": ["NVIDIA H200"]}
    same, other = matrix.cases()[:2]
    _case_meta(layout, same, here)
    _case_meta(layout, other, elsewhere)
    platforms = case_platforms(layout, [same, other], here)
    assert platforms[same.name]["differs_from_reference"] == []
    diffs = platforms[other.name]["differs_from_reference"]
    assert [d.split(":")[0] for d in diffs] == ["cpu_model", "gpus"]
    rows = [Row(c.name, c.role, "vs ref", "outputs/loss", "max_abs", 0.0, 1.0, True) for c in (same, other)]
    doc = {"digest": "sha256:" + "0" * 64, "rollout_digest": "sha256:" + "1" * 64, "platform": here}
    verdict = verdict_document(matrix.name, doc, [same, other], rows, complete=False, platforms=platforms).to_json()
    assert verdict["passed"] and verdict["cases"][other.name]["passed"]
    assert verdict["cases"][other.name]["differs_from_reference"] == diffs
    assert "Another CPU" in verdict["cases"][other.name]["platform"]
    assert verdict["reference_platform"].startswith(here["cpu_model"])


def test_a_case_without_evidence_has_no_platform_entry(tmp_path):
    matrix = load_matrix(TINY)
    assert case_platforms(RunLayout(tmp_path), matrix.cases()[:1], platform_fingerprint()) == {}
